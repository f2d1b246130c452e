"""A quiet log, and the README's commands in the order a new user runs them.

The noise patterns (``torchtitan_ext.logs.NOISE``) are first shown to catch the real lines an
earlier version printed, so the log checks below can fail; then the demo, its resume and the
README's torchrun command run in a fresh directory with the default paths, and their logs must
hold none of them.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, torchrun
from torchtitan_ext.logs import NOISE, noisy_lines

# Lines an earlier version printed (CPU demo, its resume, torchrun, pip install), one per pattern.
OLD_LINES = {
    "initial_load_model_only": "[titan] 2026-11-22 14:39:47,670 - root - WARNING - "
    "initial_load_model_only=True has no effect without an initial_load_path.",
    "lspci": "[titan] 2026-11-22 14:39:47,712 - root - WARNING - Error running lspci: [Errno 2] "
    "No such file or directory: 'lspci', fallback to use device_name",
    "peak flops fallback": "[titan] 2026-11-22 14:39:47,712 - root - WARNING - Peak flops "
    "undefined for: cpu, fallback to A100",
    "mfu on a CPU": "[titan] 2026-11-22 14:39:48,854 - root - INFO - step:  2  loss:  8.02922  "
    "grad_norm:  0.7784  memory:  0.82GiB(3.47%)  tps: 4,893  tflops: 0.19  mfu: 0.06%",
    "DTensor CPU mesh": "/x/torch/distributed/tensor/_dispatch.py:342: UserWarning: DTensor "
    "random operators may not have complete support on cpu device mesh",
    "safetensors index": "[titan] 2026-11-22 14:39:47,842 - root - WARNING - "
    "model.safetensors.index.json not found at hf_assets_path: /r/tokenizer/model.safetensors."
    "index.json.",
    "get_last_lr": "/x/torch/optim/lr_scheduler.py:461: UserWarning: To get the last learning "
    "rate computed by the scheduler, please use `get_last_lr()`.",
    "NCCL variables": "[titan] 2026-11-22 15:01:02,000 - root - WARNING - "
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
    "setuptools install boxes": "  /tmp/pip-build-env/setuptools/config/_apply_pyprojecttoml.py:82: "
    "BuildBackendWarning: `project.license` as a TOML table is deprecated",
    "ANSI colour": "[titan] 2026-11-22 14:39:47,712 - root - INFO - \x1b[34mModel llama3 "
    "debugmodel \x1b[31msize: 6,163,712 total parameters\x1b[39m",
    "set_vital": "/x/torchdata/stateful_dataloader/stateful_dataloader.py:379: UserWarning: "
    "'set_vital' is deprecated, please do not call",
    "traceback": "[rank0]: Traceback (most recent call last):",
}


def test_every_noise_pattern_catches_the_line_it_is_for():
    assert set(OLD_LINES) == set(NOISE)
    for name, line in OLD_LINES.items():
        assert name in {n for n, _ in noisy_lines(line)}, name
    quiet = "[titan] 2026-11-22 - root - INFO - step:  2  loss:  8.02922  tps: 4,893  mfu: N/A"
    assert noisy_lines(quiet) == []


def test_pyproject_license_is_an_spdx_string():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^license = "BSD-3-Clause"', text, re.M)
    assert re.search(r'"setuptools>=(7[7-9]|[89]\d)', text)


# ------------------------------------------------------------------------------ the user's path
def readme_torchrun_commands() -> list[list[str]]:
    """The torchrun command lines of the README's shell examples."""
    cmds = []
    for line in (REPO / "README.md").read_text().splitlines():
        if line.startswith(".venv/bin/torchrun ") and "torchtitan_ext.train" in line:
            cmds.append(shlex.split(line.split("#", 1)[0]))
    return cmds


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def _nproc(cmd: list[str]) -> int | None:
    for i, a in enumerate(cmd):
        if a.startswith("--nproc_per_node="):
            return int(a.split("=", 1)[1])
        if a == "--nproc_per_node" and i + 1 < len(cmd):
            return int(cmd[i + 1])
    return None


def _as_torchrun(readme_cmd: list[str]) -> list[str]:
    """A README torchrun line with this interpreter and a free rendezvous port."""
    args = readme_cmd[readme_cmd.index("torchtitan_ext.train") + 1 :]
    return torchrun(_nproc(readme_cmd), "-m", "torchtitan_ext.train", *args)


def test_readme_has_a_torchrun_command_with_its_own_dump_folder():
    cmds = readme_torchrun_commands()
    assert cmds, "README.md: no '.venv/bin/torchrun ... torchtitan_ext.train' line"
    for c in cmds:
        assert "--dump_folder" in c, shlex.join(c)
        assert _nproc(c), shlex.join(c)


@pytest.mark.integration
def test_demo_then_readme_torchrun_with_default_paths_is_quiet_and_does_not_crash(tmp_path):
    """``make demo``, its resume, then the README's torchrun command, in a fresh directory with
    the default paths (steps shortened). Then torchrun on the demo's own folder: a one-line
    config error instead of the checkpoint crash."""
    work = tmp_path / "clone"
    work.mkdir()
    (work / "train_configs").symlink_to(REPO / "train_configs")
    demo = [
        sys.executable,
        "-m",
        "torchtitan_ext.train",
        "--config-file",
        "train_configs/llama3_debug_cpu.toml",
    ]
    logs = {}
    rc, logs["demo"] = _run([*demo, "--training.steps", "2"], work)
    assert rc == 0, logs["demo"][-3000:]
    rc, logs["resume"] = _run([*demo, "--training.steps", "3"], work)
    assert rc == 0 and "Training starts at step 3" in logs["resume"], logs["resume"][-3000:]
    # the same job again: nothing left to train, said in one line, nothing built
    rc, again = _run([*demo, "--training.steps", "3"], work)
    assert rc == 0 and "nothing to do:" in again and "Building llama3" not in again, again[-3000:]
    # another seq_len on the demo's checkpoint (read from the record the trainer wrote)
    rc, other = _run([*demo, "--training.steps", "5", "--training.seq_len", "128"], work)
    assert rc == 2 and "seq_len 256 (this job: 128)" in other, other[-3000:]
    for i, cmd in enumerate(readme_torchrun_commands()):
        rc, logs[f"torchrun{i}"] = _run([*_as_torchrun(cmd), "--training.steps", "2"], work)
        assert rc == 0, logs[f"torchrun{i}"][-3000:]
        assert re.search(r"step:\s+2\s", logs[f"torchrun{i}"])
    for name, text in logs.items():
        assert noisy_lines(text) == [], (name, noisy_lines(text)[:5])
    # the same torchrun on the demo's folder (a DP=1 checkpoint): the data stream resumes at
    # DP=2 (the loader's envelope is resumable at any degree), quietly, from step 3
    rc, text = _run(
        torchrun(2, "-m", "torchtitan_ext.train", *demo[3:], "--training.steps", "4"), work
    )
    assert rc == 0, text[-3000:]
    assert "Training starts at step 4" in text and re.search(r"step:\s+4\s", text), text[-3000:]
    assert "Missing key in checkpoint" not in text and noisy_lines(text) == [], text[-3000:]
