"""Exact resume through SIGKILL, for the text loaders and their mixtures, through torchtitan's own
checkpointing: a job killed with SIGKILL (no shutdown code runs: no loader close, no final
checkpoint) in the middle of step 5, its loader's thread running ahead, restarts from the step-4
checkpoint and trains steps 5 and 6 with the losses of an uninterrupted run, which needs bitwise
the batches that run saw (model, optimizer and data state all come from the checkpoint).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, step_losses

pytestmark = pytest.mark.integration
SMALL = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--checkpoint.interval", "2",
    "--debug.seed", "0",
    "--debug.deterministic",
    "--validator.enable", "false",
]  # fmt: skip
CONFIGS = {
    "parquet": "llama3_debug_cpu.toml",
    "parquet-mixture": "llama3_mixture_cpu.toml",
    "streaming-mixture": "streaming_text_mixture_cpu.toml",
}


def _cmd(config: str, steps: int, folder: str) -> list[str]:
    return [
        sys.executable, "-m", "torchtitan_ext.train",
        "--config-file", str(REPO / "train_configs" / config), *SMALL,
        "--training.steps", str(steps), "--dump_folder", folder,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _train(config: str, steps: int, folder: str) -> tuple[str, dict[int, str]]:
    out = subprocess.run(
        _cmd(config, steps, folder), capture_output=True, text=True, cwd=REPO, env=_env(),
        timeout=600,
    )  # fmt: skip
    return step_losses(out)


def _train_until_killed(config: str, folder: str, kill_after_step: int) -> dict[int, str]:
    """Train 6 steps; SIGKILL the process as soon as it has logged ``kill_after_step``."""
    proc = subprocess.Popen(
        _cmd(config, 6, folder), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=REPO, env=_env(),
    )  # fmt: skip
    losses: dict[int, str] = {}
    lines: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            m = re.search(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", re.sub(r"\x1b\[[0-9;]*m", "", line))
            if m:
                losses.setdefault(int(m.group(1)), m.group(2))
                if int(m.group(1)) == kill_after_step:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "".join(lines[-40:])
    return losses


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_a_job_killed_mid_step_resumes_with_identical_losses(tmp_path, config):
    _, full = _train(config, 6, str(tmp_path / "full"))
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    killed = _train_until_killed(config, str(tmp_path / "cut"), kill_after_step=5)
    assert (tmp_path / "cut" / "checkpoint" / "step-4").is_dir()
    assert not (tmp_path / "cut" / "checkpoint" / "step-6").exists()
    text, resumed = _train(config, 6, str(tmp_path / "cut"))
    assert "Training starts at step 5" in text, text[-3000:]
    assert sorted(resumed) == [5, 6]
    assert {k: v for k, v in killed.items() if k <= 4} == {k: full[k] for k in range(1, 5)}
    assert resumed == {5: full[5], 6: full[6]}
