"""No DataLoader worker outlives a SIGKILLed training process (``threads.exit_with_parent``):
a worker blocked inside its dataset, where torch's own watchdog never runs, ends too."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = """
import os, signal, sys, threading
import torch
from torch.utils.data import DataLoader, IterableDataset
from torchtitan_ext.threads import exit_with_parent

class Blocked(IterableDataset):
    def __iter__(self):
        open(sys.argv[1], "w").write(str(os.getpid()))
        threading.Event().wait()  # blocked for ever, as a worker whose parent went away
        yield 0

init = exit_with_parent if sys.argv[2] == "watch" else None
it = iter(DataLoader(Blocked(), num_workers=1, worker_init_fn=init))
threading.Thread(target=lambda: next(it), daemon=True).start()
while not os.path.exists(sys.argv[1]) or not open(sys.argv[1]).read():
    pass
os.kill(os.getpid(), signal.SIGKILL)  # the training process dies without any shutdown code
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_blocked_worker_ends_with_its_killed_parent(tmp_path):
    pid_file = tmp_path / "worker.pid"
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(pid_file), "watch"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)  # fmt: skip
    assert p.returncode == -9
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # the watch polls every second; generous on a busy host
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _alive(worker)
    if alive:
        os.kill(worker, 9)
    assert not alive, "the worker outlived its killed parent"
