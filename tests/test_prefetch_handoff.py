"""The prefetching loader's hand-off to the training loop: the ready queue (whose get never wakes
the producer; hysteresis refill; prompt stop) and the adaptive scheduling policy of its threads."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchtitan_ext.pipeline import priority as prio
from torchtitan_ext.pipeline.handoff import _ReadyQueue
from torchtitan_ext.pipeline.priority import ThreadGroupPriority, can_leave_idle

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
needs_cap = pytest.mark.skipif(
    not (hasattr(os, "SCHED_IDLE") and can_leave_idle()),
    reason="this process may not leave SCHED_IDLE (no CAP_SYS_NICE)",
)


class FakePriority:
    def __init__(self) -> None:
        self.idle = False
        self.calls: list[bool] = []

    def set_idle(self, idle: bool) -> None:
        self.calls.append(idle)
        self.idle = idle


def _wait_for(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


# ---------------------------------------------------------------------------- ready queue
def test_get_is_fifo_and_an_empty_get_times_out_or_is_woken_by_put():
    q = _ReadyQueue(4, FakePriority())
    stop = threading.Event()
    for i in range(3):
        assert q.put(i, stop)
    assert [q.get(0.1) for _ in range(3)] == [0, 1, 2]
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(0.05)
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, q.put, args=("late", stop)).start()
    assert q.get(5.0) == "late"


def test_full_queue_refills_only_after_draining_to_the_low_watermark():
    q = _ReadyQueue(4, FakePriority())  # low = 2
    stop = threading.Event()
    for i in range(4):
        q.put(i, stop)
    done = threading.Event()
    threading.Thread(target=lambda: (q.put(4, stop), done.set()), daemon=True).start()
    assert q.get(0.1) == 0  # 3 left: above the low watermark, the producer keeps sleeping
    assert not done.wait(0.2) and q.qsize() == 3
    assert q.get(0.1) == 1  # 2 left: refill
    assert done.wait(5.0) and q.qsize() == 3
    assert [q.get(0.1) for _ in range(3)] == [2, 3, 4]


def test_the_producer_measures_the_consumers_rate_from_its_gets_alone(monkeypatch):
    """A get reads no clock: the producer turns the count of gets between its own puts into
    the seconds per get that size its sleeps (a put with no get in between keeps the window
    open; a step that took longer moves the estimate by a fifth)."""
    from torchtitan_ext.pipeline import handoff

    clock, reads = [100.0], [0]

    def perf_counter() -> float:
        reads[0] += 1
        return clock[0]

    monkeypatch.setattr(handoff.time, "perf_counter", perf_counter)
    q = _ReadyQueue(64, FakePriority())
    stop = threading.Event()
    for i in range(30):  # a put, 10 ms, a get, 10 ms: one get per 20 ms
        q.put(i, stop)
        clock[0] += 0.01
        before = reads[0]
        q.get(0.1)
        assert reads[0] == before, "the consumer's get read the clock"
        clock[0] += 0.01
    assert q._interval == pytest.approx(0.02, rel=1e-3)
    q.put("a", stop)
    clock[0] += 0.5  # a long step (a checkpoint, say); the producer puts without a get between
    q.put("b", stop)
    assert q._interval == pytest.approx(0.02, rel=1e-3)
    q.get(0.1)
    clock[0] += 0.02
    q.put("c", stop)
    assert q._interval == pytest.approx(0.8 * 0.02 + 0.2 * 0.52, rel=1e-3)


def test_stop_ends_a_put_on_a_full_queue_with_no_consumer():
    q = _ReadyQueue(1, FakePriority())
    stop = threading.Event()
    assert q.put("a", stop)
    result = []
    t = threading.Thread(target=lambda: result.append(q.put("b", stop)))
    t.start()
    time.sleep(0.05)
    stop.set()
    t.join(2.0)
    assert not t.is_alive() and result == [False] and q.qsize() == 1


def test_queue_drives_the_policy_idle_when_full_normal_when_falling_behind():
    fp = FakePriority()
    q = _ReadyQueue(8, fp)  # low 4, promote_at 2
    stop = threading.Event()
    for i in range(7):
        q.put(i, stop)
    assert fp.calls == []
    q.put(7, stop)
    assert fp.calls == [True]  # full: idle
    for _ in range(5):  # sizes before each get: 8..4 (the normal refill cycle): stays idle
        q.get(0.1)
    assert fp.calls == [True]
    q.get(0.1)  # size 3: still idle
    q.get(0.1)  # size 2 (= promote_at): the producer is not keeping up, back to normal
    assert fp.calls == [True, False]


# ---------------------------------------------------------------------------- thread policy
def test_priority_modes_are_validated():
    with pytest.raises(ValueError, match="adaptive"):
        ThreadGroupPriority("low")


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


@contextlib.contextmanager
def _members(group: ThreadGroupPriority, n: int = 1) -> Iterator[list[int]]:
    """``n`` threads that join ``group`` and wait; yields their native ids, then lets them leave
    and joins them."""
    go = threading.Event()
    tids: list[int] = []
    joined = threading.Barrier(n + 1)

    def member() -> None:
        group.join_current_thread()
        tids.append(threading.get_native_id())
        joined.wait(10)
        go.wait(10)
        group.leave_current_thread()

    ts = [threading.Thread(target=member) for _ in range(n)]
    for t in ts:
        t.start()
    joined.wait(10)
    try:
        yield tids
    finally:
        go.set()
        for t in ts:
            t.join()


@linux_only
def test_normal_mode_never_touches_the_policy():
    g = ThreadGroupPriority("normal")
    with _members(g) as (tid,):
        g.set_idle(True)
        assert not g.active and _policy(tid) == os.SCHED_OTHER


@needs_cap
def test_adaptive_group_switches_every_member_both_ways():
    g = ThreadGroupPriority("adaptive")
    assert g.active and not g.idle
    with _members(g, 3) as tids:
        g.set_idle(True)
        assert g.idle and all(_policy(t) == os.SCHED_IDLE for t in tids)
        g.set_idle(True)  # no-op
        g.set_idle(False)
        assert not g.idle and all(_policy(t) == os.SCHED_OTHER for t in tids)
        assert g.switches == 2
    g.close()
    g.set_idle(True)  # closed: nothing left to switch, and no error
    assert not g.idle


@linux_only
def test_adaptive_stays_normal_where_the_switch_back_is_not_allowed(monkeypatch):
    monkeypatch.setattr(prio, "_probe_result", False)
    g = ThreadGroupPriority("adaptive")
    with _members(g) as (tid,):
        g.set_idle(True)
        assert not g.active and not g.idle and _policy(tid) == os.SCHED_OTHER


@linux_only
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_probe_says_no_for_an_unprivileged_process():
    # The module needs only the standard library: run its source with the base interpreter, as
    # nobody, from "/", so that neither the checkout nor the venv has to be readable by nobody.
    src = Path(prio.__file__).read_text()
    code = src + "\nprint(can_leave_idle())\n"
    py = os.path.realpath(sys.executable)
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    cmd += ["--bounding-set=-all", py, "-I", "-c"]
    if subprocess.run([*cmd, "pass"], capture_output=True, cwd="/", timeout=60).returncode:
        pytest.skip(f"{py} cannot run as an unprivileged user here")
    out = subprocess.run([*cmd, code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
