import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TEST_DATA = REPO / "tests" / "data"

# Fixtures several test modules share, defined once in tests/support (``proc``, ``special``).
pytest_plugins = ["tests.support.vl_processor"]

# Tests never touch the network: everything they need is in the repo or built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite's own cache directories, for this process and every subprocess it starts (they
# inherit os.environ): nothing is read from or written to the user's caches under $HOME, and
# nothing left there by another checkout is trusted. Set at import, before any test module
# imports a library that reads them; removed at the end of the session.
# `make test` checks the result: run with HOME pointing at an empty directory, the suite must
# leave nothing under it (scripts/check_home_untouched.py).
# A process started by a test that imports this module again keeps its parent's directory.
_OWNER = "TORCHTITAN_EXT_TESTS_CACHE_ROOT" not in os.environ
if _OWNER:
    os.environ["TORCHTITAN_EXT_TESTS_CACHE_ROOT"] = tempfile.mkdtemp(prefix="torchtitan_ext-tests-")
CACHE_ROOT = pathlib.Path(os.environ["TORCHTITAN_EXT_TESTS_CACHE_ROOT"])
_CACHE_ENV = {
    "TORCHTITAN_EXT_CACHE": "torchtitan_ext",
    "HF_HOME": "huggingface",
    "HF_DATASETS_CACHE": "huggingface/datasets",
    "XDG_CACHE_HOME": "xdg/cache",
    "XDG_CONFIG_HOME": "xdg/config",
    "XDG_DATA_HOME": "xdg/data",
    "XDG_STATE_HOME": "xdg/state",
    "TORCH_HOME": "torch",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_HOME": "triton",
    "TRITON_CACHE_DIR": "triton/cache",
    "MPLCONFIGDIR": "matplotlib",
}
for _var, _sub in _CACHE_ENV.items():
    os.environ[_var] = str(CACHE_ROOT / _sub)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name the random order's seed at the end too (pytest -q hides the header that shows it)."""
    if config.pluginmanager.hasplugin("randomly") and config.getoption("randomly_reorganize"):
        seed = config.getoption("randomly_seed", None)
        if isinstance(seed, int):
            terminalreporter.write_line(
                f"random test order: --randomly-seed={seed} repeats it "
                f'(make test PYTEST_ARGS="-n 0 --randomly-seed={seed}": the same order in one '
                "process); -p no:randomly for file order"
            )


def pytest_unconfigure(config):
    if _OWNER:
        shutil.rmtree(CACHE_ROOT, ignore_errors=True)


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


# The launcher's rendezvous variables: a test that builds a trainer in this process must not
# leave them behind, or every later test's training subprocess inherits its MASTER_PORT (and
# LOCAL_RANK, so it would not pick a free port of its own) and fails with EADDRINUSE.
_RENDEZVOUS_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


_SESSION_RENDEZVOUS = {v: os.environ.get(v) for v in _RENDEZVOUS_ENV}


@pytest.fixture(autouse=True)
def _no_leaked_rendezvous_env():
    """Compared with the session's start, not the test's: a module fixture that builds a trainer
    is set up before this fixture, and its leak shows at its first test's teardown."""
    yield
    after = {v: os.environ.get(v) for v in _RENDEZVOUS_ENV}
    if after != _SESSION_RENDEZVOUS:
        for v, val in _SESSION_RENDEZVOUS.items():
            if val is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = val
        leaked = {v: after[v] for v in _RENDEZVOUS_ENV if after[v] != _SESSION_RENDEZVOUS[v]}
        pytest.fail(
            f"this test (or its fixtures) left rendezvous variables in os.environ: {leaked}"
        )
