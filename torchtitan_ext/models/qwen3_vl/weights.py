"""A Hugging Face safetensors checkpoint as the trainer will read it, checked without its data.

torchtitan's checkpointer loads HF weights (``[checkpoint] initial_load_in_hf``) after the model
is built, through ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``: it lists
every ``*.safetensors`` file of the directory (``model.safetensors.index.json`` is not used to
find them), then asks for each tensor of ``adapter.to_hf(model.state_dict())`` by name. So a
missing tensor ("Missing key in checkpoint state_dict"), a wrong shape ("Size mismatch") or a
damaged file are tracebacks after the build, while an integer tensor is silently cast into a
float parameter and a tensor the model has no parameter for is silently never read.

:func:`check_checkpoint` finds each of those from the files' headers (a few KB per file, no
tensor data) before anything is built, and raises :class:`WeightsError` with one line naming
the tensor and the file. What the model needs is not listed here: it is the flavor's model built
on the meta device (no memory) mapped through the same :class:`Qwen3VLStateDictAdapter` the
checkpointer uses, so the keys, the tied ``lm_head`` and both fused-expert layouts are decided
in one place.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
"""Tensor types the trainer loads as they are (cast to the parameter's dtype on the copy)."""

# bytes per element of safetensors' dtypes (sub-byte formats left out: their length is not checked)
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "C64": 8,
}  # fmt: skip
_MAX_HEADER = 100_000_000  # safetensors' own limit
_DCP_SHARDING = "DCP_SHARDING_INFO"  # torch.distributed.checkpoint._hf_utils.CUSTOM_METADATA_KEY


class WeightsError(ValueError):
    """One line: what is wrong with which tensor of which file."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a checkpoint's headers describe it."""

    file: str
    """File name inside the checkpoint directory."""
    shape: tuple[int, ...]
    dtype: str
    """safetensors' dtype name ("BF16", "F32", "I64", ...)."""


def read_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of one safetensors file, checked as ``safe_open`` checks it (the 8-byte
    length, a JSON object, every entry's dtype / shape / offsets, and a file exactly as long as
    the header says) but without reading any tensor data. A truncated or garbage file raises
    :class:`WeightsError` naming it."""
    p = Path(path)
    size = p.stat().st_size

    def bad(why: str) -> WeightsError:
        return WeightsError(f"{p}: not a readable safetensors file ({why})")

    with open(p, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"header length {n} does not fit a file of {size} bytes")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = str(meta["dtype"]), [int(d) for d in meta["shape"]]
            begin, stop = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has no valid dtype / shape / data_offsets") from None
        width = _DTYPE_BYTES.get(dtype)
        if begin > stop or (width is not None and stop - begin != math.prod(shape) * width):
            raise bad(f"tensor {name!r}: offsets {[begin, stop]} do not fit {dtype} {shape}")
        end = max(end, stop)
    if 8 + n + end != size:
        state = "truncated" if 8 + n + end > size else "longer than its header says"
        raise bad(f"{state}: the header describes {8 + n + end} bytes, the file has {size}")
    return header


def read_index(directory: str | Path) -> dict[str, str] | None:
    """``weight_map`` (tensor -> file name) of the directory's ``model.safetensors.index.json``;
    None without one. An index that does not parse raises :class:`WeightsError`."""
    path = Path(directory) / INDEX
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError("weight_map is not an object of file names")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: not a safetensors index ({type(e).__name__}: {e})") from None
    return weight_map


def scan(directory: str | Path) -> dict[str, TensorInfo]:
    """Every tensor the trainer's reader would see in ``directory`` (all ``*.safetensors``),
    after checking that each file the index names exists and each header reads. A tensor in two
    files is refused (two checkpoints in one directory: which one loads is arbitrary), unless
    both are pieces of one tensor saved by ``torch.distributed.checkpoint`` (their offsets in
    ``DCP_SHARDING_INFO``), whose full shape is then assembled as the reader does."""
    d = Path(directory)
    index = read_index(d) or {}
    by_file: dict[str, list[str]] = {}
    for key, name in index.items():
        by_file.setdefault(name, []).append(key)
    for name, keys in by_file.items():
        if not (d / name).is_file():
            more = f" and {len(keys) - 1} more tensors" if len(keys) > 1 else ""
            raise WeightsError(
                f"{d / INDEX} puts {keys[0]!r}{more} in {name}, which is missing from {d} "
                "(a shard deleted, or a download that did not finish)"
            )
    found: dict[str, TensorInfo] = {}
    pieces: set[str] = set()  # tensors saved in pieces (offsets in DCP_SHARDING_INFO)
    for f in sorted(d.glob("*.safetensors")):
        header = read_header(f)
        offsets = _dcp_offsets(f, header)
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            shape = tuple(int(x) for x in meta["shape"])
            if key in offsets:  # a piece: the reader sizes the tensor by offset + shape
                shape = tuple(s + o for s, o in zip(shape, offsets[key], strict=False))
            old = found.get(key)
            if old is not None:
                if not (key in offsets and key in pieces):
                    raise WeightsError(
                        f"{f}: tensor {key!r} is also in {old.file}: the trainer reads every "
                        f"*.safetensors in {d}, so keep one checkpoint per directory"
                    )
                shape = tuple(max(a, b) for a, b in zip(shape, old.shape, strict=False))
            if key in offsets:
                pieces.add(key)
            found[key] = TensorInfo(f.name, shape, str(meta["dtype"]))
    return found


def _dcp_offsets(path: Path, header: dict[str, Any]) -> dict[str, list[int]]:
    """Tensor -> offsets of a file ``torch.distributed.checkpoint`` saved in pieces ({} else)."""
    raw = (header.get("__metadata__") or {}).get(_DCP_SHARDING)
    if not raw:
        return {}
    try:
        return {k: [int(o) for o in v["saved_offsets"]] for k, v in json.loads(raw).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError(
            f"{path}: not a readable safetensors file ({_DCP_SHARDING} metadata: {e})"
        ) from None


@dataclass(frozen=True)
class Expected:
    """What the checkpointer will ask a checkpoint for (:func:`expected_tensors`)."""

    read: dict[str, tuple[int, ...]]
    """Tensor -> the shape the checkpointer reads it in (the checkpoint's names and layout)."""
    unread: dict[str, tuple[int, ...]]
    """Model tensors it does not read (the tied ``lm_head.weight``) -> the model's shape."""
    ignored: list[str]
    """Regexes of checkpoint tensors the model ignores."""
    model: dict[str, tuple[int, ...]]
    """The model's own shape of each tensor read in another one (fused experts, transposed)."""


def expected_tensors(model_config: Any, hf_assets_path: str | None) -> Expected:
    """What the checkpointer will read, from the flavor's model on the meta device
    through the checkpointer's adapter (built with ``hf_assets_path`` as torchtitan builds it:
    the fused-expert layout it asks for is the checkpoint's there). Not read: the tied
    ``lm_head.weight`` (it is the embedding). Ignored, as transformers ignores them: saved copies
    of buffers the model computes itself (rotary ``inv_freq``) and the HF class's
    ``_keys_to_ignore_on_load_unexpected``."""
    import torch

    from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel, hf_model_class
    from torchtitan_ext.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter

    with torch.device("meta"):
        model = Qwen3VLModel(model_config)
    state = model.state_dict()
    # Built without a path, then given it: the path's index (read by the base class, which warns
    # when there is none) only matters for saving; to_hf reads the path's headers, checked here.
    adapter = Qwen3VLStateDictAdapter(model_config, None)
    adapter.hf_assets_path = hf_assets_path
    try:
        hf = adapter.to_hf(state)
    except (ValueError, KeyError, AttributeError, OSError, struct.error) as e:
        raise WeightsError(
            f"hf_assets_path {hf_assets_path!r}: its safetensors headers / index do not read "
            f"({type(e).__name__}: {e})"
        ) from None
    ignored = [re.escape(n) + "$" for n, _ in model.named_buffers() if n not in state]
    ignored.append(r"rotary_emb\.inv_freq")
    ignored += list(hf_model_class(model_config.hf_config)._keys_to_ignore_on_load_unexpected or [])
    return Expected(
        read={k: tuple(v.shape) for k, v in hf.items()},
        unread={k: tuple(v.shape) for k, v in state.items() if k not in hf},
        ignored=ignored,
        model={k: tuple(state[k].shape) for k, v in hf.items() if state[k].shape != v.shape},
    )


def _layouts(want: Expected, key: str, source: Path, hf_assets_path: str | None) -> str:
    """The other fused-expert layout the adapter would accept for ``key`` ('' if none)."""
    if key not in want.model:
        return ""
    if hf_assets_path and source.resolve() == Path(hf_assets_path).resolve():
        return f" (or {list(want.model[key])}: either fused-expert layout loads)"
    return " (the adapter takes the fused-expert layout from hf_assets_path's safetensors)"


def check_checkpoint(
    source: str | Path, model_config: Any, hf_assets_path: str | None, flavor: str
) -> list[str]:
    """Raise :class:`WeightsError` on the first tensor the checkpoint in ``source`` cannot give
    the model of ``model_config``; return lines for the log (a tied checkpoint's ``lm_head``).

    In order: the index's files exist, every header reads, no tensor is in two files; then for
    each tensor the checkpointer reads: present, the shape it asks for (either fused-expert
    layout, as the adapter decides), a floating-point dtype (an integer tensor would be cast
    silently; float8 / float4 is a quantized checkpoint whose scales the loader does not apply).
    Last, tensors the model has no parameter for are refused: the reader skips them silently, so
    they mean weights that would be lost (another architecture, or a quantized checkpoint's
    ``weight_scale_inv``), where transformers only warns. An ``lm_head.weight`` in a tied
    checkpoint is accepted with a note: transformers ties it when it equals the embedding; the
    trainer uses the embedding as the output layer either way (comparing values would read data).
    """
    d = Path(source)
    found = scan(d)
    if hf_assets_path:  # the checkpointer's adapter parses its index
        read_index(hf_assets_path)
    index = read_index(d) or {}
    want = expected_tensors(model_config, hf_assets_path)
    expected, unread, ignored = want.read, want.unread, want.ignored
    who = f"[model] flavor {flavor!r}"
    missing = [k for k in expected if k not in found]
    if missing:
        more = f" (and {len(missing) - 1} more of its {len(expected)})" if len(missing) > 1 else ""
        key = missing[0]
        where = (
            f"{d / index[key]} does not hold it, though {INDEX} puts it there"
            if key in index
            else f"no *.safetensors in {d} holds it"
        )
        raise WeightsError(f"tensor {key!r}{more} that {who} needs is missing: {where}")
    for key, shape in [*expected.items(), *((k, s) for k, s in unread.items() if k in found)]:
        t = found[key]
        if t.shape != shape:
            raise WeightsError(
                f"{d / t.file}: tensor {key!r} has shape {list(t.shape)}; {who} needs "
                f"{list(shape)}{_layouts(want, key, d, hf_assets_path)}"
            )
        if t.dtype not in FLOAT_DTYPES:
            kind = "a quantized" if t.dtype.startswith("F") else "a non-floating-point"
            raise WeightsError(
                f"{d / t.file}: tensor {key!r} is {t.dtype}, {kind} type the trainer's loader "
                f"would cast as it is into a float parameter; use a checkpoint in "
                f"{' / '.join(FLOAT_DTYPES)}"
            )
    extra = [
        k
        for k in found
        if k not in expected and k not in unread and not any(re.search(p, k) for p in ignored)
    ]
    if extra:
        t = found[extra[0]]
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise WeightsError(
            f"{d / t.file}: tensor {extra[0]!r}{more} is not a weight of {who}: the trainer "
            "would silently not load it (a checkpoint of another architecture, or a quantized "
            "one with scales?)"
        )
    return [
        f"{d / found[k].file}: {k} is not loaded: {who} ties it to the embedding"
        for k in unread
        if k in found
    ]
