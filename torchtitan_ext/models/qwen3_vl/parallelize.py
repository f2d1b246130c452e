"""Activation checkpointing, per-block ``torch.compile`` and FSDP2 for the HF Qwen3-VL modules.

Same order and policies as torchtitan's own ``parallelize_llama`` / ``parallelize_qwen3_5``
(AC -> compile -> FSDP), applied to transformers' module tree:

- **AC**: the configured torchtitan policy (``[activation_checkpoint]``: selective, full,
  memory-budget or none) wraps every decoder layer and every vision block.
- **compile** (``[compile] enable`` with "model" in ``components``): each decoder layer and each
  vision block is compiled on its own (repeated structure: one graph, many calls), after
  ``compile.prepare`` removed the per-image loop of the vision attention (compile.py: a bounded
  number of compilations, however the image and patch counts vary).
- **FSDP2**: ``fully_shard`` per decoder layer, per vision block, the rest of the vision tower
  (patch embedding, position table, mergers), the input embedding, final norm + ``lm_head``
  (one unit with the embedding when they are tied) and the root; ``[training]
  mixed_precision_param`` / ``mixed_precision_reduce`` set the policy (bf16 parameters by
  default). As in torchtitan 0.3.0, FSDP is applied at every DP degree (at DP=1 it only installs
  the mixed-precision policy), FSDP's own gradient division is off and the trainer divides by
  the global count of valid tokens. Frozen parameters (``[model] freeze``) need no units of
  their own: FSDP2 reduce-scatters only the parameters that hold a gradient (freeze.py).

Only data parallelism is supported (``partial_dtensor`` backend); tensor, pipeline, context and
expert parallelism are refused before the model is built (preflight.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from torchtitan_ext.models.qwen3_vl import compile as qwen3_vl_compile
from torchtitan_ext.models.qwen3_vl import patch_embed
from torchtitan_ext.models.qwen3_vl.freeze import log_counts
from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel


def parallelize_qwen3_vl(
    model: Qwen3VLModel,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> Qwen3VLModel:
    """torchtitan's ``parallelize_fn`` contract (see ``trainer.py``); returns the same module."""
    if parallelism.spmd_backend != "partial_dtensor":
        # preflight.py refuses this before any model is built; kept for direct API callers.
        raise ValueError(
            "qwen3_vl supports parallelism.spmd_backend = 'partial_dtensor' (FSDP only), got "
            f"{parallelism.spmd_backend!r}"
        )
    log_counts(model, list(model.config.freeze), tied=model.tie_word_embeddings)
    kind = patch_embed.resolve(model.config.patch_embed)
    if kind != "conv":
        logger.info(f"qwen3_vl: vision patch embedding as {kind!r} ([model] patch_embed)")
    block_lists = [model.decoder_layers, model.vision_blocks]
    if ac_config is not None:
        policy = ac_config.build(dump_folder=dump_folder)
        for blocks in block_lists:
            policy.apply(_Blocks(blocks))
    if compile_config.enable and "model" in compile_config.components:
        qwen3_vl_compile.compile_blocks(model, compile_config.backend)
        logger.info("qwen3_vl: compiled each decoder layer and vision block with torch.compile")
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp(
        model,
        parallel_dims.get_mesh(names),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        cpu_offload=training.enable_cpu_offload,
    )
    return model


class _Blocks(nn.Module):
    """Presents a ModuleList as ``.layers``: torchtitan's AC policies wrap ``model.layers``'s
    children in place (the list object is shared, so the HF model sees the wrapped blocks)."""

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.layers = blocks


def apply_fsdp(
    model: Qwen3VLModel,
    mesh: Any,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward_policy: str = "default",
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` the units listed in the module docstring, innermost first."""
    import torchtitan.distributed.fsdp as tt_fsdp

    kw: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
        ),
    }
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    reshard = tt_fsdp.get_fsdp_reshard_after_forward_policy(reshard_after_forward_policy, False)
    last_reshard = reshard_after_forward_policy == "always"
    for block in model.vision_blocks:
        fully_shard(block, **kw, reshard_after_forward=reshard)
    fully_shard(model.model.visual, **kw, reshard_after_forward=reshard)
    for layer in model.decoder_layers:
        fully_shard(layer, **kw, reshard_after_forward=reshard)
    if model.tie_word_embeddings:
        # One parameter in two modules: FSDP2 needs them in one unit.
        fully_shard(
            [model.embed_tokens, model.norm, model.lm_head],
            **kw,
            reshard_after_forward=last_reshard,
        )
    else:
        fully_shard(model.embed_tokens, **kw, reshard_after_forward=reshard)
        # not resharded after forward by default: FSDP would prefetch it right away for backward
        fully_shard([model.norm, model.lm_head], **kw, reshard_after_forward=last_reshard)
    fully_shard(model, **kw)
    # Looked up at call time: torchtitan_ext.cpu_compat wraps it for gloo (SUM reductions).
    tt_fsdp.disable_fsdp_gradient_division(model)
