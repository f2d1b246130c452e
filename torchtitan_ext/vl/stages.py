"""The VL loader as pipeline stages (``torchtitan_ext.pipeline.stage`` contract).

=====================  ===================================================================
:class:`CachePacks`    source: this rank's packs of a VL cache, in ``CachedVLDataset``'s global
                       order (``vl/dataset.py``'s pure position functions)
:class:`OnlinePacks`   source: packs made now from the dataset rows (``OnlineVLDataset``, the
                       slow fallback)
:class:`CollatePacks`  transform: ``batch_size`` packs -> one batch (``vl/collate.py``)
:class:`WorkerBatches` the DataLoader worker processes as ONE stage (source + collate in the
                       workers): its state is computed from the batches it handed over
:class:`CountBatches`  the step-log counters (tokens, padding, images), carried in the state
=====================  ===================================================================

Chains (``vl/reader.py`` builds them)::

    num_workers = 0 (or online):  Prefetch(CountBatches(CollatePacks(CachePacks | OnlinePacks)))
    num_workers > 0:              CountBatches(WorkerBatches)   (the workers prefetch already)

Position. Every state carries the source's *global* position — the cache's ``(epoch, cursor)``
(packs all ranks together consumed in the epoch) or the online stream's ``(epoch, next_row,
buffered rows, packs)`` — which is the same on every rank and means the same at every DP degree
and worker count. Invariant: the state after a batch is the source position *right after its
last pack*, so batches made ahead (the Prefetch queue, worker queues) never leak into a state:
resume is bitwise exact, and a state loads at any DP degree. The position part of a state
(:func:`position_of`) is what a checkpoint stores; the counters are per process and restart at
the loaded position with the values this process had.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.threads import exit_with_parent
from torchtitan_ext.vl.dataset import CachedVLDataset, fetch_pack, position, rounds_left
from torchtitan_ext.vl.options import WorkerOptions

SOURCE_CACHE, SOURCE_ONLINE = 0, 1
"""``state["source"]``: which source wrote a position (their orders differ)."""

COUNTS = (
    "batches", "packs", "tokens", "pad_tokens", "images", "patches", "video_frames",
    "video_patches",
)  # fmt: skip
""":class:`CountBatches`' counters, in the order of ``state["counts"]``. ``video_frames`` counts
merged frames (a temporal patch: two sampled frames), the unit every batch format shares (the
``torchtitan`` one carries each merged frame as its own item)."""


def batch_arrays(batch: Any) -> tuple[Any, Any]:
    """(token ids [B, L], image grids [I, 3] or None) of a batch in any batch format."""
    if isinstance(batch, tuple):
        inp = batch[0]
        return inp["input"], inp.get("grid_thw", inp.get("image_grid_thw"))
    return batch["input_ids"], batch.get("image_grid_thw")


def video_grid_of(batch: Any) -> Any:
    """The video grids [n, 3] of a batch in any batch format, or None (no video)."""
    inp = batch[0] if isinstance(batch, tuple) else batch
    grid = inp.get("video_grid_thw")
    return inp.get("grid_thw_videos") if grid is None else grid


def batch_counts(batch: Any, pad_id: int) -> tuple[int, ...]:
    """(packs, real tokens, pad tokens, images, image patches, merged video frames, video
    patches) of one batch: :data:`COUNTS` after ``batches``."""
    tokens, grid = batch_arrays(batch)
    pad = int((tokens == pad_id).sum())
    images = patches = frames = video_patches = 0
    if grid is not None:
        images, patches = int(grid.shape[0]), int(grid.prod(dim=-1).sum())
    vgrid = video_grid_of(batch)
    if vgrid is not None:
        frames, video_patches = int(vgrid[:, 0].sum()), int(vgrid.prod(dim=-1).sum())
    return (int(tokens.shape[0]), int(tokens.numel()) - pad, pad, images, patches, frames,
            video_patches)  # fmt: skip


def _pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_pin(v) for v in batch)
    return batch


class CachePacks(Stage[dict]):
    """This DP rank's packs of a cache (``CachedVLDataset``'s order, one pack per ``next()``).

    The dataset holds the *anchor* (the global ``(epoch, cursor)`` where this pass started); the
    stage counts the packs read since, so its state is ``position(anchor, packs)`` — arithmetic,
    no replay. A finite pass (``infinite=False``) ends after the epoch's last full round; its end
    state keeps the packs no round reached in the epoch (a smaller DP degree reads them), and
    ``reset`` to it at the same degree starts the next epoch.
    """

    def __init__(self, dataset: CachedVLDataset) -> None:
        self.ds = dataset
        self._k = 0  # packs read since the anchor

    def next(self) -> dict:
        ds = self.ds
        if not ds.infinite and self._k >= rounds_left(
            ds.num_packs, ds.dp_world_size, ds._cursor, ds.remainder
        ):
            raise StopIteration
        _, index = ds.pack_index_of(self._k)
        item = fetch_pack(ds.cache, index, ds.copy_pixels)
        item["pack_index"] = torch.tensor(index, dtype=torch.int64)
        self._k += 1
        return item

    def state(self) -> State:
        ds = self.ds
        pos = position(ds.num_packs, ds.dp_world_size, ds._epoch, ds._cursor, self._k, ds.remainder)
        return {"source": SOURCE_CACHE, **ds.position_state(*pos)}

    def reset(self, state: State | None = None) -> None:
        self.ds._epoch, self.ds._cursor, self.ds._yielded = 0, 0, 0
        if state is not None:
            self.ds.load_state_dict({k: v for k, v in state.items() if k != "source"})
        self._k = 0

    def stats(self, state: State) -> dict[str, Any]:
        return {"epoch": int(state["epoch"]), "online": 0, "skipped": 0}


class OnlinePacks(Stage[dict]):
    """Packs made from the rows now (``OnlineVLDataset``: same preprocessing and packing as the
    builder); its state is the dataset's own (rank-independent: every rank packs the same global
    stream), taken right after each pack was released."""

    def __init__(self, dataset: Any) -> None:
        self.ds = dataset
        self._start = dataset.state_dict()
        self._it: Any = None

    def next(self) -> dict:
        if self._it is None:
            self._it = iter(self.ds)
        return next(self._it)

    def state(self) -> State:
        return {"source": SOURCE_ONLINE, **self.ds.state_dict()}

    def reset(self, state: State | None = None) -> None:
        self._it = None
        st = self._start if state is None else state
        self.ds.load_state_dict({k: v for k, v in st.items() if k != "source"})

    def stats(self, state: State) -> dict[str, Any]:
        skips = state.get("skips", {})
        return {"epoch": int(state["epoch"]), "online": 1, "skipped": sum(skips.values())}


class CollatePacks(Stage[Any]):
    """``batch_size`` packs -> one batch (``collate``); an epoch's last batch may hold fewer
    (as a DataLoader with ``drop_last=False``). Its state is its upstream's."""

    def __init__(
        self, upstream: Stage[dict], batch_size: int, collate: Callable, pin_memory: bool
    ) -> None:
        self.upstream = upstream
        self.batch_size = batch_size
        self.collate = collate
        self.pin = pin_memory and torch.cuda.is_available()

    def next(self) -> Any:
        packs = []
        for _ in range(self.batch_size):
            try:
                packs.append(self.upstream.next())
            except StopIteration:
                if not packs:
                    raise
                break
        batch = self.collate(packs)
        return _pin(batch) if self.pin else batch

    def state(self) -> State:
        return self.upstream.state()

    def reset(self, state: State | None = None) -> None:
        self.upstream.reset(state)


class WorkerBatches(Stage[Any]):
    """A DataLoader over ``CachedVLDataset`` with worker processes, as one stage.

    Each worker reads a disjoint block-interleaved slice of this rank's packs (so the batches
    are those of the in-process chain) and collates them; the batches they made ahead sit in
    their queues. The state is computed in this process from the packs *handed over*:
    ``position(anchor, packs)``, so what the workers made ahead never leaks into it. ``reset``
    drops the workers; the next ``next()`` starts new ones at the new anchor.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        collate: Callable,
        workers: WorkerOptions,
        pin_memory: bool,
        packs: Any = None,
    ) -> None:
        # position arithmetic, never iterated here (a mixture passes its own: vl/mix_stages.py)
        self.packs = CachePacks(dataset) if packs is None else packs
        self.ds, self.batch_size, self.collate = dataset, batch_size, collate
        self.workers, self.pin_memory = workers, pin_memory
        self._it: Any = None
        self._done = False

    def _start(self) -> Any:
        kw: dict[str, Any] = {"num_workers": self.workers.num_workers}
        kw["worker_init_fn"] = exit_with_parent  # no worker outlives a killed job
        if self.workers.prefetch_factor is not None:
            kw["prefetch_factor"] = self.workers.prefetch_factor
        loader = DataLoader(
            self.ds,
            batch_size=self.batch_size,
            collate_fn=self.collate,
            pin_memory=self.pin_memory,
            **kw,
        )
        return iter(loader)

    def _handed_over(self, item: Any) -> Any:
        """Move the position over the packs of ``item`` (what a worker made); the batch."""
        self.packs._k += int(batch_arrays(item)[0].shape[0])
        return item

    def next(self) -> Any:
        if self._done:
            raise StopIteration
        if self._it is None:
            self._it = self._start()
        try:
            item = next(self._it)
        except StopIteration:
            self._done, self._it = True, None
            raise
        return self._handed_over(item)

    def state(self) -> State:
        return self.packs.state()

    def reset(self, state: State | None = None) -> None:
        self._it, self._done = None, False  # dropping the iterator shuts its workers down
        self.packs.reset(state)

    def close(self) -> None:
        self._it = None

    def stats(self, state: State) -> dict[str, Any]:
        return self.packs.stats(state)


class CountBatches(Stage[Any]):
    """The step-log counters (:data:`COUNTS`) of the batches handed over, carried in the state
    (``{"at": upstream state, "counts": [...]}``) so that :meth:`stats` is a pure function of it
    — under a Prefetch, the counts are those of the last batch the consumer received."""

    def __init__(self, upstream: Stage[Any], pad_id: int) -> None:
        self.upstream = upstream
        self.pad_id = pad_id
        self._counts = (0,) * len(COUNTS)

    def next(self) -> Any:
        batch = self.upstream.next()
        added = (1, *batch_counts(batch, self.pad_id))
        self._counts = tuple(a + b for a, b in zip(self._counts, added, strict=True))
        return batch

    def state(self) -> State:
        return {"at": self.upstream.state(), "counts": list(self._counts)}

    def reset(self, state: State | None = None) -> None:
        self.upstream.reset(None if state is None else state["at"])
        self._counts = (0,) * len(COUNTS) if state is None else tuple(state["counts"])

    def stats(self, state: State) -> dict[str, Any]:
        out: dict[str, Any] = dict(zip(COUNTS, state["counts"], strict=True))
        total = out["tokens"] + out["pad_tokens"]
        out["pad_pct"] = 100.0 * out["pad_tokens"] / total if total else 0.0
        out.update(self.upstream.stats(state["at"]))
        return out


def position_of(state: State) -> State:
    """The source position inside a chain state (what a checkpoint stores)."""
    return state["at"]


def with_position(state: State, position: State) -> State:
    """``state`` moved to ``position``, its counters kept."""
    return {"at": position, "counts": list(state["counts"])}
