"""Text loaders: tokens/s (wall and per CPU-second) and data-wait of PrefetchingParquetLoader vs a synchronous loader vs torchtitan's HuggingFaceTextDataLoader.

All loaders read the same Parquet documents (``benchmarks/text_corpus.py``: the embedded text
enlarged to ``mb`` MB of long-tailed documents) with the same GPT-2 tokenizer, B=8, T=2048, and
``TOKENIZERS_PARALLELISM=false`` (our loader's default; set for the whole process, so for all).

* ``ours``: :class:`PrefetchingParquetLoader` (background read + ``encode_batch`` + best-fit).
* ``sync``: the same source, tokenizer call and packer, but reading and tokenizing inside
  ``next()`` (the starting point: what the thread buys).
* ``torchtitan``: torchtitan 0.3.0's stock ``HuggingFaceTextDataLoader`` pointed at the Parquet
  files through its ``DATASETS`` registry (``load_dataset("parquet", ...)``), ``num_workers=0``
  (its default); the data-wait part also runs it with one worker process.

1. Throughput. Each loader is warmed up (``warmup`` batches: thread start, buffer fill) and then
   drained as fast as possible for ``batches`` batches (median of up to 3 rounds in which the
   loaders are interleaved, a fresh loader per sample: ``benchmarks.common.interleave``). Wall tokens/s, and tokens per CPU-second
   of the whole process (``time.process_time``: all threads, including the tokenizer's Rust
   threads and our producer) = "per core". Once the consumer outpaces the producer the queue is
   empty, so prefetched work does not inflate the timed window.
2. Data-wait. A consumer that "trains" (sleeps) for twice each loader's own time per batch
   (= 50 % of its capacity, measured in situ right before), for ``steps`` steps after ``warmup``;
   wait share = time inside ``next()`` / total, and p50/p99 ``next()`` latency; garbage collection
   as in torchtitan's trainer (automatic GC off, ``gc.collect(1)`` every 50 steps). Then the same
   consumer rate with slow storage: ``delay_ms`` of sleep per row-group read of 256 documents
   (~1 MB of text: 50 ms ~ 20 MB/s); for torchtitan, whose reads we cannot hook, per 256 samples.
   A thread's cost to the training loop is not only inside ``next()``: "loop time lost" is the
   loop's time beyond its requested sleeps and ``next()`` calls (the training thread waiting for
   the GIL or a CPU when it wakes up), minus the same figure for the loop around an iterator that
   costs nothing (the sleep's own overshoot, ~0.8 % here), measured right after each loader.
   "ours, normal priority" is our loader without the adaptive ``SCHED_IDLE`` policy.
3. State snapshot: ``copy.deepcopy(loader.state_dict())`` after each batch (what
   ``AsyncDeviceLoader`` does per batch and a checkpoint does once), ours vs torchtitan's loader;
   median, p90 and max in ms.
4. The same with a CPU-bound training loop (matmuls on every core instead of a sleep, steps 3x
   as long, i.e. 1/6 of the loader's capacity), for each ``thread_priority``: where ``"idle"``
   starves and ``"adaptive"`` must not.

Parts 2 and 4 run ``wait_rounds`` rounds with the loaders alternating within each round; part 3
interleaves the two loaders over the same rounds as part 1.

Options (``--set key=value``): ``mb`` (40; quick 3), ``batches`` (200; quick 15), ``steps`` (300;
quick 15), ``warmup`` (20; quick 3), ``delay_ms`` (50), ``workers1`` (1: also torchtitan with a
worker process in the data-wait part; 0 to skip), ``wait_rounds`` (3; quick 1), ``wait_loaders``
(all; names separated by ``;``, e.g. ``ours``: only those in the data-wait part, whose torchtitan
rows take most of the run's hour on a slow machine).
"""

from __future__ import annotations

import copy
import gc
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from benchmarks.common import (
    BenchArgs,
    Row,
    compare,
    interleave,
    percentile,
    row_from,
    timed_steps,
)
from benchmarks.text_corpus import build_corpus, corpus_files, gpt2_tokenizer_dir
from torchtitan_ext.text.packing import make_packer
from torchtitan_ext.text.parquet_source import ParquetOptions, ParquetSource
from torchtitan_ext.text.prefetch import PrefetchingParquetLoader
from torchtitan_ext.text.tokenize import TextTokenizer

B, T = 8, 2048


class SyncLoader:
    """Baseline: the same source / tokenizer / packer, everything inside ``next()``."""

    def __init__(self, corpus: Any, tok: TextTokenizer, delay_s: float = 0.0) -> None:
        self.tok = tok
        # read_ahead=0: the read really happens inside next(), as in a synchronous loader.
        opts = ParquetOptions(val_files="none", read_ahead=0, chunk_rows=128)
        self.chunks = ParquetSource(corpus, opts, read_delay_s=delay_s)
        self.packer = make_packer("best_fit", T, tok.bos_id)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        rows = []
        while len(rows) < B:
            while not self.packer.ready():
                chunk = next(self.chunks)
                for ids in self.tok.encode_batch(chunk.texts, add_bos=True):
                    self.packer.add(np.array(ids, dtype=np.int64))
            rows.append(self.packer.pop_row())
        tokens = torch.from_numpy(np.stack([r.tokens for r in rows]))
        positions = torch.from_numpy(np.stack([r.positions for r in rows]))
        return {"input": tokens[:, :-1], "positions": positions[:, :-1]}, tokens[:, 1:]

    def close(self) -> None:
        self.chunks.close()


def _torchtitan_loader(corpus, tok_dir: str, workers: int, delay_s: float = 0.0):
    from datasets import load_dataset
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataLoader

    files = corpus_files(corpus)
    counter = [0]

    def text_of(sample: dict) -> str:
        if delay_s:
            counter[0] += 1
            if counter[0] % 256 == 0:  # one "row group" worth of samples
                time.sleep(delay_s)
        return sample["text"]

    DATASETS["bench_parquet"] = DatasetConfig(
        path=str(corpus),
        loader=lambda path: load_dataset(
            "parquet",
            data_files=files,
            split="train",
            # beside the corpus, not in it: the corpus directory holds only what its manifest lists
            cache_dir=f"{corpus}.hf_cache",
        ),
        sample_processor=text_of,
    )
    cfg = HuggingFaceTextDataLoader.Config(
        dataset="bench_parquet", dataset_path=str(corpus), num_workers=workers
    )
    tt_tok = HuggingFaceTokenizer(tokenizer_path=tok_dir)
    return cfg.build(dp_world_size=1, dp_rank=0, tokenizer=tt_tok, seq_len=T, local_batch_size=B)


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    gc.collect()


def throughput(make: Callable[[], Any], batches: int, warmup: int) -> dict[str, float]:
    loader = make()
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        _, labels = next(it)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    del it
    _close(loader)
    ntok = batches * B * T
    return {"wall_tps": ntok / wall, "cpu_tps": ntok / cpu, "s_per_batch": wall / batches}


def snapshot_ms(make: Callable[[], Any], batches: int, warmup: int) -> list[float]:
    """Milliseconds to take ``state_dict()`` and ``deepcopy`` it (what ``AsyncDeviceLoader``
    does for every batch, and a checkpoint for one), after each of ``batches`` batches."""
    loader = make()
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    out = []
    for _ in range(batches):
        next(it)
        t0 = time.perf_counter()
        copy.deepcopy(loader.state_dict())
        out.append(1e3 * (time.perf_counter() - t0))
    del it
    _close(loader)
    return out


def _busy(seconds: float) -> None:
    """A CPU-bound "step": matmuls on torch's intra-op threads (every core) for ``seconds``."""
    a = _busy.__dict__.setdefault("a", torch.randn(384, 384))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a


def data_wait(
    make: Callable[[], Any],
    steps: int,
    warmup: int,
    cap_batches: int,
    step_s: float | None = None,
    step: Callable[[float], None] = time.sleep,
) -> dict[str, float]:
    """Consumer at 50 % of the loader's capacity. The capacity is measured in situ right before
    (``cap_batches`` drained as fast as possible after ``warmup``), because the load on a shared
    machine drifts between phases; pass ``step_s`` to reuse a step time instead."""
    loader = make()
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    if step_s is None:
        t0 = time.perf_counter()
        for _ in range(cap_batches):
            next(it)
        step_s = 2.0 * (time.perf_counter() - t0) / cap_batches
    for _ in range(warmup):  # settle at the new rate (the queue refills)
        next(it)
        time.sleep(step_s)
    lat, total = timed_steps(it, steps, step, step_s)  # step: the "GPU step"
    del it
    _close(loader)
    return {
        "step_ms": 1e3 * step_s,
        "wait_pct": 100.0 * sum(lat) / total,
        "p50_ms": 1e3 * percentile(lat, 50),
        "p99_ms": 1e3 * percentile(lat, 99),
        "max_ms": 1e3 * max(lat),
        # time the loop lost outside next() beyond the requested sleeps (sleep overshoot, and the
        # training thread waiting for the GIL or a CPU when it wakes up from its "GPU step")
        "overrun_s": total - sum(lat) - steps * step_s,
        "total_s": total,
    }


def run(args: BenchArgs) -> list[Row]:
    q = args.quick
    ex = args.extra
    mb = float(ex.get("mb", 3 if q else 40))
    n_batches = int(ex.get("batches", 15 if q else 200))
    steps = int(ex.get("steps", 15 if q else 300))
    warm = int(ex.get("warmup", 3 if q else 20))
    delay_s = float(ex.get("delay_ms", 50)) / 1e3
    workers1 = int(ex.get("workers1", 0 if q else 1))
    reps = 1 if q else max(1, min(args.repeats, 3))
    wait_rounds = int(ex.get("wait_rounds", 1 if q else 3))

    # Process-wide and identical for every loader: tokenization on the calling thread (our loader
    # sets this itself; set here first so that all loaders run under the same setting).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpus = build_corpus(target_mb=mb)
    tok_dir = str(gpt2_tokenizer_dir())
    # Same tokenizer (GPT-2 vocab + merges) for every loader. Ours and sync encode with the
    # tiktoken engine of TextTokenizer (ids proven equal to `tokenizers`': see
    # torchtitan_ext/text/fast_bpe.py); "ours, tokenizers engine" isolates what the engine buys.
    tok = TextTokenizer.from_path(tok_dir)
    if tok.engine != "tiktoken":  # the headline rows would silently measure the slow engine
        raise RuntimeError(f"GPT-2 did not get the tiktoken engine: {tok.engine_reason}")
    tok_hf = TextTokenizer.from_path(tok_dir, engine="hf")

    makers: dict[str, Callable[[float], Callable[[], Any]]] = {
        "ours": lambda d: (
            lambda: PrefetchingParquetLoader(
                corpus, tok, seq_len=T, batch_size=B, val_files="none", read_delay_s=d
            )
        ),
        "ours, tokenizers engine": lambda d: (
            lambda: PrefetchingParquetLoader(
                corpus, tok_hf, seq_len=T, batch_size=B, val_files="none", read_delay_s=d
            )
        ),
        "sync": lambda d: lambda: SyncLoader(corpus, tok, delay_s=d),
        "torchtitan": lambda d: lambda: _torchtitan_loader(corpus, tok_dir, 0, d),
    }
    _close(makers["torchtitan"](0)())  # build HF's arrow cache outside the timings

    rows: list[Row] = []
    # -------- throughput: the four loaders interleaved, a fresh loader per sample
    t = interleave({name: call_throughput(mk(0.0), n_batches, warm) for name, mk in makers.items()},
                   reps, 0, args.guard(max_retakes=1))  # fmt: skip
    for name in makers:
        rows.append(row_from(f"tokens/s wall {name}", t[name], "tok/s", key="wall_tps",
                             group="tput", higher_is_better=True))  # fmt: skip
        rows.append(row_from(f"tokens/CPU-s {name}", t[name], "tok/cpu-s", key="cpu_tps",
                             group="tput", higher_is_better=True))  # fmt: skip
    for name in ("ours", "ours, tokenizers engine", "sync"):
        compare(rows, f"tokens/s wall {name}", "tokens/s wall torchtitan")
        r = compare(rows, f"tokens/CPU-s {name}", "tokens/CPU-s torchtitan")
        if name == "ours":
            r.target, r.met = ">= 3x", r.ratio >= 3.0
    w = compare(rows, "tokens/s wall ours", "tokens/s wall torchtitan")
    w.target, w.met = ">= 3x", w.ratio >= 3.0
    rows += _snapshot_rows(args, makers, n_batches, warm, reps)
    rows += _wait_rows(args, corpus, tok, tok_dir, makers, n_batches, steps, warm, delay_s,
                       workers1, wait_rounds)  # fmt: skip
    return rows


def call_throughput(make: Callable[[], Any], batches: int, warmup: int) -> Callable[[], dict]:
    return lambda: throughput(make, batches, warmup)


def _snapshot_rows(args, makers, n_batches, warm, reps) -> list[Row]:
    """Cost of one state snapshot (state_dict + deepcopy), ours vs torchtitan's loader, a fresh
    loader of each per round, interleaved; every snapshot of every round is a sample."""
    t = interleave(
        {n: (lambda n=n: {"ms": snapshot_ms(makers[n](0.0), max(10, n_batches // 2), warm)})
         for n in ("ours", "torchtitan")},
        reps, 0, args.guard(max_retakes=1),
    )  # fmt: skip
    rows = []
    for name in ("ours", "torchtitan"):
        ms = [x for r in t[name].results for x in r["ms"]]
        rows.append(
            Row(f"state snapshot {name}", statistics.median(ms), "ms", higher_is_better=False,
                samples=ms, info={"p90_ms": percentile(ms, 90), "max_ms": max(ms)},
                retaken=t[name].retaken, noisy=t[name].noisy)
        )  # fmt: skip
    snap = compare(rows, "state snapshot ours", "state snapshot torchtitan")
    snap.target, snap.met = "<= 0.6 ms (docs/parquet-loader.md)", snap.value <= 0.6
    return rows


def _wait_rows(args, corpus, tok, tok_dir, makers, n_batches, steps, warm, delay_s, workers1,
               rounds) -> list[Row]:  # fmt: skip
    """Data-wait at 50 % of each loader's own capacity (measured in situ), then the same
    consumer rate with slow storage; then a CPU-bound training loop per thread policy. Loaders
    alternate within each round (A B C, A B C: "ours, normal priority" runs right after "ours",
    at its rate, so it is an A/B of the thread policy)."""
    wait_makers = {k: v for k, v in makers.items() if k != "ours, tokenizers engine"}
    # What the adaptive SCHED_IDLE policy buys (torchtitan_ext.pipeline.priority), same run.
    wait_makers["ours, normal priority"] = lambda d: (
        lambda: PrefetchingParquetLoader(
            corpus,
            tok,
            seq_len=T,
            batch_size=B,
            val_files="none",
            read_delay_s=d,
            thread_priority="normal",
        )
    )
    if workers1:
        wait_makers["torchtitan 1 worker"] = lambda d: (
            lambda: _torchtitan_loader(corpus, tok_dir, 1, d)
        )
    if only := args.extra.get("wait_loaders"):  # e.g. "ours;sync"
        keep = {n.strip() for n in str(only).split(";")}
        wait_makers = {n: mk for n, mk in wait_makers.items() if n in keep}
    cap_batches = max(5, n_batches // 4)
    steps_of: dict[str, float] = {}
    rows: list[Row] = []

    def one(name: str, mk, d: float):
        def go() -> dict[str, float]:
            # "ours, normal priority" runs at ours' rate; every other loader at 50 % of its own
            # capacity, measured right before.
            same_as = "ours" if name == "ours, normal priority" else None
            res = data_wait(mk(d), steps, warm, cap_batches, steps_of.get(same_as))
            steps_of[name] = res["step_ms"] / 1e3
            # The same loop around an iterator that costs nothing: its overrun is the sleep's
            # own overshoot, which the loader's "loop time lost" row subtracts.
            empty = data_wait(
                lambda: itertools.repeat(None), steps, warm, cap_batches, res["step_ms"] / 1e3
            )
            res["lost_pct"] = 100.0 * (res["overrun_s"] - empty["overrun_s"]) / res["total_s"]
            return res

        return go

    for storage, d in (("", 0.0), (" slow storage", delay_s)):
        fns = {name: one(name, mk, d) for name, mk in wait_makers.items()}
        t = interleave(fns, rounds, 0, args.guard(max_retakes=1), rotate=False)
        for name in wait_makers:
            tag, g = f"{name}{storage}", f"wait{storage}"
            s = t[name]
            r1 = row_from(f"wait share {tag}", s, "%", key="wait_pct", group=g)
            r2 = row_from(f"next() p50 {tag}", s, "ms", key="p50_ms", group=g)
            r3 = row_from(f"next() p99 {tag}", s, "ms", key="p99_ms", group=g)
            r4 = row_from(f"loop time lost {tag}", s, "%", key="lost_pct", group=g)
            r1.info = r2.info = r3.info = r4.info = s.results[-1]
            if name == "ours":
                r1.target, r1.met = "<= 0.1%", r1.value <= 0.1
                r3.target, r3.met = "<= 0.1 ms", r3.value <= 0.1
            rows += [r1, r2, r3, r4]
        if {"ours", "torchtitan"} <= wait_makers.keys():
            compare(rows, f"wait share ours{storage}", f"wait share torchtitan{storage}")

    # -------- a CPU-bound training loop (matmuls on every core between next() calls, at 1/6 of
    # ours' capacity, so that a fair share of the CPUs is plenty for the loader): SCHED_IDLE
    # threads only get CPU time nobody else wants, so "idle" starves here, and "adaptive" must
    # fall back to normal when the queue runs low.
    def busy(policy: str):
        mk = lambda: PrefetchingParquetLoader(  # noqa: E731
            corpus, tok, seq_len=T, batch_size=B, val_files="none", thread_priority=policy
        )
        return lambda: data_wait(mk, steps, warm, cap_batches, 3 * steps_of["ours"], step=_busy)

    policies = ("adaptive", "idle", "normal")
    t = interleave({p: busy(p) for p in policies}, rounds, 0, args.guard(max_retakes=1))
    for p in policies:
        rows.append(row_from(f"wait share CPU-bound loop, {p}", t[p], "%", key="wait_pct",
                             group="busy", info=t[p].results[-1]))  # fmt: skip
    return rows
