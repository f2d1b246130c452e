"""Qwen3-VL offline preprocessing: per image vs HF Qwen3VLProcessor at equal float32 outputs (and the uint8 view, labelled), per-pack build cost vs HF on the same rows, bytes vs float32 (open time: vl_dataset).

Cases (every baseline measured in the same run, interleaved with what it is compared to):

* **Per image**, on the sample set (mixed modes, small images) and on 640x480 JPEGs (COCO /
  VQAv2-sized). Each row: decode, resize, patchify, tokenise the chat text.

  One intra-op thread for every path (as in a cache-build worker).

  - Headline, like for like on the CPU: ours to float32 (``process_sample`` then
    ``normalize_patches``: the very ``pixel_values`` tensor HF returns, checked equal per row,
    and equal ``input_ids``) against HF ``Qwen3VLProcessor`` with its PIL image processor
    (``Qwen2VLImageProcessorPil``, the one that runs without torchvision).
  - Second view, labelled *not like for like*: ours as uint8 ``[N, 768]`` patches, what a cache
    stores; the float32 ``[N, 1536]`` is then made on the GPU (``AsyncDeviceLoader``) or in the
    collate, which this row does not time.
  - Floors, not preprocessing paths: PIL decode alone, and PIL decode + RGB conversion + the
    bicubic resize (the PIL work both ours and HF do, bit-exact outputs need all of it); their
    notes say how many times the floor ours and HF take.
  - Second baseline: HF's fast image processor (``Qwen2VLImageProcessor``, torchvision backend),
    what Qwen3-VL users get where torchvision is installed. Measured when ``import torchvision``
    works in this process; otherwise the row says why not (PyPI's torchvision build for torch
    2.13.0 links ``libtorch_cuda.so`` and does not import beside the CPU-only torch wheel).

* **Per pack build** (seq 8192, ~24 COCO-sized images per pack): ``build_cache`` at 0 workers
  (in process) and at the default worker count, interleaved. Steady state = marginal cost:
  (T(all rows) - T(first quarter)) / (packs - packs) in the same round, which removes the one-off
  start-up (pool fork, source open, key hashing); the whole-run cost per pack is reported too.
  Baseline: HF ``Qwen3VLProcessor`` on one pack's worth of rows in one process (its per-image
  median on the 640x480 rows times the images per pack: processing only, no packing or writing).
* **Bytes per pack**: the cache's files against the float32 / int64 layout of the same packs.
* **pack(i) read** (tokens, positions computed, pixels copied or viewed), interleaved.

Options (``--set key=value``): ``images`` (640x480 rows timed per image, default 24; quick 6),
``rows`` (rows built into the cache, default 480; quick 48).
"""

from __future__ import annotations

import io
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.common import BenchArgs, Row, compare, interleave, row_from


def _jpeg(img: Image.Image, q: int = 90) -> bytes:
    b = io.BytesIO()
    img.save(b, "JPEG", quality=q)
    return b.getvalue()


def _coco_like_dataset(out: Path, n: int) -> Path:
    """n 640x480 / 480x640 JPEGs (COCO/VQAv2-sized) made from the shipped sources."""

    from torchtitan_ext.vl.sample_data import source_dir, write_vl_parquet

    srcs = sorted(p for p in source_dir().iterdir() if p.suffix in (".jpg", ".png"))
    rows = []
    rng = np.random.default_rng(0)
    for i in range(n):
        im = Image.open(srcs[i % len(srcs)]).convert("RGB")
        size = (640, 480) if i % 3 else (480, 640)
        im = im.resize(size, Image.BICUBIC)
        arr = np.asarray(im).astype(np.int16) + rng.integers(-8, 9, (size[1], size[0], 3))
        im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
        rows.append(
            {
                "image": {"bytes": _jpeg(im), "path": None},
                "question": f"What is shown in picture number {i}?",
                "answer": f"It shows object number {i % 17} on a plain background.",
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    write_vl_parquet(rows, out / "train-0.parquet")
    return out


def _rows(ds: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(next(ds.glob("*.parquet"))).to_pylist()


def fast_processor(proc) -> tuple[Any, str | None]:
    """(HF Qwen3VLProcessor with the torchvision image processor, None) or (None, why not)."""
    try:
        import torchvision  # noqa: F401
        from transformers import Qwen2VLImageProcessor

        from torchtitan_ext.vl import processor as P

        ip = Qwen2VLImageProcessor(**proc.image_processor.to_dict())
        fast = P._processor_class()(
            image_processor=ip,
            tokenizer=proc.tokenizer,
            video_processor=None,
            chat_template=proc.chat_template,
        )
        return fast, None
    except Exception as e:  # not installed, or installed but not importable beside this torch
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None, (
            f"not measured: torchvision does not import here ({why}). PyPI's torchvision "
            "0.28.0 (the build for torch 2.13.0) links libtorch_cuda.so, so it does not import "
            "beside the CPU-only torch wheel; on a CUDA machine `pip install torchvision==0.28.0` "
            "adds this baseline"
        )


def _per_image(proc, rows, args: BenchArgs, label: str) -> list[Row]:
    from torchtitan_ext.vl import processor as P
    from torchtitan_ext.vl import sample as VS

    p = P.ImageParams.from_processor(proc)

    def to_f32(u8: torch.Tensor) -> torch.Tensor:
        return P.normalize_patches(u8, p.mean, p.std, p.temporal_patch_size, p.rescale_factor)

    # equal outputs first: ours -> float32 is HF's pixel_values bit for bit, and the same ids
    for r in rows:
        img = P.load_image(P.decode_image(r["image"]))
        ours = VS.process_sample(proc, img, r["question"], r["answer"])
        ref = VS.hf_process(proc, [img], r["question"], r["answer"])
        assert torch.equal(to_f32(ours.pixel_u8), ref["pixel_values"]), "pixels differ"
        assert torch.equal(ours.input_ids, ref["input_ids"][0]), "ids differ"
    fast, why_not = fast_processor(proc)
    fast_diff = None
    if fast is not None:
        fast_diff = 0.0
        for r in rows:
            img = P.load_image(P.decode_image(r["image"]))
            ref = VS.hf_process(fast, [img], r["question"], r["answer"])["pixel_values"]
            ours = to_f32(VS.process_sample(proc, img, r["question"], r["answer"]).pixel_u8)
            d = (ours - ref).abs().max().item() if ours.shape == ref.shape else float("inf")
            fast_diff = max(fast_diff, d)

    def ours_u8():
        # exactly what a cache-build worker does per row (position_ids are computed at read time)
        for r in rows:
            img = P.decode_image(r["image"])
            VS.process_sample(proc, img, r["question"], r["answer"], positions=False)

    def ours_f32():
        for r in rows:
            img = P.decode_image(r["image"])
            s = VS.process_sample(proc, img, r["question"], r["answer"], positions=False)
            to_f32(s.pixel_u8)

    def hf(processor):
        def go():
            for r in rows:
                img = Image.open(io.BytesIO(r["image"]["bytes"]))
                img.load()
                VS.hf_process(processor, [img], r["question"], r["answer"])

        return go

    pp = P.ImageParams.from_processor(proc)

    def pil_decode():
        for r in rows:
            Image.open(io.BytesIO(r["image"]["bytes"])).load()

    def pil_floor():
        # the PIL work any equal-output path does: decode, to RGB as transformers does, bicubic
        # resize to smart_resize's size (HF resizes the RGB image; so does ours, bar grey)
        for r in rows:
            img = Image.open(io.BytesIO(r["image"]["bytes"]))
            img.load()
            img = P.to_rgb(img)
            rh, rw = pp.target_size(img.height, img.width)
            if (rh, rw) != (img.height, img.width):
                img.resize((rw, rh), resample=pp.resample)

    fns = {"ours_f32": ours_f32, "hf": hf(proc), "ours_u8": ours_u8, "pil_decode": pil_decode,
           "pil_floor": pil_floor}  # fmt: skip
    if fast is not None:
        fns["hf_fast"] = hf(fast)
    t = interleave(fns, args.repeats, args.warmup, args.guard())
    n = len(rows)
    g = f"per image {label}"
    hf_case = f"per image HF Qwen3VLProcessor (PIL), float32 [{label}]"
    head = row_from(f"per image ours -> float32 [{label}]", t["ours_f32"], "ms", 1e3 / n,
                    group=g, info={"images": n, "pixels_identical": True, "ids_identical": True},
                    note="like for like: the same float32 pixel_values and input_ids as HF, "
                         "checked per row")  # fmt: skip
    out = [head, row_from(hf_case, t["hf"], "ms", 1e3 / n, group=g)]
    out.append(
        row_from(f"per image ours uint8, normalisation on the device [{label}]", t["ours_u8"],
                 "ms", 1e3 / n, group=g,
                 note="not like for like: ours stops at uint8 [N, 768] patches (what a cache "
                      "stores); the float32 [N, 1536] is made later on the GPU, not timed here")
    )  # fmt: skip
    fast_case = f"per image HF Qwen3VLProcessor, fast (torchvision), float32 [{label}]"
    if fast is not None:
        note = "outputs equal to ours -> float32" if fast_diff == 0 else (
            f"outputs differ from ours / HF PIL: max |diff| {fast_diff:.3g} (torchvision's "
            "resize and fused normalisation)")  # fmt: skip
        out.append(row_from(fast_case, t["hf_fast"], "ms", 1e3 / n, group=g, note=note))
        out.append(row_from(f"per image ours -> float32, vs the fast processor [{label}]",
                            t["ours_f32"], "ms", 1e3 / n, group=g))  # fmt: skip
    else:
        out.append(Row(fast_case, float("nan"), "ms", higher_is_better=False, note=why_not))
    compare(out, head.case, hf_case)
    compare(out, out[2].case, hf_case)
    if fast is not None:
        compare(out, out[-1].case, fast_case)
    for key, what in (("pil_decode", "PIL decode alone"),
                      ("pil_floor", "PIL decode + RGB + bicubic resize")):  # fmt: skip
        floor = row_from(f"per image floor: {what} [{label}]", t[key], "ms", 1e3 / n, group=g)
        floor.note = (f"not a preprocessing path: the PIL work in both ours and HF's; ours -> "
                      f"float32 takes {head.value / floor.value:.2f}x this, HF "
                      f"{out[1].value / floor.value:.2f}x")  # fmt: skip
        out.append(floor)
    head.target, head.met = ">= 3x", head.ratio >= 3
    return out


def _builds(args: BenchArgs, data: Path, tmp: Path, n_rows: int) -> dict[str, Any]:
    """Interleaved builds at 0 and the default workers, each of all rows and of a quarter."""
    from torchtitan_ext.vl import build as B

    default = B.default_num_workers()

    def build(workers: int, n: int, tag: str):
        def go() -> dict[str, Any]:
            shutil.rmtree(tmp / tag, ignore_errors=True)
            t0 = time.perf_counter()
            k = B.build_cache(dataset=data, split="train", cache_dir=tmp / tag, seq_len=8192,
                              buffer_size=64, num_workers=workers, show_progress=False,
                              max_samples=n, rows_per_shard=max(1, n_rows // 4))  # fmt: skip
            dt = time.perf_counter() - t0
            return {"s": dt, "packs": json.loads((k / "metadata.json").read_text())["counts"]
                    ["packs"], "dir": k}  # fmt: skip

        return go

    fns = {}
    for w in sorted({0, default}):
        fns[f"{w} small"] = build(w, n_rows // 4, f"w{w}_small")
        fns[f"{w} full"] = build(w, n_rows, f"w{w}_full")
    rounds = 1 if args.quick else max(1, min(3, args.repeats))
    t = interleave(fns, rounds, warmup=0, guard=args.guard(max_retakes=1), rotate=False)
    return {"series": t, "default": default}


def _build_rows(args: BenchArgs, data: Path, tmp: Path, n_rows: int, hf_ms: float) -> list[Row]:
    res = _builds(args, data, tmp, n_rows)
    t, default = res["series"], res["default"]
    kdir = t[f"{default} full"].results[-1]["dir"]
    st = json.loads((kdir / "packing_stats.json").read_text())
    c = json.loads((kdir / "metadata.json").read_text())["counts"]
    packs = c["packs"]
    images_per_pack = c["images"] / packs
    contents = (f"{st['images_per_pack']['mean']:.1f} images x "
                f"{c['patches'] / max(c['images'], 1):.0f} patches "
                f"({c['patches'] / packs:.0f}), {c['tokens'] / packs:.0f} tokens per pack")  # fmt: skip
    print(f"pack contents: {contents}")
    rows: list[Row] = []
    for w in sorted({0, default}):
        full, small = t[f"{w} full"].results, t[f"{w} small"].results
        marg = [(f["s"] - s["s"]) / max(1, f["packs"] - s["packs"])
                for f, s in zip(full, small, strict=True)]  # fmt: skip
        what = "0 workers (in process)" if w == 0 else f"{w} workers (the default here)"
        info = {"packs": packs, "workers": w, "contents": contents}
        rows.append(Row(f"per pack build, ours, {what}, steady state", statistics.median(marg),
                        "s", higher_is_better=False, samples=marg, info=info,
                        retaken=t[f"{w} full"].retaken, noisy=t[f"{w} full"].noisy))  # fmt: skip
        whole = [f["s"] / f["packs"] for f in full]
        rows.append(Row(f"per pack build, ours, {what}, whole run incl. start-up",
                        statistics.median(whole), "s", higher_is_better=False, samples=whole,
                        info=info))  # fmt: skip
    base = Row("baseline: HF Qwen3VLProcessor on one pack's rows, 1 process",
               hf_ms / 1e3 * images_per_pack, "s", higher_is_better=False,
               info={"images_per_pack": images_per_pack},
               note="its per-image median on the 640x480 rows (this run) x the images per pack; "
                    "processing only, no packing or writing")  # fmt: skip
    rows.append(base)
    compare(rows, rows[0].case, base.case)
    if default != 0:
        compare(rows, rows[2].case, base.case)
    return rows + _bytes_and_read_rows(args, kdir, c)


def _bytes_and_read_rows(args: BenchArgs, kdir: Path, c: dict) -> list[Row]:
    from torchtitan_ext.vl import cache as C
    from torchtitan_ext.vl.inspect import float32_bytes

    meta = json.loads((kdir / "metadata.json").read_text())
    packs = c["packs"]
    stored = sum(f["size"] for f in meta["files"].values())
    f32 = float32_bytes(c["patches"], c["padded_tokens"], c["images"])
    b_ours = Row("bytes per pack, ours (uint8 pixels, int32 tokens)", stored / packs, "B",
                 higher_is_better=False)  # fmt: skip
    b_f32 = Row("bytes per pack, the same packs as float32 pixels, int64 tokens", f32 / packs,
                "B", higher_is_better=False)  # fmt: skip
    rows = [b_ours, b_f32]
    compare(rows, b_ours.case, b_f32.case)
    b_ours.target, b_ours.met = "<= 1/8 (>= 8x)", b_ours.ratio >= 8

    cache = C.VLCache.open(kdir)
    n = len(cache)
    t = interleave(
        {c: (lambda c=c: [cache.pack(i, copy_pixels=c) for i in range(n)]) for c in (True, False)},
        args.repeats, args.warmup, args.guard(),
    )  # fmt: skip
    for copy in (True, False):
        what = "private pixel copy" if copy else "pixel view"
        rows.append(row_from(f"pack(i) read incl. position_ids, {what}", t[copy], "ms", 1e3 / n,
                             group="read", info={"bytes_per_pack": stored / packs}))  # fmt: skip
    return rows


def run(args: BenchArgs) -> list[Row]:
    from torchtitan_ext.vl import processor as P
    from torchtitan_ext.vl.sample_data import make_sample_dataset

    tmp = Path(tempfile.mkdtemp(prefix="bench_vl_"))
    threads = torch.get_num_threads()
    # One intra-op thread, as in a cache-build worker (vl.build sets it) and a DataLoader worker;
    # HF's PIL path is numpy, single-threaded. (Two threads on this shared 2-core machine made
    # normalize_patches 4-20x slower than one.)
    torch.set_num_threads(1)
    try:
        proc = P.load_processor(None)
        rows: list[Row] = []
        sample = make_sample_dataset(tmp / "sample", n=14 if args.quick else 70)
        rows += _per_image(proc, _rows(sample), args, "sample set, all modes")
        n_rows = int(args.extra.get("rows", 48 if args.quick else 480))
        n_img = int(args.extra.get("images", 6 if args.quick else 24))
        coco = _coco_like_dataset(tmp / "coco", n_rows)
        label = "640x480 JPEG, COCO-sized"
        per = _per_image(proc, _rows(coco)[:n_img], args, label)
        rows += per
        hf_ms = next(
            r.value for r in per if r.case.startswith("per image HF") and "(PIL)" in r.case
        )
        rows += _build_rows(args, coco, tmp, n_rows, hf_ms)
        # (open time at realistic shapes, and against the previous open path: vl_dataset.py)
        return rows
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
