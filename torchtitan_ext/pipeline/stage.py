"""The one contract of every part of a loader: ``next``, ``state``, ``reset``, ``close``.

A loader is a chain of stages — a source (Parquet row groups, an HF stream, VL cache packs), then
transforms (tokenize + pack, VL collate), then :class:`~torchtitan_ext.pipeline.prefetch.Prefetch`
(the one background hand-off), then device staging — and every stage speaks the same four calls:

==============  ======================================================================
``next()``      the next item; ``StopIteration`` at the end of a finite stream. Errors keep
                their type (``BadInputError`` names file / row; a background thread's
                exception is re-raised as the same object with a note).
``state()``     the position right *after* the last item ``next()`` returned: a tree of
                ``int``/``float``/``str``/``bytes``/``bool``/``None``, numpy arrays, lists and
                dicts (:data:`State`). It must be cheap (a prefetching stage takes one per
                item, in its thread) and must never change after it is returned (copy, or
                share only what is never mutated, like the document arrays of a packer).
``reset(s)``    go to ``s`` (a value ``state()`` returned, possibly from another process after
                :mod:`~torchtitan_ext.pipeline.checkpoint` encoded and decoded it) or, with
                ``None``, to the start. The items that follow are bitwise the ones that
                followed ``s`` the first time (the exact-resume invariant).
``close()``     release threads and files; idempotent; a closed stage cannot be iterated.
==============  ======================================================================

Why our own class (and not torchdata.nodes' ``BaseNode`` or Grain's ``DatasetIterator``): both
have the same four calls under other names (``next``/``state_dict``/``reset``,
``__next__``/``get_state``/``set_state``), so adapters are a few lines, and what decided it was
measured: ``python -m benchmarks handoff`` (figures in ``benchmarks/RESULTS.md``, reasoning in
:mod:`~torchtitan_ext.pipeline.prefetch`) ran one producer behind each library's thread
prefetch and ours; at the median ``next()`` torchdata.nodes cost 2.5-2.9x and Grain 3.1-3.6x ours,
and neither offers what the contract relies on (states immutable once returned, so no per-item
copy; the staging copy in the same thread; the thread policy). So the contract stays ours.

torchtitan's main branch has moved its data loading to Grain.
:mod:`~torchtitan_ext.pipeline.grain_adapter` bridges both ways (tested with grain 0.2.18):
``ToGrain(stage)`` is a Grain checkpointable iterator (``get_state``/``set_state`` =
``state``/``reset``), usable as the parent of Grain's prefetch; ``FromGrain(iterator)`` makes a
Grain pipeline a source stage under our ``Prefetch`` and checkpoint envelope (Grain's states are
dicts of ints, encoded as they are).

Layering: this package imports only the standard library, numpy and torch; ``text``, ``vl`` and
``device`` build their stages on it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

OptionsT = TypeVar("OptionsT")

State = Any
"""A stage's position: ints, floats, strs, bytes, bools, None, numpy arrays, lists and dicts."""


class Stage(Generic[T]):
    """Base of every stage (see the module docstring for the contract).

    Subclasses implement :meth:`next`, :meth:`state` and :meth:`reset`; :meth:`close` defaults
    to closing :attr:`upstream` (a source has none). Iteration (``for x in stage``) calls
    :meth:`next`; ``with stage:`` closes it.
    """

    upstream: Stage[Any] | None = None

    def next(self) -> T:
        raise NotImplementedError

    def state(self) -> State:
        raise NotImplementedError

    def reset(self, state: State | None = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()

    def stats(self, state: State) -> dict[str, Any]:
        """Counters for the per-step log line as of ``state`` (one this stage returned): a pure
        function of it, so a prefetching stage can report exactly the position of the last item
        it handed over while its thread runs ahead. A stage adds its own to its upstream's."""
        return self.upstream.stats(state) if self.upstream is not None else {}

    def interrupt(self) -> None:
        """Called by a prefetching stage, from another thread, when it stops its thread: a stage
        that may block for long inside ``next()`` (waiting for a read) should return promptly
        (ending its stream early is fine: the prefetching stage resets the chain before it runs
        it again). Must be thread-safe and cheap. Default: pass it on."""
        if self.upstream is not None:
            self.upstream.interrupt()

    def join_threads(self, group: Any) -> None:
        """Called by a prefetching stage before it runs this chain in its thread: helper threads
        this stage starts (read-ahead) should join ``group``
        (:class:`~torchtitan_ext.pipeline.priority.ThreadGroupPriority`). Default: pass it on."""
        if self.upstream is not None:
            self.upstream.join_threads(group)

    # Python protocols -------------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        return self.next()

    def __enter__(self) -> Stage[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Map(Stage[U]):
    """A stateless transform: ``fn(upstream.next())``; its state is its upstream's."""

    def __init__(self, upstream: Stage[T], fn: Callable[[T], U]) -> None:
        self.upstream = upstream
        self.fn = fn

    def next(self) -> U:
        return self.fn(self.upstream.next())

    def state(self) -> State:
        return self.upstream.state()

    def reset(self, state: State | None = None) -> None:
        self.upstream.reset(state)


def options(cls: type[OptionsT], config: Any) -> OptionsT:
    """The ``cls`` options (a stage's options dataclass) held by ``config``.

    A loader's Config is *made of* its stages' options dataclasses (it inherits them, so the TOML
    keys stay flat: ``[dataloader] queue_size``); this picks one stage's fields back out by name,
    so no field list is ever retyped by hand between the Config and the stage.
    """
    return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})  # type: ignore[arg-type]
