"""A real torchtitan 0.3.0 training job on CPU through our launcher: DP=1, DP=2 under torchrun,
and checkpoint + resume continuing at the next step with the same losses as an uninterrupted run.

These use the toy loader so they test the launcher/config/trainer path on their own; the main
job's loader is exercised end to end in test_main_job.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, step_losses, torchrun

pytestmark = pytest.mark.integration
TOY = REPO / "tests" / "data" / "configs" / "toy_debug.toml"


def run(args: list[str], nproc: int = 1, timeout: int = 300) -> tuple[str, dict[int, str]]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "tests.support.run_with_toy"]
    else:
        cmd = torchrun(nproc, "-m", "tests.support.run_with_toy")
    out = subprocess.run(
        cmd + ["--config-file", str(TOY), "--debug.seed", "0", "--debug.deterministic", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    return step_losses(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[str, dict[int, str]]:
    """The reference: 4 steps in one go, DP=1."""
    return run(["--training.steps", "4", "--dump_folder", str(tmp_path_factory.mktemp("full"))])


def test_dp1_trains_checkpoints_and_resumes_exactly(tmp_path, uninterrupted):
    full, full_losses = uninterrupted
    assert sorted(full_losses) == [1, 2, 3, 4]
    assert "data_wait:" in full  # our stats appended to torchtitan's step line

    first, l1 = run(["--training.steps", "2", "--dump_folder", str(tmp_path / "b")])
    assert (tmp_path / "b" / "checkpoint" / "step-2").is_dir()
    second, l2 = run(["--training.steps", "4", "--dump_folder", str(tmp_path / "b")])
    assert "Loading the checkpoint from" in second and "Training starts at step 3" in second
    assert sorted(l2) == [3, 4]
    # the resumed run continues exactly where the uninterrupted one was
    assert {**l1, **l2} == full_losses


def test_dp2_under_torchrun(tmp_path):
    text, losses = run(["--training.steps", "2", "--dump_folder", str(tmp_path / "dp2")], nproc=2)
    assert sorted(losses) == [1, 2]
    assert "global batch size 4" in text  # 2 ranks x local batch 2
    assert (tmp_path / "dp2" / "checkpoint" / "step-2").is_dir()


def test_staging_switch_is_transparent_and_resumes_exactly(tmp_path, uninterrupted):
    """[staging] enable wraps the loader in AsyncDeviceLoader (a prefetching thread on CPU):
    same losses as without it, and a resume replays the batches that were in flight."""
    _, plain = uninterrupted
    _, staged = run(
        ["--training.steps", "4", "--staging.enable", "--dump_folder", str(tmp_path / "s")]
    )
    assert staged == plain
    _, first = run(
        ["--training.steps", "2", "--staging.enable", "--dump_folder", str(tmp_path / "c")]
    )
    _, second = run(
        ["--training.steps", "4", "--staging.enable", "--dump_folder", str(tmp_path / "c")]
    )
    assert {**first, **second} == plain
