import os
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TEST_DATA = REPO / "tests" / "data"

# Tests never touch the network: everything they need is in the repo or built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def torchrun(nproc: int, *target: str) -> list[str]:
    """The command line that runs ``target`` (``-m module`` or a script path) under torchrun with
    ``nproc`` local processes on a free port."""
    import sys

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:0",
        *target,
    ]


def step_losses(out: "subprocess.CompletedProcess[str]") -> tuple[str, dict[int, str]]:
    """A finished training subprocess -> (its log without colour codes, {step: loss as logged}).
    Fails the test, with the log's tail, when the process failed."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    assert out.returncode == 0, text[-4000:]
    losses: dict[int, str] = {}
    for m in re.finditer(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", text):
        losses.setdefault(int(m.group(1)), m.group(2))
    return text, losses


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # torch missing entirely: treat as no CUDA
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
