"""VL cache build: wall seconds per pack at 0 (in process), 1, 2, ... build workers, interleaved.

The question it answers is ``preprocess-cached --num-workers``'s default
(``vl.build.default_num_workers``). Each round builds the same cache (640x480 JPEG rows, COCO /
VQAv2-sized, seq_len 8192, ~20 images per pack, shards of a quarter of the rows so the pool
works on one shard while the main process packs, writes, hashes and fsyncs the previous one)
once per worker count, in an order that rotates every round, from scratch; the cache is deleted
between builds. Ratios are against 0 workers measured in the same rounds. Timings include the
pool's start-up, as a user's build does.

Options (``--set key=value``): ``workers`` (comma list, default ``0,1,...,cpu_count``), ``rows``
(default 240; quick 48).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import BenchArgs, Row, compare


def run(args: BenchArgs) -> list[Row]:
    from benchmarks.vl_preprocess import _coco_like_dataset
    from torchtitan_ext.vl.build import build_cache, default_num_workers

    n_cpu = os.cpu_count() or 1
    counts = [
        int(x) for x in args.extra.get("workers", ",".join(map(str, range(n_cpu + 1)))).split(",")
    ]
    n_rows = int(args.extra.get("rows", 48 if args.quick else 240))
    rounds = 1 if args.quick else max(2, min(args.repeats, 4))
    tmp = Path(tempfile.mkdtemp(prefix="bench_vl_workers_"))
    old = os.environ.get("TORCHTITAN_EXT_CACHE")
    os.environ["TORCHTITAN_EXT_CACHE"] = str(tmp / "home")
    try:
        data = _coco_like_dataset(tmp / "data", n_rows)
        times: dict[int, list[float]] = {w: [] for w in counts}
        packs = 0
        for r in range(rounds + 1):  # round 0 warms the page cache and the processor
            order = counts[r % len(counts) :] + counts[: r % len(counts)]
            for w in order:
                shutil.rmtree(tmp / "cache", ignore_errors=True)
                t0 = time.perf_counter()
                k = build_cache(data, "train", tmp / "cache", 8192, 64, num_workers=w,
                                show_progress=False, rows_per_shard=max(1, n_rows // 4))  # fmt: skip
                dt = time.perf_counter() - t0
                packs = json.loads((k / "metadata.json").read_text())["counts"]["packs"]
                if r:
                    times[w].append(dt / packs)
        rows = []
        for w in counts:
            xs = sorted(times[w])
            rows.append(
                Row(
                    case=f"build s/pack, {w} workers" + (" (in process)" if w == 0 else ""),
                    value=statistics.median(xs),
                    unit="s/pack",
                    higher_is_better=False,
                    samples=xs,
                    info={"packs": packs, "rows": n_rows, "cpus": n_cpu, "rounds": rounds},
                )
            )
        base = rows[counts.index(0)].case if 0 in counts else rows[0].case
        for r in rows:
            if r.case != base:
                compare(rows, r.case, base)
        default = default_num_workers()
        for r, w in zip(rows, counts, strict=True):
            if w == default:
                r.target = "default: fastest within 10%"
                r.met = r.value <= 1.1 * min(x.value for x in rows)
        return rows
    finally:
        if old is None:
            os.environ.pop("TORCHTITAN_EXT_CACHE", None)
        else:
            os.environ["TORCHTITAN_EXT_CACHE"] = old
        shutil.rmtree(tmp, ignore_errors=True)
