"""The streaming loader's chains in worker processes, as ONE stage.

:class:`WorkerChains` runs one chain (:class:`~torchtitan_ext.text.stream_stages.StreamDocs` ->
:class:`~torchtitan_ext.text.stream_pack.PackBatches`) per worker process of a plain
``torch.utils.data.DataLoader`` (``batch_size=None``: the chain batches). Each worker yields
``(worker, batch, chain state right after it)``; the stage keeps the latest state of every
worker and which worker comes next. Its state is ``{"workers": [chain state per worker],
"next": k}`` — pickle-free, the per-worker stage states themselves.

Why this and not torchdata's ``StatefulDataLoader``: its state is its own nested format (the
per-worker states had to be dug out of it, and could only be loaded back whole, at the same
worker count), and it snapshots worker states on a schedule. Here the state travels with each
batch, as :class:`~torchtitan_ext.pipeline.prefetch.Prefetch` does for a thread, so the
position is exact after every batch and can be re-dealt to another number of slots. The
DataLoader takes batch ``i`` from worker ``i % num_workers`` (skipping workers whose finite
stream ended); a resume starts its workers rotated so that the saved ``next`` worker is the
DataLoader's worker 0: batches continue in the same order.

Why no :class:`Prefetch` on top: the DataLoader's own queues already run ``prefetch_factor``
batches ahead per worker, and ``next()`` is a queue read; a thread would only add a hop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.text.stream_pack import PackBatches, PackOptions
from torchtitan_ext.text.stream_source import StreamSource
from torchtitan_ext.text.stream_stages import (
    StreamDocs,
    StreamOptions,
    slot_stats,
)
from torchtitan_ext.text.tokenize import TextTokenizer
from torchtitan_ext.threads import exit_with_parent


@dataclass
class ChainSpec:
    """What a worker needs to build its chain (pickled into each worker process)."""

    source: StreamSource
    stream: StreamOptions
    pack: PackOptions
    tokenizer: TextTokenizer
    seq_len: int
    batch_size: int | None

    def build(self, slot: int, nslots: int) -> PackBatches:
        docs = StreamDocs(self.source, self.stream, slot, nslots)
        return PackBatches(docs, self.tokenizer, self.seq_len, self.pack, self.batch_size)


def _as_is(item: Any) -> Any:
    """The DataLoader's per-item conversion: none (its default turns the states' numpy arrays
    into tensors)."""
    return item


class _Workers(IterableDataset):
    """The dataset each DataLoader worker iterates: its chain, from its start state."""

    def __init__(self, spec: ChainSpec, slots: list[int], nslots: int, starts: list, first: int):
        self.spec, self.slots, self.nslots = spec, slots, nslots
        self.starts, self.first = starts, first

    def __iter__(self) -> Iterator[tuple[int, Any, State]]:
        info = get_worker_info()
        n = len(self.slots)
        w = ((info.id if info is not None else 0) + self.first) % n
        chain = self.spec.build(self.slots[w], self.nslots)
        chain.reset(self.starts[w])
        while True:
            try:
                item = chain.next()
            except StopIteration:
                return
            yield w, item, chain.state()


class WorkerChains(Stage[Any]):
    """``num_workers`` chains for slots ``slots`` (of ``nslots``), one per worker process."""

    def __init__(
        self,
        spec: ChainSpec,
        slots: list[int],
        nslots: int,
        *,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.spec, self.slots, self.nslots = spec, slots, nslots
        self.prefetch_factor, self.pin_memory = prefetch_factor, pin_memory
        self._it: Iterator[Any] | None = None
        self.reset(None)

    def fresh_states(self) -> list[State]:
        """The state of every worker's chain before its first batch."""
        return [self.spec.build(s, self.nslots).state() for s in self.slots]

    def state(self) -> State:
        return {"workers": list(self.states), "next": self.next_worker}

    def reset(self, state: State | None = None) -> None:
        self._it = None  # the old iterator's workers shut down when it is dropped
        self._done = False
        if state is None:
            self.states, self.next_worker = self.fresh_states(), 0
        else:
            if len(state["workers"]) != len(self.slots):
                raise ValueError(
                    f"state holds {len(state['workers'])} workers, this stage has {len(self.slots)}"
                )
            self.states, self.next_worker = list(state["workers"]), int(state["next"])

    def next(self) -> Any:
        if self._done:
            raise StopIteration
        if self._it is None:
            ds = _Workers(self.spec, self.slots, self.nslots, list(self.states), self.next_worker)
            n = len(self.slots)
            kw: dict[str, Any] = {"num_workers": n, "pin_memory": self.pin_memory,
                                  "worker_init_fn": exit_with_parent}  # fmt: skip
            if self.prefetch_factor is not None:
                kw["prefetch_factor"] = self.prefetch_factor
            self._it = iter(DataLoader(ds, batch_size=None, collate_fn=_as_is, **kw))
        try:
            w, item, st = next(self._it)
        except StopIteration:
            self._it, self._done = None, True
            raise
        self.states[w] = st
        self.next_worker = (w + 1) % len(self.slots)
        return item

    def close(self) -> None:
        self._it = None

    def stats(self, state: State) -> dict[str, Any]:
        return merged_stats([slot_stats(s) for s in state["workers"]])


def merged_stats(per_slot: list[dict[str, Any]]) -> dict[str, Any]:
    """Epoch (slowest slot); documents used, tokens read and skips summed over slots."""
    if not per_slot:
        return {}
    skips: dict[str, int] = {}
    for s in per_slot:
        for k, v in s["skips"].items():
            skips[k] = skips.get(k, 0) + int(v)
    out = {
        "epoch": min(int(s["epoch"]) for s in per_slot),
        "docs_used": sum(int(s["docs_used"]) for s in per_slot),
        "skipped": sum(skips.values()),
        "skips": skips,
    }
    if all("tokens_read" in s for s in per_slot):
        out["tokens_read"] = sum(int(s["tokens_read"]) for s in per_slot)
    return out
