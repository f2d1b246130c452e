"""torchtitan 0.3.0's own VLM (``qwen3_5``) on a CPU, for the tests that judge the ``torchtitan``
batch format by the code that consumes it (``test_vl_qwen3_5.py``, ``test_vl_video_torchtitan.py``).
Import after ``cpu_compat.apply()`` (the module imports ``torchtitan.models.qwen3_5``)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
import torchtitan.models.qwen3_5 as qwen3_5


@contextlib.contextmanager
def eager_flex_attention() -> Iterator[None]:
    """torchtitan compiles flex attention and its block masks (inductor fails on this CPU for
    the vision mask); the eager forms compute the same function."""
    import torchtitan.models.qwen3_5.vision_encoder as ve
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend
    from torchtitan.models.common.attention import FlexAttention

    saved = ve.compiled_create_block_mask, FlexAttention.__dict__["_compiled_flex_attn"]
    ve.compiled_create_block_mask = create_block_mask
    FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
    backend = get_spmd_backend()
    set_spmd_backend("partial_dtensor")  # what cpu_compat gives a CPU job; no DP mesh here
    try:
        yield
    finally:
        set_spmd_backend(backend)
        ve.compiled_create_block_mask, FlexAttention._compiled_flex_attn = saved


def small_qwen3_5(vocab: int, n_layers: int = 2):
    """torchtitan's qwen3_5 debugmodel with a small vocabulary and full attention in every layer
    (its GatedDeltaNet layers need fla + CUDA); vision encoder and MRoPE as in the debugmodel."""
    cfg = qwen3_5.qwen3_5_configs["debugmodel"]("flex")
    cfg.vocab_size = cfg.tok_embeddings.num_embeddings = cfg.lm_head.out_features = vocab
    rope = next(layer.attention for layer in cfg.layers if layer.attention is not None).rope
    cfg.layers = qwen3_5._build_qwen35_layers(
        rope=rope, attn_backend="flex", n_layers=n_layers, dim=256, n_heads=4, n_kv_heads=2,
        head_dim=64, rotary_dim=16, hidden_dim=512, n_key_heads=2, n_value_heads=4,
        key_head_dim=64, value_head_dim=64, full_attention_interval=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return cfg, model.eval()


def trainer_stub(cfg, model) -> types.SimpleNamespace:
    """What ``Trainer.post_dataloading_process`` reads of ``self`` for one CPU model, no CP."""
    return types.SimpleNamespace(
        model_config=cfg,
        model_parts=[model],
        parallel_dims=types.SimpleNamespace(cp_enabled=False),
        config=types.SimpleNamespace(
            parallelism=types.SimpleNamespace(spmd_backend="partial_dtensor")
        ),
        ntokens_seen=0,
    )
