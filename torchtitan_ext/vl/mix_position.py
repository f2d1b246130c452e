"""Where a VL mixture stands: the global sequence of packs over several caches, as arithmetic.

A ``cached_vl`` mixture (``[[dataloader.sources]]``) reads one cache per source. Like
``vl/dataset.py`` for one cache, this module decides *which* pack comes next from a *global*
position that is the same on every DP rank, so a mixture resumes exactly, and at any DP degree,
from a few ints.

The global sequence. Item ``i`` of the sequence is ``(source k, pack index)``:

* **Which source.** Draw ``d`` picks source ``pipeline.mix.draws_block(seed, stream, d // BLOCK,
  p)[d % BLOCK]`` — the text loaders' ``Mix`` draws, on ``stream = pass`` (0 for an endless
  mixture). A draw of a source that has ended is passed over (``mix_stop = "all_exhausted"``: the
  others keep their relative weights) or ends the pass (``"first_exhausted"``).
* **Which pack of it.** Source ``k``'s ``n``-th item is the ``n``-th pack of *its own* order:
  its epoch ``n // len_k``, position ``n % len_k`` of ``vl.dataset.epoch_permutation(len_k,
  seed, epoch)`` (the order a single-source ``cached_vl`` gives that cache). A small source so
  repeats as its weight demands, each repetition reshuffled; ``max_epochs`` ends it after
  ``max_epochs * len_k`` items.
* **Passes.** With ``infinite = true`` there is one pass, endless unless every drawn source has
  ``max_epochs``. With ``infinite = false`` a pass ends when the sources end
  (``max_epochs``, default 1 then: one epoch of each source) and the next pass continues every
  source's own order on the next draw stream.

Ranks read the sequence in rounds of ``W`` items (``W`` = DP degree): rank ``r`` takes item
``c + r`` of the round starting at global cursor ``c``, exactly as ``vl/dataset.py`` does within
an epoch, so every rank reads the same number of packs. At the end of a finite pass, a round that
cannot be completed is not read (``remainder = "drop"``; a state keeps its items, so a resume at a
smaller degree reads them) or is completed from the start of the pass (``"wrap"``).

Why packs are the weight's unit. Each pack holds samples of one source only and at most
``seq_len`` tokens, so a pack is the VL counterpart of the text loaders' row: a weight is a share
of packs, hence (up to each source's padding) of tokens; the counts of source ``k`` over any
window of ``N`` packs are binomial(``N``, ``w_k``); and every pack is accounted to exactly one
source (tokens, images, patches per source). Weighting samples would tie the token share to each
source's sample lengths and put several sources in one pack.

State (:class:`MixPos`): ``pass``, ``draws`` (draws consumed in the pass), ``items`` (global
items consumed in the pass: the cursor) and ``counts`` (items of each source in the pass). The
running counts make every step O(1): recomputing them from the cursor would cost
``O(cursor / BLOCK)`` generator calls. Invariant: ``sum(counts) == items`` and ``counts`` are
exactly the sources of the first ``items`` items of the pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from torchtitan_ext.pipeline.mix import BLOCK, MixStop, draws_block
from torchtitan_ext.vl.dataset import Remainder, epoch_permutation


@dataclass(frozen=True)
class MixPlan:
    """What the global sequence depends on (the same on every rank)."""

    lens: tuple[int, ...]
    """Packs in each source's cache."""
    p: tuple[float, ...]
    """Normalised weights."""
    limits: tuple[int | None, ...]
    """Items of each source per pass (``max_epochs * len``); None: no end."""
    seed: int
    stop: MixStop = "all_exhausted"
    shuffle: bool = True
    passes: bool = False
    """True (``infinite = false``): passes repeat, each on its own draw stream."""


@dataclass(frozen=True)
class MixPos:
    """A global position: see the module docstring."""

    pass_: int
    draws: int
    items: int
    counts: tuple[int, ...]

    @classmethod
    def start(cls, nsources: int, pass_: int = 0) -> MixPos:
        return cls(pass_, 0, 0, (0,) * nsources)


@dataclass(frozen=True)
class Item:
    """One pack of the global sequence."""

    source: int
    index: int
    """Pack index in that source's cache."""


class Walker:
    """The global sequence of a :class:`MixPlan` (pure: caches only draw blocks and
    permutations, one of each at a time)."""

    def __init__(self, plan: MixPlan) -> None:
        self.plan = plan
        self._p = np.asarray(plan.p, dtype=np.float64)
        self._block: tuple[tuple[int, int], np.ndarray] | None = None
        self._perms: dict[int, tuple[int, list[int]]] = {}

    def source_of(self, stream: int, draw: int) -> int:
        key = (stream, draw // BLOCK)
        if self._block is None or self._block[0] != key:
            self._block = (key, draws_block(self.plan.seed, stream, key[1], self._p))
        return int(self._block[1][draw % BLOCK])

    def ended(self, pos: MixPos, k: int) -> bool:
        lim = self.plan.limits[k]
        return self.plan.p[k] == 0 or (lim is not None and pos.counts[k] >= lim)

    def step(self, pos: MixPos) -> tuple[int, MixPos] | None:
        """(source, position after) of the next item of the pass, or None at the pass's end."""
        if all(self.ended(pos, k) for k in range(len(self.plan.lens))):
            return None
        d = pos.draws
        while True:
            k = self.source_of(pos.pass_, d)
            d += 1
            if not self.ended(pos, k):
                counts = list(pos.counts)
                counts[k] += 1
                return k, MixPos(pos.pass_, d, pos.items + 1, tuple(counts))
            if self.plan.stop == "first_exhausted":
                return None

    def pack(self, k: int, n: int, pass_: int) -> int:
        """Cache index of source ``k``'s ``n``-th item of pass ``pass_``."""
        lim = self.plan.limits[k]
        m = n + (pass_ * lim if self.plan.passes and lim is not None else 0)
        epoch, at = divmod(m, self.plan.lens[k])
        cached = self._perms.get(k)
        if cached is None or cached[0] != epoch:
            perm = epoch_permutation(self.plan.lens[k], self.plan.seed, epoch, self.plan.shuffle)
            cached = (epoch, perm.tolist())
            self._perms[k] = cached
        return cached[1][at]

    def round(self, pos: MixPos, world: int) -> tuple[list[Item], MixPos]:
        """Up to ``world`` items from ``pos`` (fewer only at the pass's end) and the position
        after them."""
        out: list[Item] = []
        while len(out) < world:
            nxt = self.step(pos)
            if nxt is None:
                break
            k, after = nxt
            out.append(Item(k, self.pack(k, pos.counts[k], pos.pass_)))
            pos = after
        return out, pos

    def rank_round(self, pos: MixPos, world: int, rank: int) -> tuple[Item | None, MixPos, int]:
        """(item ``rank`` of the round from ``pos`` or None, the position after the round, the
        round's item count): :meth:`round` for one rank. When no source can end within the
        round (the usual case) and ``world >= 4`` the round is exactly the next ``world`` draws,
        counted with numpy (measured ~90 us per pack at 64 ranks, ~180 us at 512, against
        ~15 us per round item, item by item)."""
        plan = self.plan
        if world < 4 or any(
            p > 0 and lim is not None and c + world > lim
            for p, lim, c in zip(plan.p, plan.limits, pos.counts, strict=True)
        ):
            items, after = self.round(pos, world)
            return (items[rank] if rank < len(items) else None), after, len(items)
        src = self.sources(pos.pass_, pos.draws, world)
        k = int(src[rank])
        n = pos.counts[k] + int(np.count_nonzero(src[:rank] == k))
        added = np.bincount(src, minlength=len(plan.lens))
        counts = tuple(int(c + a) for c, a in zip(pos.counts, added, strict=True))
        after = MixPos(pos.pass_, pos.draws + world, pos.items + world, counts)
        return Item(k, self.pack(k, n, pos.pass_)), after, world

    def sources(self, stream: int, start: int, n: int) -> np.ndarray:
        """Sources of draws ``start ... start + n - 1`` of ``stream``."""
        parts, d = [], start
        while d < start + n:
            self.source_of(stream, d)  # loads d's block
            block = cast(tuple[Any, np.ndarray], self._block)
            lo = d % BLOCK
            take = min(BLOCK - lo, start + n - d)
            parts.append(block[1][lo : lo + take])
            d += take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def next_pass(self, pos: MixPos) -> MixPos | None:
        """The start of the pass after ``pos``'s, or None when passes do not repeat."""
        return MixPos.start(len(self.plan.lens), pos.pass_ + 1) if self.plan.passes else None

    def settle(self, pos: MixPos, world: int, remainder: Remainder) -> MixPos:
        """``pos`` as a reader at ``world`` ranks starts from it: a pass with no round left for
        this degree (``drop``: fewer than ``world`` items; ``wrap``: none) moves on to the next
        pass, when passes repeat (so a state saved after a pass's last round resumes, at the same
        degree, with the next pass; at a smaller one, with the rest of that pass)."""
        items, _ = self.round(pos, world)
        short = len(items) < world if remainder == "drop" else not items
        if short:
            nxt = self.next_pass(pos)
            if nxt is not None:
                return nxt
        return pos


def rank_items(
    walker: Walker, anchor: MixPos, world: int, rank: int, remainder: Remainder
) -> Iterator[tuple[Item, MixPos]]:
    """Rank ``rank``'s packs from global position ``anchor`` (settled), each with the global
    position after its round (the state after it). A finite pass ends the iterator after its
    last full round (``drop``) or its wrapped last round (``wrap``); the caller starts the next
    pass by settling the last position again."""
    if not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got {rank}, {world}")
    pos = walker.settle(anchor, world, remainder)
    while True:
        item, after, n = walker.rank_round(pos, world, rank)
        if n == world:
            yield cast(Item, item), after  # a full round: this rank has its item
            pos = after
            continue
        items, after = walker.round(pos, world)
        if remainder == "wrap" and items:
            start = MixPos.start(len(walker.plan.lens), pos.pass_)
            fill, _ = walker.round(start, world - len(items))
            items += fill
            if rank < len(items):
                yield items[rank], walker.next_pass(after) or after
        return
