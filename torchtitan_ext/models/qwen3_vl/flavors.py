"""Qwen3-VL flavors: the Hugging Face ``config.json`` of each published checkpoint, as Python.

A flavor is the ``Qwen3VLConfig`` / ``Qwen3VLMoeConfig`` keyword arguments that
``transformers`` builds the architecture from; nothing else about the model is chosen here.
When ``hf_assets_path`` holds a ``config.json`` the job refuses to start unless every
architecture field of it equals the flavor's (:func:`architecture_mismatches`), so a wrong value
below can never silently build a model that does not fit the weights.

=================  ======  ======  =====  =====  ===  ====================  ===========  ==========
flavor             layers  hidden  ffn    heads  kv   vision depth/hid/out   tied embed   MoE
=================  ======  ======  =====  =====  ===  ====================  ===========  ==========
``debugmodel``     2       64      128    4      2    2 / 32 / 64           no           --
``debugmodel_moe`` 2       64      128    4      2    2 / 32 / 64           no           4 x 48, top 2
``2B``             28      2048    6144   16     8    24 / 1024 / 2048      yes          --
``4B``             36      2560    9728   32     8    24 / 1024 / 2560      yes          --
``8B``             36      4096    12288  32     8    27 / 1152 / 4096      no           --
``32B``            64      5120    25600  64     8    27 / 1152 / 5120      no           --
``30B-A3B``        48      2048    6144   32     4    27 / 1152 / 2048      no           128 x 768, top 8
``235B-A22B``      94      4096    12288  64     4    27 / 1152 / 4096      no           128 x 1536, top 8
=================  ======  ======  =====  =====  ===  ====================  ===========  ==========

Shared by every published flavor: vocabulary 151936, head_dim 128, RMSNorm eps 1e-6, interleaved
mRoPE with sections [24, 20, 20] and theta 5e6, 262144 max positions; vision patch 16, temporal
patch 2, spatial merge 2, 2304 learned position embeddings, ``gelu_pytorch_tanh``, 16 heads,
intermediate 4096 (depth 24) or 4304 (depth 27), DeepStack taps [5, 11, 17] (depth 24) or
[8, 16, 24] (depth 27); special tokens image 151655, video 151656, vision start 151652 and end
151653. MoE flavors: ``decoder_sparse_step`` 1, no ``mlp_only_layers``, ``norm_topk_prob`` true.

Where the numbers come from (this machine has no network, so not from huggingface.co directly;
found with the code-search tools in public repositories):

- **4B**: a verbatim copy of ``Qwen/Qwen3-VL-4B-Instruct/config.json`` (text and vision) kept as
  ``QWEN3_VL_4B_INSTRUCT_CONFIG`` in a public port of kohya-ss/musubi-tuner's Krea 2 encoder.
- **30B-A3B**: ``Qwen/Qwen3-VL-30B-A3B-Instruct/config.json`` transcribed "byte-for-byte" at
  commit ``1fc78ad`` in a public Rust crate's test (text, MoE and vision fields).
- **32B**: a copy of ``Qwen3-VL-32B``'s ``config.json`` (``SHIPPED_CONFIG``) in a public Rust
  crate; the same text sizes in alibaba/Pai-Megatron-Patch
  ``toolkits/distributed_checkpoints_convertor/scripts/qwen3_vl/run_8xH20.sh``.
- **2B, 8B** text sizes and tying (``--untie-embeddings-and-output-weights`` only for 8B, 32B,
  A3B): alibaba/Pai-Megatron-Patch ``run_8xH20.sh`` (Alibaba's own converter, which also gives
  the shared head_dim 128, 262144 positions, vocabulary 151936 and mRoPE [24, 20, 20]); vision
  sizes and DeepStack taps: pytorch/torchtitan ``experiments/qwen3_vl`` flavors "2B" and "8B";
  2B's rope theta 5e6: a Qwen3-VL-2B metadata dump in a public InfiniCore port.
- **235B-A22B**: a public model-architecture note "verified against
  ``Qwen/Qwen3-VL-235B-A22B-Instruct/config.json``" (all text, MoE, vision and token fields) and
  Pai-Megatron-Patch ``run_A22B_16xH20.sh`` (the same sizes). **Not found** in these sources:
  its ``rms_norm_eps``; 1e-6 is used, as in every other Qwen3-VL config, and the
  ``config.json`` check above turns a difference into an error naming the field.

The debug flavors are ours: random weights, a 640-token vocabulary that covers the offline
processor's 574 tokens, and that processor's special-token ids (``tests/test_qwen3_vl_model.py``
checks they agree), so a tiny model trains on CPU in seconds on the shipped sample set.
"""

from __future__ import annotations

import copy
from typing import Any

# Qwen's tokenizer: <|vision_start|> 151652, <|vision_end|> 151653, <|image_pad|> 151655,
# <|video_pad|> 151656 (identical in every published Qwen3-VL config.json above).
QWEN_TOKEN_IDS: dict[str, int] = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
# The offline processor's ids (vl/processor.py: its 14 Qwen special tokens follow a 560-token BPE).
OFFLINE_TOKEN_IDS: dict[str, int] = {
    "image_token_id": 572,
    "video_token_id": 573,
    "vision_start_token_id": 569,
    "vision_end_token_id": 570,
}


def _text(
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv: int,
    *,
    vocab: int = 151936,
    head_dim: int = 128,
    mrope: tuple[int, int, int] = (24, 20, 20),
    theta: float = 5_000_000.0,
    max_positions: int = 262144,
) -> dict[str, Any]:
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": theta,
            "mrope_section": list(mrope),
            "mrope_interleaved": True,
        },
    }


def _moe(experts: int, top_k: int, expert_ffn: int) -> dict[str, Any]:
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_ffn,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _vision(depth: int, hidden: int, ffn: int, out: int, taps: list[int], **kw: Any) -> dict:
    base = {
        "depth": depth,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_heads": 16,
        "out_hidden_size": out,
        "deepstack_visual_indexes": taps,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "num_position_embeddings": 2304,
    }
    base.update(kw)
    return base


def _small_vision(out: int) -> dict:  # ViT of Qwen3-VL 2B / 4B
    return _vision(24, 1024, 4096, out, [5, 11, 17])


def _large_vision(out: int) -> dict:  # ViT of Qwen3-VL 8B / 32B / 30B-A3B / 235B-A22B
    return _vision(27, 1152, 4304, out, [8, 16, 24])


def _flavor(text: dict, vision: dict, *, tie: bool, ids: dict[str, int] = QWEN_TOKEN_IDS) -> dict:
    return {
        "text_config": {**text, "tie_word_embeddings": tie},
        "vision_config": vision,
        "tie_word_embeddings": tie,
        **ids,
    }


_DEBUG_TEXT = _text(2, 64, 128, 4, 2, vocab=640, head_dim=16, mrope=(3, 3, 2), theta=10000.0)
_DEBUG_VISION = _vision(2, 32, 64, 64, [0, 1], num_heads=2, num_position_embeddings=256)

FLAVORS: dict[str, dict[str, Any]] = {
    "debugmodel": _flavor(_DEBUG_TEXT, _DEBUG_VISION, tie=False, ids=OFFLINE_TOKEN_IDS),
    # 2 * 48 != 64: the fused expert tensors are never square, so a transposed checkpoint
    # layout is always detectable from the shapes.
    "debugmodel_moe": _flavor(
        {**_DEBUG_TEXT, **_moe(4, 2, 48)}, _DEBUG_VISION, tie=False, ids=OFFLINE_TOKEN_IDS
    ),
    "2B": _flavor(_text(28, 2048, 6144, 16, 8), _small_vision(2048), tie=True),
    "4B": _flavor(_text(36, 2560, 9728, 32, 8), _small_vision(2560), tie=True),
    "8B": _flavor(_text(36, 4096, 12288, 32, 8), _large_vision(4096), tie=False),
    "32B": _flavor(_text(64, 5120, 25600, 64, 8), _large_vision(5120), tie=False),
    "30B-A3B": _flavor(
        {**_text(48, 2048, 6144, 32, 4), **_moe(128, 8, 768)}, _large_vision(2048), tie=False
    ),
    "235B-A22B": _flavor(
        {**_text(94, 4096, 12288, 64, 4), **_moe(128, 8, 1536)}, _large_vision(4096), tie=False
    ),
}


def is_moe(flavor_config: dict[str, Any]) -> bool:
    return "num_experts" in flavor_config["text_config"]


def flavor_config(flavor: str) -> dict[str, Any]:
    """A deep copy of the flavor's HF config kwargs; ValueError names the known flavors."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown qwen3_vl flavor {flavor!r}; known flavors: {', '.join(FLAVORS)}")
    return copy.deepcopy(FLAVORS[flavor])


def build_hf_config(flavor_cfg: dict[str, Any], attn_implementation: str = "sdpa") -> Any:
    """The transformers config object (``Qwen3VLConfig`` or ``Qwen3VLMoeConfig``)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    cls = Qwen3VLMoeConfig if is_moe(flavor_cfg) else Qwen3VLConfig
    cfg = cls(**copy.deepcopy(flavor_cfg))
    cfg._attn_implementation = attn_implementation
    cfg.text_config._attn_implementation = attn_implementation
    cfg.vision_config._attn_implementation = attn_implementation
    cfg.use_cache = False
    cfg.text_config.use_cache = False
    return cfg


# Fields of config.json that define the architecture (and so must equal the flavor's).
_TOP_FIELDS = ("model_type", "tie_word_embeddings", *QWEN_TOKEN_IDS)
_TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "attention_bias",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
    "norm_topk_prob",
)
_ROPE_FIELDS = ("rope_type", "rope_theta", "mrope_section", "mrope_interleaved")
_VISION_FIELDS = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "out_hidden_size",
    "deepstack_visual_indexes",
    "hidden_act",
    "in_channels",
    "patch_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "num_position_embeddings",
)


def _norm(v: Any) -> Any:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def architecture_mismatches(expected: Any, found: Any) -> list[str]:
    """``field: expected != found`` for every architecture field where two HF configs differ."""
    out = []

    def cmp(prefix: str, a: Any, b: Any, names: tuple[str, ...]) -> None:
        for n in names:
            va, vb = _norm(getattr(a, n, None)), _norm(getattr(b, n, None))
            if isinstance(va, list):
                va = [_norm(x) for x in va]
            if isinstance(vb, list):
                vb = [_norm(x) for x in vb]
            if va != vb:
                out.append(f"{prefix}{n}: flavor {va!r} != config.json {vb!r}")

    cmp("", expected, found, _TOP_FIELDS)
    cmp("text_config.", expected.text_config, found.text_config, _TEXT_FIELDS)
    rope_a = expected.text_config.rope_parameters or {}
    rope_b = found.text_config.rope_parameters or {}
    for n in _ROPE_FIELDS:
        va, vb = _norm(rope_a.get(n)), _norm(rope_b.get(n))
        if isinstance(va, list):
            va, vb = [_norm(x) for x in va], [_norm(x) for x in (vb or [])]
        if va != vb:
            out.append(f"text_config.rope_parameters.{n}: flavor {va!r} != config.json {vb!r}")
    cmp("vision_config.", expected.vision_config, found.vision_config, _VISION_FIELDS)
    return out
