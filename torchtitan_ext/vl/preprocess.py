"""``preprocess-cached`` / ``python -m torchtitan_ext.vl.preprocess``: build the VL sample store.

Thin CLI over :func:`torchtitan_ext.vl.build.build_cache` (see build.py for the algorithm and
cache.py for the layout). It builds the *sample store* (``vl/plan.py``: every image processed
once, whatever the pack length); ``--seq-len`` / ``--buffer-size`` / ``--buckets`` are the plan's
options: the plan is computed from the stored lengths and its stats printed (a new value plans
the same store again, in seconds). ``--packed`` builds a packed cache instead
(packs fixed at build time; its key holds the plan options). With ``RANK``/``WORLD_SIZE`` set (torchrun or a job array) each rank
builds its share of shards; every rank returns once the manifest is written. ``--dataset sample``
and ``--dataset sample_chat`` use the generated sample datasets (``torchtitan_ext.vl.sample_data``).
Every option is a :class:`~torchtitan_ext.vl.build.BuildConfig` field of the same name (its default
comes from there and it reaches the build by name); ``--format`` and ``--<role>-column`` choose the
row layout (``vl/layouts.py``).

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
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from torchtitan_ext.vl.build import BuildConfig

    d = {f.name: f.default for f in fields(BuildConfig)}
    p = argparse.ArgumentParser(
        prog="preprocess-cached",
        description="Preprocess a VL dataset (VQA rows or chat conversations) into a Qwen3-VL "
        "sample store (TensorDict memmaps) and print the plan of --seq-len/--buffer-size/--buckets.",
    )
    _source_args(p, d)
    _cache_args(p, d)
    _run_args(p)
    return p


def _source_args(p: argparse.ArgumentParser, d: dict) -> None:
    """Which rows, read how: the dataset, its split, its row layout and columns."""
    from torchtitan_ext.vl.layouts import COLUMN_ROLES, FORMATS

    p.add_argument(
        "--dataset",
        required=True,
        help="local Parquet file/dir/glob, a hub dataset name, 'sample' (VQA), 'sample_chat' or "
        "'sample_video'",
    )
    p.add_argument("--split", default=d["split"])
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=d["format"],
        help="row layout: vqa (image/question/answer), messages (HF chat), llava "
        "(conversations with <image>), cauldron (images + texts); auto: detected from the columns",
    )
    for role in COLUMN_ROLES:
        p.add_argument(
            f"--{role}-column",
            default=None,
            metavar="NAME",
            help=f"the {role} column (overrides detection)",
        )
    p.add_argument(
        "--truncate",
        action="store_true",
        default=d["truncate"],
        help="fit a sample longer than --seq-len by dropping whole trailing turns (cut after an "
        "assistant turn); default: skip it as too_long",
    )


def _cache_args(p: argparse.ArgumentParser, d: dict) -> None:
    """The rest of the cache key (packing, processor, images, fingerprint) and where it goes."""
    from torchtitan_ext.vl.sources import FINGERPRINTS

    p.add_argument(
        "--seq-len",
        type=int,
        default=d["seq_len"],
        help="max tokens per pack (the plan's; with --truncate also the store's cut)",
    )
    p.add_argument(
        "--buffer-size", type=int, default=d["buffer_size"], help="best-fit buffer (the plan's)"
    )
    p.add_argument(
        "--buckets",
        type=buckets_arg,
        default=None,
        help="comma-separated padded lengths (<= seq-len; the plan's); default: pad to seq-len",
    )
    p.add_argument("--packed", action="store_true",
                   help="build a packed cache (packs fixed at build time) instead "
                   "of the sample store")  # fmt: skip
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
    _video_args(p, d)
    p.add_argument(
        "--fingerprint",
        choices=FINGERPRINTS,
        default=d["fingerprint"],
        help="'full': hash every byte of the source files for the cache key (remembered per file "
        "by size+mtime); 'quick': size + first/last MiB only (misses same-size edits mid-file)",
    )


def _video_args(p: argparse.ArgumentParser, d: dict) -> None:
    """The video knobs (``BuildConfig.video_*``, part of the key): one flag each."""
    from torchtitan_ext.vl.build_config import VIDEO_CONFIG_FILE, VIDEO_OPTIONS
    from torchtitan_ext.vl.video import VideoOptions

    what = {
        "video_fps": "frames sampled per second of video",
        "video_min_frames": "sample at least this many frames of a video",
        "video_max_frames": "sample at most this many frames of a video",
        "video_min_pixels": "pixel budget floor of a video's sampled frames together",
        "video_max_pixels": "pixel budget of a video's sampled frames together",
        "video_cap_pixels_per_frame": "qwen-vl-utils' per-frame pixel cap",
        "video_max_tokens": "the per-frame cap's token ceiling",
    }
    base = VideoOptions()
    for name, field in VIDEO_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        fallback = getattr(base, field)
        text = (f"{what[name]} (default: the processor's {VIDEO_CONFIG_FILE}, else "
                f"{fallback}; part of the key)")  # fmt: skip
        if isinstance(fallback, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=d[name], help=text)
        else:
            p.add_argument(flag, type=type(fallback), default=d[name], help=text)


def _count(text: str) -> int:
    """An integer >= 0 (argparse's type: anything else is a usage error, exit code 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _run_args(p: argparse.ArgumentParser) -> None:
    """How this build runs (not part of the key)."""
    from torchtitan_ext.vl.build import default_num_workers

    p.add_argument("--force", action="store_true", help="rebuild even if the cache exists")
    p.add_argument(
        "--num-workers",
        type=_count,
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


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    from torchtitan_ext.vl.build import (
        OPTION_NAMES,
        CacheLockedError,
        build_cache,
        default_num_workers,
    )
    from torchtitan_ext.vl.pack_source import resolve_dataset

    bad_dir = _cache_dir_error(a.cache_dir)
    if bad_dir:
        print(f"preprocess-cached: error: --cache-dir {a.cache_dir}: {bad_dir}", file=sys.stderr)
        return 2
    workers = default_num_workers() if a.num_workers is None else a.num_workers
    options = {n: getattr(a, n) for n in OPTION_NAMES if n not in ("seq_len", "buffer_size")
               and hasattr(a, n)}  # fmt: skip
    t0 = time.perf_counter()
    try:
        path = build_cache(
            resolve_dataset(a.dataset),
            a.split,
            a.cache_dir,
            a.seq_len,
            a.buffer_size,
            num_workers=workers,
            strict=a.strict,
            force=a.force,
            show_progress=not a.quiet,
            store=not a.packed,
            **options,
        )
    except (CacheLockedError, FileNotFoundError, ValueError) as e:
        print(f"preprocess-cached: error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    with open(os.path.join(path, "packing_stats.json")) as f:
        st = json.load(f)
    with open(os.path.join(path, "metadata.json")) as f:
        lay = json.load(f)["layout"]
    cols = ", ".join(f"{r}={c!r}" for r, c in lay["columns"].items() if c is not None)
    how = "detected" if a.format == "auto" else "as asked"
    print(f"cache: {path}")
    print(f"row layout {lay['layout']} ({how}) from columns {cols}")
    print(f"{lay['layout']} samples: {st['samples_packed']} kept, {st['samples_text_only']} "
          f"text-only; {st['images']} images, {st['videos']} videos")  # fmt: skip
    skipped = dict(st["skipped"])
    if a.packed:
        packs, samples, fill = st["packs"], st["samples_packed"], st["fill_pct"]["mean"]
    else:
        plan = _plan_stats(path, a)
        print(f"sample store: {st['samples_packed']} samples, {st['tokens']} tokens, "
              f"{st['images']} images ({dt:.1f}s this run)")  # fmt: skip
        if plan["too_long"]:
            skipped["too_long"] = skipped.get("too_long", 0) + plan["too_long"]
        packs, samples, fill = plan["packs"], plan["samples"], plan["fill_pct"]
        print(f"plan seq_len {plan['seq_len']} buffer {plan['buffer_size']} buckets "
              f"{plan['buckets']}: {json.dumps(plan['bucket_counts'])}")  # fmt: skip
    n_skip = sum(skipped.values())
    print(f"packs {packs}  samples {samples}  skipped {n_skip} {skipped}  fill {fill}%  "
          f"({dt:.1f}s this run)")  # fmt: skip
    if not packs:  # a cache no loader can read: the build did not do its job
        print(
            f"preprocess-cached: error: no usable rows in {a.dataset} ({a.split}): "
            f"{n_skip} skipped {skipped}; the cache at {path} holds no packs",
            file=sys.stderr,
        )
        return 2
    return 0


def buckets_arg(text: str) -> list[int]:
    """``--buckets`` (here and in inspect-cache): comma-separated token counts; argparse turns
    the error into one usage line and exit code 2."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated token counts, e.g. 512,768"
        ) from None


def _cache_dir_error(cache_dir: str | None) -> str | None:
    """Why ``--cache-dir`` cannot hold a cache, or None: checked before the data is
    fingerprinted (nothing is created here; the build makes the missing directories)."""
    if cache_dir is None:
        return None
    path = Path(cache_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def _plan_stats(path, a: argparse.Namespace) -> dict:
    """The stats of the plan of ``--seq-len`` / ``--buffer-size`` / ``--buckets`` over the
    store at ``path`` (computed from the stored lengths, nothing kept)."""
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    return PlannedStore.open(
        path, PlanOptions.make(a.seq_len, a.buffer_size, a.buckets)
    ).plan.stats()


if __name__ == "__main__":
    sys.exit(main())
