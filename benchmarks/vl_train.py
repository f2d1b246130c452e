"""Qwen3-VL training on CPU through torchtitan's trainer: step time with the offline cache (``cached_vl``) vs online preprocessing of the same rows, and the share of each step spent waiting for data.

Each mode builds the trainer from ``train_configs/qwen3_vl_tiny_cpu.toml`` (the random
``debugmodel`` flavor, batches of two packs of up to 1024 tokens) in its own process, exactly as
``python -m torchtitan_ext.train`` does, and times ``Trainer.train_step`` (fetch + forward +
backward + optimizer) after warm-up steps; the data wait is the trainer's own measurement
(``metrics_processor.data_loading_times``, the ``next()`` on the loader inside the step):

* **cached**: packs memory-mapped from the cache (built before timing); pixels normalised in the
  collate (no GPU here);
* **cached + staging**: the same behind ``AsyncDeviceLoader`` (``[staging] enable``: on CPU a
  background thread fetching one batch ahead);
* **online** (baseline): ``use_preprocessed_cache = false``, the loader's online fallback, which
  decodes, resizes, tokenises and packs the same rows inside the training step;
* **cached + compile**: the cached mode with ``[compile] enable`` (each decoder layer and vision
  block compiled, ``models/qwen3_vl/compile.py``; backend ``inductor``, option ``backend``),
  compared with the plain cached mode (eager). Its extra rows count dynamo's compilations
  (frames compiled, recompilations included) per 100 steps over all steps and over the timed
  (post-warm-up) steps, each process starting from an empty compile cache; the steady-state step
  time is the usual step-time row. Option ``compile=0`` leaves this mode out.

Wall time is what a run takes; CPU time (the process's user + system time, all its threads) is
what a step costs the machine, and moves much less than wall time when other jobs share the box.
The modes run one after the other in ``rounds`` alternating rounds (a fresh process each), so a
change of the machine's load hits all of them; ratios compare medians of the same run. Options
(``--set key=value``): ``rows`` (sample rows, default 300, quick 48), ``steps`` (timed steps per
round, default 8, quick 4), ``warmup`` (untimed steps, default 3, quick 2: the compiled mode
compiles in its first two steps), ``rounds`` (default
3, quick 1), ``threads`` (torch intra-op threads per process, default 1: with one per core the
steps of every mode swung 3-10x on the loaded 2-core box).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchArgs, Row, compare

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml"
MODES = {
    "cached": [],
    "cached + staging": ["--staging.enable"],
    "online": ["--dataloader.no-use-preprocessed-cache"],
}
COMPILED = "cached + compile"


def _worker(out: str, steps: int, warmup: int, argv: list[str]) -> None:
    """In a fresh process: build the trainer like the launcher, time ``steps`` train steps."""
    import torch

    from torchtitan_ext.train import build_trainer

    trainer = build_trainer(str(TINY), argv)
    mp = trainer.metrics_processor
    mp.log = lambda *a, **k: None  # no log lines (and no reset of the wait list) while timing
    it = trainer.batch_generator(trainer.dataloader)
    step_s, cpu_s, wait_s, frames = [], [], [], []
    from torchtitan_ext.models.qwen3_vl.compile import compile_counts

    for k in range(warmup + steps):
        f0 = compile_counts()["frames"]
        mp.data_loading_times.clear()
        trainer.step += 1
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train_step(it)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        frames.append(compile_counts()["frames"] - f0)
        if k >= warmup:
            step_s.append(dt)
            cpu_s.append(dc)
            wait_s.append(sum(mp.data_loading_times))
    stats = trainer.dataloader.get_stats() if hasattr(trainer.dataloader, "get_stats") else {}
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    doc = {"step_s": step_s, "cpu_s": cpu_s, "wait_s": wait_s, "frames": frames, "stats": stats}
    Path(out).write_text(json.dumps(doc))


def _measure(mode: str, args: list[str], steps: int, warmup: int, env: dict) -> dict:
    """``mode``'s worker; ``args`` end with the mode's own switches."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "benchmarks.vl_train", "--worker", out, str(steps), str(warmup)]
    p = subprocess.run(cmd + args, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"vl_train worker ({mode}) failed:\n{(p.stdout + p.stderr)[-3000:]}")
    doc = json.loads(Path(out).read_text())
    os.unlink(out)
    return doc


def run(args: BenchArgs) -> list[Row]:
    n_rows = int(args.extra.get("rows", 48 if args.quick else 300))
    steps = int(args.extra.get("steps", 4 if args.quick else 8))
    warmup = int(args.extra.get("warmup", 2 if args.quick else 3))
    rounds = int(args.extra.get("rounds", 1 if args.quick else 3))
    work = Path(tempfile.mkdtemp(prefix="bench_vl_train_"))
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        TORCHTITAN_EXT_CACHE=os.environ.get("TORCHTITAN_EXT_CACHE", str(work / "home")),
        TOKENIZERS_PARALLELISM="false",
        # One intra-op thread per process: with torch's default (one per core) the step time
        # of every mode swung 3-10x on the shared 2-core box (threads spinning on busy cores),
        # swamping the data path under test. Options: ``threads``.
        OMP_NUM_THREADS=args.extra.get("threads", "1"),
    )
    common = ["--dataloader.max_samples", str(n_rows), "--checkpoint.no-enable"]
    common += ["--dataloader.cache_dir", str(work / "cache"), "--dump_folder", str(work / "out")]
    common += ["--training.steps", str(10 * (steps + warmup)), "--debug.seed", "0"]
    # build the cache once, untimed (the cached modes then open it)
    _measure("cached", common, 1, 0, env)
    modes = dict(MODES)
    if args.extra.get("compile", "1") != "0":
        backend = args.extra.get("backend", "inductor")
        modes[COMPILED] = ["--compile.enable", "--compile.backend", backend]
    # modes alternate round by round, so a change of the shared machine's load hits all of them
    results: dict[str, dict[str, list]] = {m: {} for m in modes}
    for rnd in range(rounds):
        for i, (mode, switches) in enumerate(modes.items()):
            # a fresh compile cache per process: dynamo's saved dynamic-shape profile (in the
            # inductor cache dir) would otherwise hide the recompiles of a new job
            env["TORCHINDUCTOR_CACHE_DIR"] = str(work / f"inductor_{rnd}_{i}")
            r = _measure(mode, common + switches, steps, warmup, env)
            for k in ("step_s", "cpu_s", "wait_s"):
                results[mode].setdefault(k, []).extend(r[k])
            results[mode].setdefault("frames", []).append(r["frames"])
            results[mode]["stats"] = r["stats"]
    rows = _rows(results)
    if COMPILED in results:
        rows += _compile_rows(results[COMPILED], warmup, modes[COMPILED][-1])
    return rows


def _compile_rows(r: dict, warmup: int, backend: str) -> list[Row]:
    """Compilations per 100 steps of the compiled mode (one sample per round)."""
    rows = []
    for what, first in (("all steps", 0), ("after warm-up", warmup)):
        per100 = [100.0 * sum(f[first:]) / max(len(f[first:]), 1) for f in r["frames"]]
        rows.append(
            Row(
                f"compilations per 100 steps, {what}, {COMPILED}",
                statistics.median(per100),
                "frames/100 steps",
                higher_is_better=False,
                samples=per100,
                info={"frames_per_step": r["frames"], "backend": backend},
            )
        )
    return rows


def _rows(results: dict[str, dict]) -> list[Row]:
    rows: list[Row] = []
    for what, key in (("step time", "step_s"), ("CPU time per step", "cpu_s")):
        for mode, r in results.items():
            ms = [1e3 * s for s in r[key]]
            stats = r["stats"]
            info = {"images": stats.get("images"), "patches": stats.get("patches")}
            rows.append(
                Row(f"{what}, {mode}", statistics.median(ms), "ms/step", higher_is_better=False,
                    samples=ms, info=info)
            )  # fmt: skip
        compare(rows, f"{what}, cached", f"{what}, online")
        compare(rows, f"{what}, cached + staging", f"{what}, online")
        if COMPILED in results:
            compare(rows, f"{what}, {COMPILED}", f"{what}, cached")
    for mode, r in results.items():
        share = [100.0 * w / s for w, s in zip(r["wait_s"], r["step_s"], strict=True)]
        rows.append(
            Row(
                f"data-wait share of the step, {mode}",
                statistics.median(share),
                "%",
                higher_is_better=False,
                samples=share,
                info={"wait_ms_median": 1e3 * statistics.median(r["wait_s"])},
            )
        )
    compare(rows, "data-wait share of the step, cached", "data-wait share of the step, online")
    return rows


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
