"""``[model] patch_embed = "matmul"``: the vision patch embedding as one matmul.

transformers' ``Qwen3VLVisionPatchEmbed`` (and ``Qwen3VLMoeVisionPatchEmbed``, the same code)
runs an ``nn.Conv3d`` whose kernel equals its stride over inputs that are exactly one kernel
each (``[N, C, T, P, P]``): every output is the dot product of one flattened patch with each
filter. :func:`matmul_forward` computes that as ``F.linear(x.view(N, C*T*P*P),
weight.view(out, -1), bias)`` -- the same weights in the same layout (``proj.weight`` stays
``[out, C, T, P, P]``, the state-dict keys and checkpoints are unchanged), only the kernel
differs (a GEMM instead of a convolution, which some backends run much faster). Equal outputs
in float32 to ~1e-6 (``tests/test_qwen3_vl_compile.py``), not bit for bit: the sums run in
another order.

The default, ``"auto"`` (:func:`resolve`), is the matmul where CUDA is present and the conv
elsewhere. On an H200 (bf16, the 2B vision tower, 16,384 patches, forward + backward) the conv
took 16.0 ms and the matmul 0.54 ms (``scripts/gpu_check.py``, 2026-11-26); on a CPU the conv
keeps transformers' own arithmetic, so a CPU job's logits equal a Hugging Face model's loaded
from its export (1e-6) and its first loss equals HF's.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def matmul_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Qwen3VLVisionPatchEmbed.forward`` (transformers 5.x, ``modeling_qwen3_vl.py``) with
    ``self.proj`` (Conv3d, kernel == stride) applied as a matmul on the flattened patches."""
    weight = self.proj.weight
    x = hidden_states.view(-1, weight[0].numel()).to(dtype=weight.dtype)
    return F.linear(x, weight.view(weight.shape[0], -1), self.proj.bias)


def _patch_embed_classes() -> tuple[type, ...]:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionPatchEmbed

    return (Qwen3VLVisionPatchEmbed, Qwen3VLMoeVisionPatchEmbed)


def resolve(kind: str) -> str:
    """``"auto"`` -> ``"matmul"`` where CUDA is present, else ``"conv"``; other kinds as given."""
    if kind != "auto":
        return kind
    return "matmul" if torch.cuda.is_available() else "conv"


def apply(model: nn.Module, kind: str) -> int:
    """Give every Qwen3-VL patch embedding under ``model`` the forward of ``kind`` (a key of
    ``model.PATCH_EMBEDS``, ``"auto"`` resolved here); returns how many were set. ``"conv"``
    restores transformers'."""
    from torchtitan_ext.models.qwen3_vl.model import PATCH_EMBEDS

    if kind not in PATCH_EMBEDS:
        raise ValueError(f"qwen3_vl patch_embed {kind!r}: expected one of {list(PATCH_EMBEDS)}")
    kind = resolve(kind)
    count = 0
    for module in model.modules():
        if isinstance(module, _patch_embed_classes()):
            if kind == "matmul":
                module.forward = types.MethodType(matmul_forward, module)
            else:
                module.__dict__.pop("forward", None)
            count += 1
    return count
