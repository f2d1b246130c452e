"""Prefetch: the one background hand-off of every loader — runs its upstream chain in a thread.

Contract (:class:`~torchtitan_ext.pipeline.stage.Stage`): ``next()`` returns the upstream's next
item; ``state()`` is the upstream's ``state()`` taken *in the thread, right after that item was
made* (one snapshot per item, travelling with it), so whatever is still queued is simply made
again after a resume; ``reset(s)`` stops the thread, and the next ``next()`` restarts it from
``s``. The stage adds no position of its own: its state *is* its upstream's.

Why a thread. The expensive steps (tokenizers' Rust encode, pyarrow reads, the host-to-device
copy) release the GIL, so one thread overlaps them with the training loop without pickling
documents across processes.

Why this hand-off. :class:`~torchtitan_ext.pipeline.handoff._ReadyQueue` — ``next()`` is a
``deque`` pop that never wakes the producer (``queue.Queue.get`` does, from inside the training
loop; traced earlier with ``perf sched`` on 2 cores as 2-5 ms stalls a few times per 100 steps).

What was measured (``python -m benchmarks handoff``, table in ``benchmarks/RESULTS.md``): one
producer (GPT-2 ``encode_batch`` of 4 documents per item, GIL released) behind each hand-off, 8
items ahead, one state per item, a consumer at 50 % load (sleeping or spinning in Python), 5
interleaved rounds on the 2-core VM while other jobs kept its load average at 3-7:

==========================  ======================  ======================
``next()`` p50: median      sleeping consumer       spinning consumer
(per-round range)
==========================  ======================  ======================
ours (``Prefetch``)         34 us (32-36)           30 us (27-31)
thread + ``queue.Queue``    53 us (51-62)           48 us (43-1066)
torchdata.nodes Prefetcher  87 us (84-106)          87 us (69-3089)
Grain ThreadPrefetch        105 us (101-115)        107 us (96-549)
==========================  ======================  ======================

The median is the hand-off's own cost: there ours was below ``queue.Queue`` in every paired round
(1.4-1.8x with the sleeping consumer), torchdata.nodes' was 2.5-2.9x ours and Grain's 3.1-3.6x
(their per-item machinery: torchdata's semaphore, snapshot store and polling ``get``; Grain's
``deepcopy`` of the state and its stats wrappers around ``next``). The tails did *not* separate
the variants on that host: p99 0.2-80 ms and 1-12 % of the loop lost outside ``next()`` for
every one of them, the ranges overlapping (the other jobs' load dominated; the adaptive
``SCHED_IDLE`` policy, which yields to them, had the widest p99 range). A second run right
after (``--repeats 3 --set consumers=sleep --noise-tol 0``, load average 2.6-4.7) repeated the
medians (ours 35 us, 34 with the normal policy, ``queue.Queue`` 59, torchdata.nodes 89, Grain
117) and again overlapping tails (p99 0.2-16 ms), though with the adaptive policy the loop lost
0.65 % (-0.07 to 2.6) against 2.5-4.5 % for every other variant. So the earlier tail advantage
is neither confirmed nor refuted here; a quiet host is needed for that.

Decision: keep ours. Neither library's thread hand-off is cheaper, and neither offers what this
stage is for: no per-item copy of the state (ours relies on states being immutable once
returned; Grain deep-copies each), ``then`` (the staging copy in the same thread), the thread
policy, the same exception object relayed. Building on Grain would take: each loader chain
wrapped as :class:`~torchtitan_ext.pipeline.grain_adapter.ToGrain` under Grain's
``ThreadPrefetchIterDataset``, staging as a ``map`` under it, our checkpoint envelope kept
(Grain's states are plain dicts), and the thread policy given up; on torchdata.nodes, a
``BaseNode`` per stage under its ``Prefetcher`` and ``PinMemory`` nodes, likewise.

Other duties, each in one place:

* **Then** — an optional ``then(item)`` runs in the thread after the snapshot: device staging
  over a prefetching stage passes its host-to-device copy here (:meth:`Prefetch.set_then` on a
  built stage), so it needs no thread, queue or snapshot of its own.
* **Errors** — an exception in the thread is re-raised by ``next()`` as the *same* object
  (:func:`torchtitan_ext.threads.relay`); the stage's state becomes the upstream's
  ``state_after_error()`` where it defines one (the counts up to the error), else stays.
* **End** — a finite upstream's ``StopIteration`` travels with the state at the end of the
  pass; ``next()`` raises ``StopIteration`` from then on, until ``reset``.
* **Freeing** — what the consumer lets go of is freed by the thread, not on the training loop:
  the thread keeps each item (its value, state and host arrays: CPU tensors, numpy arrays)
  until the consumer is :data:`KEEP_HANDED` items further on, then drops it. Freeing a packer snapshot of
  ~1000 entries took ~35 us of the training loop; on the 2-core VM, woken from a 20 ms step,
  freeing a batch of three ``[8, 2048]`` tensors took 35-50 us there (3 us with warm caches),
  and torchtitan's loop drops the previous batch inside its timed ``next()``. Costs host memory
  for ``KEEP_HANDED`` more items; an item a consumer keeps longer is freed where it drops it.
  Arrays are not kept after ``then`` (staging recycles its own buffers).
* **Thread policy** — :mod:`~torchtitan_ext.pipeline.priority` (``thread_priority``): idle
  while the queue is full, normal when it runs low; the upstream's helper threads join the group.
* **Shutdown** — ``close()``, ``with``, and a ``weakref.finalize`` (also at interpreter exit) set
  the stop event, :meth:`~torchtitan_ext.pipeline.stage.Stage.interrupt` the upstream chain (a
  source waiting for a slow read returns at once) and join the thread under a deadline (:func:`torchtitan_ext.threads.join`); the
  thread holds no reference to the stage, so dropping the stage stops it.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from torchtitan_ext import threads
from torchtitan_ext.pipeline.handoff import _ReadyQueue
from torchtitan_ext.pipeline.priority import PRIORITY_MODES, ThreadGroupPriority
from torchtitan_ext.pipeline.stage import Stage, State

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PrefetchOptions:
    """Options of :class:`Prefetch` (a loader Config inherits them; TOML ``[dataloader]``)."""

    queue_size: int = 8
    """Items (batches) made ahead: the backpressure bound (~0.26 MB per text batch at B=8,
    T=2048)."""

    thread_priority: Literal["adaptive", "idle", "normal"] = "adaptive"
    """OS scheduling policy of the loader's threads. ``"adaptive"``: ``SCHED_IDLE`` while the
    queue is full (a waking training thread then preempts them at once instead of queueing
    behind them: measured on 2 cores, the loop's time lost outside ``next()`` fell from
    0.5-0.9 % to ~0), normal as soon as it runs down to a quarter; used only where the process
    may switch back (``CAP_SYS_NICE``), else normal. ``"idle"``: always idle; ``"normal"``:
    never touched."""


# An item is queued as a plain ``(value, state)`` tuple (the ``next()`` fast path tells it apart
# by ``type(item) is tuple``: cheaper on the training loop than an object with a ``__dict__``);
# the end of a pass and an error travel as the two classes below.


@dataclass
class _End:
    state: State


KEEP_HANDED = 2
"""Items handed to the consumer that the thread still references (its current item and the one
before), besides those queued: see "Freeing" in the module docstring."""


_SCALARS = (int, float, str, bytes, bool, type(None))


def host_arrays(value: Any) -> list[Any]:
    """The CPU tensors and numpy arrays in ``value`` (through nested tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_cpu else []
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)) or (value and isinstance(value[0], _SCALARS)):
        return []  # (a list of numbers is not walked item by item)
    return [a for v in value for a in host_arrays(v)]


@dataclass
class _Failure:
    exc: BaseException
    state: State | None


class _Worker:
    """One run of the thread. Holds no reference to the :class:`Prefetch` (so dropping the stage
    runs its finalizer, which stops us)."""

    def __init__(
        self,
        upstream: Stage[Any],
        then: Callable[[Any], Any] | None,
        queue_size: int,
        name: str,
        thread_priority: str,
    ) -> None:
        self.upstream = upstream
        self.then = then
        self.priority = ThreadGroupPriority(thread_priority)
        self.q = _ReadyQueue(queue_size, self.priority)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.busy_s = 0.0
        # (item, host arrays) of the items made recently, freed here once the consumer is
        # KEEP_HANDED items past them (see "Freeing" in the module docstring)
        self.held: collections.deque = collections.deque()

    def _run(self) -> None:
        self.priority.join_current_thread()
        up = self.upstream
        try:
            while not self.stop_event.is_set():
                t0 = time.perf_counter()
                try:
                    value = up.next()
                except StopIteration:
                    self.q.put(_End(up.state()), self.stop_event)
                    return
                if self.stop_event.is_set():
                    return  # the upstream may have ended early because of the stop
                st = up.state()
                if self.then is not None:
                    # the item's memory is staging's, which recycles it: only the state is kept
                    value = self.then(value)
                    item, kept = (value, st), (st, ())
                else:
                    item = (value, st)
                    # the arrays too, taken before the consumer can change the containers
                    kept = (item, host_arrays(value))
                self.busy_s += time.perf_counter() - t0
                if not self.q.put(item, self.stop_event):
                    return
                self.held.append(kept)
                while len(self.held) > self.q.qsize() + KEEP_HANDED:
                    self.held.popleft()  # the consumer has moved past it: freed here
        except BaseException as e:  # noqa: BLE001 - relayed to the consumer, which re-raises it
            self.q.put(_Failure(e, _state_after(up, e)), self.stop_event)
        finally:
            self.held.clear()
            self.priority.leave_current_thread()
            self.priority.close()

    def stop(self, timeout: float) -> bool:
        self.stop_event.set()
        self.upstream.interrupt()  # a stage waiting for a read returns now, not after it
        self.q.clear()
        return not threads.join([self.thread], timeout, logger, "left running as a daemon")


def _state_after(up: Stage[Any], exc: BaseException) -> State | None:
    """The upstream's ``state_after_error()`` where it has one; None if it has none or fails
    itself (noted on ``exc``): the original error must still reach the consumer."""
    after = getattr(up, "state_after_error", None)
    if after is None:
        return None
    try:
        return after()
    except Exception as e:  # noqa: BLE001 - secondary; the relayed error is the first one
        exc.add_note(f"(state_after_error() failed too: {type(e).__name__}: {e})")
        return None


def _shutdown(ref: list[_Worker | None], timeout: float = 10.0) -> bool:
    w, ref[0] = ref[0], None
    return w.stop(timeout) if w is not None else True


class Prefetch(Stage[Any]):
    """Run ``upstream`` in a background thread, ``queue_size`` items ahead (see the module doc).

    Args:
        upstream: the chain to run in the thread; used only by that thread while it runs.
        options: :class:`PrefetchOptions` (queue size, thread policy).
        name: the thread's name (shows in ``py-spy`` / error notes).
        then: applied to each item in the thread, after its state was taken (device staging).
    """

    def __init__(
        self,
        upstream: Stage[Any],
        options: PrefetchOptions | None = None,
        *,
        name: str = "prefetch",
        then: Callable[[Any], Any] | None = None,
    ) -> None:
        options = options or PrefetchOptions()
        queue_size, thread_priority = options.queue_size, options.thread_priority
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if thread_priority not in PRIORITY_MODES:
            raise ValueError(
                f"thread_priority must be one of {PRIORITY_MODES}, got {thread_priority!r}"
            )
        self.upstream = upstream
        self.queue_size = queue_size
        self.name = name
        self.thread_priority = thread_priority
        self.then = then
        self._state: State = upstream.state()
        self._upstream_at_state = True  # the upstream sits exactly at self._state
        self._done = False
        self._wait_s = 0.0
        self._ref: list[_Worker | None] = [None]
        self._q: _ReadyQueue | None = None  # the running worker's queue (next()'s one lookup)
        self._finalizer = weakref.finalize(self, _shutdown, self._ref)

    # ------------------------------------------------------------------ thread control
    def _worker(self) -> _Worker:
        w = self._ref[0]
        if w is None:
            if not self._finalizer.alive:
                raise RuntimeError(f"{self.name}: the stage is closed")
            if not self._upstream_at_state:
                self.upstream.reset(self._state)
            w = _Worker(self.upstream, self.then, self.queue_size, self.name, self.thread_priority)
            self.upstream.join_threads(w.priority)
            self._ref[0], self._q = w, w.q
            self._upstream_at_state = False  # the thread moves it on from here
            w.thread.start()
        return w

    def _stop(self) -> None:
        self._q = None
        _shutdown(self._ref)

    def start(self) -> None:
        """Start the thread now rather than at the first ``next()`` (a wrapper whose ``iter()``
        begins a pass gets its first items made while the caller still sets up)."""
        if not self._done:
            self._worker()

    def set_then(self, then: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
        """Install ``then`` (applied to each item in the thread, after its state was taken) on an
        existing stage and return the previous one: device staging puts its host-to-device copy
        on a loader's Prefetch this way. A running thread is stopped first; the items it had
        made ahead are dropped and made again, through ``then``, from the state of the last
        item returned, so the stream stays exact."""
        self._stop()
        prev, self.then = self.then, then
        return prev

    @property
    def done(self) -> bool:
        """A finite upstream's pass has ended: ``next()`` raised ``StopIteration`` (until
        ``reset``)."""
        return self._done

    @property
    def worker(self) -> _Worker | None:
        """The running thread's worker (None when stopped): its queue, busy time and policy."""
        return self._ref[0]

    # ------------------------------------------------------------------ contract
    def next(self) -> Any:
        # The training loop's call, made with cold caches after each step, where every object
        # touched costs: the common case is one attribute load, a deque pop and a tuple unpack;
        # starting, waiting, the end and errors are off that path.
        q = self._q
        if q is None:
            if self._done:
                raise StopIteration
            q = self._worker().q
        item = q.get_nowait()
        if item is None:
            item = self._wait()
        if type(item) is tuple:
            value, self._state = item
            return value
        return self._finish(item)

    __next__ = next

    def _wait(self) -> Any:
        """The queue was empty: wait for the thread's next item (timed: ``consumer_wait_ms``)."""
        w = self._ref[0]
        if w is None:  # stopped from another thread (a finalizer) since next() looked
            raise RuntimeError(f"{self.name}: the stage was stopped while waiting")
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    return w.q.wait(0.5)
                except queue.Empty:
                    if not w.thread.is_alive():
                        msg = f"{self.name}: thread ended without a result"
                        raise RuntimeError(msg) from None
        finally:
            self._wait_s += time.perf_counter() - t0

    def _finish(self, item: _End | _Failure) -> Any:
        """The end of a finite pass (``StopIteration``) or the thread's error, re-raised."""
        name = self._ref[0].thread.name if self._ref[0] is not None else self.name
        self._stop()
        if isinstance(item, _End):
            self._done = True
            self._state = item.state
            raise StopIteration
        if item.state is not None:
            self._state = item.state
        raise threads.relay(item.exc, f"the background thread {name!r}", f"{self.name}")

    def state(self) -> State:
        return self._state

    def reset(self, state: State | None = None) -> None:
        self._stop()
        self.upstream.reset(state)
        self._state = self.upstream.state() if state is None else state
        self._upstream_at_state = True
        self._done = False

    def close(self, timeout: float = 10.0) -> bool:  # type: ignore[override]
        """Stop the thread (idempotent), waiting up to ``timeout`` s; False if it is still
        running then (logged with where it is blocked). Closes the upstream too."""
        if self._finalizer.detach() is None:
            return True
        self._q = None
        ok = _shutdown(self._ref, timeout)
        self.upstream.close()
        return ok

    def stats(self, state: State) -> dict[str, Any]:
        return self.upstream.stats(state)

    def get_stats(self) -> dict[str, Any]:
        """The upstream's counters as of the last item returned, plus the hand-off's own."""
        w = self._ref[0]
        out = dict(self.upstream.stats(self._state))
        out.update(
            queue_depth=w.q.qsize() if w is not None else 0,
            queue_capacity=self.queue_size,
            thread_alive=bool(w is not None and w.thread.is_alive()),
            consumer_wait_ms=self._wait_s * 1e3,
            producer_busy_ms=(w.busy_s * 1e3) if w is not None else 0.0,
            threads_idle=int(w is not None and w.priority.idle),
            priority_switches=w.priority.switches if w is not None else 0,
        )
        return out
