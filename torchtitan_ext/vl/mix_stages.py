"""A VL mixture's source stages: one rank's packs of the global mixed sequence.

=========================  ==============================================================
:class:`MixPacks`          source (in process): this rank's packs, read from each source's
                           cache in ``vl/mix_position.py``'s global order
:class:`MixedVLDataset`    the same packs for DataLoader worker processes (block-interleaved
                           as ``CachedVLDataset``'s, so the order does not depend on workers)
:class:`MixWorkerBatches`  the workers as ONE stage; its state is computed here from the
                           batches handed over (what the workers made ahead never leaks in)
=========================  ==============================================================

Chains (``vl/mix_reader.py`` builds them; ``CollatePacks`` and ``CountBatches`` are
``vl/stages.py``'s)::

    num_workers = 0:  Prefetch(CountBatches(CollatePacks(MixPacks)))
    num_workers > 0:  CountBatches(MixWorkerBatches)

State of :class:`MixPacks` (and of :class:`MixWorkerBatches`): the global position
(:func:`position_state`: plain ints, the same on every rank, what a checkpoint stores) plus
``per``, this process's counters per source (packs, tokens, images, patches), which stay out of
the checkpoint (:func:`strip_counters`) as ``CountBatches``' do: they would differ by rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.vl.dataset import Remainder, fetch_pack
from torchtitan_ext.vl.mix_position import Item, MixPos, Walker, rank_items
from torchtitan_ext.vl.options import WorkerOptions
from torchtitan_ext.vl.stages import SOURCE_CACHE, WorkerBatches, batch_arrays

PER = ("packs", "tokens", "images", "patches")
"""Per-source counters, in the order of ``state["per"][k]``."""

POSITION_KEYS = ("source", "names", "stream", "draws", "items", "taken", "ended", "sources", "seed")
"""The keys of a mixture position (the checkpointed part of the state). Named as
``pipeline.mix.Mix.state``'s (``names``, ``stream``, ``draws``, ``taken``, ``ended``,
``sources``), so tools that find a mixture in a loader's state find this one: ``stream`` is the
pass (its draw stream), ``taken`` the items of each source in the pass, ``sources`` each
source's cache size (``{"packs": N}``)."""


def position_state(pos: MixPos, names: Sequence[str], walker: Walker) -> dict[str, Any]:
    """A fresh dict of plain values: the global position and what it is a position *of*."""
    return {
        "source": SOURCE_CACHE,
        "names": list(names),
        "stream": pos.pass_,
        "draws": pos.draws,
        "items": pos.items,
        "taken": list(pos.counts),
        "ended": [walker.ended(pos, k) for k in range(len(names))],
        "sources": [{"packs": n} for n in walker.plan.lens],
        "seed": walker.plan.seed,
    }


def position_from(state: State) -> MixPos:
    return MixPos(
        int(state["stream"]), int(state["draws"]), int(state["items"]), tuple(state["taken"])
    )


def strip_counters(state: State) -> State:
    """The checkpointed part (the position) of a :class:`MixPacks` state."""
    return {k: state[k] for k in POSITION_KEYS}


def pack_counts(pack: dict[str, Any]) -> tuple[int, int, int, int]:
    """(1, real tokens, images, vision patches) of one pack dict."""
    grid = pack["image_grid_thw"]
    images = int(grid.shape[0])
    patches = int(grid.prod(dim=-1).sum()) if images else 0
    return 1, int(pack["num_tokens"]), images, patches


class MixPacks(Stage[dict]):
    """This DP rank's packs of the mixture (``vl/mix_position.py``), one per ``next()``.

    ``caches[k]`` is source ``k``'s ``VLCache`` (anything with ``pack(i)``). The state after a
    pack is the global position after its round, so batches made ahead never leak into it."""

    def __init__(
        self,
        caches: Sequence[Any],
        walker: Walker,
        names: Sequence[str],
        *,
        rank: int,
        world: int,
        remainder: Remainder,
        copy_pixels: bool = True,
    ) -> None:
        self.caches, self.walker, self.names = list(caches), walker, list(names)
        self.copy_pixels = copy_pixels  # CachedVLDataset's: False when the collate copies anyway
        self.rank, self.world, self.remainder = rank, world, remainder
        self._start = MixPos.start(len(self.names))
        self.reset(None)

    def _items(self) -> Iterator[tuple[Item, MixPos]]:
        if self._it is None:
            self._it = rank_items(self.walker, self._pos, self.world, self.rank, self.remainder)
        return self._it

    def next(self) -> dict:
        item, after = next(self._items())  # StopIteration: the finite pass is over
        pack = fetch_pack(self.caches[item.source], item.index, self.copy_pixels)
        pack["pack_index"] = torch.tensor(item.index, dtype=torch.int64)
        self._pos = after
        self.count(item.source, pack_counts(pack))
        return pack

    def skip(self, n: int) -> list[Item]:
        """Move over ``n`` packs without reading them (the worker stage's position)."""
        out = []
        for _ in range(n):
            item, self._pos = next(self._items())
            out.append(item)
        return out

    def count(self, k: int, added: Sequence[int]) -> None:
        self._per[k] = [a + b for a, b in zip(self._per[k], added, strict=True)]

    def state(self) -> State:
        return {
            **position_state(self._pos, self.names, self.walker),
            "per": [list(c) for c in self._per],
        }

    def reset(self, state: State | None = None) -> None:
        self._it: Iterator[tuple[Item, MixPos]] | None = None
        if state is None:
            self._pos = self._start
            self._per = [[0] * len(PER) for _ in self.names]
            return
        self._pos = position_from(state)
        self._per = [list(map(int, c)) for c in state["per"]]

    def stats(self, state: State) -> dict[str, Any]:
        """``Mix.stats``' shape: per source its counters, ``items`` (packs), realised ``share``,
        ``target`` weight, ``epoch`` (of its own order) and ``ended`` (in this pass)."""
        pos = position_from(state)
        total = sum(int(c[0]) for c in state["per"])
        plan = self.walker.plan
        sources = {}
        for k, name in enumerate(self.names):
            per = dict(zip(PER, map(int, state["per"][k]), strict=True))
            lim = plan.limits[k]
            done = pos.counts[k] + (pos.pass_ * lim if plan.passes and lim is not None else 0)
            sources[name] = {
                **per,
                "items": per["packs"],
                "share": per["packs"] / total if total else 0.0,
                "target": float(plan.p[k]),
                "epoch": done // plan.lens[k],
                "ended": bool(self.walker.ended(pos, k)),
            }
        return {"epoch": pos.pass_, "online": 0, "skipped": 0, "sources": sources}


class MixedVLDataset(IterableDataset):
    """This rank's mixture packs for DataLoader workers: worker ``w`` of ``n`` takes the rank's
    packs in blocks of ``block_size``, blocks ``w, w + n, ...`` (as ``vl.dataset.worker_item_index``),
    from ``anchor``; each pack dict carries ``mix_source``. ``sources[k]``: a packed cache's path
    (opened in each worker) or a planned sample store (pickled as its path and plan)."""

    def __init__(
        self,
        sources: Sequence[Path | Any],
        walker: Walker,
        *,
        rank: int,
        world: int,
        remainder: Remainder,
        block_size: int,
    ) -> None:
        super().__init__()
        self.paths, self.walker = list(sources), walker
        self.rank, self.world, self.remainder, self.block_size = rank, world, remainder, block_size
        self.anchor = MixPos.start(len(self.paths))
        self._caches: list[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_caches": None}  # workers map the caches themselves

    def caches(self) -> list[Any]:
        if self._caches is None:
            from torchtitan_ext.vl.cache import VLCache

            self._caches = [VLCache.open(p) if isinstance(p, Path) else p for p in self.paths]
        return self._caches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        wid, n = (0, 1) if info is None else (info.id, info.num_workers)
        caches = self.caches()
        items = rank_items(self.walker, self.anchor, self.world, self.rank, self.remainder)
        for j, (item, _) in enumerate(items):
            if (j // self.block_size) % n != wid:
                continue  # another worker's block
            pack = fetch_pack(caches[item.source], item.index)
            pack["pack_index"] = torch.tensor(item.index, dtype=torch.int64)
            pack["mix_source"] = item.source
            yield pack


class SourceCollate:
    """``collate`` that also returns each source's counters of the batch: ``(batch, per)``."""

    def __init__(self, collate: Callable, nsources: int) -> None:
        self.collate, self.nsources = collate, nsources

    def __call__(self, packs: list[dict[str, Any]]) -> tuple[Any, list[list[int]]]:
        per = [[0] * len(PER) for _ in range(self.nsources)]
        for pack in packs:
            k = int(pack.pop("mix_source"))
            per[k] = [a + b for a, b in zip(per[k], pack_counts(pack), strict=True)]
        return self.collate(packs), per


class MixWorkerBatches(WorkerBatches):
    """:class:`~torchtitan_ext.vl.stages.WorkerBatches` over :class:`MixedVLDataset`: the state
    is ``packs``' (a :class:`MixPacks` used for its arithmetic only), moved over the packs of
    each batch handed over and counting them per source."""

    def __init__(
        self,
        dataset: MixedVLDataset,
        packs: MixPacks,
        batch_size: int,
        collate: Callable,
        workers: WorkerOptions,
        pin_memory: bool,
    ) -> None:
        collate_per_source = SourceCollate(collate, len(packs.names))
        super().__init__(dataset, batch_size, collate_per_source, workers, pin_memory, packs)

    def _start(self) -> Any:
        self.ds.anchor = self.packs._pos
        return super()._start()

    def _handed_over(self, item: Any) -> Any:
        batch, per = item
        self.packs.skip(int(batch_arrays(batch)[0].shape[0]))
        for k, added in enumerate(per):
            self.packs.count(k, added)
        return batch
