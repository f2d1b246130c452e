"""Shared helpers for benchmark cases.

A case is a module ``benchmarks/<name>.py`` exposing ``run(args: BenchArgs) -> list[Row]``.
Every case measures its own baseline *in the same run* and reports ratios against it, because
absolute numbers on these shared 2-core machines drift by tens of percent between runs.

    python -m benchmarks NAME [--repeats N] [--quick] [--out results/NAME.json]
    python -m benchmarks --list
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BenchArgs:
    repeats: int = 5
    """Timed repetitions per measurement; the median is reported."""
    warmup: int = 1
    """Untimed repetitions before timing (JIT, page cache, thread start-up)."""
    quick: bool = False
    """Smaller inputs: a smoke run for tests/CI, not numbers to quote."""
    extra: dict[str, str] = field(default_factory=dict)
    """Case-specific ``--set key=value`` options."""


@dataclass
class Row:
    """One measured line of a case's table."""

    case: str
    """What was measured, e.g. ``tokens/s ours``."""
    value: float
    """The median of the repeats (unit in ``unit``)."""
    unit: str
    baseline: str | None = None
    """Name of the row this one is compared against (same run)."""
    ratio: float | None = None
    """value / baseline value (or the inverse for lower-is-better units; see ``higher_is_better``)."""
    higher_is_better: bool = True
    target: str | None = None
    """The issue's target as text, e.g. ``>= 3x``; ``met`` says whether this run met it."""
    met: bool | None = None
    samples: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def median_time(
    fn: Callable[[], Any], repeats: int = 5, warmup: int = 1
) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``repeats`` runs (after ``warmup`` untimed runs)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def compare(rows: list[Row], name: str, baseline: str) -> Row:
    """Fill ``ratio`` of row ``name`` against row ``baseline`` (as 'how many times better')."""
    by = {r.case: r for r in rows}
    r, b = by[name], by[baseline]
    r.baseline = baseline
    if r.value == 0 or b.value == 0:
        r.ratio = float("inf") if r.higher_is_better else 0.0
    else:
        r.ratio = r.value / b.value if r.higher_is_better else b.value / r.value
    return r


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n== {title} ==")
    header = f"{'case':<48} {'median':>14} {'unit':<10} {'ratio':>8}  {'vs':<28} {'target':<12} met"
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        met = "" if r.met is None else ("yes" if r.met else "NO")
        print(
            f"{r.case:<48} {r.value:>14.4g} {r.unit:<10} {ratio:>8}  {r.baseline or '':<28} "
            f"{r.target or '':<12} {met}"
        )


def write_json(path: str, name: str, args: BenchArgs, rows: list[Row]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "args": asdict(args),
        "rows": [asdict(r) for r in rows],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
