"""The GPU acceptance run (``make gpu-check``) on a machine without CUDA: it says so and exits 0;
its log parser reads torchtitan's step lines; its mid-size worker (the trainer built in process,
timed steps, MFU / data-wait / memory figures) runs end to end on the CPU with the tiny flavor,
so the first GPU it meets does not find a plumbing bug."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"


def _env(tmp_path):
    return dict(os.environ, PYTHONPATH=str(REPO), TORCHTITAN_EXT_CACHE=str(tmp_path / "home"))


def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the run would start")
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=_env(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    assert "no CUDA device" in out.stdout and "nothing was run" in out.stdout


@pytest.mark.parametrize("args", [["--only", "bogus"], ["--flavor", "nope"]])
def test_bad_arguments_are_refused_before_looking_for_a_gpu(tmp_path, args):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=_env(tmp_path)
    )
    assert out.returncode == 2 and "expected" in out.stderr, out.stderr


def test_step_lines_are_parsed():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    log = (
        "[titan] 2026-11-25 10:00:00,000 - root - INFO - step:  1  loss:  6.48260  grad_norm:  "
        "1.2345  memory:  0.41GiB(0.52%)  tps: 12,345  tflops: 1.23  mfu: 0.12%\n"
        "\x1b[31mstep:  2  \x1b[32mloss:  6.10000  tps: 999\n"
    )
    got = gpu_check._steps(log)
    assert got == {1: {"loss": 6.4826, "tps": 12345.0}, 2: {"loss": 6.1, "tps": 999.0}}


@pytest.mark.integration
def test_midsize_worker_runs_on_cpu_with_the_tiny_flavor(tmp_path):
    res = tmp_path / "mid.json"
    cmd = [sys.executable, str(SCRIPT), "--worker", "midsize", str(res), "debugmodel", "--quick"]
    cmd += ["--", "--training.seq_len", "1024", "--dataloader.buckets", "512", "768"]
    cmd += ["--training.mixed_precision_param", "float32", "--dataloader.max_samples", "24"]
    cmd += ["--dataloader.cache_dir", str(tmp_path / "cache")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    r = json.loads(res.read_text())
    assert r["steps"] == 5 and r["warmup"] == 3
    assert 0 < r["tokens"] <= 2 * 1024 and r["step_ms"] > 0
    assert 0 <= r["wait_share"] < 100
