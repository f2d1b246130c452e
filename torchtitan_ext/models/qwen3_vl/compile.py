"""``torch.compile`` of the qwen3_vl blocks without a recompile per batch.

``parallelize.py`` compiles each decoder layer and each vision block on its own. Left as
transformers wrote them, the vision blocks recompiled for almost every batch (CPU, tiny config,
aot_eager: 11-17 s steps at steps 2, 4, 8, ... until dynamo's recompile limit switched them,
*and the decoder layers that share their code object* ``GradientCheckpointingLayer.__call__``,
back to eager): transformers' ``Qwen3VLVisionAttention.forward`` (and ``Qwen3VLMoeVisionAttention``'s,
the same code), for every non-flash implementation, splits q/k/v by
``(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()`` and loops over the images in Python. The
``.tolist()`` is a graph break and the list's length (the image count) a guard, so each new
image count or patch count compiled again.

What changes (only when compile is on: :func:`compile_blocks`, called by ``parallelize.py``;
eager training keeps transformers' path, which is as fast there, see below):

- **vision attention** (:func:`prepare`): each ``Qwen3VL(Moe)VisionAttention`` instance's
  ``forward`` is swapped for :func:`vision_attention_forward`, which replaces *only* the
  ``else:`` branch of ``modeling_qwen3_vl.py`` ``Qwen3VLVisionAttention.forward`` ("Other
  implementations: Process each chunk separately") by :func:`segment_attention`: the segments
  (one per image frame, from ``cu_seqlens``) are gathered into ``[segments, longest, ...]``,
  padded with a zero row, and attended in **one** SDPA call whose key mask hides the padding;
  an index puts the rows back in order. The index tensors (:func:`vision_layout`) are built
  once per vision forward by a forward pre-hook on the vision tower, outside the compiled
  blocks, and reach the attention through transformers' ``**kwargs``. The qkv projection, the
  vision RoPE and the output projection are transformers' lines; flash-attention
  implementations (varlen kernels, no loop) keep transformers' forward. Modules, parameters and
  state-dict keys are untouched (instance attributes, no new module). Every real row attends
  exactly the keys of its own segment, as in the per-image loop: equal outputs and gradients
  (``tests/test_qwen3_vl_compile.py``, 1e-5).
- **why not one block-diagonal mask over all patches**: measured on this CPU (1 thread, fwd +
  bwd of the attention alone, 16 images / 4500 patches, 2 heads of 16): transformers' loop
  0.044-0.061 s, the padded segments 0.042-0.045 s, a dense ``[N, N]`` block-diagonal mask
  0.82-0.98 s (it computes every cross-image score: ~16x the work at 16 images); in training
  the dense mask made compiled (aot_eager) steps 2.7-4.2 s against 0.65-1.1 s. The padded
  segments are as fast as the loop eagerly too, so eager keeps transformers' code (no gain).
- **dynamic dims instead of patch buckets**: the vision blocks are compiled with
  ``dynamic=True``: the patch count, the segment count and the longest segment are symbols,
  not guards, so one graph serves every batch (the first compilation may still specialise
  what the first batch happens to make equal; in the recompile test the vision block compiles
  twice, then never again). Backends add their own guards: inductor's CPU code generator
  guards reductions over more than 4096 rows (``need_use_acc_helper``), so a block first
  compiled for more than 4096 patches compiles once more for a batch with fewer (measured: tiny
  config, inductor, 5 frames at step 1 and 1 at step 3, none in later steps). A one-segment
  batch gets an empty second segment
  (:func:`vision_layout`) because dynamo always specialises a dimension of size 1. Padding
  the patches to buckets would cost one compilation per bucket plus the padded rows' compute;
  it was not needed for the bound, and the speed of a static against a dynamic graph was not
  measured (a GPU run could still prefer buckets for inductor's static kernels).
- **language model**: nothing to swap. The loader's ``[dataloader] buckets`` give a few
  sequence lengths; the causal/packed mask (``create_causal_mask``), the mRoPE tables and the
  DeepStack injection of visual embeddings (``Qwen3VLTextModel._deepstack_process``, a boolean
  index whose size is the image-token count) all run *between* the compiled decoder layers, so a
  layer sees only ``[B, L, D]`` hidden states, a ``[B, 1, L, L]`` mask and ``[B, L, d]``
  cos/sin. Compiled with dynamo's default (automatic dynamic shapes): one compilation for the
  first bucket, one with a symbolic length at the second, none after (at most one per bucket).

:func:`compile_counts` reads dynamo's counters; ``benchmarks/vl_train.py`` and the recompile test
report them.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LAYOUT_KWARG = "vision_layout"
"""Keyword under which :func:`prepare`'s hook hands :func:`vision_layout` to the attention (it
travels with transformers' ``**kwargs`` from ``Qwen3VLVisionModel.forward`` through each block)."""


def vision_layout(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors that lay ``N`` packed patch rows out as ``[segments, longest, ...]``.

    ``cu_seqlens`` is ``[0, l0, l0 + l1, ...]`` (transformers' ``get_vision_cu_seqlens``: one
    segment per image frame). Returns ``(gather, keep, scatter)``: ``gather [S, Lmax]`` the row
    of each (segment, position), ``N`` (a zero row appended by the attention) where the segment
    is shorter; ``keep [S, Lmax]`` True on real positions (the attention's key mask); a single
    segment gets an empty second one (keeping only its first key, the zero row), so ``S >= 2``;
    ``scatter [N]`` the flat ``segment * Lmax + position`` of each row, to put the rows back in
    order. Computed outside the compiled blocks (it needs the longest length on the host, one
    sync per step, as transformers' own ``.tolist()``), once per vision forward."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    if lengths.numel() < 2:
        # dynamo specialises a dimension of size 1 (a one-image batch would compile again): add
        # an empty segment, which attends to the zero row only (a fully masked row is NaN)
        starts = F.pad(starts, (0, 2 - lengths.numel()), value=int(cu_seqlens[-1]))
        lengths = F.pad(lengths, (0, 2 - lengths.numel()))
    n = int(cu_seqlens[-1])
    longest = int(lengths.max())
    pos = torch.arange(longest, device=cu_seqlens.device)
    keep = pos[None, :] < lengths[:, None]
    gather = torch.where(keep, starts[:, None] + pos[None, :], n)
    keep[:, 0] = True  # the empty segment's one key: the zero row
    rows = torch.arange(n, device=cu_seqlens.device)
    seg = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    scatter = seg * longest + rows - starts[seg]
    return gather, keep, scatter


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of ``q, k, v [heads, N, d]`` within each segment of ``layout``, as one SDPA
    call over ``[segments, heads, Lmax, d]`` with the padded keys masked; returns ``[N, heads,
    d]``. Each real row sees exactly the keys of its own segment, as in transformers' per-image
    loop; padded query rows are computed and dropped."""
    gather, keep, scatter = layout
    heads, _, dim = q.shape

    def padded(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat([t, t.new_zeros(heads, 1, dim)], dim=1)  # row N: the padding row
        return t[:, gather].transpose(0, 1)  # [S, heads, Lmax, d]

    out = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), attn_mask=keep[:, None, None, :], dropout_p=dropout,
        scale=scale,
    )  # fmt: skip
    out = out.transpose(1, 2).reshape(-1, heads, dim)  # [S * Lmax, heads, d]
    return out.index_select(0, scatter)


def vision_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seqlen: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Qwen3VLVisionAttention.forward`` (transformers 5.x, ``modeling_qwen3_vl.py``) with its
    non-flash branch (split by ``cu_seqlens.tolist()``, one attention call per image) replaced
    by :func:`segment_attention` (see the module docstring).

    Bound to an instance by :func:`prepare`; the qkv projection, the rotary embedding and the
    output projection are transformers' lines. The attention itself is
    ``F.scaled_dot_product_attention`` whatever ``attn_implementation`` says (sdpa, eager or
    flex give the same softmax attention; flash implementations are never swapped)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    layout = kwargs.get(LAYOUT_KWARG)
    if layout is None:  # called without prepare's hook (e.g. the block on its own)
        layout = vision_layout(cu_seqlens)
    seq_length = hidden_states.shape[0]
    q, k, v = (
        self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3)
    ).unbind(0)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    dropout = 0.0 if not self.training else self.attention_dropout
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, head_dim]
    out = segment_attention(q, k, v, layout, self.scaling, dropout)
    return self.proj(out.reshape(seq_length, -1).contiguous())


def _add_layout(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the vision tower: :func:`vision_layout` of this call's
    ``cu_seqlens`` (transformers' ``get_vision_cu_seqlens`` of ``grid_thw``) into ``kwargs``."""
    from transformers.vision_utils import get_vision_cu_seqlens

    grid_thw = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
    cu = kwargs.get("cu_seqlens")
    if cu is None:
        cu = get_vision_cu_seqlens(grid_thw)
    kwargs[LAYOUT_KWARG] = vision_layout(cu.to(grid_thw.device))
    return args, kwargs


def _vision_attention_classes() -> tuple[type, ...]:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionAttention

    return (Qwen3VLVisionAttention, Qwen3VLMoeVisionAttention)


def _vision_tower_classes() -> tuple[type, ...]:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    return (Qwen3VLVisionModel, Qwen3VLMoeVisionModel)


def prepare(model: nn.Module) -> int:
    """Swap the forward of every non-flash vision attention under ``model`` (see the module
    docstring); returns how many were swapped. Idempotent; the modules and their weights stay."""
    from transformers.utils.generic import is_flash_attention_requested

    swapped = 0
    for module in model.modules():
        if isinstance(module, _vision_tower_classes()) and not getattr(module, "_layout_hook", 0):
            if not is_flash_attention_requested(module.config):
                module.register_forward_pre_hook(_add_layout, with_kwargs=True)
                module._layout_hook = True
        if not isinstance(module, _vision_attention_classes()):
            continue
        if is_flash_attention_requested(module.config):
            continue
        module.forward = types.MethodType(vision_attention_forward, module)
        swapped += 1
    return swapped


def compile_blocks(model: nn.Module, backend: str) -> None:
    """``torch.compile`` each decoder layer and each vision block of a ``Qwen3VLModel`` on its
    own (``parallelize.py``'s compile step), after :func:`prepare`."""
    torch._dynamo.config.capture_scalar_outputs = True  # MoE routing (as torchtitan)
    prepare(model)
    for layer in model.decoder_layers:
        layer.compile(backend=backend, fullgraph=False)
    for block in model.vision_blocks:
        block.compile(backend=backend, fullgraph=False, dynamic=True)


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counts so far: ``frames`` (frames compiled, each compilation and
    recompilation of a function, graph-break resumes included) and ``graphs`` (FX graphs
    produced)."""
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["ok"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
    }
