"""OS scheduling policy for a loader's background threads: get out of the training thread's way.

Why. A background loader thread shares the CPUs (and the GIL) with the training loop. Traced with
``perf sched`` on a 2-vCPU VM: when the training thread wakes from its step while our producer
holds the GIL, the producer's GIL release wakes the training thread *onto the producer's CPU*,
where it waits, runnable, behind the still-busy producer (up to the next 4 ms tick) while the
other CPU idles. Measured with ``python -m benchmarks text_loaders`` (consumer at 50 % of
capacity), with the ready-queue hand-off and ``sched_yield`` of :mod:`~torchtitan_ext.text.prefetch`
already in place, at the normal policy the training loop still lost 0.5-0.9 % of its time this way
(outside ``next()``, beyond an empty loop's sleep overshoot), and ``next()`` had p99 0.015-0.13 ms.

With the producer and its readers at ``SCHED_IDLE`` the kernel lets a waking normal thread
preempt them at once and treats a CPU running only them as idle when placing a wakee: the loss
fell to ~0 (-0.09 to +0.08 %) and p99 ``next()`` to 11-43 us. ``SCHED_IDLE`` threads, however, only
run on CPU time nobody else wants, so a training process that keeps every core busy starves them
(the benchmark's CPU-bound loop, matmuls on both cores between steps: 18 % of its time waiting
with ``"idle"``, 0.03-0.04 % with ``"adaptive"`` or ``"normal"``). Hence the default, ``"adaptive"``: idle
while the ready queue is full, back to normal as soon as the consumer finds it at a quarter of its
capacity (half of the refill point), i.e. whenever the loader is at risk of falling behind.

Leaving ``SCHED_IDLE`` needs ``CAP_SYS_NICE`` (or ``RLIMIT_NICE`` >= 20); Linux refuses it to
unprivileged threads. ``"adaptive"`` therefore probes once per process (in a throwaway thread)
whether the switch back is allowed, and where it is not, or off Linux, leaves the threads at the
normal policy: it never demotes a thread it could not promote again. ``"idle"`` demotes
unconditionally (for hosts with cores to spare); ``"normal"`` never touches the policy.

Linux threads inherit the policy of the thread that creates them: a thread a group member starts
while idle starts idle. The prefetching loader's members start only their own read-ahead helpers
(which join the group), and the group starts at the normal policy, so the library thread pools
created on first use (Arrow's, the tokenizer's) start normal; checked by listing every thread's
policy after a run in ``tests/test_prefetch.py``.
"""

from __future__ import annotations

import os
import threading

PRIORITY_MODES = ("adaptive", "idle", "normal")

_probe_lock = threading.Lock()
_probe_result: bool | None = None


def _supported() -> bool:
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


def can_leave_idle() -> bool:
    """Whether a thread of this process may go from ``SCHED_IDLE`` back to the normal policy
    (probed once, in a throwaway thread, so no real thread is ever stuck at idle)."""
    global _probe_result
    with _probe_lock:
        if _probe_result is None:
            result = [False]

            def probe() -> None:
                try:
                    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
                    result[0] = True
                except OSError:  # EPERM (no CAP_SYS_NICE) or unsupported: the answer is no
                    result[0] = False

            if _supported():
                t = threading.Thread(target=probe, name="sched-idle-probe", daemon=True)
                t.start()
                t.join()
            _probe_result = result[0]
        return _probe_result


class ThreadGroupPriority:
    """The scheduling policy of a group of threads (a producer and its readers), switched
    together. Threads join with :meth:`join_current_thread` and leave with
    :meth:`leave_current_thread`; :meth:`set_idle` is cheap when nothing changes (one attribute
    read) and costs one ``sched_setscheduler`` per thread when it does."""

    def __init__(self, mode: str = "adaptive") -> None:
        if mode not in PRIORITY_MODES:
            raise ValueError(f"thread priority must be one of {PRIORITY_MODES}, got {mode!r}")
        self.mode = mode
        if mode == "normal" or not _supported():
            self.active = False
        elif mode == "idle":
            self.active = True
        else:
            self.active = can_leave_idle()
        self.adaptive = self.active and mode == "adaptive"
        self.idle = self.active and mode == "idle"  # the group's current policy
        self.switches = 0  # policy changes so far (for get_stats)
        self._tids: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _apply(self, tid: int, idle: bool) -> None:
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            self._tids.discard(tid)  # exited without leaving (killed interpreter, etc.)

    def join_current_thread(self) -> None:
        if not self.active:
            return
        tid = threading.get_native_id()
        with self._lock:
            if self._closed:
                return
            self._tids.add(tid)
            if self.idle:
                self._apply(tid, True)

    def leave_current_thread(self) -> None:
        """Forget the calling thread before it ends (its id could later name another thread),
        and put it back to normal if it may (so that it does not exit idle)."""
        tid = threading.get_native_id()
        with self._lock:
            self._tids.discard(tid)
            if self.idle and self.adaptive:
                self._apply(tid, False)

    def set_idle(self, idle: bool) -> None:
        """Adaptive mode only: move every thread of the group to ``SCHED_IDLE`` (True) or back
        to the normal policy (False). A no-op when already there."""
        if not self.adaptive or idle == self.idle:
            return
        with self._lock:
            if self._closed or idle == self.idle:
                return
            for tid in list(self._tids):
                self._apply(tid, idle)
            self.idle = idle
            self.switches += 1

    def close(self) -> None:
        """No further switches (the threads are gone or going)."""
        with self._lock:
            self._closed = True
            self._tids.clear()
