"""train_configs/qwen3_vl_chat_tiny_cpu.toml end to end: torchtitan's launcher and trainer train
the qwen3_vl model on the shipped chat sample (several images per sample, several turns, system
prompts, text-only rows; loss on the assistant turns only) and the loss falls."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, step_losses

pytestmark = pytest.mark.integration
CHAT = REPO / "train_configs" / "qwen3_vl_chat_tiny_cpu.toml"


def test_chat_config_trains_and_the_loss_falls(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               TORCHTITAN_EXT_CACHE=str(tmp_path / "home"))  # fmt: skip
    args = ["--config-file", str(CHAT), "--debug.seed", "0", "--training.steps", "20",
            "--dataloader.max_samples", "12", "--dataloader.cache_dir", str(tmp_path / "cache"),
            "--checkpoint.no-enable", "--dump_folder", str(tmp_path / "out")]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "torchtitan_ext.train", *args],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=600)  # fmt: skip
    text, losses = step_losses(out)
    assert sorted(losses) == list(range(1, 21))
    assert float(losses[20]) < 0.5 * float(losses[1]), losses
    assert "row layout messages (as asked) from columns messages='messages', image='images'" in text
    assert any("images/step:" in ln for ln in text.splitlines() if "step: 20" in ln)
