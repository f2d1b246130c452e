"""The Parquet text loader before and after its rebuild on the pipeline's stages: tokens/s, data-wait and next() p99, the same corpus and settings.

``before`` is :class:`torchtitan_ext.text.prefetch.PrefetchingParquetLoader` at the commit the
stages started from (``before``, default ``0e944ef``: a producer thread of its own, its own
hand-off and state), checked out as a detached git worktree under the system temp dir;
``after`` is this checkout's (``ParquetSource -> PackedBatches -> Prefetch``). Both run in a
fresh subprocess per sample (two versions of one package cannot share a process), importing
only their own tree; the import and the loader's construction are outside the timed part. The
data is the text-loader corpus (``benchmarks/text_corpus.py``, ``mb`` MB, GPT-2 tokenizer),
B=8, T=2048, ``val_files="none"``, every other option at its default (the same defaults in
both versions).

1. Throughput: ``warmup`` batches, then ``batches`` batches timed: wall tokens/s and tokens per
   CPU-second of the process (loader thread included). ``before`` and ``after`` alternate within
   each of ``repeats`` rounds; the per-round ratio after/before gives the paired range. Target:
   after >= 0.95x before (the rebuild must not cost throughput).
2. Data-wait: a consumer at 50 % of the ``after`` loader's capacity (its fastest
   ``s_per_batch`` from part 1, times two) for ``steps`` steps
   (:func:`benchmarks.common.timed_steps`): the share of the loop inside ``next()`` and its
   p50/p99, alternating per round.

Rows are skipped (with a note) when the ``before`` commit is not in this checkout's history.

Options (``--set key=value``): ``before`` (commit), ``mb`` (20; quick 2), ``batches`` (150;
quick 10), ``steps`` (300; quick 20), ``warmup`` (10; quick 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import BenchArgs, Row, compare, interleave, row_from
from benchmarks.text_corpus import build_corpus, gpt2_tokenizer_dir

REPO = Path(__file__).resolve().parents[1]
BEFORE = "0e944ef"
B, T = 8, 2048

# Runs inside the version under test (cwd and PYTHONPATH = its tree); prints one JSON object.
SNIPPET = r"""
import json, os, sys, time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
a = json.loads(sys.argv[1])
sys.path.insert(0, a["bench_root"])
from benchmarks.common import percentile, timed_steps
from torchtitan_ext.text.prefetch import PrefetchingParquetLoader
ld = PrefetchingParquetLoader(a["corpus"], a["tok"], seq_len=a["T"], batch_size=a["B"], val_files="none")
out = {}
if a["mode"] == "tput":
    for _ in range(a["warmup"]):
        next(ld)
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(a["batches"]):
        next(ld)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    n = a["batches"] * a["B"] * a["T"]
    out = {"wall_tps": n / wall, "cpu_tps": n / cpu, "s_per_batch": wall / a["batches"]}
else:
    for _ in range(a["warmup"]):
        next(ld)
        time.sleep(a["step_s"])
    lat, total = timed_steps(ld, a["steps"], time.sleep, a["step_s"])
    out = {"wait_pct": 100.0 * sum(lat) / total, "p50_ms": 1e3 * percentile(lat, 50),
           "p99_ms": 1e3 * percentile(lat, 99)}
ld.close()
print("RESULT " + json.dumps(out))
"""


def worktree(commit: str) -> Path | None:
    """A detached worktree of ``commit`` (made once, reused), or None without that history."""
    ok = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True
    )
    if ok.returncode != 0:
        return None
    path = Path(tempfile.gettempdir()) / f"torchtitan_ext-before-{commit}"
    if not (path / "torchtitan_ext").is_dir():
        subprocess.run(
            ["git", "worktree", "add", "--detach", "-f", str(path), commit],
            cwd=REPO, check=True, capture_output=True,
        )  # fmt: skip
    return path


def sample(root: Path, args: dict[str, Any]) -> dict[str, float]:
    """One measurement in a fresh process of the tree at ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root), TOKENIZERS_PARALLELISM="false")
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, json.dumps({**args, "bench_root": str(REPO)})],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{root}: no result\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def run(args: BenchArgs) -> list[Row]:
    q, ex = args.quick, args.extra
    before = worktree(str(ex.get("before", BEFORE)))
    if before is None:
        return [Row("before: the loader before the stages", float("nan"), "tok/s",
                    info={"skipped": f"commit {ex.get('before', BEFORE)} not in this history"})]  # fmt: skip
    base = {
        "corpus": str(build_corpus(target_mb=float(ex.get("mb", 2 if q else 20)))),
        "tok": str(gpt2_tokenizer_dir()), "B": B, "T": T,
        "batches": int(ex.get("batches", 10 if q else 150)),
        "steps": int(ex.get("steps", 20 if q else 300)),
        "warmup": int(ex.get("warmup", 2 if q else 10)),
    }  # fmt: skip
    roots = {"before": before, "after": REPO}
    reps = 1 if q else max(1, args.repeats)
    t = interleave(
        {n: (lambda r=r: sample(r, {**base, "mode": "tput"})) for n, r in roots.items()},
        reps, 0, args.guard(max_retakes=1),
    )  # fmt: skip
    rows: list[Row] = []
    for name in roots:
        rows.append(row_from(f"tokens/s wall {name}", t[name], "tok/s", key="wall_tps",
                             group="tput", higher_is_better=True))  # fmt: skip
        rows.append(row_from(f"tokens/CPU-s {name}", t[name], "tok/cpu-s", key="cpu_tps",
                             group="tput", higher_is_better=True))  # fmt: skip
    r = compare(rows, "tokens/s wall after", "tokens/s wall before")
    r.target, r.met = ">= 0.95x", r.ratio >= 0.95
    compare(rows, "tokens/CPU-s after", "tokens/CPU-s before")

    step_s = 2.0 * min(t["after"].values("s_per_batch"))
    w = interleave(
        {n: (lambda r=r: sample(r, {**base, "mode": "wait", "step_s": step_s}))
         for n, r in roots.items()},
        reps, 0, args.guard(max_retakes=1),
    )  # fmt: skip
    for name in roots:
        rows.append(row_from(f"data-wait share {name} (consumer at 50 %)", w[name], "%",
                             key="wait_pct", group="wait", info={"step_ms": 1e3 * step_s}))  # fmt: skip
        rows.append(row_from(f"next() p50 {name}", w[name], "ms", key="p50_ms", group="wait"))
        rows.append(row_from(f"next() p99 {name}", w[name], "ms", key="p99_ms", group="wait"))
    compare(rows, "next() p99 after", "next() p99 before")
    return rows
