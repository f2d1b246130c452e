"""CachedVLDataset: CPU ms per training step (fetch + collate) of ~8k-token / ~24-image packs, warm and cold, vs HF Qwen3VLProcessor online and our online path on the same rows; cache open time for 100 / 1k / 10k packs.

Cases (each baseline measured in the same run, interleaved with what it is compared to):

* **step**: a real cache built by ``build_cache`` at the default 1,024 rows per shard from
  synthetic 640x480 JPEG rows (the sample images resized; 1200 patches = 300 tokens each, so ~24
  images per 8192-token pack and ~43 packs in a full shard, as in a real 8k-token cache). One
  training step = ``next()`` on the dataset + collate of one pack (B=1), with one intra-op thread
  (like a DataLoader worker or the staging thread; one row with the default thread count).
  Only ~8k-token packs are timed (not an epoch's drain-tail packs). Warm rows: the page cache
  and the dataset's memory maps already hold the pack (a warm-up pass touched every pack).

  - Cached: HF format with uint8 pixels (``normalize_on="device"``: the float32 is made on the
    GPU after the copy, not timed here), torchtitan format uint8, HF uint8 + a contiguous copy
    (what the staging thread's pinned copy costs), and HF format with float32 pixels normalised
    on the CPU in the collate (``normalize_on="collate"``: the like-for-like output of HF's
    processor).
  - **Planned store**: the same packs read from a sample store through a plan (``vl/plan.py``)
    as the loader reads them: torchtitan u8 copies each image's pixels once, from the store's
    map into the padded batch (``vl/pixel_rows.py``); hf u8 gathers them into one array.
    Baseline: the earlier torchtitan read, which gathered each pack's pixels into one array and
    then copied them again into the per-image padding.
  - Baseline **HF online**: ``Qwen3VLProcessor`` (PIL image processor) on the rows of one pack,
    float32 ``pixel_values``, concatenated into one HF-format batch (what a fine-tuning stack
    that preprocesses in its collate does; no best-fit buffer, whose cost is negligible).
  - Baseline **ours online**: ``OnlineVLDataset`` (our fast per-row path + best-fit packing
    inside the loader, no cache) with uint8 and with float32 pixels: the like-for-like rows for
    "uint8 online vs uint8 cached" and "float32 online vs float32 cached".
  - Baseline: the same packs as float32 / int64 in one TensorDict memmap per pack (the earlier
    cache layout), materialised per step.
  - First touch: a fresh dataset (fresh maps), page cache warm.
  - **Cold read**: the cache's files are evicted from this machine's page cache before each pass
    (``fsync`` + ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file, residency checked with
    ``mincore``; ``/proc/sys/vm/drop_caches`` would empty every job's cache on a shared machine),
    then a fresh dataset reads the packs in shuffled order: every step reads its pack from disk.
    On a virtual machine the host may still cache the virtual disk; the disk MB/s in the row's
    info says what was reached.
  - Train-side cost of the ``cached_vl`` loader — in process (fetch + collate in its one Prefetch
    thread) and with one DataLoader worker — a 50 ms sleep per step standing in for the GPU step.
* **open**: see ``benchmarks/_vl_open.py``.

Options (``--set key=value``): ``rows`` (rows in the step cache, default 1024 = one default
shard, ~43 packs; quick 72), ``cold_passes`` (default 2; quick 1), ``open_sizes`` (comma list,
default 100,1000,10000; quick 100,1000), ``cases`` (default ``step,open``).
"""

from __future__ import annotations

import gc
import io
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks._vl_open import open_rows
from benchmarks.common import (
    BenchArgs,
    Row,
    compare,
    evict,
    interleave,
    resident_fraction,
    row_from,
)

SEQ = 8192
IMG_W, IMG_H = 640, 480
FULL = 0.85 * SEQ
"""Packs with more tokens than this are timed (an epoch's drain-tail packs are not)."""


def _rows_dataset(out: Path, n: int) -> Path:
    """n VQA rows with 640x480 JPEGs made from the shipped sample images."""
    from PIL import Image

    from torchtitan_ext.vl.sample_data import source_dir, write_vl_parquet

    srcs = sorted(p for p in source_dir().iterdir() if p.suffix.lower() in (".jpg", ".png"))
    imgs = []
    for p in srcs:
        with Image.open(p) as im:
            imgs.append(im.convert("RGB").resize((IMG_W, IMG_H)))
    rows = []
    for i in range(n):
        im = imgs[i % len(imgs)]
        if (i // len(imgs)) % 2:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        b = io.BytesIO()
        im.save(b, "JPEG", quality=85)
        rows.append(
            {
                "image": {"bytes": b.getvalue(), "path": None},
                "question": f"What is shown in picture number {i}?",
                "answer": f"Picture {i} shows {srcs[i % len(srcs)].stem.replace('_', ' ')}.",
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    write_vl_parquet(rows, out / "train-0.parquet")
    return out


def _per_pack_layout(pack: dict[str, torch.Tensor], out: Path) -> Path:
    """The earlier per-pack layout: float32 pixel_values [N, 1536] + int64 text, TensorDict."""
    from tensordict import TensorDict

    from torchtitan_ext.vl.collate import PixelNorm, normalize

    td = TensorDict(
        {
            "input_ids": pack["input_ids"].clone(),
            "labels": pack["labels"].clone(),
            "position_ids": pack["position_ids"].clone(),
            "pixel_values": normalize(pack["pixel_u8"].clone(), PixelNorm()),
            "image_grid_thw": pack["image_grid_thw"].clone(),
        },
        batch_size=[],
    )
    td.memmap_(str(out))
    return out


def _touch(batch) -> None:
    """Copy every tensor into fresh memory (what the staging thread's pinned copy costs)."""
    if isinstance(batch, tuple):
        for b in batch:
            _touch(b)
    elif isinstance(batch, dict):
        for v in batch.values():
            _touch(v)
    elif isinstance(batch, torch.Tensor):
        torch.empty_like(batch).copy_(batch)


def _stepper(
    it: Iterator[dict], collate: Callable, threads: int = 1, materialise: bool = False
) -> Callable[[], float]:
    """One timed step per call: next() + collate of the next ~8k-token pack; returns seconds
    (drain-tail packs in between are fetched untimed)."""

    def step() -> float:
        torch.set_num_threads(threads)
        while True:
            t0 = time.perf_counter()
            p = next(it)
            b = collate([p])
            if materialise:
                _touch(b)
            dt = time.perf_counter() - t0
            if int(p["num_tokens"]) > FULL:
                return dt

    return step


def _hf_online_stepper(proc, rows: list[dict], images_per_pack: int) -> Callable[[], float]:
    """HF online: Qwen3VLProcessor on the next ``images_per_pack`` rows, one float32 HF batch."""
    from PIL import Image

    from torchtitan_ext.vl.sample import hf_process

    k = {"i": 0}

    def step() -> float:
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        outs = []
        for _ in range(images_per_pack):
            r = rows[k["i"] % len(rows)]
            k["i"] += 1
            img = Image.open(io.BytesIO(r["image"]["bytes"]))
            outs.append(hf_process(proc, [img], r["question"], r["answer"]))
        {  # noqa: B018 - the batch is built for its cost
            "input_ids": torch.cat([o["input_ids"] for o in outs], 1),
            "pixel_values": torch.cat([o["pixel_values"] for o in outs]),
            "image_grid_thw": torch.cat([o["image_grid_thw"] for o in outs]),
        }
        return time.perf_counter() - t0

    return step


def _build(args: BenchArgs, work: Path) -> tuple[Path, Path, dict[str, Any]]:
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache

    n_rows = int(args.extra.get("rows", 72 if args.quick else 1024))
    data = _rows_dataset(work / "rows", n_rows)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    path = build_cache(data, "train", work / "cache", seq_len=SEQ, buffer_size=32,
                       show_progress=False)  # fmt: skip
    build_s = time.perf_counter() - t0
    torch.set_num_threads(threads)  # (build_cache in process leaves the caller at 1 thread)
    cache = VLCache.open(path)
    full = [i for i in range(len(cache))
            if int(cache.pack(i, copy_pixels=False)["num_tokens"]) > FULL]  # fmt: skip
    p = cache.pack(full[len(full) // 2] if full else 0)
    info = {
        "tokens": int(p["num_tokens"]),
        "images": int(p["image_grid_thw"].shape[0]),
        "patches": int(p["pixel_u8"].shape[0]),
        "pixel_mb_per_pack": round(p["pixel_u8"].numel() / 2**20, 1),
        "packs_in_cache": len(cache),
        "full_packs": len(full),
        "shards": len(cache.metadata["shards"]),
        "rows_per_shard": cache.metadata["config"]["rows_per_shard"],
        "cache_mb": round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20),
        "cache_build_s": round(build_s, 1),
    }
    return path, data, info


def _cold_rows(args: BenchArgs, path: Path, info: dict, coll: Callable) -> list[Row]:
    """Steps on a fresh dataset right after evicting the cache's files from the page cache."""
    from torchtitan_ext.vl.dataset import CachedVLDataset

    files = [p for p in path.rglob("*") if p.is_file()]
    passes = int(args.extra.get("cold_passes", 1 if args.quick else 2))
    samples: list[float] = []
    resident: list[float] = []
    mb = info["pixel_mb_per_pack"]
    for k in range(passes):
        gc.collect()  # no live map may pin the pages
        evict(files)
        resident.append(resident_fraction(files))
        ds = CachedVLDataset(path, 0, 1, seed=k, shuffle=True, infinite=False)
        step = _stepper(iter(ds), coll)
        for _ in range(info["full_packs"]):
            try:
                samples.append(step())
            except StopIteration:
                break
        del ds, step
    cold_info = {**info, "resident_after_evict": max(resident), "passes": passes,
                 "disk_mb_per_s": round(mb / statistics.median(samples), 1)}  # fmt: skip
    how = ("pages evicted (posix_fadvise DONTNEED, "
           f"{100 * max(resident):.0f} % still resident); shuffled order; "
           f"{cold_info['disk_mb_per_s']:.0f} MB/s of pixel data at the median")  # fmt: skip
    return [Row("cold read: step hf u8, fetch+collate", statistics.median(samples) * 1e3,
                "ms/step", higher_is_better=False, samples=[x * 1e3 for x in samples],
                info=cold_info, note=how + "; a virtual disk may be cached by the host")]  # fmt: skip


def _step_rows(args: BenchArgs, work: Path) -> list[Row]:
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.collate import PackCollator, PixelNorm
    from torchtitan_ext.vl.dataset import CachedVLDataset
    from torchtitan_ext.vl.online import OnlineVLDataset
    from torchtitan_ext.vl.processor import load_processor

    threads0 = int(args.extra.get("_threads0", torch.get_num_threads()))
    path, data, info = _build(args, work)
    cache = VLCache.open(path)
    special, norm = cache.special_tokens, PixelNorm.from_metadata(cache.metadata)
    del cache

    def coll(fmt: str, on: str) -> PackCollator:
        return PackCollator(fmt, special, norm, on)

    out = _cold_rows(args, path, info, coll("hf", "device"))  # before any map pins the pages

    def warm_iter(copy_pixels: bool = True) -> Iterator[dict]:
        ds = CachedVLDataset(path, 0, 1, seed=0, shuffle=False, copy_pixels=copy_pixels)
        it = iter(ds)
        for _ in range(len(ds.cache)):  # every pack once through this dataset's maps
            int(next(it)["pixel_u8"][:, 0].sum())
        return it

    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    threads = torch.get_num_threads()
    store = build_cache(data, "train", work / "cache", seq_len=SEQ, buffer_size=32,
                        show_progress=False, store=True)  # fmt: skip
    torch.set_num_threads(threads)

    def planned_iter(copy_pixels: bool = True) -> Iterator[dict]:
        planned = PlannedStore.open(store, PlanOptions.make(SEQ, 32, None))
        assert len(planned) == info["packs_in_cache"], "the plan has the packed cache's packs"
        for i in range(len(planned)):  # every pack's pages once through these maps
            int(planned.pack(i)["pixel_u8"][:, 0].sum())
        return iter(CachedVLDataset(planned, 0, 1, seed=0, shuffle=False, copy_pixels=copy_pixels))

    def planned(fmt: str, on: str, gather_first: bool = False) -> Callable[[], float]:
        """Steps over the planned store as the loader reads it (pixels left in the store where
        the collate copies them); ``gather_first``: each pack's pixels gathered into one array
        first, as before ``vl/pixel_rows.py`` (the torchtitan layout then copies them again)."""
        c = coll(fmt, on)
        return _stepper(planned_iter(gather_first or not c.copies_pixels), c)

    def online_iter() -> Iterator[dict]:
        return iter(OnlineVLDataset(data, "train", seq_len=SEQ, buffer_size=32, dp_rank=0,
                                    dp_world_size=1, infinite=True, shuffle=False))  # fmt: skip

    import pyarrow.parquet as pq

    rows = pq.read_table(next(data.glob("*.parquet"))).to_pylist()
    per_pack = _layout_step(path, work)

    def cached(fmt: str, on: str, *a: Any, **kw: Any) -> Callable[[], float]:
        """Steps over the cache as the loader reads it: pixel views where the collate copies."""
        c = coll(fmt, on)
        return _stepper(warm_iter(not c.copies_pixels), c, *a, **kw)

    fns: dict[str, Callable[[], Any]] = {
        "tt_u8": cached("torchtitan", "device"),
        "plan_tt_u8": planned("torchtitan", "device"),
        "plan_hf_u8": planned("hf", "device"),
        "hf_u8": cached("hf", "device"),
        "hf_u8_copy": cached("hf", "device", materialise=True),
        "hf_f32": cached("hf", "collate"),
        "tt_u8_threads": cached("torchtitan", "device", threads0),
        "online_u8": _stepper(online_iter(), coll("hf", "device")),
        "online_f32": _stepper(online_iter(), coll("hf", "collate")),
        "hf_online": _hf_online_stepper(load_processor(None), rows, info["images"]),
        # followed (rounds rotate) only by per_pack: the two arrays it frees each step leave the
        # allocator in a state that slows whichever step comes next (page faults on fresh memory)
        "plan_tt_u8_gather": planned("torchtitan", "device", gather_first=True),
        "per_pack": per_pack,
    }
    reps = max(args.repeats, 5) * (1 if args.quick else 4)
    t = interleave(fns, reps, args.warmup + 1, args.guard())
    torch.set_num_threads(1)
    g = "step"
    named = [
        ("tt_u8", "step torchtitan u8 (fetch+collate)", None),
        ("plan_tt_u8", "step torchtitan u8, planned store (gather+collate)",
         "the same packs read sample by sample from the sample store (vl/plan.py), each "
         "image's pixels copied once, from the store's map into the batch"),
        ("plan_tt_u8_gather", "baseline: step torchtitan u8, planned store, pixels gathered "
         "first", "the earlier planned read: one gather copy, then the per-image padding copy"),
        ("plan_hf_u8", "step hf u8, planned store (gather+collate)", None),
        ("hf_u8", "step hf u8 (fetch+collate)",
         "uint8 pixels: the float32 is made on the GPU after the copy, not timed here"),
        ("hf_u8_copy", "step hf u8 + contiguous copy", None),
        ("hf_f32", "step hf float32 on CPU (collate)",
         "like for like with HF: float32 pixel_values normalised on the CPU"),
        ("tt_u8_threads", f"step torchtitan u8, {threads0} intra-op threads", None),
        ("online_u8", "baseline: ours online, hf u8 (no cache)", None),
        ("online_f32", "baseline: ours online, hf float32 on CPU (no cache)", None),
        ("hf_online", "baseline: HF online (Qwen3VLProcessor on one pack's rows, float32)",
         f"{info['images']} rows per step through the HF processor, concatenated"),
        ("per_pack", "baseline: float32 pack, one TensorDict memmap per pack",
         "the earlier cache layout (float32 pixels, int64 text), materialised"),
    ]  # fmt: skip
    for key, case, note in named:
        out.append(row_from(case, t[key], "ms/step", 1e3, group=g, info=info, note=note))
    first = _first_touch(path, coll("torchtitan", "device"), info)
    out.append(first)
    out.append(_loader_row(path, reps, info, num_workers=1))
    inproc = _loader_row(path, reps, info, num_workers=0)
    inproc.target, inproc.met = "<= 5 ms", inproc.value <= 5.0
    out.append(inproc)
    hf_online = "baseline: HF online (Qwen3VLProcessor on one pack's rows, float32)"
    online_u8 = "baseline: ours online, hf u8 (no cache)"
    compare(out, "step torchtitan u8, planned store (gather+collate)",
            "step torchtitan u8 (fetch+collate)")  # fmt: skip
    compare(out, "step hf u8, planned store (gather+collate)", "step hf u8 (fetch+collate)")
    compare(out, "step hf float32 on CPU (collate)", hf_online)  # like for like: float32
    compare(out, "step hf u8 (fetch+collate)", online_u8)  # like for like: uint8
    compare(out, "baseline: ours online, hf float32 on CPU (no cache)", hf_online)
    compare(out, "cold read: step hf u8, fetch+collate", online_u8)
    # the uint8 view against HF online, labelled: a different output (normalised later)
    u8_vs_hf = row_from("step hf u8 vs HF online (not like for like: uint8)", t["hf_u8"],
                        "ms/step", 1e3, group=g,
                        note="uint8 here, float32 from HF: the normalisation runs later on the "
                             "GPU")  # fmt: skip
    out.append(u8_vs_hf)
    compare(out, u8_vs_hf.case, hf_online)
    for r in out:
        if r.case in ("step torchtitan u8 (fetch+collate)", "step hf u8 (fetch+collate)",
                      "step torchtitan u8, planned store (gather+collate)",
                      "step hf u8, planned store (gather+collate)"):  # fmt: skip
            r.target, r.met = "<= 5 ms", r.value <= 5.0
    return out


def _layout_step(path: Path, work: Path) -> Callable[[], None]:
    """A step of the earlier layout: materialise one float32 / int64 per-pack TensorDict."""
    from tensordict import TensorDict

    from torchtitan_ext.vl.cache import VLCache

    cache = VLCache.open(path)
    full = [i for i in range(len(cache)) if int(cache.pack(i)["num_tokens"]) > FULL] or [0]
    dirs = [_per_pack_layout(cache.pack(i), work / f"per_pack_{i}") for i in full[:2]]
    tds = [TensorDict.load_memmap(str(d), allow_pickle=False) for d in dirs]
    k = {"i": 0}

    def step() -> None:
        torch.set_num_threads(1)
        td = tds[k["i"] % len(tds)]
        k["i"] += 1
        {key: td[key].clone() for key in td.keys()}  # noqa: B018

    return step


def _first_touch(path: Path, coll: Any, info: dict) -> Row:
    """Steps of a fresh dataset (fresh memory maps), page cache warm: each pack's pixel pages
    are faulted into the process on first use (once per epoch per process)."""
    from torchtitan_ext.vl.dataset import CachedVLDataset

    ds = CachedVLDataset(
        path, 0, 1, seed=0, shuffle=False, infinite=False, copy_pixels=not coll.copies_pixels
    )  # as the loader reads it; fmt: skip
    step = _stepper(iter(ds), coll)
    xs = []
    for _ in range(info["full_packs"]):
        try:
            xs.append(step() * 1e3)
        except StopIteration:
            break
    return Row("step torchtitan u8, first touch of a pack", statistics.median(xs), "ms/step",
               higher_is_better=False, samples=xs, info=info,
               note="fresh memory maps, page cache warm")  # fmt: skip


def _loader_row(path: Path, reps: int, info: dict, num_workers: int) -> Row:
    """The training thread's wait in ``next()`` of the ``cached_vl`` loader: in process (the
    one Prefetch thread fetches and collates) or with DataLoader workers."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    cfg = CachedVLDataLoader.Config(
        cache_path=str(path),
        num_workers=num_workers,
        normalize_on="device",
        batch_format="torchtitan",
        shuffle=False,
    )
    loader = cfg.build(dp_rank=0, dp_world_size=1, seq_len=SEQ, local_batch_size=1)
    it = iter(loader)
    for _ in range(3):  # start the thread / worker, fill its queue
        next(it)
    waits = []
    for _ in range(reps):
        time.sleep(0.05)
        t0 = time.perf_counter()
        next(it)
        waits.append((time.perf_counter() - t0) * 1e3)
    loader.close()
    where = f"{num_workers} worker" if num_workers else "loader in process (Prefetch thread)"
    return Row(
        case=f"step torchtitan u8, {where} (train-side)",
        value=statistics.median(waits),
        unit="ms/step",
        higher_is_better=False,
        samples=waits,
        info=info,
        note="time the training thread waits in next(); a 50 ms sleep stands in for the GPU step",
    )


def run(args: BenchArgs) -> list[Row]:
    work = Path(tempfile.mkdtemp(prefix="vl_dataset_bench_"))
    old = os.environ.get("TORCHTITAN_EXT_CACHE")
    os.environ.setdefault("TORCHTITAN_EXT_CACHE", str(work / "home"))
    threads = torch.get_num_threads()
    args.extra.setdefault("_threads0", str(threads))
    try:
        cases = args.extra.get("cases", "step,open").split(",")
        rows = _step_rows(args, work / "step") if "step" in cases else []
        return rows + (open_rows(args, work / "open") if "open" in cases else [])
    finally:
        torch.set_num_threads(threads)
        if old is None:
            os.environ.pop("TORCHTITAN_EXT_CACHE", None)
        shutil.rmtree(work, ignore_errors=True)
