"""The main CPU job's step time in float32 vs bfloat16, on this CPU and with torch limited to AVX2
(as on a CPU without native bf16 matmul); what ``cpu_compat.cpu_param_dtype`` picks.

Each measurement runs the train launcher on ``train_configs/llama3_debug_cpu.toml`` (the demo:
llama3 debug model, seq 256, batch 4) in a subprocess, since the ISA limit must be set before torch
loads: ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` keeps oneDNN's matmuls and torch's own
kernels off AVX-512 and its bf16 instructions. Time per step: the spacing of the step log lines
after the first step (which includes warm-up), median over the steps of a run, then the median of
``--repeats`` runs. Runs alternate dtypes so that a change in the machine's load hits both.

    python -m benchmarks cpu_dtype [--repeats 3] [--quick] [--set steps=12]
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from benchmarks.common import BenchArgs, Row, compare

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "llama3_debug_cpu.toml"
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
_STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) - .*step:\s+(\d+)\s")


def step_seconds(log: str) -> list[float]:
    """Seconds between consecutive step log lines, from step 2 on."""
    times = [
        datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for m in _STEP.finditer(log)
    ]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def run_job(dtype: str | None, env_extra: dict[str, str], steps: int) -> tuple[float, str]:
    """(median seconds per step, the dtype the job logged) for one training run."""
    args = [
        "--training.steps",
        str(steps),
        "--checkpoint.enable",
        "false",
        "--metrics.log_freq",
        "1",
    ]
    if dtype is not None:
        args += ["--training.mixed_precision_param", dtype]
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchtitan_ext.train",
                "--config-file",
                str(CONFIG),
                *args,
                "--dump_folder",
                d,
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            env={**os.environ, **env_extra},
            timeout=1800,
        )
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise RuntimeError(f"training run failed:\n{log[-2000:]}")
    chosen = re.search(r"cpu_compat: training in (\w+)", log)
    return statistics.median(step_seconds(log)), chosen.group(1) if chosen else "?"


def run(args: BenchArgs) -> list[Row]:
    steps = int(args.extra.get("steps", 6 if args.quick else 12))
    repeats = 1 if args.quick else args.repeats
    rows: list[Row] = []
    for label, env in (("this CPU", {}), ("AVX2 only", AVX2)):
        samples: dict[str, list[float]] = {"float32": [], "bfloat16": []}
        for _ in range(repeats):
            for dtype in ("bfloat16", "float32"):
                s, _ = run_job(dtype, env, steps)
                samples[dtype].append(1e3 * s)
        _, default = run_job(None, env, 3)
        for dtype, xs in samples.items():
            rows.append(
                Row(
                    case=f"{label}: {dtype} ms/step",
                    value=statistics.median(xs),
                    unit="ms",
                    higher_is_better=False,
                    samples=xs,
                    info={"default_here": default, "steps": steps},
                )
            )
        best = min(samples, key=lambda d: statistics.median(samples[d]))
        r = compare(rows, f"{label}: float32 ms/step", f"{label}: bfloat16 ms/step")
        r.target = f"default = {best}"
        r.met = default == best
        r.info["default_here"] = default
    return rows
