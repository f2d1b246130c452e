"""The shipped CPU configs are seeded: two fresh runs of the same config give the same losses
(the weights' random init and every RNG come from ``[debug] seed``), with nothing passed on the
command line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, step_losses

CPU_CONFIGS = [
    "llama3_debug_cpu",
    "qwen3_vl_tiny_cpu",
    "qwen3_vl_chat_tiny_cpu",
    "streaming_text_cpu",
]


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_cpu_configs_set_a_seed(name):
    from torchtitan_ext.config import load_config

    cfg = load_config(REPO / "train_configs" / f"{name}.toml")
    assert cfg.debug.seed is not None, f"{name}.toml sets no [debug] seed"


@pytest.mark.integration
def test_two_fresh_runs_of_the_tiny_vl_config_give_equal_losses(tmp_path):
    """Each run in its own fresh process and folders, the only argument beside the config file
    being where to write (no --debug.seed: the config's own seed must do it)."""
    losses = []
    for k in range(2):
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        env["TORCHTITAN_EXT_CACHE"] = str(tmp_path / f"home{k}")
        cmd = [sys.executable, "-m", "torchtitan_ext.train"]
        cmd += ["--config-file", str(REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml")]
        cmd += ["--training.steps", "3", "--dataloader.max_samples", "24"]
        cmd += ["--checkpoint.no-enable", "--dump_folder", str(tmp_path / f"run{k}")]
        cmd += ["--dataloader.cache_dir", str(tmp_path / f"cache{k}")]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
        losses.append(step_losses(out)[1])
    assert sorted(losses[0]) == [1, 2, 3]
    assert losses[0] == losses[1]
