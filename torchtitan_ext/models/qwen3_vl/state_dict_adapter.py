"""Hugging Face checkpoint <-> qwen3_vl state dict, for torchtitan's checkpointer.

Why this mechanism: torchtitan's ``CheckpointManager`` already loads HF safetensors
(``[checkpoint] initial_load_in_hf = true``, path ``hf_assets_path``) through
``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``: every rank asks only for the
slices of each tensor its FSDP shard holds (``safe_open(...).get_slice``), so a 30B or 235B
checkpoint is never materialised whole on one rank, the dtype is cast on the copy, and the same
adapter writes HF safetensors back (``last_save_in_hf``). The alternative,
``from_pretrained`` on every rank then sharding, needs the full model in each rank's memory.

Because :class:`~torchtitan_ext.models.qwen3_vl.model.Qwen3VLModel` registers transformers'
modules under their HF names, the mapping is the identity except for:

- **fused MoE experts** (``mlp.experts.gate_up_proj`` / ``down_proj``): transformers 5 keeps them
  as ``[E, 2I, H]`` / ``[E, H, I]`` while the published Qwen3-VL-MoE checkpoints store
  ``[E, H, 2I]`` / ``[E, I, H]`` (transformers' ``conversion_mapping`` entry ``qwen3_vl_moe``:
  ``Transpose(1, 2, check_dims=True)``). As transformers does, the layout is decided per tensor
  from the checkpoint's own shapes (read from the safetensors headers, no tensor data): a tensor
  whose shape is the model's is taken as is, a transposed one is transposed (as a view: the HF
  reader copies each slice straight into the parameter). An export (:meth:`exporting`, or no HF
  checkpoint in ``hf_assets_path``, so no load to serve) always writes the published layout, as
  contiguous tensors (safetensors refuses views), so every consumer of the published checkpoints
  reads it;
- **tied embeddings** (2B, 4B): the checkpoint has no ``lm_head.weight``; the model's
  ``lm_head.weight`` is the embedding itself, so it is neither read nor written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from torchtitan_ext.models.qwen3_vl.flavors import is_moe
from torchtitan_ext.models.qwen3_vl.weights import read_header

_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
_LM_HEAD = "lm_head.weight"


def safetensors_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for every ``*.safetensors`` file in ``directory`` (headers only;
    a damaged file raises ``weights.WeightsError`` naming it)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        for name, meta in read_header(f).items():
            if name != "__metadata__":
                shapes[name] = tuple(meta["shape"])
    return shapes


class Qwen3VLStateDictAdapter(StateDictAdapter):
    def __init__(self, model_config: Any, hf_assets_path: str | None) -> None:
        super().__init__(model_config, hf_assets_path)
        hf_config = model_config.hf_config
        text = hf_config["text_config"]
        self.tied = bool(hf_config.get("tie_word_embeddings"))
        # The model's (transformers') shapes of the fused expert tensors.
        self.expert_shapes: dict[str, tuple[int, int, int]] = {}
        if is_moe(hf_config):
            e, i, h = text["num_experts"], text["moe_intermediate_size"], text["hidden_size"]
            self.expert_shapes = {
                _EXPERT_SUFFIXES[0]: (e, 2 * i, h),
                _EXPERT_SUFFIXES[1]: (e, h, i),
            }
        self._checkpoint_shapes: dict[str, tuple[int, ...]] | None = None
        self._exporting = False

    @contextmanager
    def exporting(self) -> Iterator[None]:
        """Within: :meth:`to_hf` serves a save (published layout, contiguous), whatever layout
        the checkpoint in ``hf_assets_path`` has. torchtitan calls ``to_hf`` both to read an HF
        checkpoint (where the tensors must be views in *its* layout) and to write one, and cannot
        say which; the caller of the save can (``ExtTrainer``, the export command)."""
        self._exporting = True
        try:
            yield
        finally:
            self._exporting = False

    def write_hf_assets(self, step_dir: str | Path, model_record: dict[str, Any]) -> None:
        """After an export's weights are on disk: ``config.json`` and the job's processor, from
        the checkpoint's model record (:func:`export.write_hf_assets`). The trainer calls this
        on any adapter that has it, so the torchtitan glue names no model."""
        from torchtitan_ext.models.qwen3_vl.export import write_hf_assets

        write_hf_assets(step_dir, model_record["hf_config"], model_record["processor"])

    def _expert_shape(self, key: str) -> tuple[int, int, int] | None:
        for suffix, shape in self.expert_shapes.items():
            if key.endswith(suffix):
                return shape
        return None

    def _checkpoint_shape(self, key: str) -> tuple[int, ...] | None:
        if self._checkpoint_shapes is None:
            path = self.hf_assets_path
            ok = bool(path) and Path(str(path)).is_dir()
            self._checkpoint_shapes = safetensors_shapes(str(path)) if ok else {}
        return self._checkpoint_shapes.get(key)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in state_dict.items():
            if self.tied and key == _LM_HEAD:
                continue
            shape = self._expert_shape(key)
            if shape is not None:
                found = None if self._exporting else self._checkpoint_shape(key)
                if found is None:  # a save: the published layout, packed for safetensors
                    value = value.transpose(1, 2).contiguous()
                elif found != shape:  # a load from the published layout: a view
                    value = value.transpose(1, 2)
            out[key] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in hf_state_dict.items():
            shape = self._expert_shape(key)
            if shape is not None and tuple(value.shape) != shape:
                value = value.transpose(1, 2)
            out[key] = value
        return out
