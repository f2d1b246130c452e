"""Stage <-> Grain iterator, both ways: the two contracts are the same four calls under other names.

==================  ======================================
:class:`Stage`      Grain ``DatasetIterator``
==================  ======================================
``next()``          ``__next__()``
``state()``         ``get_state()``
``reset(s)``        ``set_state(s)``
``close()``         ``close()``
==================  ======================================

* :class:`ToGrain` — a stage (a whole loader chain) as the checkpointable iterator Grain's
  transformations accept as a parent (e.g. ``grain.experimental.ThreadPrefetchDatasetIterator``).
* :class:`FromGrain` — a Grain ``DatasetIterator`` (``IterDataset.__iter__()``, e.g. a
  ``MapDataset.source(...).shuffle(...).to_iter_dataset()`` pipeline) as a source stage, so
  our ``Prefetch``, checkpoint envelope and stats work on top of it. Grain's states are dicts of
  ints / strs / bytes, which :mod:`~torchtitan_ext.pipeline.checkpoint` encodes as they are.

Neither imports Grain (they speak its protocol), so this module keeps the package's layering
(standard library, numpy, torch). Tested against grain 0.2.18 in
``tests/test_pipeline_grain_adapter.py`` (skipped where grain is not installed).
"""

from __future__ import annotations

from typing import Any

from torchtitan_ext.pipeline.stage import Stage, State


class ToGrain:
    """``stage`` as a Grain checkpointable iterator (``__next__`` / ``get_state`` / ``set_state``).

    Grain deep-copies ``get_state()`` per element in its prefetch thread; a stage's state is
    immutable once returned, so that copy is only cost, never needed for correctness.
    """

    def __init__(self, stage: Stage[Any]) -> None:
        self.stage = stage

    def __iter__(self) -> ToGrain:
        return self

    def __next__(self) -> Any:
        return self.stage.next()

    def get_state(self) -> State:
        return self.stage.state()

    def set_state(self, state: State) -> None:
        self.stage.reset(state)

    def close(self) -> None:
        self.stage.close()


class FromGrain(Stage[Any]):
    """A Grain ``DatasetIterator`` as a source stage; ``reset(None)`` returns to the state it had
    when wrapped (Grain has no "start over" call of its own)."""

    def __init__(self, iterator: Any) -> None:
        self.it = iterator
        self.start = iterator.get_state()

    def next(self) -> Any:
        return next(self.it)

    def state(self) -> State:
        return self.it.get_state()

    def reset(self, state: State | None = None) -> None:
        self.it.set_state(self.start if state is None else state)

    def close(self) -> None:
        self.it.close()
