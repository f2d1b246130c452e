"""Benchmark runner: ``python -m benchmarks NAME [NAME ...] [--repeats N] [--quick]``.

Each NAME is a module ``benchmarks/NAME.py`` with ``run(args) -> list[Row]``; see common.py.
Results print as a table of medians and ratios (baseline measured in the same run) and are
written as JSON to ``benchmarks/results/NAME.json`` (or ``--out-dir``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from benchmarks.common import BenchArgs, print_table, write_json

_NOT_CASES = {"common", "__main__"}


def available() -> list[str]:
    """Modules of this package that define ``run(args)`` (helpers such as the shared corpus
    builder don't), found without importing them."""
    here = os.path.dirname(__file__)
    names = []
    for m in pkgutil.iter_modules([here]):
        if m.name in _NOT_CASES or m.name.startswith("_"):
            continue
        with open(os.path.join(here, f"{m.name}.py"), encoding="utf-8") as f:
            if "\ndef run(" in f.read():
                names.append(m.name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("names", nargs="*", help="benchmark cases to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--quick", action="store_true", help="small inputs: a smoke run, not numbers to quote"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="case-specific option"
    )
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args(argv)
    if a.list or not a.names:
        for n in available():
            doc = (importlib.import_module(f"benchmarks.{n}").__doc__ or "").strip().splitlines()
            print(f"{n:<20} {doc[0] if doc else ''}")
        return 0
    extra = dict(kv.split("=", 1) for kv in a.set)
    args = BenchArgs(repeats=a.repeats, warmup=a.warmup, quick=a.quick, extra=extra)
    failed = []
    for name in a.names:
        if name not in available():
            print(
                f"unknown benchmark {name!r}; available: {', '.join(available())}", file=sys.stderr
            )
            return 2
        mod = importlib.import_module(f"benchmarks.{name}")
        rows = mod.run(args)
        print_table(f"{name} (medians of {args.repeats}{', quick' if args.quick else ''})", rows)
        out = os.path.join(a.out_dir, f"{name}{'_quick' if args.quick else ''}.json")
        write_json(out, name, args, rows)
        print(f"wrote {out}")
        failed += [f"{name}: {r.case}" for r in rows if r.met is False]
    if failed:
        print("\ntargets not met in this run:\n  " + "\n  ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
