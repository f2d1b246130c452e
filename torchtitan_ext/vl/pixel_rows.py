"""A pack's uint8 pixel rows left where they lie: :class:`PixelRows`, views of a sample store's
memory maps, one per sample, that a collate copying the pixels anyway reads straight from.

Why: a planned pack (``vl/plan.py``) gathers its samples from several places in the store, so
its ``pixel_u8`` tensor is a new array (one copy); the torchtitan layout then copies the rows
again into per-image padding (``collate_torchtitan._pad_per_image``). A packed cache's pack is
one slice of its mapping (a view) and pays only the second copy. With ``copy_pixels=False``
(asked for by the loaders exactly when the collate copies the pixels: ``PackCollator.
copies_pixels``) a planned pack carries a ``PixelRows`` instead, and the pixels are copied once,
from the store's pages into the batch.

Contract: ``rows.tensor()`` is bitwise the ``pixel_u8`` of the same pack read with
``copy_pixels=True``; ``rows[lo:hi]`` is rows ``lo:hi`` of it (a view of the store's map when
the range lies in one sample, as every image's rows do). A ``PixelRows`` pickles as its rows
(one compact array, never the maps it views).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch


@dataclass(frozen=True)
class PixelRows:
    """uint8 rows [N, D] as consecutive segments (views), in the pack's row order."""

    segments: tuple[np.ndarray, ...]
    """Each [n_k, D] uint8; the rows are their concatenation."""
    patch_dim: int
    """D (so an empty ``PixelRows`` still has a shape)."""
    starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The first row of each segment, then N (plain ints: a lookup per image is a bisect)."""

    def __post_init__(self) -> None:
        starts = tuple(accumulate((len(s) for s in self.segments), initial=0))
        object.__setattr__(self, "starts", starts)

    @classmethod
    def of(
        cls, parts: Sequence[torch.Tensor | np.ndarray | PixelRows], patch_dim: int
    ) -> PixelRows:
        """The rows of ``parts`` one after the other (CPU tensors and arrays are viewed, not
        copied; a ``PixelRows`` contributes its segments)."""
        segments: list[np.ndarray] = []
        for p in parts:
            if isinstance(p, PixelRows):
                segments.extend(p.segments)
            elif isinstance(p, torch.Tensor):
                segments.append(p.numpy())
            else:
                segments.append(p)
        return cls(tuple(s for s in segments if len(s)), patch_dim)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.starts[-1], self.patch_dim)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, rows: slice) -> np.ndarray:
        """Rows ``rows.start:rows.stop`` (step 1): a view when they lie in one segment."""
        lo, hi, step = rows.indices(len(self))
        if step != 1:
            raise ValueError("PixelRows takes a plain row range")
        hi = max(hi, lo)
        k = bisect_right(self.starts, lo) - 1  # the segment holding row lo
        if k >= len(self.segments):  # an empty range at the end
            return np.zeros((0, self.patch_dim), dtype=np.uint8)
        s = self.starts[k]
        if hi <= self.starts[k + 1]:
            return self.segments[k][lo - s : hi - s]
        last = bisect_left(self.starts, hi)  # segments k .. last-1 hold the range
        pieces = [self.segments[j] for j in range(k, last)]
        pieces[0] = pieces[0][lo - s :]
        pieces[-1] = pieces[-1][: hi - self.starts[last - 1]]
        return np.concatenate(pieces)

    def numpy(self) -> np.ndarray:
        """All rows in one new array (the one copy a materialised pack pays)."""
        if not self.segments:
            return np.zeros((0, self.patch_dim), dtype=np.uint8)
        return np.concatenate(self.segments)

    def tensor(self) -> torch.Tensor:
        """All rows as a new uint8 tensor [N, D]: the pack's ``pixel_u8``."""
        return torch.from_numpy(self.numpy())

    def __reduce__(self):
        return (PixelRows, ((self.numpy(),), self.patch_dim))


def pixel_tensor(pixels: torch.Tensor | PixelRows) -> torch.Tensor:
    """A pack's ``pixel_u8`` as a tensor (a ``PixelRows`` is gathered: one copy)."""
    return pixels.tensor() if isinstance(pixels, PixelRows) else pixels


def cat_pixel_rows(parts: Sequence[torch.Tensor | PixelRows]) -> torch.Tensor | PixelRows:
    """The packs' pixel rows one after the other: as ``cat_rows`` when every part is a tensor
    (the one tensor itself for one pack), else one ``PixelRows`` viewing them all."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=0)
    return PixelRows.of(parts, int(parts[0].shape[-1]))
