"""Shared helpers for benchmark cases: rows, interleaved timing with a noise guard, machine facts.

A case is a module ``benchmarks/<name>.py`` exposing ``run(args: BenchArgs) -> list[Row]``; the
runner (``python -m benchmarks``) finds it by that function, so a new case needs no registration.

Rules every case follows (a sceptical reader checks them in ``benchmarks/RESULTS.md``):

* **Measured baselines only.** Every ratio (:func:`compare`) is against a row measured in the
  same run. Figures from elsewhere (an earlier implementation, another machine) may be quoted as
  history in the text, never as a row a ratio is taken against.
* **Equal outputs.** A baseline and the candidate produce the same result (or the row's case
  name says what differs: "uint8, not like for like", ...).
* **Interleaved repeats.** A and B are timed A B, B A, A B ... (:func:`interleave`), so a change
  of the host's load hits both; medians and min-max ranges are reported, and ratios come with
  the range of the per-round (paired) ratios.
* **Noise guard.** Each timed sample is bracketed by a fixed calibration loop; a sample whose
  calibration ran more than ``noise_tol`` slower than the fastest calibration seen (the host was
  busy with other work) is taken again, up to ``max_retakes`` times, then kept and counted as
  noisy (:class:`NoiseGuard`). Rows say how many samples were re-taken and how many stayed noisy.

    python -m benchmarks NAME [--repeats N] [--quick]
    python -m benchmarks --results          # every case, then benchmarks/RESULTS.md
    python -m benchmarks --list
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class BenchArgs:
    repeats: int = 5
    """Timed repetitions (interleaved rounds) per measurement; the median is reported."""
    warmup: int = 1
    """Untimed repetitions before timing (JIT, page cache, thread start-up)."""
    quick: bool = False
    """Smaller inputs: a smoke run for tests/CI, not numbers to quote."""
    extra: dict[str, str] = field(default_factory=dict)
    """Case-specific ``--set key=value`` options."""
    noise_tol: float = 0.25
    """Re-take a sample whose calibration loop ran this much slower than the fastest seen
    (0 disables the guard)."""
    max_retakes: int = 3
    """Re-takes per sample before it is kept and counted as noisy."""

    def guard(self, max_retakes: int | None = None) -> NoiseGuard:
        """A noise guard with this run's settings (``max_retakes`` lower for costly samples)."""
        return NoiseGuard(self.noise_tol, self.max_retakes if max_retakes is None else max_retakes)


@dataclass
class Row:
    """One measured line of a case's table."""

    case: str
    """What was measured, labelled for what it is, e.g. ``per image ours -> float32``."""
    value: float
    """The median of the samples (unit in ``unit``); NaN for a row that could not be measured
    (``note`` says why)."""
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
    note: str | None = None
    """Shown next to the row: what is not like for like, why it was skipped, ..."""
    group: str | None = None
    """Rows of one :func:`interleave` call share a group: sample k of each came from round k,
    so :func:`compare` can pair them."""
    ratio_range: tuple[float, float] | None = None
    """Min and max of the per-round ratios (paired samples of the same group)."""
    retaken: int = 0
    """Samples re-taken because the host was slow (noise guard)."""
    noisy: int = 0
    """Samples kept although the host stayed slow through every re-take."""
    guarded: bool = False
    """The samples were taken through the noise guard (so ``retaken`` / ``noisy`` mean
    something)."""

    @property
    def lo(self) -> float:
        return min(self.samples) if self.samples else self.value

    @property
    def hi(self) -> float:
        return max(self.samples) if self.samples else self.value


# ----------------------------------------------------------------------------------------------
# noise guard + interleaved timing


def _calibration_work(n: int) -> int:
    """Fixed pure-Python work (the interpreter's speed is what every case depends on)."""
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1_000_003
    return acc


class NoiseGuard:
    """Decides whether a sample was taken while the host was slow.

    Before and after each sample a fixed loop (~``calib_ms`` on a quiet host; its iteration
    count is fixed on first use) is timed. The fastest calibration seen so far is the reference
    for a quiet host; if either calibration of a sample is more than ``tol`` slower, the sample
    is re-taken (at most ``max_retakes`` times; the last one is kept and counted as noisy).
    ``tol <= 0`` disables the guard. ``calibrate`` can be replaced (tests).
    """

    def __init__(
        self,
        tol: float,
        max_retakes: int,
        calib_ms: float = 3.0,
        calibrate: Callable[[], float] | None = None,
    ) -> None:
        self.tol, self.max_retakes, self.calib_ms = tol, max_retakes, calib_ms
        self._n = 0
        self._calibrate = calibrate or self._timed_loop
        self.best = math.inf
        self.calibrations: list[float] = []

    @property
    def enabled(self) -> bool:
        return self.tol > 0

    def _timed_loop(self) -> float:
        if not self._n:  # size the loop once: ~calib_ms on this host now
            t0 = time.perf_counter()
            _calibration_work(20_000)
            dt = max(time.perf_counter() - t0, 1e-6)
            self._n = max(1000, int(20_000 * self.calib_ms / 1e3 / dt))
        t0 = time.perf_counter()
        _calibration_work(self._n)
        return time.perf_counter() - t0

    def calibrate(self) -> float:
        """Time the calibration loop once; returns its seconds and updates the reference."""
        t = self._calibrate()
        self.calibrations.append(t)
        self.best = min(self.best, t)
        return t

    def warm(self, n: int = 5) -> None:
        """A few calibrations up front, so the first samples have a reference."""
        if self.enabled:
            for _ in range(n):
                self.calibrate()

    def slow(self, *calibrations: float) -> bool:
        return self.enabled and any(c > self.best * (1 + self.tol) for c in calibrations)


@dataclass
class Series:
    """The samples of one function of an :func:`interleave` call, in round order."""

    name: str
    samples: list[float] = field(default_factory=list)
    """Seconds of wall time per call, or the number the function returned."""
    results: list[Any] = field(default_factory=list)
    """What the function returned each round (a dict of its own metrics, or None)."""
    retaken: int = 0
    noisy: int = 0
    guarded: bool = False

    def values(self, key: str) -> list[float]:
        """One metric of functions that return a dict."""
        return [float(r[key]) for r in self.results]


def interleave(
    fns: Mapping[str, Callable[[], Any]],
    rounds: int,
    warmup: int = 1,
    guard: NoiseGuard | None = None,
    rotate: bool = True,
) -> dict[str, Series]:
    """Run each function once per round, all of them in every round (A B C, B C A, C A B, ...
    with ``rotate``; A B C every round without), after ``warmup`` untimed rounds.

    A function's sample is its wall time in seconds, unless it returns a number (its own
    measurement, e.g. tokens per CPU-second or a time it took itself) or a dict (kept in
    ``results``; the sample is then the wall time). With a ``guard``, a sample taken while the
    host was slow is re-taken at once, in the same round, so samples stay paired by round.
    """
    names = list(fns)
    guarded = guard is not None and guard.enabled
    out = {n: Series(n, guarded=guarded) for n in names}
    for _ in range(warmup):
        for n in names:
            fns[n]()
    if guard is not None and guard.enabled and not guard.calibrations:
        guard.warm()
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)] if rotate else names
        for n in order:
            _sample(fns[n], out[n], guard)
    return out


def call(fn: Callable[..., Any], *a: Any, **kw: Any) -> Callable[[], None]:
    """A function for :func:`interleave` that runs ``fn(*a, **kw)`` and drops its result, so
    that its wall time is the sample (whatever ``fn`` returns)."""

    def go() -> None:
        fn(*a, **kw)

    return go


def _sample(fn: Callable[[], Any], s: Series, guard: NoiseGuard | None) -> None:
    attempts = 0
    while True:
        c0 = guard.calibrate() if guard is not None and guard.enabled else 0.0
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        c1 = guard.calibrate() if guard is not None and guard.enabled else 0.0
        if guard is None or not guard.slow(c0, c1):
            break
        if attempts >= guard.max_retakes:
            s.noisy += 1
            break
        attempts += 1
        s.retaken += 1
    is_number = isinstance(res, (int, float)) and not isinstance(res, bool)
    s.samples.append(float(res) if is_number else dt)
    s.results.append(res)


def row_from(
    case: str,
    series: Series,
    unit: str,
    scale: float = 1.0,
    *,
    key: str | None = None,
    group: str | None = None,
    higher_is_better: bool = False,
    **kw: Any,
) -> Row:
    """A row of the median of ``series`` (or of its ``key`` metric), times ``scale``."""
    xs = [x * scale for x in (series.values(key) if key else series.samples)]
    return Row(
        case=case,
        value=statistics.median(xs) if xs else float("nan"),
        unit=unit,
        higher_is_better=higher_is_better,
        samples=xs,
        group=group,
        retaken=series.retaken,
        noisy=series.noisy,
        guarded=series.guarded,
        **kw,
    )


def median_time(
    fn: Callable[[], Any], repeats: int = 5, warmup: int = 1, guard: NoiseGuard | None = None
) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` over ``repeats`` runs (after ``warmup`` untimed runs), for
    a single measurement with nothing to interleave it with."""
    s = interleave({"fn": fn}, repeats, warmup, guard)["fn"]
    return statistics.median(s.samples), s.samples


def compare(rows: list[Row], name: str, baseline: str) -> Row:
    """Fill ``ratio`` of row ``name`` against row ``baseline`` (as 'how many times better'), and
    ``ratio_range`` from the per-round ratios when both rows come from one interleaved run.
    The baseline must be a row of this run (never a quoted figure)."""
    by = {r.case: r for r in rows}
    r, b = by[name], by[baseline]
    r.baseline = baseline

    def better(x: float, base: float) -> float:
        if x == 0 or base == 0:
            return float("inf") if r.higher_is_better else 0.0
        return x / base if r.higher_is_better else base / x

    r.ratio = better(r.value, b.value)
    if r.group is not None and r.group == b.group and len(r.samples) == len(b.samples) > 1:
        paired = [better(x, y) for x, y in zip(r.samples, b.samples, strict=True)]
        r.ratio_range = (min(paired), max(paired))
    return r


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def fmt(x: float) -> str:
    """A number with 3-4 significant digits (no exponent for the usual ranges)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x == 0 or math.isinf(x):
        return str(x)
    a = abs(x)
    if a >= 1e5:
        return f"{x / 1e6:.3g} M"
    if a >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def fmt_range(xs: list[float]) -> str:
    """min-max of several samples ("a to b" when a dash would read as a minus sign); else ""."""
    if len(xs) < 2:
        return ""
    lo, hi = min(xs), max(xs)
    return f"{fmt(lo)} to {fmt(hi)}" if lo < 0 or hi < 0 else f"{fmt(lo)}-{fmt(hi)}"


def fmt_ratio(ratio: float | None, ratio_range: Any = None) -> str:
    """``2.31x (2.05-2.60)``: the ratio of medians and the range of the per-round ratios."""
    if ratio is None or math.isnan(ratio):
        return ""
    s = f"{ratio:.2f}x"
    if ratio_range:
        s += f" ({ratio_range[0]:.2f}-{ratio_range[1]:.2f})"
    return s


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n== {title} ==")
    header = (
        f"{'case':<58} {'median':>10} {'range':>19} {'unit':<10} {'ratio (paired range)':>22}"
        f"  {'vs':<40} {'target':<12} met"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        met = "" if r.met is None else ("yes" if r.met else "NO")
        rng = fmt_range(r.samples)
        print(
            f"{r.case:<58} {fmt(r.value):>10} {rng:>19} {r.unit:<10} {fmt_ratio(r.ratio, r.ratio_range):>22}  "
            f"{r.baseline or '':<40} {r.target or '':<12} {met}"
        )
        extra = []
        if r.retaken or r.noisy:
            extra.append(f"noise guard: {r.retaken} re-taken, {r.noisy} kept noisy")
        if r.note:
            extra.append(r.note)
        if extra:
            print(f"    ({'; '.join(extra)})")


# ----------------------------------------------------------------------------------------------
# page cache (cold reads)


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache: ``fsync`` then
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file. Only this run's files are touched (unlike
    ``/proc/sys/vm/drop_caches``, which would empty the cache of every job on the machine).
    Pages still mapped by a live memory map stay: close the maps first. Check with
    :func:`resident_fraction`."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[Path]) -> float:
    """Share of these files' pages in the page cache (``mincore`` on a fresh read-only map)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for p in paths:
        size = os.path.getsize(p)
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            n = -(-size // page)
            vec = ctypes.create_string_buffer(n)
            try:
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {p}")
            finally:
                libc.munmap(addr, size)
            resident += sum(b & 1 for b in vec.raw)
            total += n
        finally:
            os.close(fd)
    return resident / total if total else 0.0


# ----------------------------------------------------------------------------------------------
# machine facts and JSON


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip()


def machine() -> dict[str, Any]:
    """CPU model and cores, memory, software versions: the facts a reader needs to compare."""
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    versions = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "tokenizers", "pyarrow", "numpy"):
        m = sys.modules.get(mod)
        if m is not None:
            versions[mod] = getattr(m, "__version__", "?")
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "memory_gib": mem,
        "platform": platform.platform(),
        "versions": versions,
    }


def commit() -> dict[str, Any]:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "--short=10", "HEAD"), "dirty": bool(status)}


def write_json(
    path: str | os.PathLike,
    name: str,
    args: BenchArgs,
    rows: list[Row],
    *,
    started: dict[str, Any] | None = None,
    command: str | None = None,
    note: str | None = None,
    error: str | None = None,
) -> None:
    """One case's results with the machine, date, commit and command that produced them."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    started = started or {}
    doc = {
        "benchmark": name,
        "time": started.get("time") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "duration_s": started.get("duration_s"),
        "machine": machine(),
        "git": commit(),
        "command": command or "python -m benchmarks " + shlex.join(sys.argv[1:]),
        "note": note,
        "error": error,
        "loadavg": {"before": started.get("loadavg"), "after": loadavg()},
        "args": asdict(args),
        "rows": [asdict(r) for r in rows],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)


def timed_steps(
    it: Any, steps: int, step: Callable[[float], None], step_s: float
) -> tuple[list[float], float]:
    """The training loop of the loader benchmarks: ``steps`` times ``next(it)`` (its latency
    recorded) then ``step(step_s)`` (the "GPU step"); returns (latencies, total seconds).

    Garbage collection as torchtitan's trainer does it (GarbageCollection, training.gc_freq):
    automatic GC off, a generation-1 collection every 50 steps. With automatic GC on, a
    generation-2 pass (~65 ms here: torch & co. hold ~10^6 tracked objects) can start in any
    thread at any time, including inside ``next()``."""
    lat: list[float] = []
    gc.collect(1)
    gc.disable()
    try:
        t_start = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            next(it)
            lat.append(time.perf_counter() - t0)
            if i % 50 == 49:
                gc.collect(1)
            step(step_s)
        return lat, time.perf_counter() - t_start
    finally:
        gc.enable()
