"""Hand-off: ``next()`` latency (p50/p99/mean) and the loop's time lost, for our Prefetch vs a thread + queue.Queue vs torchdata.nodes vs Grain, one producer, a consumer at 50 % load.

The question it answers: should the pipeline's one background hand-off
(:class:`torchtitan_ext.pipeline.prefetch.Prefetch` over ``handoff._ReadyQueue``) be replaced by
a library's? Every variant runs the *same* producer in one background thread, 8 items ahead, with
one state snapshot per item:

* **producer** — a :class:`~torchtitan_ext.pipeline.stage.Stage` whose ``next()`` tokenizes
  ``docs`` documents of the shared benchmark corpus (``benchmarks/text_corpus.py``, GPT-2 BPE,
  HF ``tokenizers`` ``encode_batch``: Rust, releases the GIL, as our loaders' tokenization) and
  concatenates the ids into one int32 array; its state is one int.
* ``ours`` — ``Prefetch(stage)`` (default ``thread_priority="adaptive"``: ``SCHED_IDLE`` while
  the queue is full, where the process may switch back); ``ours, normal priority`` — the same
  hand-off with the policy untouched, so the hand-off and the thread policy are told apart.
* ``thread + queue.Queue`` — a plain thread putting ``(item, state)`` into a
  ``queue.Queue(maxsize=8)`` (the old device-staging hand-off).
* ``torchdata.nodes`` — ``Loader(Prefetcher(IterableWrapper(stateful iterable), 8))``.
* ``grain`` — ``grain.experimental.ThreadPrefetchDatasetIterator(parent, 8)`` over an iterator
  with ``get_state``/``set_state`` (what ``IterDataset.to_iter_dataset`` / ``.prefetch`` threads
  use); skipped with a note when grain is not installed (``pip install grain``).

Method (as ``benchmarks/text_loaders.py``'s data-wait part): each round first times the producer
alone (``cap`` items drained synchronously, after a warm-up) and sets the consumer's step to
twice its per-item time, so every loader runs at 50 % of its capacity and the queue neither
starves nor stays full. Then, for each variant in turn (A B C D E, A B C D E, ...: ``rotate``
off), a fresh loader is warmed up (``warmup`` items, then ``warmup`` steps at the new rate), and
``steps`` steps are timed: ``next()`` then the step, garbage collection as torchtitan's trainer
does it (automatic GC off, ``gc.collect(1)`` every 50 steps). The step is either a ``sleep``
(a training loop waiting on the GPU) or a pure-Python ``spin`` that holds the GIL (a Python-heavy
training loop); both are run. "loop time lost" is the loop's wall time beyond its ``next()``
calls and requested steps, minus the same figure for the loop around an iterator that costs
nothing (the step's own overshoot), measured in the same round: what a hand-off costs the loop
outside ``next()`` (waking onto a busy CPU, waiting for the GIL).

Options (``--set key=value``): ``docs`` (4 documents per item), ``steps`` (300; quick 40),
``warmup`` (20; quick 4), ``cap`` (40 items; quick 8), ``consumers`` (``sleep,spin``),
``rounds`` (``--repeats``).
"""

from __future__ import annotations

import itertools
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import (
    BenchArgs,
    Row,
    compare,
    interleave,
    percentile,
    row_from,
    timed_steps,
)
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage

QUEUE = 8
BASELINE = "thread + queue.Queue"


class TokenizeStage(Stage[np.ndarray]):
    """The producer: ``docs`` documents per item through ``encode_batch``; state = next index."""

    def __init__(self, texts: list[str], tok: Any, docs: int) -> None:
        self.texts, self.tok, self.docs, self.i = texts, tok, docs, 0

    def next(self) -> np.ndarray:
        n = len(self.texts)
        batch = [self.texts[(self.i * self.docs + k) % n] for k in range(self.docs)]
        enc = self.tok.encode_batch(batch)
        self.i += 1
        return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in enc])

    def state(self) -> int:
        return self.i

    def reset(self, state: int | None = None) -> None:
        self.i = state or 0


# ------------------------------------------------------------------------------ the variants
class QueueThread:
    """The old staging hand-off: a thread, ``queue.Queue(maxsize)``, ``(item, state)`` pairs."""

    def __init__(self, stage: Stage[Any], maxsize: int) -> None:
        self.stage, self.q = stage, queue.Queue(maxsize)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="queue-thread")
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            item = self.stage.next()
            st = self.stage.state()
            while not self.stop.is_set():
                try:
                    self.q.put((item, st), timeout=0.1)
                    break
                except queue.Full:
                    pass

    def __next__(self) -> Any:
        item, self.state = self.q.get()
        return item

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


class _StatefulIterable:
    """The producer as torchdata's ``Stateful`` iterable (``IterableWrapper`` restores it)."""

    def __init__(self, stage: Stage[Any]) -> None:
        self.stage = stage

    def __iter__(self) -> _StatefulIterable:
        return self

    def __next__(self) -> Any:
        return self.stage.next()

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.stage.state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.stage.reset(sd["i"])


class _TorchdataLoader:
    def __init__(self, stage: Stage[Any]) -> None:
        from torchdata.nodes import IterableWrapper, Loader, Prefetcher

        self.node = Prefetcher(IterableWrapper(_StatefulIterable(stage)), prefetch_factor=QUEUE)
        self.it = iter(Loader(self.node))

    def __next__(self) -> Any:
        return next(self.it)

    def close(self) -> None:
        self.node._it._shutdown()  # noqa: SLF001 - torchdata stops its thread only here


class _GrainParent:
    """The producer as Grain's checkpointable iterator (``get_state`` / ``set_state``)."""

    def __init__(self, stage: Stage[Any]) -> None:
        self.stage = stage

    def __iter__(self) -> _GrainParent:
        return self

    def __next__(self) -> Any:
        return self.stage.next()

    def get_state(self) -> dict[str, Any]:
        return {"i": self.stage.state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.stage.reset(state["i"])


def grain_missing() -> str | None:
    try:
        import grain.experimental  # noqa: F401
    except Exception as e:  # not installed, or a dependency missing
        return f"grain not importable ({type(e).__name__}: {e}); pip install grain"
    return None


def _grain(stage: Stage[Any]) -> Any:
    from grain.experimental import ThreadPrefetchDatasetIterator

    return ThreadPrefetchDatasetIterator(_GrainParent(stage), prefetch_buffer_size=QUEUE)


def variants(make_stage: Callable[[], Stage[Any]]) -> dict[str, Callable[[], Any]]:
    """name -> a function building a fresh loader (``next(x)`` works; ``x.close()`` stops it)."""
    out: dict[str, Callable[[], Any]] = {
        "ours": lambda: Prefetch(make_stage(), PrefetchOptions(queue_size=QUEUE)),
        "ours, normal priority": lambda: Prefetch(
            make_stage(), PrefetchOptions(queue_size=QUEUE, thread_priority="normal")
        ),
        BASELINE: lambda: QueueThread(make_stage(), QUEUE),
        "torchdata.nodes": lambda: _TorchdataLoader(make_stage()),
    }
    if grain_missing() is None:
        out["grain"] = lambda: _grain(make_stage())
    return out


# ------------------------------------------------------------------------------ the consumer
def spin(seconds: float) -> None:
    """A pure-Python step: holds the GIL (but for the interpreter's switch interval)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def consume(it: Any, steps: int, warmup: int, step_s: float, step: Callable[[float], None]):
    """``steps`` timed steps (``next`` + ``step``) after ``warmup`` untimed ones at the rate."""
    for _ in range(warmup):
        next(it)
    for _ in range(warmup):
        next(it)
        step(step_s)
    lat, total = timed_steps(it, steps, step, step_s)
    return lat, total - sum(lat) - steps * step_s, total


def per_item_s(make_stage: Callable[[], Stage[Any]], cap: int, warmup: int) -> float:
    st = make_stage()
    for _ in range(warmup):
        st.next()
    t0 = time.perf_counter()
    for _ in range(cap):
        st.next()
    return (time.perf_counter() - t0) / cap


def run(args: BenchArgs) -> list[Row]:
    from benchmarks.text_corpus import corpus_documents, gpt2_tokenizer_dir

    q, ex = args.quick, args.extra
    docs = int(ex.get("docs", 4))
    steps = int(ex.get("steps", 40 if q else 300))
    warm = int(ex.get("warmup", 4 if q else 20))
    cap = int(ex.get("cap", 8 if q else 40))
    consumers = ex.get("consumers", "sleep,spin").split(",")
    rounds = 1 if q else max(1, args.repeats)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # encode on the calling thread
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(gpt2_tokenizer_dir() / "tokenizer.json"))
    texts = corpus_documents(target_mb=1 if q else 4)

    def make_stage() -> Stage[Any]:
        return TokenizeStage(texts, tok, docs)

    makers = variants(make_stage)
    rows: list[Row] = []
    for mode in consumers:
        step = {"sleep": time.sleep, "spin": spin}[mode]
        step_of = {"s": per_item_s(make_stage, cap, warm) * 2}

        def sample(mk: Callable[[], Any], step=step, step_of=step_of) -> Callable[[], dict]:
            def go() -> dict[str, float]:
                # re-measure the capacity before each variant: the host's load drifts
                step_of["s"] = 2 * per_item_s(make_stage, cap, warm)
                s = step_of["s"]
                ld = mk()
                try:
                    lat, over, total = consume(ld, steps, warm, s, step)
                finally:
                    ld.close()
                _, empty_over, _ = consume(itertools.repeat(None), steps, warm, s, step)
                return {
                    "p50_us": 1e6 * percentile(lat, 50),
                    "p99_us": 1e6 * percentile(lat, 99),
                    "mean_us": 1e6 * statistics.fmean(lat),
                    "max_ms": 1e3 * max(lat),
                    "lost_pct": 100.0 * (over - empty_over) / total,
                    "step_ms": 1e3 * s,
                }

            return go

        fns = {name: sample(mk) for name, mk in makers.items()}
        t = interleave(fns, rounds, 0, args.guard(max_retakes=1), rotate=False)
        g = f"handoff {mode}"
        for name in makers:
            s = t[name]
            info = {"last_round": s.results[-1], "docs_per_item": docs, "queue": QUEUE}
            for key, label, unit in (("p50_us", "next() p50", "us"), ("p99_us", "next() p99", "us"),
                                     ("mean_us", "next() mean", "us"),
                                     ("lost_pct", "loop time lost", "%")):  # fmt: skip
                rows.append(row_from(f"{label} {name}, {mode} step", s, unit, key=key, group=g,
                                     info=info))  # fmt: skip
        for name in makers:
            if name != BASELINE:
                for label in ("next() p50", "next() p99", "next() mean"):
                    compare(
                        rows, f"{label} {name}, {mode} step", f"{label} {BASELINE}, {mode} step"
                    )
    missing = grain_missing()
    if missing:
        rows.append(Row("grain", float("nan"), "us", note=f"skipped: {missing}"))
    return rows
