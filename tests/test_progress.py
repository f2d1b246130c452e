"""Long tools say what they are doing: verify_data_diversity shows progress on stderr, and
``-q/--quiet`` (the one name every tool uses for it) turns it off."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "verify_data_diversity.py"


def _diversity(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--batches",
            "4",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_verify_data_diversity_shows_progress_unless_quiet():
    out = _diversity()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "building the loader" in out.stderr and "4/4" in out.stderr  # the bar reached its end
    quiet = _diversity("--quiet")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "batch/s" not in quiet.stderr and "building the loader" not in quiet.stderr
    assert "OK: no duplicates" in quiet.stdout


@pytest.mark.parametrize("module", ["torchtitan_ext.tokenizer.cli", "torchtitan_ext.vl.preprocess"])
def test_every_tool_spells_quiet_the_same(module):
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert "-q, --quiet" in out.stdout, out.stdout
