"""Tiny randomly initialised Qwen3-VL models (transformers, built from a config: no download):
``tiny_model`` (whose token ids are the offline processor's special tokens) for the
packing-equivalence tests, ``rope_model`` for ``get_rope_index``; ``run_hf`` runs one sample as
transformers processed it."""

from __future__ import annotations

from typing import Any

import torch


def tiny_model(special: dict[str, int], vocab: int) -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [3, 3, 2],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            deepstack_visual_indexes=[0],
            num_position_embeddings=256,
        ),
        image_token_id=special["image_pad_id"],
        video_token_id=special["video_pad_id"],
        vision_start_token_id=special["vision_start_id"],
        vision_end_token_id=special["vision_end_id"],
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(cfg)


def rope_model() -> torch.nn.Module:
    """The ``Qwen3VLModel`` inside :func:`tiny_model`: its ``get_rope_index`` reads only the
    config (the token ids it is given are its arguments)."""
    ids = {"image_pad_id": 1, "video_pad_id": 2, "vision_start_id": 3, "vision_end_id": 4}
    return tiny_model(ids, vocab=600).model.eval()


def run_hf(model: torch.nn.Module, ref: dict) -> Any:
    """One sample as transformers runs it alone (no grad): the processor's output (``inputs`` of
    ``tests/support/vl_chat.hf_reference``) and its labels; the model computes its own mRoPE
    positions from the ids and grids."""
    with torch.no_grad():
        return model(**ref["inputs"], labels=ref["labels"][None], use_cache=False)
