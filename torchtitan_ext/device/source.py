"""Any iterable loader as a pipeline stage, for staging a loader that has no Prefetch of its own.

:class:`LoaderStage` is what :class:`~torchtitan_ext.device.staging.AsyncDeviceLoader` puts
under its own :class:`~torchtitan_ext.pipeline.prefetch.Prefetch` when the wrapped loader (the VL
``DataLoader``, any torchtitan ``BaseDataLoader``) exposes no prefetching stage it could join:

==============  ======================================================================
``next()``      ``next(iter(loader))`` (``iter`` taken once per pass, on the first ``next``)
``state()``     a deep copy of ``loader.state_dict()`` (``None`` without snapshots), or of
                ``loader.rank_state()`` for one of this package's adapters (``rank_states``:
                their ``state_dict()`` gathers every rank, a collective that must never run
                per batch in a background thread). The Prefetch takes it once per batch, in
                its thread, right after the batch was pulled, so it travels with the batch.
                Deep: a loader may return live references into its own mutable state.
``reset(s)``    ``loader.load_state_dict(s)`` (not with ``rank_states``: the adapter loads
                the envelope itself), then a new pass; ``reset(None)`` starts a new
                pass *from where the loader is* (``iter(loader)`` again: what a new epoch of a
                ``DataLoader`` means), not from position zero.
``close()``     drops the iterator (a ``DataLoader`` iterator shuts its workers down when
                collected); the loader itself belongs to the caller.
==============  ======================================================================
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator
from typing import Any

from torchtitan_ext.device.h2d import _Stats
from torchtitan_ext.pipeline.stage import Stage, State


class LoaderStage(Stage[Any]):
    """``loader`` (an iterable, with ``state_dict``/``load_state_dict`` when ``snapshot``) as a
    stage; ``stats`` receives the pull and snapshot times (see the module docstring)."""

    def __init__(
        self, loader: Iterable[Any], snapshot: bool, stats: _Stats, rank_states: bool = False
    ) -> None:
        self.loader = loader
        self.snapshot = snapshot
        self.rank_states = rank_states
        self.counters = stats
        self._it: Iterator[Any] | None = None

    def next(self) -> Any:
        if self._it is None:
            self._it = iter(self.loader)
        t0 = time.perf_counter()
        batch = next(self._it)
        self.counters.add("fetch_s", time.perf_counter() - t0)
        return batch

    def state(self) -> State:
        if not self.snapshot:
            return None
        t0 = time.perf_counter()
        get = self.loader.rank_state if self.rank_states else self.loader.state_dict  # type: ignore[attr-defined]
        st = copy.deepcopy(get())
        with self.counters.lock:
            self.counters.snapshot_s += time.perf_counter() - t0
            self.counters.snapshots += 1
        return st

    def reset(self, state: State | None = None) -> None:
        if state is not None and self.rank_states:
            raise TypeError(
                f"{type(self.loader).__name__}: resume it with load_state_dict(envelope); a "
                "bare rank state cannot be loaded"
            )
        if state is not None:
            # a copy: the loader may keep (and later mutate) what it is given, and ``state`` is
            # the Prefetch's own record of the position
            self.loader.load_state_dict(copy.deepcopy(state))  # type: ignore[attr-defined]
        self._it = None

    def close(self) -> None:
        self._it = None
