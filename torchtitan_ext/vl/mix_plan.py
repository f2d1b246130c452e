"""A plan over SEVERAL sample stores with weights: a VL mixture that only re-plans.

Adding a source or changing a weight processes no image: every source is a sample store
(``vl/plan.py``) built once; the mixture is a plan over their samples, computed from the stored
lengths.

==========================  ===================================================================
step                        rule
==========================  ===================================================================
eligible samples            each store's samples of at most ``seq_len`` tokens (the others are
                            counted ``too_long``)
samples per source          ``total`` (default: all eligible samples of all sources) split by
                            weight, largest remainder: ``n_j ~ total * w_j / sum(w)``
a source's sample order     its eligible samples in ``permutation(seed, j, epoch)`` order,
                            epoch after epoch, cut at ``n_j`` (a source weighted above its size
                            repeats: per-source epochs as the weight demands)
interleave                  the ``k``-th sample of source ``j`` sits at virtual time
                            ``(k + 0.5) / n_j``; the stream is every source's samples sorted by
                            that time (ties: lower source index first), so each source is spread
                            evenly over the stream
packing                     ``best_fit_packs(seq_len, buffer_size)`` over the stream, padded to
                            the smallest bucket (the packer of a single-store plan)
==========================  ===================================================================

Everything is a pure function of the stores' sample lengths, the weights, ``total`` and the
seed: the same inputs give the same packs, built in memory at start (like a single-store plan).

**The weight unit is samples**, not tokens: a VL sample's length is mostly its images'
(resolution x count), so token weights would let a source of large images crowd out one of small
ones for the same weight, and would change a source's share when only its image resolution
changed. Samples per source is what ms-swift / LLaMA-Factory mixing (``interleave_datasets``
probabilities) mean, and it keeps "how often an example of each source is seen" the knob. (The
text-side mixture weighs tokens, where a document's length is its content.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.vl.assemble import assemble_pack
from torchtitan_ext.vl.cache import VLCache
from torchtitan_ext.vl.packing import best_fit_packs
from torchtitan_ext.vl.plan import PlanOptions


@dataclass
class MixPlan:
    """Packs over several stores: pack ``i`` is the samples ``(source[m], sample[m])`` for ``m``
    in ``offsets[i]:offsets[i + 1]`` (store-global sample indices), padded to ``pack_len[i]``."""

    options: PlanOptions
    weights: tuple[float, ...]
    seed: int
    source: np.ndarray
    """int32 [M]: the source of each member, pack after pack."""
    sample: np.ndarray
    """int64 [M]: the store-global sample index of each member."""
    offsets: np.ndarray
    """int64 [K+1]."""
    pack_len: np.ndarray
    """int32 [K]."""
    per_source: tuple[int, ...]
    """Samples drawn from each source (``n_j``)."""
    too_long: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.pack_len)


def split_by_weight(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` samples split in proportion to ``weights``, largest remainder (ties: lower
    index), so the counts add up to ``total`` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {list(weights)}")
    exact = total * w / w.sum()
    n = np.floor(exact).astype(np.int64)
    rest = total - int(n.sum())
    order = sorted(range(len(w)), key=lambda j: (-(exact[j] - n[j]), j))
    for j in order[:rest]:
        n[j] += 1
    return n.tolist()


def source_order(eligible: np.ndarray, n: int, seed: int, j: int) -> np.ndarray:
    """``n`` samples of one source: its ``eligible`` samples permuted afresh each source epoch
    (``numpy`` generator seeded ``(seed, j, epoch)``), cut at ``n``."""
    if n and not len(eligible):
        raise ValueError(f"mixture source {j} has no sample of at most seq_len tokens")
    out, epoch = [], 0
    while sum(map(len, out)) < n:
        rng = np.random.default_rng([seed, j, epoch])
        out.append(eligible[rng.permutation(len(eligible))])
        epoch += 1
    return np.concatenate(out)[:n] if out else np.zeros(0, dtype=np.int64)


def plan_mixture(
    lengths: Sequence[np.ndarray],
    weights: Sequence[float],
    options: PlanOptions,
    *,
    seed: int = 0,
    total: int | None = None,
) -> MixPlan:
    """The mixture plan of sources whose samples have ``lengths[j]`` tokens (store order); the
    module docstring states the rules."""
    if len(lengths) != len(weights):
        raise ValueError(f"{len(lengths)} sources but {len(weights)} weights")
    lens = [np.asarray(x, dtype=np.int64) for x in lengths]
    eligible = [np.flatnonzero(x <= options.seq_len) for x in lens]
    total = sum(map(len, eligible)) if total is None else int(total)
    counts = split_by_weight(total, weights)
    src_parts, smp_parts, time_parts = [], [], []
    for j, (e, n) in enumerate(zip(eligible, counts, strict=True)):
        src_parts.append(np.full(n, j, dtype=np.int32))
        smp_parts.append(source_order(e, n, seed, j))
        time_parts.append((np.arange(n, dtype=np.float64) + 0.5) / max(n, 1))
    times = np.concatenate(time_parts)
    src = np.concatenate(src_parts)
    order = np.lexsort((src, times))  # by time, then source
    src, smp = src[order], np.concatenate(smp_parts)[order]
    base = np.concatenate(([0], np.cumsum([len(x) for x in lens]))).astype(np.int64)
    stream = np.concatenate(lens)[base[src] + smp] if len(src) else np.zeros(0, np.int64)
    packs = list(best_fit_packs(stream.tolist(), options.seq_len, options.buffer_size))
    flat = np.fromiter((i for p in packs for i in p), dtype=np.int64, count=len(stream))
    offsets = np.concatenate(([0], np.cumsum([len(p) for p in packs]))).astype(np.int64)
    tokens = np.add.reduceat(stream[flat], offsets[:-1]) if packs else np.zeros(0, np.int64)
    buckets = np.asarray(options.buckets, dtype=np.int64)
    pack_len = buckets[np.searchsorted(buckets, tokens, side="left")].astype(np.int32)
    return MixPlan(options, tuple(float(w) for w in weights), int(seed), src[flat], smp[flat],
                   offsets, pack_len, tuple(counts),
                   tuple(len(x) - len(e) for x, e in zip(lens, eligible, strict=True)))  # fmt: skip


class MixedStores:
    """The packs of a :class:`MixPlan`, read from its stores (``len``, ``pack(i)``,
    ``pack_shape(i)``, ``special_tokens``, ``metadata``: what ``CachedVLDataset`` iterates).
    The stores must share the processor's special tokens and image parameters."""

    def __init__(self, stores: Sequence[VLCache], plan: MixPlan) -> None:
        first = stores[0]
        for s in stores:
            if not s.is_store:
                raise ValueError(f"{s.path}: a packed cache, not a sample store")
            if s.special_tokens != first.special_tokens or s.image_params != first.image_params:
                raise ValueError(
                    f"{s.path}: special tokens or image parameters differ from {first.path} "
                    "(a mixture needs one processor)"
                )
        self.stores, self.plan = list(stores), plan
        self.metadata, self.special_tokens = first.metadata, first.special_tokens
        self.image_params, self.spatial_merge_size = first.image_params, first.spatial_merge_size
        self._starts = [
            np.concatenate(([0], np.cumsum([int(sh["samples"]) for sh in s.metadata["shards"]])))
            for s in self.stores
        ]

    @classmethod
    def open(
        cls, paths: Sequence[str | Path], weights: Sequence[float], options: PlanOptions,
        *, seed: int = 0, total: int | None = None,
    ) -> MixedStores:  # fmt: skip
        stores = [VLCache.open(p) for p in paths]
        lengths = [
            np.concatenate([s.shard_sample_lengths(k) for k in range(s.num_shards)])
            if s.num_shards else np.zeros(0, np.int64)
            for s in stores
        ]  # fmt: skip
        return cls(stores, plan_mixture(lengths, weights, options, seed=seed, total=total))

    def __len__(self) -> int:
        return len(self.plan)

    def pack_shape(self, i: int) -> int:
        return int(self.plan.pack_len[i])

    def pack(self, i: int, copy_pixels: bool = True) -> dict[str, torch.Tensor]:
        """Pack ``i``: its samples gathered from their stores, assembled like any pack."""
        p = self.plan
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("t", "m", "l", "g", "x")}
        for j, g in zip(p.source[p.offsets[i] : p.offsets[i + 1]].tolist(),
                        p.sample[p.offsets[i] : p.offsets[i + 1]].tolist(), strict=True):  # fmt: skip
            k = int(np.searchsorted(self._starts[j], g, side="right")) - 1
            a = self.stores[j].shard_arrays(k)
            o = a["pack_offsets"]
            loc = g - int(self._starts[j][k])
            (_, t0, i0, p0), (_, t1, i1, p1) = o[loc].tolist(), o[loc + 1].tolist()
            parts["t"].append(a["tokens"][t0:t1])
            parts["m"].append(a["label_mask"][t0:t1])
            parts["l"].append(a["sample_lens"][loc : loc + 1])
            parts["g"].append(a["grid_thw"][i0:i1])
            parts["x"].append(a["pixels"][p0:p1])
        c = {k: np.concatenate(v) for k, v in parts.items()}
        return assemble_pack(c["t"], c["m"], c["l"], c["g"], c["x"], int(p.pack_len[i]),
                             self.special_tokens, self.spatial_merge_size, copy_pixels=False)  # fmt: skip
