"""The tiny Qwen3-VL trained on a mixture of the shipped VQA and chat samples
(``train_configs/qwen3_vl_mixture_tiny_cpu.toml``), and that config's per-source stats."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_tiny_qwen3_vl_trains_on_the_mixture_example(tmp_path: Path) -> None:
    """``train_configs/qwen3_vl_mixture_tiny_cpu.toml`` trains a few steps, and the same config's
    loader (peek builds it as training does) reports per-source stats."""
    cfg = ROOT / "train_configs" / "qwen3_vl_mixture_tiny_cpu.toml"
    envv = {
        **os.environ, "PYTHONPATH": str(ROOT), "TORCHTITAN_EXT_CACHE": str(tmp_path / "home"),
    }  # fmt: skip
    common = ["--config-file", str(cfg), "--dataloader.cache_dir", str(tmp_path / "cache")]

    def run(module: str, *args: str) -> str:
        cmd = [sys.executable, "-m", module, *common, *args]
        out = subprocess.run(cmd, cwd=ROOT, env=envv, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        return out.stdout + out.stderr

    log = run("torchtitan_ext.train", "--training.steps", "3", "--checkpoint.no-enable",
              "--dump_folder", str(tmp_path / "out"))  # fmt: skip
    assert re.search(r"step:\s+3\s+loss", log), log[-3000:]
    run("torchtitan_ext.peek", "--batches", "8", "--out", str(tmp_path / "b.npz"),
        "--pixels", "sha256")  # fmt: skip
    from torchtitan_ext.peek_files import load_batches

    _, meta = load_batches(tmp_path / "b.npz")
    stats = meta["stats"]
    sources = stats["sources"]
    assert list(sources) == ["vqa", "chat"]
    assert sum(v["packs"] for v in sources.values()) == stats["packs"] == 16
    assert all(v["packs"] > 0 and v["tokens"] > 0 and v["images"] > 0 for v in sources.values())
    assert sources["vqa"]["target"] == 0.75 and sources["chat"]["target"] == 0.25
