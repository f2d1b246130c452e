"""``inspect-cache`` / ``python -m torchtitan_ext.vl.inspect``: summarise, verify, render a VL cache.

The summary opens the cache as training does (``VLCache.open``: manifest digest, file sizes,
shard ``meta.json``; no tensor data) and reads packing_stats.json after checking its sha256:
packs, samples/pack, tokens, fill %, images, patches, bytes per pack and the ratio to a float32
layout (pixel_values float32 [N, 1536], input_ids/labels int64, position_ids int64 [4, L],
image_grid_thw int64). ``--verify`` also re-hashes every file (sha256; ~1 GB/s) and checks every
shard's index; ``--render PACK OUT.png`` draws one pack (render.py; a pack's videos as frame
strips, video_render.py).

A sample store (``vl/plan.py``; what ``preprocess-cached`` builds) is summarised the same way, its
"packs" being its samples; with ``--seq-len`` (and ``--buffer-size``, ``--buckets``) the plan of
those options is computed from the stored lengths and its stats are shown (``plan``), and
``--render`` draws a pack of that plan.

Exit status: 0 when everything checked is intact; 2 with one line on stderr naming the file and
what is wrong when the cache is damaged (or is not a cache). Nothing is written to the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from torchtitan_ext.vl.cache import CacheError, VLCache, resolve_cache_dir, verify_cache
from torchtitan_ext.vl.format import PACKING_STATS
from torchtitan_ext.vl.preprocess import buckets_arg


def float32_bytes(patches: int, padded_tokens: int, images: int) -> int:
    """Bytes of the same packs as float32 pixels, int64 text and 4 position rows."""
    return patches * 1536 * 4 + padded_tokens * (8 + 8 + 4 * 8) + images * 3 * 8


def packing_stats(cache: VLCache) -> dict[str, Any]:
    """packing_stats.json of an opened cache, checked against its recorded sha256 first."""
    f = cache.path / PACKING_STATS
    data = f.read_bytes()  # present with the recorded size: VLCache.open checked that
    if hashlib.sha256(data).hexdigest() != cache.metadata["files"][PACKING_STATS]["sha256"]:
        raise CacheError(f"{f}: sha256 mismatch (content changed, size unchanged)")
    st = json.loads(data)
    if not isinstance(st, dict):
        raise CacheError(f"{f}: not a JSON object")
    return st


def summary(path: str | Path) -> dict[str, Any]:
    """The numbers of the table; raises CacheError when the cache is damaged."""
    p = Path(path)
    cache = VLCache.open(p)
    meta = cache.metadata
    st = packing_stats(cache)
    c = meta["counts"]
    stored = sum(f["size"] for f in meta["files"].values())
    pixel_bytes = sum(f["size"] for k, f in meta["files"].items() if k.endswith("pixels.memmap"))
    f32 = float32_bytes(c["patches"], c["padded_tokens"], c["images"])
    f32 += c.get("video_patches", 0) * 1536 * 4 + c.get("videos", 0) * 3 * 8
    packs = max(c["packs"], 1)
    return {
        "path": str(p),
        "store": cache.is_store,
        "key": meta["key"],
        "config": meta["config"],
        "layout": meta["layout"],
        "samples_truncated": st.get("samples_truncated", 0),
        "packs": c["packs"],
        "rows_read": c["rows_read"],
        "samples": c["samples"],
        "skipped": st["skipped"],
        "samples_per_pack": st["samples_per_pack"],
        "images_per_pack": st["images_per_pack"],
        "fill_pct": st["fill_pct"],
        "bucket_counts": st["bucket_counts"],
        "tokens": c["tokens"],
        "padded_tokens": c["padded_tokens"],
        "images": c["images"],
        "patches": c["patches"],
        "videos": c.get("videos", 0),
        "video_patches": c.get("video_patches", 0),
        "videos_per_pack": st.get("videos_per_pack", {"mean": 0.0}),
        "samples_text_only": st.get("samples_text_only", 0),
        "bytes_total": stored,
        "bytes_per_pack": stored / packs,
        "pixel_bytes_per_pack": pixel_bytes / packs,
        "float32_bytes_per_pack": f32 / packs,
        "ratio_vs_float32": stored / f32 if f32 else 0.0,
        "versions": meta["versions"],
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f}"


def _layout_text(layout: dict[str, Any]) -> str:
    cols = ", ".join(f"{r}={c}" for r, c in layout.get("columns", {}).items() if c is not None)
    return f"{layout.get('layout', '?')} ({cols})"


def format_table(s: dict[str, Any]) -> str:
    spp, ipp, fill = s["samples_per_pack"], s["images_per_pack"], s["fill_pct"]
    cfg = s["config"]
    plan_opts = (
        ("kind", "sample store: one unpadded sample per entry (packs are planned at load)")
        if s.get("store")
        else ("seq_len / buffer / buckets",
              f"{cfg['seq_len']} / {cfg['buffer_size']} / {cfg['buckets']}")
    )  # fmt: skip
    rows = [
        ("cache", s["path"]),
        ("key", s["key"][:16]),
        plan_opts,
        ("row layout", _layout_text(s["layout"])),
        ("packs", f"{s['packs']}"),
        (
            "rows read / packed / skipped",
            f"{s['rows_read']} / {s['samples']} / {sum(s['skipped'].values())} {s['skipped']}"
            + (f" ({s['samples_truncated']} truncated)" if s["samples_truncated"] else ""),
        ),
        (
            "samples per pack (mean/min/max)",
            f"{spp['mean']:.2f} / {spp['min']:.0f} / {spp['max']:.0f}",
        ),
        ("tokens (content / padded)", f"{s['tokens']} / {s['padded_tokens']}"),
        (
            "fill % (mean/min/p50/max)",
            f"{fill['mean']:.1f} / {fill['min']:.1f} / {fill['p50']:.1f} / {fill['max']:.1f}",
        ),
        ("bucket counts", json.dumps(s["bucket_counts"])),
        ("images (per pack mean)", f"{s['images']} ({ipp['mean']:.2f})"),
        ("patches (per pack mean)", f"{s['patches']} ({s['patches'] / max(s['packs'], 1):.0f})"),
        *_video_rows(s),
        (
            "bytes per pack (pixels)",
            f"{_fmt_bytes(s['bytes_per_pack'])} ({_fmt_bytes(s['pixel_bytes_per_pack'])})",
        ),
        ("float32 layout bytes per pack", _fmt_bytes(s["float32_bytes_per_pack"])),
        (
            "ratio vs float32",
            f"{r:.4f} (1/{1 / r:.2f})" if (r := s["ratio_vs_float32"]) else "n/a (no packs)",
        ),
        ("total on disk", _fmt_bytes(s["bytes_total"])),
    ]
    if "plan" in s:
        pl = s["plan"]
        rows += [
            ("plan: seq_len / buffer / buckets",
             f"{pl['seq_len']} / {pl['buffer_size']} / {pl['buckets']}"),
            ("plan: packs / samples / too_long", f"{pl['packs']} / {pl['samples']} / "
                                                 f"{pl['too_long']}"),
            ("plan: samples per pack, fill %", f"{pl['samples_per_pack']:.2f}, {pl['fill_pct']}"),
            ("plan: bucket counts", json.dumps(pl["bucket_counts"])),
        ]  # fmt: skip
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _video_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's video and text-only rows, only when there is something to count (a table
    of an image-only cache is what it was)."""
    rows = []
    if s["videos"]:
        vpp, n = s["videos_per_pack"], max(s["packs"], 1)
        rows += [("videos (per pack mean)", f"{s['videos']} ({vpp['mean']:.2f})"),
                 ("video patches (per pack mean)",
                  f"{s['video_patches']} ({s['video_patches'] / n:.0f})")]  # fmt: skip
    if s["samples_text_only"]:
        rows.append(("text-only samples", str(s["samples_text_only"])))
    return rows


def _fail(what: str) -> int:
    print(f"inspect-cache: error: {' '.join(what.splitlines())}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="inspect-cache", description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", required=True, help="a cache key directory (or its parent)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument(
        "--verify",
        action="store_true",
        help="also hash every file and check every shard's index; exit 2 naming what is wrong",
    )
    ap.add_argument(
        "--render",
        nargs=2,
        metavar=("PACK", "OUT_PNG"),
        help="draw pack PACK (image thumbnails, video frames, a token strip per sample) to OUT_PNG",
    )
    ap.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="a sample store: show the plan of this pack length (and render its packs)",
    )
    ap.add_argument("--buffer-size", type=int, default=64, help="the plan's best-fit buffer")
    ap.add_argument(
        "--buckets",
        type=buckets_arg,
        default=None,
        help="the plan's padded lengths, e.g. 4096,6144",
    )
    a = ap.parse_args(argv)
    try:
        path = resolve_cache_dir(a.cache_dir)
    except (OSError, ValueError) as e:
        return _fail(str(e))
    try:
        s = summary(path)
    except CacheError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e.filename or path}: {e.strerror or e}")
    except (KeyError, TypeError, ValueError) as e:  # a sound digest over foreign content
        return _fail(f"{path / PACKING_STATS}: unexpected content ({e!r})")
    planned = None
    if a.seq_len is not None and s["store"]:
        from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

        try:
            planned = PlannedStore.open(
                path, PlanOptions.make(a.seq_len, a.buffer_size, a.buckets or None)
            )
        except (CacheError, ValueError) as e:
            return _fail(str(e))
        s["plan"] = planned.plan.stats()
    print(json.dumps(s, indent=1) if a.json else format_table(s))
    if a.verify:
        problems = verify_cache(path)
        if problems:
            more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
            return _fail(f"verify failed: {problems[0]}{more}")
        n = len(VLCache.open(path).metadata["files"])
        print(f"verify: OK ({n} files, sizes and sha256 match)")
    if a.render:
        from torchtitan_ext.vl.render import render_pack

        try:
            packs = planned if planned is not None else VLCache.open(path)
            out = render_pack(packs, int(a.render[0]), a.render[1])
        except (CacheError, IndexError, ValueError) as e:  # ValueError: video rows vs grid
            return _fail(str(e))
        print(f"rendered pack {a.render[0]} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
