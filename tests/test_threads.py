"""torchtitan_ext.threads: the shared stop-aware hand-off, error relay and bounded join."""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback

import pytest

from torchtitan_ext import threads

LOG = logging.getLogger("test_threads")


def _in_thread(fn, name: str = "helper") -> tuple[threading.Thread, list]:
    """Run ``fn`` in a daemon thread; the list receives its result or exception."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


# ----------------------------------------------------------------------------- relay


def _worker_raises() -> None:
    raise KeyError("from the worker")


def test_relay_reraises_the_same_exception_with_the_workers_frames_and_a_note():
    t, out = _in_thread(_worker_raises, name="relay-worker")
    t.join(5)
    (exc,) = out
    with pytest.raises(KeyError) as ei:
        raise threads.relay(exc, "the thread 'relay-worker'", "test_relay")
    assert ei.value is exc  # the same object: type and attributes survive
    frames = [f.name for f in traceback.extract_tb(ei.value.__traceback__)]
    assert "_worker_raises" in frames  # the worker's traceback is kept
    assert "test_relay_reraises_the_same_exception_with_the_workers_frames_and_a_note" in frames
    (note,) = ei.value.__notes__
    assert "'relay-worker'" in note and "test_relay" in note


# ----------------------------------------------------------------------------- put / get


def test_put_on_a_full_queue_returns_false_once_stopped():
    q: queue.Queue = queue.Queue(maxsize=1)
    q.put("first")
    stop = threading.Event()
    t, out = _in_thread(lambda: threads.put(q, "second", stop, poll_s=0.02))
    time.sleep(0.1)
    assert t.is_alive()  # blocked: nobody reads the queue
    stop.set()
    t.join(2)
    assert not t.is_alive() and out == [False]
    assert q.get_nowait() == "first" and q.empty()  # "second" was never queued


def test_put_hands_over_and_nothing_after_the_stop():
    q: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    assert threads.put(q, 1, stop) is True
    stop.set()
    assert threads.put(q, 2, stop) is False  # room, but stopped: not queued
    assert q.get_nowait() == 1 and q.empty()


def test_get_on_an_empty_queue_raises_stopped_once_stopped():
    q: queue.Queue = queue.Queue()
    stop = threading.Event()
    t, out = _in_thread(lambda: threads.get(q, stop, poll_s=0.02))
    time.sleep(0.1)
    assert t.is_alive()
    stop.set()
    t.join(2)
    assert not t.is_alive() and len(out) == 1 and isinstance(out[0], threads.Stopped)
    q.put("x")
    assert threads.get(q, threading.Event()) == "x"


# ----------------------------------------------------------------------------- join


def _stuck_waiting(release: threading.Event) -> None:
    release.wait()


def test_join_reports_a_stuck_thread_within_one_deadline(caplog):
    release = threading.Event()
    stuck = [
        threading.Thread(target=_stuck_waiting, args=(release,), name=f"stuck-{i}", daemon=True)
        for i in range(5)
    ]
    done = threading.Thread(target=lambda: None, name="quick", daemon=True)
    for t in (*stuck, done):
        t.start()
    try:
        with caplog.at_level(logging.ERROR, logger=LOG.name):
            t0 = time.monotonic()
            alive = threads.join([*stuck, done], 0.5, LOG, "kept for the test")
            took = time.monotonic() - t0
        assert alive == stuck
        # one deadline for the set (0.5 s), not 0.5 s per thread (2.5 s): a wide margin for load
        assert 0.45 <= took < 2.0
        (rec,) = [r for r in caplog.records if r.name == LOG.name]  # logged once
        msg = rec.getMessage()
        assert "did not stop within 0.5 s (kept for the test)" in msg
        assert "'stuck-0'" in msg and "'stuck-1'" in msg and "quick" not in msg
        assert "_stuck_waiting" in msg  # where each is blocked
    finally:
        release.set()
    caplog.clear()
    assert threads.join(stuck, 5, LOG) == [] and not caplog.records


def test_join_skips_the_calling_thread(caplog):
    with caplog.at_level(logging.ERROR, logger=LOG.name):
        t0 = time.monotonic()
        assert threads.join([threading.current_thread()], 5, LOG) == []
    assert time.monotonic() - t0 < 1 and not caplog.records
