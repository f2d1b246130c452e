"""Committing a packed VL cache (format: ``vl/format.py``) whose shards ``vl/write.py`` wrote.

:func:`write_manifest` reads every shard's ``stats.json``, writes ``packing_stats.json`` then
``metadata.json`` (the cache's commit marker), each by an atomic rename, after checking the
result with the reader's own checks (``vl/cache.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_ext.data.cachedir import sha256_file
from torchtitan_ext.vl.cache import VLCache
from torchtitan_ext.vl.format import (
    COLUMNS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PACKING_STATS,
    SHARD_COUNTS,
    SHARD_META,
    SHARD_STATS,
    SHARDS,
    CacheError,
    manifest_digest,
    shard_meta_template,
)
from torchtitan_ext.vl.write import SKIP_EXAMPLES, fsync_dir, write_json_atomic


def _dist(xs: Sequence[float]) -> dict[str, float]:
    if not len(xs):
        return {"mean": 0.0, "min": 0.0, "p50": 0.0, "max": 0.0}
    a = np.asarray(xs, dtype=np.float64)
    return {
        "mean": round(float(a.mean()), 4),
        "min": round(float(a.min()), 4),
        "p50": round(float(np.median(a)), 4),
        "max": round(float(a.max()), 4),
    }


_TOTALS = ("packs", "samples", "tokens", "padded_tokens", "images", "patches", "videos",
           "video_patches", "text_only", "rows_read", "truncated", "turns_dropped")  # fmt: skip


def _gather(kdir: Path, ranges: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """Every shard's stats.json folded: totals, skips, per-pack lists, shard docs, file records."""
    g: dict[str, Any] = {
        "tot": Counter(), "skipped": Counter(), "rows": {}, "errors": {}, "fill": [],
        "spp": [], "ipp": [], "vpp": [], "plen": [], "shards": [], "files": {},
    }  # fmt: skip
    for k, (a, b) in enumerate(ranges):
        d = kdir / SHARDS / f"{k:05d}"
        st = json.loads((d / SHARD_STATS).read_text())
        for name, rec in st["files"].items():
            g["files"][f"{SHARDS}/{k:05d}/{name}"] = rec
        g["files"][f"{SHARDS}/{k:05d}/{SHARD_STATS}"] = {
            "size": (d / SHARD_STATS).stat().st_size,
            "sha256": sha256_file(d / SHARD_STATS),
        }
        for c in _TOTALS:
            g["tot"][c] += st[c]
        g["skipped"].update(st["skipped"])
        for r, rows in st["skipped_rows"].items():
            g["rows"][r] = (g["rows"].get(r, []) + rows)[:SKIP_EXAMPLES]
        for r, types in st["skipped_errors"].items():
            g["errors"].setdefault(r, Counter()).update(types)
        g["fill"] += st["pack_fill"]
        g["spp"] += st["pack_samples"]
        g["ipp"] += st["pack_images"]
        g["vpp"] += st["pack_videos"]
        g["plen"] += st["pack_len"]
        shard = {"name": f"{k:05d}", "rows": [a, b]}
        g["shards"].append(shard | {c: st[c] for c in SHARD_COUNTS})
    return g


def _packing_stats(g: dict[str, Any], kdir: Path) -> dict[str, Any]:
    tot, skipped = g["tot"], g["skipped"]
    n_skip = sum(skipped.values())
    if tot["rows_read"] != tot["samples"] + n_skip:
        raise RuntimeError(
            f"{kdir}: counts do not reconcile: read {tot['rows_read']} != packed "
            f"{tot['samples']} + skipped {n_skip}"
        )
    return {
        "packs": tot["packs"],
        "rows_read": tot["rows_read"],
        "samples_packed": tot["samples"],
        "samples_truncated": tot["truncated"],
        "samples_text_only": tot["text_only"],
        "turns_dropped": tot["turns_dropped"],
        "skipped_total": n_skip,
        "skipped": dict(sorted(skipped.items())),
        "skipped_example_rows": dict(sorted(g["rows"].items())),
        "skipped_error_types": {r: dict(sorted(c.items())) for r, c in sorted(g["errors"].items())},
        "reconciles": True,
        "samples_per_pack": _dist(g["spp"]),
        "images_per_pack": _dist(g["ipp"]),
        "videos_per_pack": _dist(g["vpp"]),
        "fill_pct": {k: round(v * 100, 2) for k, v in _dist(g["fill"]).items()},
        "tokens": tot["tokens"],
        "padded_tokens": tot["padded_tokens"],
        "images": tot["images"],
        "patches": tot["patches"],
        "videos": tot["videos"],
        "video_patches": tot["video_patches"],
        "bucket_counts": {str(b): c for b, c in sorted(Counter(g["plen"]).items())},
    }


def write_manifest(
    kdir: Path, ranges: Sequence[tuple[int, int]], identity: dict[str, Any]
) -> dict[str, Any]:
    """Write ``packing_stats.json`` then ``metadata.json`` for a cache whose shards are complete.

    ``identity``: the manifest fields that describe what was built (``key``, ``config``,
    ``dataset_fingerprint``, ``layout``, ``processor``, ``image_params``, ``special_tokens``,
    ``versions``). The manifest is checked with the reader's checks before it is committed.
    """
    g = _gather(kdir, ranges)
    stats = _packing_stats(g, kdir)
    write_json_atomic(kdir / PACKING_STATS, stats)
    files = dict(g["files"])
    files[PACKING_STATS] = {
        "size": (kdir / PACKING_STATS).stat().st_size,
        "sha256": sha256_file(kdir / PACKING_STATS),
    }
    first = kdir / SHARDS / "00000" / SHARD_META
    template = shard_meta_template(json.loads(first.read_text())) if ranges else {}
    tot = g["tot"]
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        **identity,
        "counts": {
            "packs": tot["packs"],
            "samples": tot["samples"],
            "rows_read": tot["rows_read"],
            "skipped": stats["skipped_total"],
            "tokens": tot["tokens"],
            "padded_tokens": tot["padded_tokens"],
            "images": tot["images"],
            "patches": tot["patches"],
            "videos": tot["videos"],
            "video_patches": tot["video_patches"],
        },
        "storage": {
            **{c.name: f"{c.dtype} {_shape_doc(c)}" for c in COLUMNS},
            "position_ids": "computed at read (not stored)",
            "padding": "added at read to pack_len",
        },
        "shard_meta": template,
        "shards": g["shards"],
        "files": dict(sorted(files.items())),
    }
    meta["digest"] = manifest_digest(meta)
    cache = VLCache(kdir, meta)
    try:
        for problem in cache.layout_problems(writing=True):
            raise CacheError(problem)
        cache.pack_lengths()  # maps every shard: checks every shard's index
    except CacheError as e:
        raise RuntimeError(f"refusing to commit a cache that fails its own checks: {e}") from None
    write_json_atomic(kdir / MANIFEST, meta)
    fsync_dir(kdir)
    return meta


def _shape_doc(c) -> str:
    rows = {"packs": "K", "samples": "S", "tokens": "T", "images": "I", "patches": "P",
            "videos": "V", "video_patches": "VP"}[c.count]  # fmt: skip
    rows += "+1" if c.plus_one else ""
    width = {-1: "3*patch^2", -2: "3*temporal_patch*patch^2"}.get(c.width, str(c.width))
    return f"[{rows}, {width}]" if c.width else f"[{rows}]"
