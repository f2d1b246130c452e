#!/usr/bin/env python3
"""Run every test alone, each in a fresh pytest process, and list the ones that fail.

    python scripts/run_tests_alone.py                       # the whole suite (~1 h on 2 cores)
    python scripts/run_tests_alone.py tests/test_packing.py -k resume -j 2

A test that passes in the suite but fails alone depends on another test (a fixture it did not
request, a module-level cache, a registry entry, a file another test left behind). Arguments
are passed to the collection (``pytest --collect-only -q ARGS``); ``-j N`` runs N at a time.
Exit status 1 when any test failed alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider"]


def collect(args: list[str]) -> list[str]:
    out = subprocess.run(
        [*PYTEST, "--collect-only", "-q", *args], capture_output=True, text=True, cwd=REPO
    )
    ids = [line for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if out.returncode != 0 or not ids:
        sys.exit(f"collection failed (exit {out.returncode}):\n{out.stdout[-3000:]}{out.stderr}")
    return ids


def run_one(node: str, timeout: float) -> tuple[str, int, float, str]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [*PYTEST, "-q", "-rN", node],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = -1, f"timed out after {timeout} s\n{e.stdout or ''}"
    return node, rc, time.perf_counter() - t0, text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=1, help="tests run at a time (default 1)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test (default 900)")
    args, rest = ap.parse_known_args(argv)
    ids = collect(rest)
    print(f"{len(ids)} tests, each alone, {args.jobs} at a time", flush=True)
    failed: list[tuple[str, int, str]] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        for i, (node, rc, secs, text) in enumerate(
            pool.map(lambda n: run_one(n, args.timeout), ids), 1
        ):
            # 0: passed; 5 would be "no test ran" (a node id that no longer resolves): a failure
            status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            print(f"[{i}/{len(ids)}] {status:16s} {secs:6.1f}s  {node}", flush=True)
            if rc != 0:
                failed.append((node, rc, text))
    print(f"\n{len(ids) - len(failed)} passed, {len(failed)} failed alone", end="")
    print(f" in {time.perf_counter() - t0:.0f} s")
    for node, rc, text in failed:
        print(f"\n==== {node} (exit {rc})\n{text[-3000:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
