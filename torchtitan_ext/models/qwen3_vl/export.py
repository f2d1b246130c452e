"""A trained qwen3_vl model as a Hugging Face directory that ``from_pretrained`` loads.

Two ways in, one directory out (safetensors in the published layout, ``config.json``, and the
tokenizer, image processor and chat template that tokenized the training data):

- **at the end of training**, ``[checkpoint] last_save_in_hf = true`` (with
  ``last_save_model_only = true``): torchtitan writes the weights into ``checkpoint/step-N``
  through the state-dict adapter (every rank its shards); ``ExtTrainer`` runs that save inside
  :meth:`~torchtitan_ext.models.qwen3_vl.state_dict_adapter.Qwen3VLStateDictAdapter.exporting`
  and then, on rank 0, :func:`write_hf_assets`;
- **from any saved step**, ``torchtitan-ext-export`` (:mod:`torchtitan_ext.export`) reads the
  model weights of a DCP checkpoint (a full training checkpoint or a model-only one) and writes
  the same directory with :func:`export_dcp`.

Both need to know the model and the processor of the job: :func:`export_record` is what
``ExtTrainer`` adds to the job record of every checkpoint (``torchtitan_ext_job.json``), so a
checkpoint folder is enough to export it, whatever the config file says today.
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from torchtitan_ext.models.qwen3_vl.flavors import is_moe

PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
)
"""Files copied from the processor directory (those present): never weights or ``config.json``,
which come from the trained model."""

SHARD_BYTES = 5 * 1024**3
"""Largest safetensors file :func:`export_dcp` writes (tensors are read one file at a time)."""

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class ExportError(ValueError):
    """A checkpoint or directory that cannot be exported; the message is one line."""


# ----------------------------------------------------------------------------- the job's record
def export_record(config: Any) -> dict[str, Any]:
    """What an export needs of the job (part of its checkpoints' job record): the HF config the
    model was built from, and the processor directory that tokenized its data (``model_path``,
    else ``hf_assets_path`` when it holds a processor, else the embedded offline processor)."""
    from torchtitan_ext.loaders.vl import processor_path

    loader = config.dataloader
    path = processor_path(getattr(loader, "model_path", None), config.hf_assets_path)
    if path is None:
        from torchtitan_ext.vl.processor import offline_processor_dir

        path = str(offline_processor_dir())
    return {
        "hf_config": copy.deepcopy(config.model_spec.model.hf_config),
        "processor": str(Path(path).resolve()),
    }


# ------------------------------------------------------------------------------ config + processor
def hf_export_config(hf_config: dict[str, Any], dtype: torch.dtype) -> Any:
    """The ``Qwen3VLConfig`` / ``Qwen3VLMoeConfig`` written as ``config.json``: the flavor's
    fields, the class ``from_pretrained`` builds (``architectures``) and the weights' dtype.
    transformers' own defaults otherwise (generation uses the KV cache, unlike training)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    from torchtitan_ext.models.qwen3_vl.model import hf_model_class

    cls = Qwen3VLMoeConfig if is_moe(hf_config) else Qwen3VLConfig
    cfg = cls(**copy.deepcopy(hf_config))
    cfg.architectures = [hf_model_class(hf_config).__name__]
    cfg.dtype = dtype
    return cfg


def saved_dtype(out_dir: str | Path) -> torch.dtype:
    """The floating dtype most of the weights in ``out_dir``'s safetensors have (headers only)."""
    counts: Counter[str] = Counter()
    for f in Path(out_dir).glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        counts.update(m["dtype"] for k, m in header.items() if k != "__metadata__")
    floats = [(c, d) for d, c in counts.items() if d in _ST_DTYPES]
    if not floats:
        raise ExportError(f"{out_dir}: no floating-point safetensors weights to describe")
    return _ST_DTYPES[max(floats)[1]]


def write_hf_assets(
    out_dir: str | Path, hf_config: dict[str, Any], processor_dir: str | Path
) -> list[str]:
    """``config.json`` (dtype read from the weights already in ``out_dir``) and the processor's
    files (:data:`PROCESSOR_FILES`); returns the names written. Call once, after the weights."""
    out, src = Path(out_dir), Path(processor_dir)
    if not (src / "preprocessor_config.json").is_file():
        raise ExportError(
            f"processor directory {src}: missing preprocessor_config.json (the processor that "
            "tokenized the training data is needed; pass its directory)"
        )
    hf_export_config(hf_config, saved_dtype(out)).save_pretrained(out)
    written = ["config.json"]
    for name in PROCESSOR_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            written.append(name)
    return written


# -------------------------------------------------------------------------------- DCP -> HF
def _model_keys(hf_config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The model's state-dict keys -> shape as the torchtitan model registers them
    (built on the meta device: no memory)."""
    from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel

    with torch.device("meta"):
        model = Qwen3VLModel(Qwen3VLModel.Config(hf_config=copy.deepcopy(hf_config)))
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def export_dcp(
    step_dir: str | Path,
    out_dir: str | Path,
    hf_config: dict[str, Any],
    processor_dir: str | Path,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write the model weights of the DCP checkpoint ``step_dir`` (optimizer, scheduler and
    loader state are left out) as an HF directory; ``dtype`` None keeps the stored dtype.
    Reads at most :data:`SHARD_BYTES` of tensors at a time. Returns the files written."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel
    from torchtitan_ext.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter

    reader = FileSystemReader(str(step_dir))
    stored = reader.read_metadata().state_dict_metadata
    expected = _model_keys(hf_config)
    tied = bool(hf_config.get("tie_word_embeddings"))
    adapter = Qwen3VLStateDictAdapter(Qwen3VLModel.Config(hf_config=hf_config), None)
    missing = [k for k in expected if k not in stored and not (tied and k == "lm_head.weight")]
    if missing:
        raise ExportError(
            f"{step_dir}: {len(missing)} model weights are not in this checkpoint (first: "
            f"{missing[0]}); it was not saved from this model"
        )
    shards: list[list[str]] = [[]]
    size = 0
    for key, shape in expected.items():
        meta = stored.get(key)
        if meta is None:
            continue  # the tied lm_head: the embedding, not written
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != shape:
            found = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "not a tensor"
            raise ExportError(f"{step_dir}: {key} is {found}, the model's is {shape}")
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, keys in enumerate(shards, 1):
        part = {
            k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in keys
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(part, storage_reader=reader, no_dist=True)
        with adapter.exporting():
            hf = adapter.to_hf(part)
        hf = {k: (v.to(dtype) if dtype and v.is_floating_point() else v) for k, v in hf.items()}
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(hf, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(hf, name))
        total += sum(v.numel() * v.element_size() for v in hf.values())
        del part, hf
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    files = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    return [*files, "model.safetensors.index.json", *write_hf_assets(out, hf_config, processor_dir)]
