"""Collate cached Qwen3-VL packs into the two batch formats a trainer consumes.

Input: a list of pack dicts as yielded by ``CachedVLDataset`` (``input_ids`` [L], ``labels`` [L],
``position_ids`` [4, L], ``pixel_u8`` uint8 [N, 768], ``image_grid_thw`` [n_img, 3], ...). Packs
are already padded to a bucket length; a batch is padded to its longest pack (with
``local_batch_size = 1``, the usual choice for 8k packs, nothing is padded and the text tensors are
views). Pixels travel as uint8 (half the bytes of one float32 temporal half, an eighth of the
processor's float32 [N, 1536]); normalisation ``(x/255 - mean)/std`` plus the temporal duplication
happens either here (``normalize_on="collate"``, CPU) or after the host-to-device copy
(``normalize_on="device"``: ``pixel_values`` stays **uint8** [.., 768] and is normalised where it
lands — ``AsyncDeviceLoader`` normalises uint8 ``pixel_values`` right after its copy (its
``PixelNormalize`` default key), or call ``finish_on_device`` yourself). The dtype is the marker:
a float ``pixel_values`` is final, a uint8 one still needs normalising.

Formats
-------
``"hf"`` — keyword arguments of ``transformers.Qwen3VLForConditionalGeneration.forward``::

    input_ids [B, L], labels [B, L] (unshifted: HF shifts inside the loss), position_ids [4, B, L]
    (row 0 = text position restarting at 0 per sample; rows 1..3 = mRoPE t/h/w),
    pixel_values float32 [sum N, 1536], image_grid_thw [n_img, 3], use_cache=False,
    pixel_values_videos float32 [sum N_vid, 1536], video_grid_thw [n_vid, 3] (only when a pack
    holds video: ``vl/video_batch.py``)

  ``attention_mask`` is deliberately absent (None): with no mask, no KV cache and position ids
  that restart per sample, transformers builds a block-causal mask from the position ids (its
  packed-sequence detection), so each sample attends only to itself. ``use_cache=False`` is part of
  the batch because with the cache on the detection is skipped (facts.md: Δlogit 0.49).

``"torchtitan"`` — torchtitan 0.3.0's ``MultiModalCollator`` layout: :mod:`torchtitan_ext.vl.collate_torchtitan`.

``"qwen3_vl"`` — ``(input_dict, labels)`` for torchtitan's trainer and the ``qwen3_vl`` model
(``torchtitan_ext.models.qwen3_vl``, transformers' Qwen3-VL inside): the ``"hf"`` tensors under
torchtitan's names, so the trainer's ``model(input_dict["input"], **rest)`` is the model call::

    input [B, L], position_ids [4, B, L], pixel_values [sum N, 1536] (uint8 [sum N, 768] with
    normalize_on="device"), image_grid_thw [n_img, 3] (both absent in a text-only batch),
    pixel_values_videos, video_grid_thw as in "hf" (absent without video);
    labels [B, L] shifted as in "torchtitan" (torchtitan's loss does not shift)

Cost (``python -m benchmarks vl_dataset``, 2-core box, 8113 tokens / 23 images / 27.6k patches):
fetch + collate 1.7 ms in the HF format with uint8 pixels (B=1: no pixel copy), 2.8 ms in the
torchtitan format (the per-image padding copies ~21 MB of uint8, through numpy: torch's 2-thread
copy measured 23 ms on the loaded box); CPU normalisation (``normalize_on="collate"``) writes
~170 MB of float32 and costs ~70 ms here (up to ~400 ms under load) — the reason pixels travel as
uint8 and are normalised on the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl.collate_parts import (
    BATCH_FORMATS,
    BatchFormat,
    NormalizeOn,
    PixelNorm,
    batch_length,
    cat_rows,
    normalize,
    pad_stack,
    shift_labels,
)
from torchtitan_ext.vl.collate_torchtitan import (
    collate_torchtitan,
    torchtitan_special_tokens,
    zero_padding,
)
from torchtitan_ext.vl.pixel_rows import pixel_tensor
from torchtitan_ext.vl.video_batch import add_videos, finish_videos

__all__ = [
    "BATCH_FORMATS",
    "BatchFormat",
    "NormalizeOn",
    "PackCollator",
    "PixelNorm",
    "collate_hf",
    "collate_qwen3_vl",
    "collate_torchtitan",
    "finish_on_device",
    "normalize",
    "shift_labels",
]


def collate_hf(
    packs: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int,
    norm: PixelNorm = PixelNorm(),
    normalize_on: NormalizeOn = "collate",
    pad_to: int | None = None,
) -> dict[str, Any]:
    """Packs -> Qwen3-VL forward kwargs (see the module docstring)."""
    if not packs:
        raise ValueError("collate_hf needs at least one pack")
    length = batch_length(packs, pad_to)
    pos = pad_stack([p["position_ids"] for p in packs], length, 0)  # [B, 4, L]
    batch: dict[str, Any] = {
        "input_ids": pad_stack([p["input_ids"] for p in packs], length, pad_id),
        "labels": pad_stack([p["labels"] for p in packs], length, IGNORE_INDEX),
        "position_ids": pos.transpose(0, 1),  # [4, B, L]
        "image_grid_thw": cat_rows([p["image_grid_thw"] for p in packs]),
        "use_cache": False,
    }
    pixels = cat_rows([pixel_tensor(p["pixel_u8"]) for p in packs])
    if normalize_on == "collate":
        batch["pixel_values"] = normalize(pixels, norm)
    elif normalize_on == "device":
        batch["pixel_values"] = pixels  # uint8: normalised after the device copy
    else:
        raise ValueError(f"normalize_on must be 'collate' or 'device', got {normalize_on!r}")
    if batch["image_grid_thw"].shape[0] == 0:
        # No image: the model must not see empty image inputs.
        batch.pop("pixel_values")
        batch.pop("image_grid_thw")
    add_videos(batch, packs, mean=norm.mean, std=norm.std, normalize_on=normalize_on)
    return batch


def collate_qwen3_vl(
    packs: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int,
    norm: PixelNorm = PixelNorm(),
    normalize_on: NormalizeOn = "collate",
    pad_to: int | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Packs -> ``(input_dict, labels)`` for the ``qwen3_vl`` model (see the module docstring)."""
    batch = collate_hf(packs, pad_id=pad_id, norm=norm, normalize_on=normalize_on, pad_to=pad_to)
    del batch["use_cache"]  # the model never uses a KV cache
    labels = shift_labels(batch.pop("labels"))
    return {"input": batch.pop("input_ids"), **batch}, labels


def finish_on_device(batch: Any, norm: PixelNorm = PixelNorm()) -> Any:
    """Turn a ``normalize_on="device"`` batch into the final one, on whatever device it lives.

    Accepts either format: an HF kwargs dict with uint8 ``pixel_values`` [N, 768] or a torchtitan
    ``(input_dict, labels)`` with uint8 ``pixel_values`` [n_img, max_patches, 768] (pad rows are
    set back to exactly 0 like torchtitan's collator, using ``grid_thw``). A uint8
    ``pixel_values_videos`` is normalised with the video formula (``vl/video_batch.py``); in the
    torchtitan layout its padding rows are zeroed again from ``grid_thw_videos``.
    Tensors already float (or absent) pass through unchanged.
    """
    if isinstance(batch, tuple):
        input_dict, labels = batch
        return finish_on_device(input_dict, norm), labels
    if not isinstance(batch, dict):
        return batch
    videos = batch.get("pixel_values_videos")
    finish_videos(batch, mean=norm.mean, std=norm.std)
    if isinstance(videos, torch.Tensor) and videos.dim() == 3 and "grid_thw_videos" in batch:
        zero_padding(batch["pixel_values_videos"], batch["grid_thw_videos"])  # torchtitan layout
    u8 = batch.get("pixel_values")
    if not isinstance(u8, torch.Tensor) or u8.dtype != torch.uint8:
        return batch
    values = normalize(u8, norm)
    if u8.dim() == 3:  # torchtitan layout: zero the padding rows again
        values = zero_padding(values, batch["grid_thw"])
    batch["pixel_values"] = values
    return batch


class PackCollator:
    """Picklable collate_fn (DataLoader workers) for either format."""

    def __init__(
        self,
        batch_format: BatchFormat,
        special_tokens: Mapping[str, int],
        norm: PixelNorm = PixelNorm(),
        normalize_on: NormalizeOn = "collate",
        pad_to: int | None = None,
    ) -> None:
        if batch_format not in BATCH_FORMATS:
            raise ValueError(f"batch_format must be one of {BATCH_FORMATS}, got {batch_format!r}")
        if normalize_on not in ("collate", "device"):
            raise ValueError(f"normalize_on must be 'collate' or 'device', got {normalize_on!r}")
        self.batch_format, self.normalize_on, self.norm, self.pad_to = (
            batch_format,
            normalize_on,
            norm,
            pad_to,
        )
        self.special_tokens = dict(special_tokens)
        self.pad_id = torchtitan_special_tokens(special_tokens)["pad_id"]

    @property
    def copies_pixels(self) -> bool:
        """True when no batch holds a pack's own ``pixel_u8`` tensor: the torchtitan layout
        copies it into per-image padding, and ``normalize_on="collate"`` makes new float pixels.
        Then the packs may view the cache's mapping (``CachedVLDataset(copy_pixels=False)``); an
        ``"hf"`` / ``"qwen3_vl"`` batch normalised on the device hands the pack's tensor itself
        to the staging copy, so there the pack keeps its private copy."""
        return self.batch_format == "torchtitan" or self.normalize_on == "collate"

    def __call__(self, packs: Sequence[Mapping[str, torch.Tensor]]) -> Any:
        if self.batch_format == "qwen3_vl":
            return collate_qwen3_vl(
                packs,
                pad_id=self.pad_id,
                norm=self.norm,
                normalize_on=self.normalize_on,
                pad_to=self.pad_to,
            )
        if self.batch_format == "hf":
            return collate_hf(
                packs,
                pad_id=self.pad_id,
                norm=self.norm,
                normalize_on=self.normalize_on,
                pad_to=self.pad_to,
            )
        return collate_torchtitan(
            packs,
            special_tokens=self.special_tokens,
            norm=self.norm,
            normalize_on=self.normalize_on,
            pad_to=self.pad_to,
        )
