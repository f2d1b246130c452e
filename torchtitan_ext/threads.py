"""Background threads that feed a consumer: stop-aware hand-off, error relay and bounded join.

The package runs its producers in daemon threads (:mod:`~torchtitan_ext.pipeline.prefetch`'s
thread, which device staging shares or runs as its own,
:mod:`~torchtitan_ext.tokenizer.pretokenize`'s reader). Each needs the same three things, and this
module is their one home:

* :func:`put` / :func:`get` / :class:`Stopped` — a blocking hand-off on a bounded queue that
  re-checks a stop :class:`threading.Event` every ``poll_s``. Why: a producer blocked on a full
  queue whose consumer went away (closed, garbage-collected, interpreter exit) would otherwise
  wait in ``put`` for ever; here it ends within ``poll_s`` of the stop. ``put`` returns False
  (the item *not* queued) once stopped, ``get`` raises :class:`Stopped` (it has nothing to
  return); the stop is checked before every attempt, so nothing is handed over after it. Any
  queue with ``put(item, timeout=)`` raising ``queue.Full`` and ``get(timeout=)`` raising
  ``queue.Empty`` works (``queue.Queue``, ``multiprocessing`` queues).
* :func:`exit_with_parent` — a DataLoader ``worker_init_fn`` after which no worker process
  outlives its training process (a SIGKILLed job's workers used to stay).
* :func:`relay` — the consumer re-raises a worker's exception as the *same* object. Why: its
  type survives (callers catch ``BadInputError``, ``DataloaderExhaustedError``), and so does its
  traceback, which still holds the worker's frames (raising it again appends the consumer's).
  Those frames do not say which thread they ran on, so a note names the thread and the
  re-raiser.
* :func:`join` — joins a set of threads under one deadline and reports, once, those still
  alive. Why: a Python thread cannot be killed (a read that never returns keeps its thread), so
  shutdown may only wait a bounded time; what it leaves behind is logged with the frames each
  thread is blocked in (from :func:`sys._current_frames`) and returned, so the caller keeps what
  such a thread still uses. The calling thread is skipped (a finaliser may run on a worker).

Not here: hand-offs with their own wake-up policy, such as the prefetching loader's
``_ReadyQueue`` (a ``deque`` measured for the training loop's latency): they take the same stop
event but keep their own loop.

Layering: this module imports only the standard library; ``text``, ``vl``, ``device`` and
``tokenizer`` import it, never the other way round.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from typing import Any

__all__ = ["POLL_S", "Stopped", "get", "join", "put", "relay"]

POLL_S = 0.05
"""Default seconds between two checks of the stop event by a blocked :func:`put` / :func:`get`."""


class Stopped(Exception):
    """A blocking hand-off gave up because its stop event is set (the pipeline is closing)."""


def put(q: Any, item: Any, stop: threading.Event, poll_s: float = POLL_S) -> bool:
    """Put ``item`` on the bounded queue ``q``, waiting for room; False (not queued) once
    ``stop`` is set, also while the queue stays full because nobody reads it any more."""
    while not stop.is_set():
        try:
            q.put(item, timeout=poll_s)
            return True
        except queue.Full:
            continue
    return False


def get(q: Any, stop: threading.Event, poll_s: float = POLL_S) -> Any:
    """The next item of ``q``, waiting for one; :class:`Stopped` once ``stop`` is set."""
    while not stop.is_set():
        try:
            return q.get(timeout=poll_s)
        except queue.Empty:
            continue
    raise Stopped


def relay(exc: BaseException, thread: str, by: str) -> BaseException:
    """``exc``, raised in the background ``thread``, with a note for re-raising it in ``by``:
    ``raise relay(exc, ...)`` keeps its type and the thread's traceback (see the module doc)."""
    exc.add_note(
        f"(raised in {thread}; re-raised by {by}; the traceback above holds that thread's frames)"
    )
    return exc


def join(
    threads: Iterable[threading.Thread],
    timeout: float,
    log: logging.Logger,
    consequence: str = "left running as daemons",
    stack_depth: int = 4,
) -> list[threading.Thread]:
    """Join ``threads`` (all but the calling one) within ``timeout`` seconds in total; return
    those still alive, after logging them as one error with the innermost ``stack_depth`` frames
    each is blocked in. ``consequence`` says in that message what happens to them."""
    me = threading.current_thread()
    others = [t for t in threads if t is not me]
    deadline = time.monotonic() + timeout
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t for t in others if t.is_alive()]
    if alive:
        frames = sys._current_frames()
        where = []
        for t in alive:
            frame = frames.get(t.ident or -1)
            stack = (
                "".join(traceback.format_stack(frame)[-stack_depth:])
                if frame is not None
                else "?\n"
            )
            where.append(f"thread {t.name!r} is blocked at:\n{stack}")
        log.error(
            "%s did not stop within %g s (%s);\n%s",
            ", ".join(repr(t.name) for t in alive),
            timeout,
            consequence,
            "".join(where).rstrip("\n"),
        )
    return alive


def exit_with_parent(worker_id: int = 0, poll_s: float = 1.0) -> None:
    """A DataLoader ``worker_init_fn``: the worker process ends (``os._exit``) within ``poll_s``
    of its parent's death. Why: after the training process is SIGKILLed, torch's own watchdog
    runs only between items, and a worker blocked handing one over (its parent gone) stayed
    alive for ever, holding its memory (seen: two streaming workers of a killed job, 19 minutes
    later). A daemon thread that polls the parent's pid does not depend on what the worker's
    main thread is blocked in. (``prctl(PR_SET_PDEATHSIG)`` would fire on the death of the
    *thread* that forked the worker, which may be a loader thread that is merely restarted.)"""
    import os

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
