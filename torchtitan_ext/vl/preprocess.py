"""``preprocess-cached`` / ``python -m torchtitan_ext.vl.preprocess``: build the packed VL cache.

Thin CLI over :func:`torchtitan_ext.vl.build.build_cache` (see build.py for the algorithm and
cache.py for the layout). With ``RANK``/``WORLD_SIZE`` set (torchrun or a job array) each rank
builds its share of shards; every rank returns once the manifest is written. ``--dataset sample``
uses the generated sample dataset (``torchtitan_ext.vl.sample_data``). Every default comes from
:class:`~torchtitan_ext.vl.build.BuildConfig`.

Measured (2-core box, 2 workers, seq_len 8192, 640x480 JPEGs; benchmarks/vl_preprocess.py):
0.064-0.072 s of wall time per pack of ~20 images / 24,000 patches / 7,300 tokens at steady state
(0.15 s when the box was shared with other jobs). ``--num-workers``: see
:func:`~torchtitan_ext.vl.build.default_num_workers`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields


def _parser() -> argparse.ArgumentParser:
    from torchtitan_ext.vl.build import BuildConfig, default_num_workers
    from torchtitan_ext.vl.sources import FINGERPRINTS

    d = {f.name: f.default for f in fields(BuildConfig)}
    p = argparse.ArgumentParser(
        prog="preprocess-cached",
        description="Preprocess a VQA-style dataset into a packed Qwen3-VL TensorDict memmap cache.",
    )
    p.add_argument(
        "--dataset",
        required=True,
        help="local Parquet file/dir/glob, a hub dataset name, or 'sample'",
    )
    p.add_argument("--split", default=d["split"])
    p.add_argument("--seq-len", type=int, default=d["seq_len"], help="max tokens per pack")
    p.add_argument("--buffer-size", type=int, default=d["buffer_size"], help="best-fit buffer")
    p.add_argument(
        "--buckets",
        default=None,
        help="comma-separated padded lengths (<= seq-len); default: pad to seq-len",
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="Qwen3-VL processor dir (default: the offline processor, built locally)",
    )
    p.add_argument("--cache-dir", default="preprocessed_cache")
    p.add_argument("--max-samples", type=int, default=None, help="read at most N input rows")
    p.add_argument(
        "--rows-per-shard",
        type=int,
        default=d["rows_per_shard"],
        help=f"input rows per shard (resume/scale-out unit; default {d['rows_per_shard']})",
    )
    p.add_argument(
        "--exif-transpose",
        action=argparse.BooleanOptionalAction,
        default=d["exif_transpose"],
        help="turn photos upright by their EXIF orientation, as HF datasets does (part of the key)",
    )
    p.add_argument(
        "--fingerprint",
        choices=FINGERPRINTS,
        default=d["fingerprint"],
        help="'full': hash every byte of the source files for the cache key (remembered per file "
        "by size+mtime); 'quick': size + first/last MiB only (misses same-size edits mid-file)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the cache exists")
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help=f"decode/resize/patchify processes (default here: {default_num_workers()}; "
        "0 = in the main process)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="fail on the first bad row (naming it) instead of counting a skip",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    from torchtitan_ext.vl.build import CacheLockedError, build_cache, default_num_workers

    dataset = a.dataset
    if dataset == "sample":
        from torchtitan_ext.vl.sample_data import sample_dataset_path

        dataset = str(sample_dataset_path())
    buckets = [int(x) for x in a.buckets.split(",") if x.strip()] if a.buckets else None
    workers = default_num_workers() if a.num_workers is None else a.num_workers
    t0 = time.perf_counter()
    try:
        path = build_cache(
            dataset,
            a.split,
            a.cache_dir,
            a.seq_len,
            a.buffer_size,
            num_workers=workers,
            strict=a.strict,
            force=a.force,
            show_progress=not a.quiet,
            model_path=a.model_path,
            max_samples=a.max_samples,
            buckets=buckets,
            rows_per_shard=a.rows_per_shard,
            exif_transpose=a.exif_transpose,
            fingerprint=a.fingerprint,
        )
    except (CacheLockedError, FileNotFoundError, ValueError) as e:
        print(f"preprocess-cached: error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    with open(os.path.join(path, "packing_stats.json")) as f:
        st = json.load(f)
    print(f"cache: {path}")
    print(
        f"packs {st['packs']}  samples {st['samples_packed']}  skipped {st['skipped_total']} "
        f"{st['skipped']}  fill {st['fill_pct']['mean']}%  ({dt:.1f}s this run)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
