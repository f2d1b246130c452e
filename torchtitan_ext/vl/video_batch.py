"""Video in a collated Qwen3-VL batch: a pack's ``video_u8`` / ``video_grid_thw`` become the
model's ``pixel_values_videos`` / ``video_grid_thw``.

A pack dict may carry ``video_u8`` uint8 [N, 1536] (patch rows of ``vl.video``: both temporal
frames real, HF's row order) and ``video_grid_thw`` int64 [n_vid, 3], videos in token order; a
pack without them, or with zero videos, holds no video. The batch keys:

| ``normalize_on`` | ``pixel_values_videos`` | normalised by |
|---|---|---|
| ``"collate"`` | float32 [sum N, 1536], HF's bit for bit | :func:`~torchtitan_ext.vl.video.normalize_video_patches` here |
| ``"device"`` | uint8 [sum N, 1536] | :func:`finish_videos` after the copy (``collate.finish_on_device``) |

Video rows use the video formula ``(x - mean*255) / (std*255)``, not the image one
(``vl.video`` explains why the two can differ in the last bit); the uint8 dtype is the marker
that normalisation is still due, as for ``pixel_values``. A batch without video has neither key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtitan_ext.vl.video import normalize_video_patches

VIDEO_ROWS, VIDEO_GRID = "video_u8", "video_grid_thw"
"""Pack keys."""
BATCH_VIDEOS = "pixel_values_videos"
"""Batch key of the video rows (the grid keeps its name, ``video_grid_thw``)."""


def has_video(packs: Sequence[Mapping[str, Any]]) -> bool:
    """True when any pack holds at least one video."""
    return any(VIDEO_GRID in p and int(p[VIDEO_GRID].shape[0]) > 0 for p in packs)


def add_videos(
    batch: dict[str, Any],
    packs: Sequence[Mapping[str, Any]],
    *,
    mean: Sequence[float],
    std: Sequence[float],
    normalize_on: str,
) -> None:
    """Put the packs' videos into ``batch`` (in place; nothing when no pack holds one)."""
    with_video = [p for p in packs if VIDEO_GRID in p and int(p[VIDEO_GRID].shape[0]) > 0]
    if not with_video:
        return
    rows = [p[VIDEO_ROWS] for p in with_video]
    grids = [p[VIDEO_GRID] for p in with_video]
    u8 = rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
    grid = grids[0] if len(grids) == 1 else torch.cat(grids, dim=0)
    if int(grid.prod(dim=1).sum()) != u8.shape[0]:
        raise ValueError(
            f"video_grid_thw accounts for {int(grid.prod(dim=1).sum())} patches but video rows "
            f"are {u8.shape[0]}"
        )
    if normalize_on == "collate":
        batch[BATCH_VIDEOS] = normalize_video_patches(u8, mean, std)
    else:  # "device": uint8 until finish_videos
        batch[BATCH_VIDEOS] = u8
    batch[VIDEO_GRID] = grid


def finish_videos(batch: dict[str, Any], *, mean: Sequence[float], std: Sequence[float]) -> None:
    """Normalise a uint8 ``pixel_values_videos`` in place (on its device); float passes. Rows
    are the last dim: [N, 1536] (``hf`` / ``qwen3_vl``) or [n_frames, max_patches, 1536]
    (``torchtitan``; its padding rows are the caller's to zero again)."""
    u8 = batch.get(BATCH_VIDEOS)
    if isinstance(u8, torch.Tensor) and u8.dtype == torch.uint8:
        flat = u8.reshape(-1, u8.shape[-1])
        batch[BATCH_VIDEOS] = normalize_video_patches(flat, mean, std).view(u8.shape)
