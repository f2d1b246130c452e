"""Benchmark runner: ``python -m benchmarks NAME [NAME ...] [--repeats N] [--quick]``.

Each NAME is a module ``benchmarks/NAME.py`` with ``run(args) -> list[Row]`` (found by that
function: a new case needs no registration); see common.py for the rules every case follows.
Results print as a table of medians, ranges and ratios (baselines measured in the same run) and
are written as JSON, with the machine, date, commit and command, to
``benchmarks/results/NAME.json`` (``NAME_quick.json`` for ``--quick``; or ``--out-dir``).

``--results`` runs the named cases (all of them without names) and regenerates
``benchmarks/RESULTS.md`` from every case's latest JSON (``--render-only``: from the JSON files
alone, running nothing).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import shlex
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import BenchArgs, loadavg, print_table, write_json

HERE = Path(__file__).resolve().parent
_NOT_CASES = {"common", "__main__", "report"}


def available() -> list[str]:
    """Modules of this package that define ``run(args)`` (helpers such as the shared corpus
    builder don't), found without importing them."""
    names = []
    for m in pkgutil.iter_modules([str(HERE)]):
        if m.name in _NOT_CASES or m.name.startswith("_"):
            continue
        if "\ndef run(" in (HERE / f"{m.name}.py").read_text(encoding="utf-8"):
            names.append(m.name)
    return sorted(names)


def case_options(sets: list[str], name: str, cases: list[str]) -> dict[str, str]:
    """``--set`` options for case ``name``: ``KEY=VALUE`` applies to every case,
    ``CASE.KEY=VALUE`` to that case only."""
    out: dict[str, str] = {}
    for kv in sets:
        if "=" not in kv:
            raise SystemExit(f"--set {kv!r}: expected KEY=VALUE or CASE.KEY=VALUE")
        k, v = kv.split("=", 1)
        scope, dot, key = k.partition(".")
        if dot and scope in cases:
            if scope == name:
                out[key] = v
        else:
            out[k] = v
    return out


def case_command(name: str, args: BenchArgs) -> str:
    """The command that reproduces one case's table."""
    d = BenchArgs()
    parts = ["python", "-m", "benchmarks", name, "--repeats", str(args.repeats)]
    parts += ["--warmup", str(args.warmup)] if args.warmup != d.warmup else []
    parts += ["--quick"] if args.quick else []
    parts += ["--noise-tol", str(args.noise_tol)] if args.noise_tol != d.noise_tol else []
    parts += ["--max-retakes", str(args.max_retakes)] if args.max_retakes != d.max_retakes else []
    for k, v in args.extra.items():
        if not k.startswith("_"):
            parts += ["--set", f"{k}={v}"]
    return shlex.join(parts)


def json_path(out_dir: str | os.PathLike, name: str, quick: bool) -> Path:
    return Path(out_dir) / f"{name}{'_quick' if quick else ''}.json"


def _parser() -> argparse.ArgumentParser:
    d = BenchArgs()  # the defaults live there
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("names", nargs="*", help="benchmark cases to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--repeats", type=int, default=d.repeats,
                   help="interleaved rounds per measurement")  # fmt: skip
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument(
        "--quick", action="store_true", help="small inputs: a smoke run, not numbers to quote"
    )
    p.add_argument("--set", action="append", default=[], metavar="[CASE.]KEY=VALUE",
                   help="case-specific option (CASE. limits it to one case)")  # fmt: skip
    p.add_argument("--noise-tol", type=float, default=d.noise_tol,
                   help="re-take a sample whose calibration loop ran this much slower than the "
                        "fastest seen (0: no guard)")  # fmt: skip
    p.add_argument("--max-retakes", type=int, default=d.max_retakes)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--results", action="store_true",
                   help="run the cases (all without names), then regenerate --results-file")  # fmt: skip
    p.add_argument("--render-only", action="store_true",
                   help="with --results: render from the JSON files in --out-dir, run nothing")  # fmt: skip
    p.add_argument("--results-file", default=str(HERE / "RESULTS.md"))
    p.add_argument("--note", default=None,
                   help="a remark stored with the results and shown in RESULTS.md "
                        "(e.g. 'machine shared with other jobs')")  # fmt: skip
    return p


def _run_case(name: str, args: BenchArgs, out: Path, note: str | None) -> tuple[bool, list]:
    """Run one case, print its table, write its JSON; (False, []) if it raised (the JSON says
    so)."""
    mod = importlib.import_module(f"benchmarks.{name}")
    started = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": loadavg()}
    t0 = time.perf_counter()
    try:
        rows, error = mod.run(args), None
    except Exception:  # a broken case must not stop the others; its JSON carries the error
        rows, error = [], traceback.format_exc()
        print(error, file=sys.stderr)
    started["duration_s"] = round(time.perf_counter() - t0, 1)
    title = (
        f"{name} (medians of {args.repeats} interleaved rounds{', quick' if args.quick else ''})"
    )
    print_table(title, rows)
    write_json(out, name, args, rows, started=started, command=case_command(name, args),
               note=note, error=error)  # fmt: skip
    print(f"wrote {out}")
    return error is None, rows


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    cases = available()
    if a.list or not (a.names or a.results):
        for n in cases:
            doc = (importlib.import_module(f"benchmarks.{n}").__doc__ or "").strip().splitlines()
            print(f"{n:<20} {doc[0] if doc else ''}")
        return 0
    names = a.names or (cases if a.results else [])
    unknown = [n for n in names if n not in cases]
    if unknown:
        print(f"unknown benchmark {unknown[0]!r}; available: {', '.join(cases)}", file=sys.stderr)
        return 2
    failed, broken = [], []
    if not a.render_only:
        import torch

        threads = torch.get_num_threads()
        for name in names:
            # a case may leave torch's global intra-op thread count changed (an in-process
            # cache build sets 1): every case starts from the process default
            torch.set_num_threads(threads)
            args = BenchArgs(
                repeats=a.repeats, warmup=a.warmup, quick=a.quick,
                extra=case_options(a.set, name, cases), noise_tol=a.noise_tol,
                max_retakes=a.max_retakes,
            )  # fmt: skip
            out = json_path(a.out_dir, name, a.quick)
            ok, rows = _run_case(name, args, out, a.note)
            if not ok:
                broken.append(name)
            failed += [f"{name}: {r.case}" for r in rows if r.met is False]
    if failed:
        print("\ntargets not met in this run:\n  " + "\n  ".join(failed))
    if a.results:
        from benchmarks.report import write_results

        path = write_results(a.results_file, a.out_dir, cases, quick=a.quick)
        print(f"wrote {path}")
    if broken:
        print(f"\ncases that raised: {', '.join(broken)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
