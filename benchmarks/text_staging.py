"""Staging over a Prefetch-topped text loader: fused (no thread of its own) vs the former wrapper.

The loader: a toy text chain on the pipeline contract — a counter source (its ``state()`` calls
counted), a Map doing tokenizer-like work that releases the GIL (a numpy sort of 20k floats plus
building a B=8, T=2048 batch; ~1 ms), topped by ``Prefetch(queue_size=8)`` exposed as
``.pipeline``, with a torchtitan-style ``state_dict()`` (the checkpoint envelope of
``pipeline.state()``). ``torchtitan_ext.text.prefetch.PrefetchingParquetLoader`` does not expose a
``.pipeline`` yet; this chain stands in for it.

Configurations, interleaved round by round (A B C, B C A, ...), all on the CPU:

* **loader alone** — no staging (the baseline of every ratio);
* **fused, auto** / **fused, staged** — ``AsyncDeviceLoader`` of this branch: the copy (CPU
  ``mode="staged"``: the slot machinery with synchronous copies, the work a GPU copy puts in
  the thread) runs as the loader's Prefetch ``then``; ``auto`` on the CPU adds nothing;
* **before, auto** / **before, staged** — the former ``AsyncDeviceLoader`` (fetch thread + stage
  thread over ``queue.Queue``, a ``deepcopy(loader.state_dict())`` per batch), loaded from the
  commit this branch started from (``git show``; rows are skipped without that history).

Per configuration: a consumer that is busy half of the time (``time.sleep`` of twice the
loader's per-batch time, measured in situ at the start of the run, the same step for every
configuration) for ``steps`` steps after ``warmup``; GC as torchtitan's trainer runs it.
Reported: ``next()`` p50 / p99 (ms), the share of time inside ``next()``, Python threads alive
beyond the process's own after the warm-up (the loader's own Prefetch thread included), and
state snapshots per batch during the timed steps (source ``state()`` calls + adapter
``state_dict()`` calls, divided by the batches the source made meanwhile).

Options (``--set key=value``): ``steps`` (default 300; quick 30), ``warmup`` (30; quick 5),
``before`` (the commit of the former wrapper), ``priority`` (the loader's ``thread_priority``,
default ``adaptive``).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import types
from typing import Any

import numpy as np
import torch

from benchmarks.common import REPO, BenchArgs, Row, compare, interleave, percentile, row_from
from torchtitan_ext.device.staging import AsyncDeviceLoader
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Map, Stage

B, T = 8, 2048
BEFORE = "7d73fd0"
"""The commit this branch started from: its AsyncDeviceLoader is the two-thread wrapper."""


class _Counter(Stage[int]):
    def __init__(self) -> None:
        self.i = 0
        self.made = 0
        self.state_calls = 0

    def next(self) -> int:
        self.i += 1
        self.made += 1
        return self.i - 1

    def state(self) -> dict[str, int]:
        self.state_calls += 1
        return {"i": self.i}

    def reset(self, state: dict[str, int] | None = None) -> None:
        self.i = 0 if state is None else int(state["i"])


def _tokenize_like(i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    rng = np.random.default_rng(i)
    np.sort(rng.random(20_000))  # releases the GIL, like a tokenizer's Rust encode
    x = torch.from_numpy(rng.integers(3, 32000, (B, T + 1)))
    return {"input": x[:, :-1], "positions": torch.arange(T).repeat(B, 1)}, x[:, 1:]


class ToyTextLoader:
    """A Prefetch-topped text loader with the adapter calls staging relies on."""

    priority = "adaptive"
    """The Prefetch's ``thread_priority`` (``--set priority=...``)."""

    def __init__(self) -> None:
        self.src = _Counter()
        opts = PrefetchOptions(queue_size=8, thread_priority=self.priority)  # type: ignore[arg-type]
        self.pipeline = Prefetch(Map(self.src, _tokenize_like), opts, name="text-prefetch")
        self.state_dict_calls = 0

    def __iter__(self) -> ToyTextLoader:
        return self

    def __next__(self) -> Any:
        return self.pipeline.next()

    def state_dict(self) -> dict[str, Any]:
        self.state_dict_calls += 1
        return checkpoint.envelope("toy_text", [self.pipeline.state()])

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pipeline.reset(checkpoint.open_envelope(sd, "toy_text", 1)[0])

    def close(self) -> None:
        self.pipeline.close()


def load_before(commit: str) -> type | None:
    """The former ``AsyncDeviceLoader`` (staging.py + its pipeline.py at ``commit``), or None
    when the repository history is not available."""
    files = {}
    for name in ("pipeline", "staging"):
        out = subprocess.run(
            ["git", "show", f"{commit}:torchtitan_ext/device/{name}.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            return None
        files[name] = out.stdout
    pipe = types.ModuleType("_staging_before_pipeline")
    sys.modules[pipe.__name__] = pipe
    exec(compile(files["pipeline"], f"{commit}:device/pipeline.py", "exec"), pipe.__dict__)
    src = files["staging"].replace("torchtitan_ext.device.pipeline", pipe.__name__)
    mod = types.ModuleType("_staging_before")
    sys.modules[mod.__name__] = mod
    exec(compile(src, f"{commit}:device/staging.py", "exec"), mod.__dict__)
    return mod.AsyncDeviceLoader


def _capacity_s(n: int = 60) -> float:
    """Seconds per batch of the loader alone, drained as fast as possible."""
    ld = ToyTextLoader()
    for _ in range(10):
        next(ld)
    t0 = time.perf_counter()
    for _ in range(n):
        next(ld)
    dt = (time.perf_counter() - t0) / n
    ld.close()
    return dt


def paced(wrap: Any, steps: int, warmup: int, step_s: float) -> dict[str, float]:
    """Consumer busy half of the time over ``wrap(loader)``; latency, threads, snapshots."""
    base = set(threading.enumerate())
    ld = ToyTextLoader()
    it = iter(wrap(ld))
    for _ in range(warmup):
        next(it)
        time.sleep(step_s)
    lat: list[float] = []
    alive = {t for t in threading.enumerate() if t.name != "sched-idle-probe"}
    threads = len(alive - base)
    src = ld.src
    made0, snaps0 = src.made, src.state_calls + ld.state_dict_calls
    gc.collect(1)
    gc.disable()
    try:
        t_start = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            next(it)
            lat.append(time.perf_counter() - t0)
            if i % 50 == 49:
                gc.collect(1)
            time.sleep(step_s)  # the "GPU step"
        total = time.perf_counter() - t_start
    finally:
        gc.enable()
    snaps = (src.state_calls + ld.state_dict_calls - snaps0) / max(src.made - made0, 1)
    if it is not ld:
        it.close()
    ld.close()
    return {
        "p50_ms": 1e3 * percentile(lat, 50),
        "p99_ms": 1e3 * percentile(lat, 99),
        "wait_pct": 100.0 * sum(lat) / total,
        "threads": float(threads),
        "snapshots_per_batch": snaps,
    }


def run(args: BenchArgs) -> list[Row]:
    q = args.quick
    steps = int(args.extra.get("steps", 30 if q else 300))
    warmup = int(args.extra.get("warmup", 5 if q else 30))
    before = load_before(args.extra.get("before", BEFORE))
    ToyTextLoader.priority = args.extra.get("priority", "adaptive")
    step_s = 2.0 * _capacity_s(20 if q else 60)

    configs: dict[str, Any] = {
        "loader alone": lambda ld: ld,
        "fused, auto": lambda ld: AsyncDeviceLoader(ld, "cpu"),
        "fused, staged": lambda ld: AsyncDeviceLoader(ld, "cpu", mode="staged"),
    }
    if before is not None:
        configs["before, auto"] = lambda ld: before(ld, "cpu")
        configs["before, staged"] = lambda ld: before(ld, "cpu", mode="staged")
    fns = {k: (lambda w=w: paced(w, steps, warmup, step_s)) for k, w in configs.items()}
    t = interleave(fns, 1 if q else args.repeats, 0 if q else args.warmup, args.guard(1))

    rows: list[Row] = []
    g = "text staging"
    for name in configs:
        for key, label, unit in (
            ("p50_ms", "next() p50", "ms"),
            ("p99_ms", "next() p99", "ms"),
            ("wait_pct", "time in next()", "%"),
            ("threads", "threads added", "threads"),
            ("snapshots_per_batch", "snapshots per batch", "per batch"),
        ):
            rows.append(row_from(f"{label}: {name}", t[name], unit, key=key, group=g))
    for label in ("next() p50", "next() p99"):
        for name in configs:
            if name != "loader alone":
                r = compare(rows, f"{label}: {name}", f"{label}: loader alone")
                if name.startswith("fused"):
                    r.target = ">= 0.8x (no worse than without staging, within noise)"
                    r.met = r.ratio is not None and r.ratio >= 0.8
    by = {r.case: r for r in rows}
    for name in ("fused, auto", "fused, staged"):
        r = by[f"threads added: {name}"]
        alone = by["threads added: loader alone"].value
        r.target, r.met = "as many as the loader alone", r.value == alone
        s = by[f"snapshots per batch: {name}"]
        # a count at an instant between an item and its state() can be off by one
        s.target, s.met = "1", round(s.value, 1) == 1.0
    if before is None:
        rows.append(Row("before: former AsyncDeviceLoader", float("nan"), "ms",
                        note=f"skipped: commit {BEFORE} not in this checkout's history"))  # fmt: skip
    for r in rows:
        r.info.setdefault("step_ms", 1e3 * step_s)
    return rows
