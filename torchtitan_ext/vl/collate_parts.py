"""The pieces every Qwen3-VL batch format is made of (``vl/collate.py``,
``vl/collate_torchtitan.py``): the format names, how uint8 patches become the processor's float
patches (:class:`PixelNorm`, :func:`normalize`), padding and stacking packs, and torchtitan's
label shift."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchtitan_ext.constants import IGNORE_INDEX

BatchFormat = Literal["hf", "torchtitan", "qwen3_vl"]
BATCH_FORMATS: tuple[str, ...] = ("hf", "torchtitan", "qwen3_vl")
NormalizeOn = Literal["collate", "device"]


@dataclass(frozen=True)
class PixelNorm:
    """How uint8 patches [N, 3*16*16] become the processor's float patches [N, 3*T*16*16]."""

    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    temporal_patch_size: int = 2
    merge_size: int = 2

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> PixelNorm:
        """Read the values from a cache's ``metadata.json`` (any nesting level, e.g. the
        processor fingerprint's ``image`` table), falling back to Qwen3-VL's for absent keys."""
        found: dict[str, Any] = {}

        def walk(d: Mapping[str, Any]) -> None:
            for k, v in d.items():
                if isinstance(v, Mapping):
                    walk(v)
                elif k not in found:
                    found[k] = v

        walk(metadata)
        d = cls()
        mean = found.get("image_mean", found.get("mean", d.mean))
        std = found.get("image_std", found.get("std", d.std))
        return cls(
            mean=tuple(float(x) for x in mean),  # type: ignore[arg-type]
            std=tuple(float(x) for x in std),  # type: ignore[arg-type]
            temporal_patch_size=int(found.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(found.get("merge_size", found.get("spatial_merge_size", d.merge_size))),
        )


def normalize(pixel_u8: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    """uint8 [..., 768] -> float32 [..., 768 * T] exactly as the HF processor (on any device).

    Delegates to ``device.normalize.normalize_pixels`` (the AsyncDeviceLoader's) when present (one implementation for
    collate and device), else to ``vl.processor.normalize_patches``.
    """
    fn = _normalizer()
    lead = pixel_u8.shape[:-1]
    flat = pixel_u8.reshape(-1, pixel_u8.shape[-1])
    out = fn(flat, mean=norm.mean, std=norm.std, temporal_patch_size=norm.temporal_patch_size)
    return out.reshape(*lead, out.shape[-1])


_NORMALIZER = None


def _normalizer():
    global _NORMALIZER
    if _NORMALIZER is None:
        try:
            from torchtitan_ext.device.normalize import normalize_pixels as fn
        except ImportError:  # staging helper's module absent: the processor has the same op
            from torchtitan_ext.vl.processor import normalize_patches as fn
        _NORMALIZER = fn
    return _NORMALIZER


def pad_stack(tensors: Sequence[torch.Tensor], length: int, value: int) -> torch.Tensor:
    """Stack 1-D (or [..., L]) tensors along a new dim 0, right-padding the last dim."""
    if len(tensors) == 1 and tensors[0].shape[-1] == length:
        return tensors[0].unsqueeze(0)
    out = torch.full((len(tensors), *tensors[0].shape[:-1], length), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, ..., : t.shape[-1]] = t
    return out


def cat_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=0)


def batch_length(packs: Sequence[Mapping[str, torch.Tensor]], pad_to: int | None = None) -> int:
    """Padded length of a batch: the longest pack (a bucket length), or ``pad_to`` if larger."""
    longest = max(int(p["input_ids"].shape[-1]) for p in packs)
    return max(longest, pad_to or 0)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's unshifted labels [B, L] -> torchtitan's: ``out[:, t]`` is the target of token ``t``
    (``labels[:, t + 1]``), -100 at the end. torchtitan's loss compares position ``t`` of the
    logits with position ``t`` of the labels; transformers shifts inside its loss instead."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    return out
