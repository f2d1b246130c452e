"""The iterator face of a loader whose chain is topped by a :class:`~.prefetch.Prefetch`.

:class:`PrefetchedLoader` gives such a loader the calls a training loop and a checkpointer use —
``next`` / ``iter`` (whose iterator is :attr:`pipeline` itself), ``done``, ``close`` (and ``with``), ``get_stats``, ``reset``, and
``state_dict`` / ``load_state_dict`` (:meth:`rank_state`, encoded pickle-free by
:mod:`~.checkpoint`) — each a call on :attr:`pipeline`. A loader builds its chain, sets
``self.pipeline`` and, when its checkpoint form differs from the live state (a packer made
compact), overrides :meth:`rank_state`. The Parquet loader and its mixture are two such loaders.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.prefetch import Prefetch
from torchtitan_ext.pipeline.stage import State


class PrefetchedLoader:
    """Calls on :attr:`pipeline`, the loader's topmost stage (see the module docstring)."""

    pipeline: Prefetch

    def __iter__(self) -> Iterator[Any]:
        # The Prefetch itself: a training loop's next() is then one call, not two (on a loop
        # woken with cold caches each call costs microseconds; pipeline/prefetch.py, next()).
        return self.pipeline

    def __next__(self) -> Any:
        return self.pipeline.next()

    @property
    def done(self) -> bool:
        """A finite pass has ended (``StopIteration`` raised), also when the batches were taken
        from :attr:`pipeline` directly (device staging, fused)."""
        return self.pipeline.done

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the background thread and its helpers (idempotent), waiting up to ``timeout``
        seconds: True once they have all ended. One still running then (a read that never
        returns cannot be interrupted from Python) is logged as an error with where it is
        blocked, and False is returned. The loader cannot be iterated afterwards."""
        return self.pipeline.close(timeout)

    def __enter__(self) -> PrefetchedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_stats(self) -> dict[str, Any]:
        """Counters for logging (cheap; safe to call every step), as of the last batch returned
        by ``next()`` (exact, and preserved across a resume)."""
        return self.pipeline.get_stats()

    def rank_state(self) -> State:
        """This rank's state as of the last batch returned (what a checkpoint holds)."""
        return self.pipeline.state()

    def reset(self, state: State | None = None) -> None:
        """Go to ``state`` (a :meth:`rank_state`, decoded) or, with None, to the start."""
        self.pipeline.reset(state)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`rank_state`, encoded pickle-free (numpy arrays as little-endian bytes)."""
        return checkpoint.encode(self.rank_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next batch is the one that followed it."""
        self.reset(checkpoint.decode(state))
