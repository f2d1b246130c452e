import os
import pathlib

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
