"""One shard of the packed VL cache (``vl/cache.py``): its columns mapped read-only on first use
(``np.memmap`` mode ``"c"``: ``O_RDONLY`` + copy-on-write, so nothing written to an array reaches
the file), and its pack index checked against the shard's counts before any pack is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_ext.vl.format import COLUMNS, ITEMSIZE, CacheError, column_shape


class _Shard:
    """One shard's arrays, mapped read-only (copy-on-write) on first use and index-checked."""

    __slots__ = ("cols", "doc", "path", "rel", "shapes")

    def __init__(self, path: Path, rel: str, doc: dict[str, Any], patch_dim: int, video_dim: int):
        self.path, self.rel, self.doc = path, rel, doc
        self.shapes = {c.name: column_shape(c, doc, patch_dim, video_dim) for c in COLUMNS}
        self.cols: dict[str, np.ndarray] | None = None

    def files(self) -> dict[str, int]:
        """``name.memmap`` -> expected bytes, for the columns that have rows (and so a file)."""
        out = {}
        for name, shape in self.shapes.items():
            n = shape[0] * (shape[1] if len(shape) > 1 else 1) * ITEMSIZE[name]
            if n:
                out[f"{name}.memmap"] = n
        return out

    def arrays(self, seq_len: int) -> dict[str, np.ndarray]:
        if self.cols is None:
            cols = {}
            for c in COLUMNS:
                shape = self.shapes[c.name]
                if int(np.prod(shape)) == 0:
                    cols[c.name] = np.zeros(shape, dtype=c.dtype)
                else:  # mode "c": O_RDONLY + MAP_PRIVATE: writes never reach the file
                    mm = np.memmap(self.path / f"{c.name}.memmap", c.dtype, "c", shape=shape)
                    cols[c.name] = np.asarray(mm)
            if not len(cols["video_offsets"]):  # a shard without video stores no offsets
                cols["video_offsets"] = np.zeros((int(self.doc["packs"]) + 1, 2), np.int64)
            _check_index(cols, self.doc, seq_len, f"{self.path}/")
            self.cols = cols
        return self.cols


def _check_index(cols: dict[str, np.ndarray], doc: dict[str, Any], seq_len: int, where: str):
    """The pack index of a shard agrees with its counts and with itself (cheap: K, S, I ints)."""
    o, plen = cols["pack_offsets"], cols["pack_len"].astype(np.int64)

    def bad(name: str, what: str) -> CacheError:
        return CacheError(f"{where}{name}: {what} (damaged; run inspect-cache --verify)")

    last = [doc["samples"], doc["tokens"], doc["images"], doc["patches"]]
    if o[0].tolist() != [0, 0, 0, 0] or o[-1].tolist() != last:
        raise bad("pack_offsets.memmap", f"first/last rows {o[0].tolist()}/{o[-1].tolist()}, counts say "
                                  f"[0, 0, 0, 0]/{last}")  # fmt: skip
    if (np.diff(o, axis=0) < 0).any():
        raise bad("pack_offsets.memmap", "offsets decrease")
    ntok = np.diff(o[:, 1])
    if ((plen < ntok) | (plen > seq_len)).any():
        raise bad(
            "pack_len.memmap", f"a padded length is below its pack's tokens or above {seq_len}"
        )
    lens = cols["sample_lens"].astype(np.int64)
    if (lens <= 0).any() or np.diff(np.concatenate(([0], np.cumsum(lens)))[o[:, 0]]).tolist() != (
        ntok.tolist()
    ):
        raise bad(
            "sample_lens.memmap / pack_offsets.memmap",
            "sample lengths do not add up to the packs' token counts",
        )
    grid = cols["grid_thw"].astype(np.int64)
    if (grid <= 0).any():
        raise bad("grid_thw.memmap", "an image grid is not positive")
    per_img = np.concatenate(([0], np.cumsum(grid.prod(axis=1))))
    if np.diff(per_img[o[:, 2]]).tolist() != np.diff(o[:, 3]).tolist():
        raise bad(
            "grid_thw.memmap / pack_offsets.memmap",
            "image grids do not add up to the packs' patch counts",
        )
    _check_video_index(cols, doc, bad)


def _check_video_index(cols: dict[str, np.ndarray], doc: dict[str, Any], bad) -> None:
    """The video offsets agree with the counts and with the video grids (as for images)."""
    vo = cols["video_offsets"]
    last = [doc["videos"], doc["video_patches"]]
    if vo[0].tolist() != [0, 0] or vo[-1].tolist() != last:
        raise bad("video_offsets.memmap", f"first/last rows {vo[0].tolist()}/{vo[-1].tolist()}, "
                                          f"counts say [0, 0]/{last}")  # fmt: skip
    if (np.diff(vo, axis=0) < 0).any():
        raise bad("video_offsets.memmap", "offsets decrease")
    vgrid = cols["video_grid_thw"].astype(np.int64)
    if (vgrid <= 0).any():
        raise bad("video_grid_thw.memmap", "a video grid is not positive")
    per_vid = np.concatenate(([0], np.cumsum(vgrid.prod(axis=1))))
    if np.diff(per_vid[vo[:, 0]]).tolist() != np.diff(vo[:, 1]).tolist():
        raise bad(
            "video_grid_thw.memmap / video_offsets.memmap",
            "video grids do not add up to the packs' video patch counts",
        )
