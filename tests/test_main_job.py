"""The README's main job (train_configs/llama3_debug_cpu.toml: llama3 debug model, the
prefetching Parquet loader on the embedded corpus) through torchtitan 0.3.0's Trainer on CPU.

Resume is proven through torchtitan's own checkpointing: a job stopped at step 2 and restarted
continues at step 3 with the same per-step losses as an uninterrupted run, which needs the
loader to hand out exactly the same batches after the resume (model, optimizer and data state
all come back from the checkpoint). Done at DP=1 and DP=2 (torchrun, gloo).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, step_losses, torchrun

pytestmark = pytest.mark.integration
MAIN = REPO / "train_configs" / "llama3_debug_cpu.toml"
SMALL = [
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--checkpoint.interval",
    "2",
    "--debug.seed",
    "0",
    "--debug.deterministic",
]


def train(args: list[str], nproc: int = 1) -> tuple[str, dict[int, str]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    launcher = [sys.executable, "-m", "torchtitan_ext.train"]
    if nproc > 1:
        launcher = torchrun(nproc, "-m", "torchtitan_ext.train")
    out = subprocess.run(
        launcher + ["--config-file", str(MAIN), *SMALL, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    return step_losses(out)


@pytest.mark.parametrize("nproc", [1, 2], ids=["dp1", "dp2"])
def test_main_job_resumes_with_identical_losses(tmp_path, nproc):
    _, full = train(["--training.steps", "4", "--dump_folder", str(tmp_path / "full")], nproc)
    assert sorted(full) == [1, 2, 3, 4]
    text1, first = train(["--training.steps", "2", "--dump_folder", str(tmp_path / "cut")], nproc)
    assert "queue:" in text1 and "data_wait:" in text1  # loader stats in torchtitan's step line
    text2, second = train(["--training.steps", "4", "--dump_folder", str(tmp_path / "cut")], nproc)
    assert "Training starts at step 3" in text2
    assert {**first, **second} == full
