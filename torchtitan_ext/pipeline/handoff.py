"""The prefetching loader's hand-off: a bounded queue whose ``get`` never wakes the producer.

Used by :class:`~torchtitan_ext.pipeline.prefetch.Prefetch` (its thread puts, its ``next()``
gets). Its
wake-up policy is what keeps the training loop's ``next()`` in microseconds, so it is kept
apart from the generic stop-aware hand-off of :mod:`torchtitan_ext.threads`; it takes the same
stop event.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

from torchtitan_ext.pipeline.priority import ThreadGroupPriority


class _ReadyQueue:
    """Bounded single-producer / single-consumer hand-off whose ``get`` never wakes the producer.

    Why not ``queue.Queue``: its ``get`` notifies a producer blocked on a full queue, so the
    training loop itself wakes the background thread, from inside ``next()``. Traced with
    ``perf sched`` on a 2-vCPU VM: the woken producer soon holds the GIL, the training thread
    blocks on it, and when the producer drops it (entering Rust) the kernel queues the training
    thread on the *producer's* CPU while the other CPU idles: runnable-but-waiting stalls of
    2-5 ms a few times per 100 steps, plus ~20-60 us per ``get`` for the cross-CPU wake-up.

    Here ``get`` is a ``deque`` pop (atomic under the GIL) and blocks, on a condition that the
    producer signals, only when the queue is empty; it reads no clock (the training loop's
    ``next()`` runs with cold caches after each step, so every call it skips counts). A producer that finds the queue full sleeps
    on its own timer, for about the time the consumer needs (at its measured rate) to bring the
    queue down to ``low`` batches, then refills it in one burst: few wake-ups, none of them
    caused by the training loop.
    """

    # Longest single producer sleep: bounds how stale the rate estimate can get and how long a
    # stop can go unnoticed (a stop also ends the sleep at once).
    MAX_SLEEP_S = 0.05

    def __init__(self, maxsize: int, priority: ThreadGroupPriority) -> None:
        self.maxsize = maxsize
        self.low = maxsize // 2  # refill once this many (or fewer) remain
        # Below the refill point on purpose: reaching `low` is the normal cycle; falling well
        # under it means the producer is not keeping up at idle priority.
        self.promote_at = self.low // 2
        # Adaptive policy of the producer's threads (see torchtitan_ext.pipeline.priority): idle once
        # the queue is full, normal again as soon as get() finds it below the low watermark.
        self.priority = priority
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        # The producer measures the consumer's rate from what left the queue (its puts minus
        # what is still queued), so a get reads no clock and writes no counter.
        self._puts = 0
        self._mark: tuple[float, int] | None = None  # producer: (time, gets) at the last sample
        self._interval: float | None = None  # producer: EMA of the seconds between two gets

    def qsize(self) -> int:
        return len(self._items)

    # ------------------------------------------------------------------ consumer
    def get_nowait(self) -> Any:
        """The consumer's fast path: the next item, or None when the queue is empty (items are
        never None). Never blocks and never wakes the producer."""
        items = self._items
        if self.priority.idle and len(items) <= self.promote_at:
            self.priority.set_idle(False)  # falling behind: the producer needs a full share of CPU
        try:
            return items.popleft()
        except IndexError:
            return None

    def wait(self, timeout: float) -> Any:
        """Block until the producer signals an item; ``queue.Empty`` after ``timeout`` s."""
        with self._cond:
            while not self._items:
                if not self._cond.wait(timeout):
                    raise queue.Empty
            return self._items.popleft()

    def get(self, timeout: float) -> Any:
        """Next item; ``queue.Empty`` if none arrived within ``timeout`` seconds."""
        item = self.get_nowait()
        return item if item is not None else self.wait(timeout)

    # ------------------------------------------------------------------ producer
    def _sample_rate(self) -> None:
        """Fold the consumer's gets since the last sample into the EMA of seconds per get (a
        sample with no new get leaves the window open)."""
        now, gets = time.perf_counter(), self._puts - len(self._items)
        if self._mark is not None:
            t, g = self._mark
            if gets == g:
                return
            dt = (now - t) / (gets - g)
            self._interval = dt if self._interval is None else 0.8 * self._interval + 0.2 * dt
        self._mark = (now, gets)

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Append ``item`` (False, without appending, once ``stop`` is set)."""
        self._sample_rate()
        if len(self._items) >= self.maxsize:
            while (excess := len(self._items) - self.low) > 0:
                # Half the expected drain time, then look again: the rate may have changed.
                est = 0.5 * excess * self._interval if self._interval else 0.001
                if stop.wait(min(max(est, 0.0005), self.MAX_SLEEP_S)):
                    return False
                self._sample_rate()
        if stop.is_set():
            return False
        self._items.append(item)
        self._puts += 1
        with self._cond:
            self._cond.notify()
        if len(self._items) >= self.maxsize and not self.priority.idle:
            self.priority.set_idle(True)  # ahead: run only on CPU time nobody else wants
        return True

    def clear(self) -> None:
        self._puts -= len(self._items)  # dropped, not taken: not counted as gets
        self._items.clear()
