"""``preprocess-cached`` / ``python -m torchtitan_ext.vl.preprocess``: build the packed VL cache.

Thin CLI over :func:`torchtitan_ext.vl.cache.build_cache` (see cache.py for the algorithm and
layout). With ``RANK``/``WORLD_SIZE`` set (torchrun or a job array) each rank builds its share of
shards; every rank returns once the manifest is written. ``--dataset sample`` uses the generated
sample dataset (``torchtitan_ext.vl.sample_data``).

Measured (2-core box, 2 workers, seq_len 8192, 640x480 JPEGs; benchmarks/vl_preprocess.py):
0.064-0.072 s of wall time per pack of ~20 images / 24,000 patches / 7,300 tokens at steady state
(0.15 s when the box was shared with other jobs), vs the seed's quoted 1.7 s per pack of 24 images /
29,600 patches: 19-26x, also when scaled to the seed's patch count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="preprocess-cached",
        description="Preprocess a VQA-style dataset into a packed Qwen3-VL TensorDict memmap cache.",
    )
    p.add_argument(
        "--dataset",
        required=True,
        help="local Parquet file/dir/glob, a hub dataset name, or 'sample'",
    )
    p.add_argument("--split", default="train")
    p.add_argument("--seq-len", type=int, default=8192, help="max tokens per pack")
    p.add_argument("--buffer-size", type=int, default=64, help="best-fit buffer size")
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
        default=None,
        help="input rows per shard (resume/scale-out unit; default 1024)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the cache exists")
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="decode/resize/patchify processes (default: CPU count; 0 = in-process)",
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
    from torchtitan_ext.vl.cache import DEFAULT_ROWS_PER_SHARD, CacheLockedError, build_cache

    dataset = a.dataset
    if dataset == "sample":
        from torchtitan_ext.vl.sample_data import sample_dataset_path

        dataset = str(sample_dataset_path())
    buckets = [int(x) for x in a.buckets.split(",") if x.strip()] if a.buckets else None
    workers = (os.cpu_count() or 1) if a.num_workers is None else a.num_workers
    t0 = time.perf_counter()
    try:
        path = build_cache(
            dataset=dataset,
            split=a.split,
            cache_dir=a.cache_dir,
            seq_len=a.seq_len,
            buffer_size=a.buffer_size,
            model_path=a.model_path,
            max_samples=a.max_samples,
            num_workers=workers,
            strict=a.strict,
            force=a.force,
            buckets=buckets,
            show_progress=not a.quiet,
            rows_per_shard=a.rows_per_shard or DEFAULT_ROWS_PER_SHARD,
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
