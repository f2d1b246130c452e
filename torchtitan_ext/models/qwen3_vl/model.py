"""Qwen3-VL as a torchtitan model: transformers' own modules behind torchtitan's model protocol.

The architecture is ``transformers.Qwen3VLForConditionalGeneration`` (dense) or
``Qwen3VLMoeForConditionalGeneration`` (MoE), built from the flavor's HF config; nothing of it is
re-implemented here. :class:`Qwen3VLModel` registers the HF model's two top-level children under
their HF names (``model`` = vision tower + language model, ``lm_head``), so its state-dict keys
*are* the keys of a Hugging Face checkpoint (``model.language_model.layers.0...``,
``model.visual.blocks.0...``, ``lm_head.weight``), and adds what torchtitan's trainer needs:

- ``forward(tokens, *, position_ids, pixel_values=None, image_grid_thw=None,
  pixel_values_videos=None, video_grid_thw=None)`` -> logits ``[B, L, V]`` (hidden states when
  a ``ChunkedLossWrapper`` set ``_skip_lm_head``). The trainer calls it as
  ``model(input_dict["input"], **rest_of_input_dict)``, which is exactly what the ``cached_vl``
  loader's ``batch_format = "qwen3_vl"`` yields.
- ``init_states``: HF's own ``_init_weights`` on every module (seeded by torchtitan), including
  the rotary ``inv_freq`` buffers that a meta-device build leaves empty.
- ``Config.get_nparams_and_flops`` for torchtitan's MFU (language model only, active experts).

Packed samples stay independent: ``attention_mask`` is never passed, ``use_cache`` is off and
row 0 of ``position_ids`` restarts at 0 for every sample, so transformers builds a causal mask
that is also block-diagonal per sample (its packed-sequence detection in ``create_causal_mask``);
the vision tower attends within each image and each video frame (``cu_seqlens`` from
``image_grid_thw`` / ``video_grid_thw``); mRoPE rows 1-3 restart per sample too. ``tests/test_qwen3_vl_train.py`` checks a pack's logits through the
torchtitan-built model against its samples run alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torchtitan.protocols.model import BaseModel

from torchtitan_ext.models.qwen3_vl import patch_embed
from torchtitan_ext.models.qwen3_vl.flavors import build_hf_config, is_moe

ATTN_BACKENDS = {"sdpa": "sdpa", "eager": "eager"}
"""``[model] attn_backend`` -> transformers' attention implementation. "sdpa" (default) keeps
each sample of a pack to itself through the position ids (``packed == unpacked`` holds on CPU and
on an H200); "eager" is the reference. No "flex": transformers 5.23's Qwen3-VL refuses
``flex_attention`` when the model is built (``_flex_attn_can_dispatch``)."""


COMPONENTS = ("vision", "merger", "language_model", "embeddings", "lm_head")
"""Names ``[model] freeze`` accepts (which parameters each covers: ``component_of``)."""

PATCH_EMBEDS = ("auto", "conv", "matmul")
"""``[model] patch_embed``: transformers' Conv3d, the same weights as one matmul
(patch_embed.py), or ``"auto"`` (the default): the matmul where CUDA is present, the conv
elsewhere (patch_embed.resolve)."""


def hf_model_class(flavor_cfg: dict[str, Any]) -> type:
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    return (
        Qwen3VLMoeForConditionalGeneration
        if is_moe(flavor_cfg)
        else Qwen3VLForConditionalGeneration
    )


def build_hf_model(flavor_cfg: dict[str, Any], attn_implementation: str = "sdpa") -> nn.Module:
    """The plain transformers model of a flavor (on the current default device / dtype)."""
    return hf_model_class(flavor_cfg)(build_hf_config(flavor_cfg, attn_implementation))


class Qwen3VLModel(BaseModel):
    """torchtitan model protocol around a transformers Qwen3-VL (see the module docstring)."""

    _skip_lm_head: bool = False

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        flavor: str = "debugmodel"
        """Name of the flavor the HF config came from (for logs and errors)."""

        hf_config: dict[str, Any] = field(default_factory=dict)
        """``Qwen3VLConfig`` / ``Qwen3VLMoeConfig`` keyword arguments (see flavors.py)."""

        attn_backend: str = "sdpa"
        """Key of :data:`ATTN_BACKENDS`."""

        freeze: list[str] = field(default_factory=list)
        """Components kept fixed (``[model] freeze``): keys of :data:`COMPONENTS`."""

        patch_embed: str = "auto"
        """``[model] patch_embed``: a key of :data:`PATCH_EMBEDS`."""

        def option_problem(self) -> str | None:
            """What is wrong with the ``[model]`` options (``freeze``, ``patch_embed``), as one
            sentence naming the key, or None. The config loader asks right after the command
            line is applied, so a bad value is refused before any other check or build."""
            from torchtitan_ext.models.qwen3_vl.freeze import freeze_problem

            tied = bool(self.hf_config.get("tie_word_embeddings"))
            problem = freeze_problem(self.freeze, tied=tied)
            if problem:
                return f"[model] freeze = {list(self.freeze)}: {problem}"
            if self.patch_embed not in PATCH_EMBEDS:
                return (
                    f"[model] patch_embed = {self.patch_embed!r}: expected one of "
                    f"{', '.join(repr(p) for p in PATCH_EMBEDS)}"
                )
            return None

        def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
            # Nothing to take from the job: the HF config is complete, and the token ids, pack
            # length and batch format are checked before anything is built (preflight.py).
            return None

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            return count_params_and_flops(model, self.hf_config, seq_len)

    def __init__(self, config: Config) -> None:
        super().__init__()
        if config.attn_backend not in ATTN_BACKENDS:
            raise ValueError(
                f"qwen3_vl attn_backend {config.attn_backend!r}: expected one of "
                f"{sorted(ATTN_BACKENDS)}"
            )
        # Imported here: freeze.py reads this module's COMPONENTS.
        from torchtitan_ext.models.qwen3_vl.freeze import apply_freeze, freeze_problem

        problem = freeze_problem(
            config.freeze, tied=bool(config.hf_config.get("tie_word_embeddings"))
        )
        if problem:
            raise ValueError(f"qwen3_vl freeze {config.freeze}: {problem}")
        hf = build_hf_model(config.hf_config, ATTN_BACKENDS[config.attn_backend])
        patch_embed.apply(hf, config.patch_embed)  # checked by the preflight; raises if bad
        self.config = config
        # The HF wrapper is kept unregistered (its children are registered below under the same
        # names), for its config and its _init_weights.
        object.__setattr__(self, "_hf", hf)
        self.model = hf.model
        self.lm_head = hf.lm_head
        apply_freeze(self, config.freeze, tied=self.tie_word_embeddings)

    # -- torchtitan protocol -------------------------------------------------------------------
    @property
    def hf_config(self) -> Any:
        return self._hf.config

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self._hf.config.tie_word_embeddings)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.language_model.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self.model.language_model.norm

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.language_model.layers

    @property
    def vision_blocks(self) -> nn.ModuleList:
        return self.model.visual.blocks

    def verify_module_protocol(self) -> None:
        """HF submodules are plain ``nn.Module`` (not torchtitan ``Module``): nothing to verify,
        initialisation is :meth:`init_states`'s."""

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids.dim() != 3 or position_ids.shape[0] != 4:
            raise ValueError(
                "qwen3_vl expects position_ids [4, B, L] (text row + 3 mRoPE rows), got "
                f"{tuple(position_ids.shape)}; use the cached_vl loader's batch_format 'qwen3_vl'"
            )
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw must be given together")
        if (pixel_values_videos is None) != (video_grid_thw is None):
            raise ValueError("pixel_values_videos and video_grid_thw must be given together")
        for name, px in (
            ("pixel_values", pixel_values),
            ("pixel_values_videos", pixel_values_videos),
        ):
            if px is not None and px.dtype == torch.uint8:
                # transformers would cast the raw bytes to float without a word
                raise ValueError(
                    f"qwen3_vl got uint8 {name}: a normalize_on='device' batch must pass the "
                    "loader's finish_on_device after its copy"
                )
        out = self.model(
            input_ids=tokens,
            position_ids=position_ids,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw,
            use_cache=False,
        )
        hidden = out.last_hidden_state
        if self._skip_lm_head:
            return hidden
        return self.lm_head(hidden)

    @torch.no_grad()
    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """Random init exactly as transformers' ``_init_weights`` (torchtitan seeds the RNG).

        Called after ``to_empty``: every parameter and every buffer (the rotary ``inv_freq``
        tables are non-persistent buffers computed in ``__init__``, so a meta-device build
        leaves them empty) is written here. HF weights, when configured, are loaded afterwards
        by torchtitan's checkpointer.
        """
        hf = self._hf
        for module in hf.modules():
            hf._init_weights(module)
        if self.tie_word_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            raise RuntimeError(
                "qwen3_vl: tied embeddings lost their tie during materialisation (lm_head and "
                "embed_tokens no longer share one parameter)"
            )


def _active_params(model: nn.Module, hf_config: dict[str, Any]) -> tuple[int, int, int]:
    """(all parameters, language-model parameters that multiply per token, embeddings)."""
    text = hf_config["text_config"]
    total = sum(p.numel() for p in model.parameters())
    lm = sum(p.numel() for n, p in model.named_parameters() if ".visual." not in f".{n}")
    embed = text["vocab_size"] * text["hidden_size"]
    per_token = lm - (0 if hf_config.get("tie_word_embeddings") else embed)
    if is_moe(hf_config):
        expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        per_token -= expert - expert * text["num_experts_per_tok"] // text["num_experts"]
    return total, per_token, embed


def count_params_and_flops(
    model: nn.Module, hf_config: dict[str, Any], seq_len: int
) -> tuple[int, int]:
    """torchtitan's convention (``models/utils.get_dense_model_nparams_and_flops``): 6 x the
    parameters each token multiplies (MoE: the routed top-k share of the experts) + attention
    ``6 * layers * heads * (qk + v head dims) * seq_len``. The vision tower is left out (its cost
    is per image patch, not per token), so MFU here is the language model's."""
    text = hf_config["text_config"]
    total, per_token, _ = _active_params(model, hf_config)
    attn = 6 * text["num_hidden_layers"] * text["num_attention_heads"] * 2 * text["head_dim"]
    return total, 6 * per_token + attn * seq_len
