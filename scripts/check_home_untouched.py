#!/usr/bin/env python3
"""Run a command with ``HOME`` pointing at a new, empty directory and fail if the command left
anything under it.

    python scripts/check_home_untouched.py -- python -m pytest -q

``make test`` runs the suite this way: the suite must keep its caches (datasets, tokenizers,
torch, matplotlib, ...) in its own temporary directories (tests/conftest.py), so a test that
writes to the user's home, or reads something left there, shows up here as a listed path.
Exit status: the command's own when it failed, else 1 when something was left, else 0. Prints
nothing on success (the command's last line, e.g. pytest's summary, stays the last line).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def leftovers(home: Path, limit: int = 50) -> list[str]:
    """Paths under ``home`` (relative), directories included, at most ``limit``."""
    out = []
    for root, dirs, files in os.walk(home):
        for name in sorted(dirs) + sorted(files):
            out.append(str((Path(root) / name).relative_to(home)))
            if len(out) >= limit:
                return out
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp(prefix="empty-home-"))
    try:
        print(f"HOME={home} for this run (it must stay empty)", flush=True)
        rc = subprocess.run(argv, env={**os.environ, "HOME": str(home)}).returncode
        left = leftovers(home)
        if left:
            print(
                f"\nFAILED home check: the run left {len(left)}+ path(s) under HOME={home}:",
                file=sys.stderr,
            )
            for p in left:
                print(f"  ~/{p}", file=sys.stderr)
            print(
                "Point whatever wrote them at the suite's own directories (tests/conftest.py).",
                file=sys.stderr,
            )
            return rc or 1
        print(f"home check: HOME={home} is still empty", flush=True)
        return rc
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
