"""Process once, plan many: packs as a *plan* over a sample store.

A **sample store** is a VL cache built with ``store=True`` (``preprocess-cached`` builds one): the
same shard format, manifest, checksums, ``verify`` and ``inspect-cache`` as a packed cache
(``vl/format.py``), but every entry is ONE sample, unpadded, in input-row order. Its key hashes the
data fingerprint, the processor and the image/chat options, not ``seq_len`` / ``buffer_size`` /
``buckets`` (``seq_len`` only with ``truncate``, whose cut depends on it). So a new pack length or
new buckets decode and process no image again: they only make a new plan.

A **plan** (:class:`Plan`) is the list of packs over the store's samples, computed from the stored
sample LENGTHS only (no pixel or token is touched):

========================  ===================================================================
what                      how
========================  ===================================================================
samples considered        each store shard's samples in row order; those longer than
                          ``seq_len`` are left out (counted ``too_long``)
packing                   ``vl.packing.best_fit_packs`` (``seq_len``, ``buffer_size``), the
                          buffer restarting at each store shard: the packer, and the grouping,
                          of a packed cache built with the same options
padded length             the smallest bucket >= the pack's tokens (``normalize_buckets``)
pack order                shard by shard, packs in the order the packer emits them
========================  ===================================================================

Invariant: pack ``i`` of a plan is bitwise pack ``i`` of the packed cache built with the same
data, processor and options (``seq_len``, ``buffer_size``, ``buckets``, ``rows_per_shard``): the
same samples in the same order, assembled by the same function (``assemble.assemble_pack``).
Restarting the buffer per shard costs a few partly filled packs per 1,024 rows and keeps every
pack's samples inside one shard (one set of memory maps per read).

Plans are built in memory when the loader starts, never written to disk: a plan is a pure
function of the store's sample lengths and four options, ~1 µs per sample (about a second for a
million samples: ``python -m benchmarks vl_plan``), and a file would need its own key,
invalidation and integrity checks, and a writable store directory (stores can be read-only).
Ordering, sharding over DP ranks and resume (``vl/dataset.py``) work over plan indices exactly as
they did over pack indices: ``len`` and ``pack(i)`` are all they use.

Positions (the four mRoPE rows) are not stored: they are a pure function of a sample's tokens and
image grids, recomputed per sample when a pack is read (~0.1 ms per pack), exactly as for a
packed cache; storing them would add 32 bytes per token (6x the token bytes) to save that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.vl.assemble import assemble_pack
from torchtitan_ext.vl.cache import VLCache
from torchtitan_ext.vl.packing import best_fit_packs, normalize_buckets
from torchtitan_ext.vl.pixel_rows import PixelRows


@dataclass(frozen=True)
class PlanOptions:
    """The options a plan packs with (what a packed cache's key held besides the data)."""

    seq_len: int
    """Maximum tokens per pack; longer samples are left out (``too_long``)."""
    buffer_size: int = 64
    """Best-fit buffer: candidates considered for each pack."""
    buckets: tuple[int, ...] = ()
    """Padded pack lengths (each <= seq_len); empty: every pack is padded to seq_len."""

    @classmethod
    def make(cls, seq_len: int, buffer_size: int, buckets: Sequence[int] | None) -> PlanOptions:
        """Checked options (one clear error for a bad value)."""
        if int(buffer_size) < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        return cls(int(seq_len), int(buffer_size), tuple(normalize_buckets(seq_len, buckets)))


@dataclass
class Plan:
    """Packs over a store's samples. Pack ``i`` is the shard-local samples
    ``members[offsets[i]:offsets[i + 1]]`` of store shard ``shard[i]``, padded to
    ``pack_len[i]``."""

    options: PlanOptions
    shard: np.ndarray
    """int32 [K]: the store shard of each pack."""
    members: np.ndarray
    """int64 [M]: shard-local sample indices, pack after pack, in placement order."""
    offsets: np.ndarray
    """int64 [K+1]: each pack's slice of ``members``."""
    tokens: np.ndarray
    """int64 [K]: content tokens of each pack."""
    pack_len: np.ndarray
    """int32 [K]: padded length (bucket) of each pack."""
    too_long: int
    """Store samples longer than ``seq_len``, in no pack."""

    def __len__(self) -> int:
        return len(self.pack_len)

    def stats(self) -> dict[str, Any]:
        """Packs, samples, fill and bucket counts (``inspect-cache``, ``preprocess-cached``)."""
        k = max(len(self), 1)
        sizes = np.diff(self.offsets)
        fill = self.tokens / np.maximum(self.pack_len, 1)
        buckets, counts = np.unique(self.pack_len, return_counts=True)
        return {
            "seq_len": self.options.seq_len,
            "buffer_size": self.options.buffer_size,
            "buckets": list(self.options.buckets),
            "packs": len(self),
            "samples": int(len(self.members)),
            "too_long": self.too_long,
            "samples_per_pack": round(float(sizes.sum()) / k, 3),
            "tokens": int(self.tokens.sum()),
            "padded_tokens": int(self.pack_len.astype(np.int64).sum()),
            "fill_pct": round(float(fill.mean()) * 100, 2) if len(self) else 0.0,
            "bucket_counts": {str(int(b)): int(c) for b, c in zip(buckets, counts, strict=True)},
        }


def plan_packs(shard_lengths: Sequence[np.ndarray], options: PlanOptions) -> Plan:
    """The plan of a store whose shard ``s`` holds samples of ``shard_lengths[s]`` tokens (in
    row order). Touches lengths only; the module docstring states the rules."""
    seq_len, buckets = options.seq_len, np.asarray(options.buckets, dtype=np.int64)
    shard_of: list[np.ndarray] = []
    members: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    member_lens: list[np.ndarray] = []
    too_long = 0
    for s, lens in enumerate(shard_lengths):
        lens = np.asarray(lens, dtype=np.int64)
        keep = np.flatnonzero(lens <= seq_len)
        too_long += len(lens) - len(keep)
        packs = list(best_fit_packs(lens[keep].tolist(), seq_len, options.buffer_size))
        if not packs:
            continue
        local = np.fromiter((i for p in packs for i in p), dtype=np.int64, count=len(keep))
        members.append(keep[local])
        member_lens.append(lens[members[-1]])
        sizes.append(np.fromiter(map(len, packs), dtype=np.int64, count=len(packs)))
        shard_of.append(np.full(len(packs), s, dtype=np.int32))
    if not members:
        z = np.zeros(0, dtype=np.int64)
        return Plan(options, z.astype(np.int32), z, np.zeros(1, np.int64), z,
                    z.astype(np.int32), too_long)  # fmt: skip
    sz = np.concatenate(sizes)
    offsets = np.concatenate(([0], np.cumsum(sz)))
    mem = np.concatenate(members)
    tokens = np.add.reduceat(np.concatenate(member_lens), offsets[:-1])
    pack_len = buckets[np.searchsorted(buckets, tokens, side="left")].astype(np.int32)
    return Plan(options, np.concatenate(shard_of), mem, offsets, tokens, pack_len, too_long)


class PlannedStore:
    """The packs of a plan, read from a sample store: what ``CachedVLDataset`` iterates
    (``len``, ``pack(i)``, ``pack_shape(i)``, ``pack_lengths()``, ``pack_rows(i)``, ``verify()``
    and the store's ``metadata`` / ``special_tokens``), like a packed ``VLCache``.

    ``pack(i)`` gathers the pack's samples from the store's memory maps (tokens, label masks,
    patches, grids, each concatenated in plan order) and assembles them with the packed cache's
    own ``assemble_pack``. Pickles without its memory maps (a DataLoader worker re-opens the
    store; the plan travels, a few bytes per sample).
    """

    def __init__(self, store: VLCache, plan: Plan) -> None:
        if not store.is_store:
            raise ValueError(f"{store.path}: a packed cache, not a sample store: read it as it is")
        self.store, self.plan = store, plan
        self.path: Path = store.path
        self.metadata = store.metadata
        self.special_tokens = store.special_tokens
        self.image_params = store.image_params
        self.spatial_merge_size = store.spatial_merge_size
        self.patch_dim = store.patch_dim
        self.seq_len = plan.options.seq_len

    @classmethod
    def open(cls, path: str | Path, options: PlanOptions) -> PlannedStore:
        """Open the store at ``path`` (all of ``VLCache.open``'s checks) and plan it."""
        store = VLCache.open(path)
        if not store.is_store:
            raise ValueError(f"{path}: a packed cache, not a sample store: read it as it is")
        lengths = [store.shard_sample_lengths(s) for s in range(store.num_shards)]
        return cls(store, plan_packs(lengths, options))

    def __len__(self) -> int:
        return len(self.plan)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "plan": self.plan}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(VLCache.open(state["path"]), state["plan"])

    def _locate(self, i: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        n = len(self.plan)
        if not -n <= i < n:
            raise IndexError(f"pack {i} out of range (the plan has {n} packs)")
        i %= n
        p = self.plan
        a = self.store.shard_arrays(int(p.shard[i]))
        return a, p.members[p.offsets[i] : p.offsets[i + 1]]

    def pack(self, i: int, copy_pixels: bool = True) -> dict[str, torch.Tensor | PixelRows]:
        """Pack ``i`` of the plan: ``VLCache.pack``'s tensors, the pixels gathered into a fresh
        array. ``copy_pixels=False`` (for a collate that copies the pixels anyway:
        ``PackCollator.copies_pixels``) leaves them where they lie: ``pixel_u8`` is then a
        :class:`~torchtitan_ext.vl.pixel_rows.PixelRows` of per-sample views of the store's
        map, whose ``tensor()`` is bitwise the gathered array; every other key is unchanged."""
        a, m = self._locate(i)
        # a store's "pack" j is sample j: its [sample, token, image, patch] ranges, and its
        # [video, video patch] ranges; each column's starts and ends as lists of ints
        lo, hi = a["pack_offsets"][m].T.tolist(), a["pack_offsets"][m + 1].T.tolist()
        vlo, vhi = a["video_offsets"][m].T.tolist(), a["video_offsets"][m + 1].T.tolist()

        def views(col: str, starts: list[int], ends: list[int]) -> list[np.ndarray]:
            src = a[col]
            return [src[x:y] for x, y in zip(starts, ends, strict=True)]

        def gather(col: str, starts: list[int], ends: list[int]) -> np.ndarray:
            if starts == ends:  # nothing (e.g. no video in the pack): skip the Python loop
                return a[col][:0]
            return np.concatenate(views(col, starts, ends))

        rows = PixelRows(tuple(views("pixels", lo[3], hi[3])), int(a["pixels"].shape[1]))
        return assemble_pack(
            gather("tokens", lo[1], hi[1]), gather("label_mask", lo[1], hi[1]),
            a["sample_lens"][m], gather("grid_thw", lo[2], hi[2]),
            rows.numpy() if copy_pixels else rows, int(self.plan.pack_len[i]),
            self.special_tokens, self.spatial_merge_size, copy_pixels=False,
            video_grid_thw=gather("video_grid_thw", vlo[0], vhi[0]),
            video_pixels=gather("video_pixels", vlo[1], vhi[1]),
        )  # fmt: skip

    def pack_shape(self, i: int) -> int:
        return int(self.plan.pack_len[i])

    def pack_lengths(self) -> np.ndarray:
        return self.plan.pack_len.astype(np.int64)

    def pack_rows(self, i: int) -> list[int]:
        """Input row index of each sample of pack ``i``."""
        a, m = self._locate(i)
        return a["sample_rows"][m].tolist()

    def verify(self) -> list[str]:
        """The store's ``verify`` (the plan is recomputed, never stored)."""
        return self.store.verify()
