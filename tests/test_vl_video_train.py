"""train_configs/qwen3_vl_video_tiny.toml end to end: torchtitan's launcher and trainer train the
qwen3_vl model on the generated video sample (videos through the offline cache, timestamps per
merged frame, an image and a video together, two videos, text-only rows) and the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, step_losses

pytestmark = pytest.mark.integration
VIDEO = REPO / "train_configs" / "qwen3_vl_video_tiny.toml"


def test_video_config_trains_and_the_loss_falls(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               TORCHTITAN_EXT_CACHE=str(tmp_path / "home"))  # fmt: skip
    args = ["--config-file", str(VIDEO), "--training.steps", "20",
            "--dataloader.cache_dir", str(tmp_path / "cache"),
            "--checkpoint.no-enable", "--dump_folder", str(tmp_path / "out")]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "torchtitan_ext.train", *args],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=900)  # fmt: skip
    text, losses = step_losses(out)
    assert sorted(losses) == list(range(1, 21))
    assert float(losses[20]) < 0.5 * float(losses[1]), losses
    assert "row layout messages (as asked) from columns messages='messages'" in text
    assert "video='videos'" in text
    assert list((tmp_path / "cache").glob("*/shards/00000/video_pixels.memmap"))
    last = next(ln for ln in text.splitlines() if "step: 20" in ln)
    assert "images/step:" in last and re.search(r"frames/step: [1-9]", last), last
