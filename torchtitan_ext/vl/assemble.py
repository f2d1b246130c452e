"""Assembling one pack's tensors from its samples' stored arrays: the one function behind a packed
cache's ``VLCache.pack`` and a plan's ``PlannedStore.pack`` (``vl/plan.py``), so that the two give
bitwise the same pack for the same samples in the same order."""

from __future__ import annotations

import numpy as np
import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl.pixel_rows import PixelRows


def assemble_pack(
    tokens: np.ndarray,
    label_mask: np.ndarray,
    sample_lens: np.ndarray,
    grid_thw: np.ndarray,
    pixels: np.ndarray | PixelRows,
    pad_to: int,
    special_tokens: dict[str, int],
    merge_size: int,
    copy_pixels: bool = True,
    *,
    video_grid_thw: np.ndarray | None = None,
    video_pixels: np.ndarray | None = None,
) -> dict[str, torch.Tensor | PixelRows]:
    """One pack's tensors (``VLCache.pack``'s dict) from its samples' stored arrays, in order:
    padding to ``pad_to``, labels from the mask (each sample's first token never a target) and
    the four position rows per sample (a pure function of its tokens and grids). The one
    assembly of a packed cache's pack and of a planned pack of a sample store (``vl/plan.py``),
    so the two are bitwise equal for the same samples in the same order. A pack holding a video
    (``video_grid_thw`` non-empty: the samples' videos in token order, ``video_pixels`` their
    rows) also gets ``video_u8`` / ``video_grid_thw`` and video positions; a pack without one
    gets neither key, so its dict is what it was before videos. ``pixels`` given as a
    ``PixelRows`` (a planned pack read for a collate that copies the pixels) is the pack's
    ``pixel_u8`` as it is."""
    from torchtitan_ext.vl.positions import pack_position_rows

    tok = tokens.astype(np.int64)
    mask = label_mask.astype(bool)
    grid = grid_thw.astype(np.int64)
    n, L = len(tok), pad_to
    ids = np.full(L, special_tokens["pad_id"], dtype=np.int64)
    ids[:n] = tok
    labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
    labels[:n] = np.where(mask, tok, IGNORE_INDEX)
    lens = sample_lens.astype(np.int64)
    labels[(np.cumsum(lens) - lens)[lens > 0]] = IGNORE_INDEX  # no sample's first token
    pos = np.zeros((4, L), dtype=np.int64)
    # the whole pack at once: per sample exactly position_rows of that sample alone
    has_video = video_grid_thw is not None and len(video_grid_thw) > 0
    vgrid = video_grid_thw.astype(np.int64) if has_video else None
    video_kw = {"video_grid_thw": vgrid, "video_pad_id": special_tokens["video_pad_id"]}
    pos[:, :n] = pack_position_rows(tok, lens, grid, special_tokens["image_pad_id"], merge_size,
                                    **(video_kw if has_video else {}))  # fmt: skip
    pack = {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(pos),
        "seq_lens": torch.from_numpy(sample_lens.astype(np.int32)),
        "pixel_u8": _pixels(pixels, copy_pixels),
        "image_grid_thw": torch.from_numpy(grid),
        "num_tokens": torch.tensor(n, dtype=torch.int64),
    }
    if has_video:  # always a copy: video rows are few next to a pack's tokens
        pack["video_u8"] = torch.from_numpy(np.array(video_pixels, dtype=np.uint8))
        pack["video_grid_thw"] = torch.from_numpy(vgrid)
    return pack


def _pixels(pixels: np.ndarray | PixelRows, copy: bool) -> torch.Tensor | PixelRows:
    """``pixel_u8``: rows left in a sample store stay there (``vl/pixel_rows.py``)."""
    if isinstance(pixels, PixelRows):
        return pixels
    # numpy's copy: torch's clone of a file-backed tensor measured ~20 ms per 1.5 MB here
    return torch.from_numpy(pixels.copy() if copy else pixels)
