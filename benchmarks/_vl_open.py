"""VL cache open at realistic shapes, for ``benchmarks/vl_dataset.py`` (not a case itself).

Caches of 100 / 1k / 10k packs: 8192-token packs of ~24 samples (~340 tokens each) at the
default 1,024 rows per shard, so ~43 packs per shard and ~230 shards at 10k packs, written by
the builder's own writers (``vl.write.write_shard`` / ``vl.manifest.write_manifest``: the exact
on-disk layout of a real build, digest included) from synthetic rows whose images are tiny (opening
reads no pixel byte, so only the pixel files' sizes differ from a real cache). Timed,
interleaved (``benchmarks.common.interleave``): ``VLCache.open`` (digest check, every file's
size, every shard's ``meta.json``, lazy shards), the previous open path (``metadata.json`` + one
``TensorDict.load_memmap`` per shard + its index arrays, the same-run baseline),
``CachedVLDataset`` construction and, up to 1k packs (100 in quick runs; writing 10k
directories alone takes minutes), the earlier layout: one TensorDict memmap directory per pack +
``LazyStackedTensorDict``. Also: the deferred cost, the first ``pack(i)`` of each shard (maps it
and checks its index).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.common import BenchArgs, Row, call, compare, interleave, row_from

SEQ = 8192


def _synth_rows(first_row: int, n: int, rng) -> list:
    """n VQA-like processed rows of ~340 tokens (a chat turn around one tiny image: 4 patches,
    one image token), so ~24 fill an 8192-token pack and a 1,024-row shard holds ~43 packs, as
    in a real 8k-token cache; the pixel bytes are small because opening never reads them."""
    import numpy as np

    from torchtitan_ext.vl.write import ProcessedRow

    out = []
    for i in range(n):
        ln = int(rng.integers(300, 380))
        tok = rng.integers(20, 1000, ln, dtype=np.int32)
        tok[5] = SYNTH_IMAGE_PAD
        mask = np.zeros(ln, dtype=np.uint8)
        mask[ln - 20 :] = 1
        pix = rng.integers(0, 256, (4, 768), dtype=np.uint8)
        grid = np.array([[1, 2, 2]], dtype=np.int32)
        out.append(ProcessedRow(first_row + i, tok, mask, pix, grid))
    return out


SYNTH_IMAGE_PAD = 572  # only needs to differ from the text ids above


def _synth_caches(work: Path, sizes: list[int]) -> dict[int, Path]:
    """Caches of ~n packs each with the real on-disk layout (``vl.write``: the builder's own
    shard and manifest writers), at the default 1,024 rows per shard; the smaller caches reuse
    the first shards of the largest by hard links."""
    import numpy as np

    from torchtitan_ext.vl.build import DEFAULT_ROWS_PER_SHARD, BuildConfig, _versions
    from torchtitan_ext.vl.manifest import write_manifest
    from torchtitan_ext.vl.packing import normalize_buckets
    from torchtitan_ext.vl.processor import (
        ImageParams,
        load_processor,
        processor_fingerprint,
        special_token_ids,
    )
    from torchtitan_ext.vl.write import write_shard

    proc = load_processor(None)
    rps = DEFAULT_ROWS_PER_SHARD
    rng = np.random.default_rng(0)
    big = work / "synth_largest"
    ranges: list[tuple[int, int]] = []
    packs = 0
    while packs < max(sizes):
        k = len(ranges)
        rows = _synth_rows(k * rps, rps, rng)
        st = write_shard(
            big / "shards" / f"{k:05d}", rows, SEQ, 64, normalize_buckets(SEQ, None), 768
        )
        ranges.append((k * rps, (k + 1) * rps))
        packs += st["packs"]
    per_shard = packs / len(ranges)
    identity = {
        "key": "synthetic",
        "config": dataclasses.asdict(BuildConfig(dataset="synthetic", seq_len=SEQ)),
        "dataset_fingerprint": {"kind": "synthetic"},
        "layout": {"layout": "vqa"},
        "processor": processor_fingerprint(proc),
        "image_params": dataclasses.asdict(ImageParams.from_processor(proc)),
        "special_tokens": special_token_ids(proc) | {"image_pad_id": SYNTH_IMAGE_PAD},
        "versions": _versions(),
    }
    out = {}
    for n in sizes:
        k = max(1, round(n / per_shard))
        d = big if k == len(ranges) else work / f"synth_{n}"
        if d != big:
            for j in range(k):
                src, dst = big / "shards" / f"{j:05d}", d / "shards" / f"{j:05d}"
                dst.mkdir(parents=True)
                for f in src.iterdir():
                    os.link(f, dst / f.name)
        write_manifest(d, ranges[:k], identity)
        out[n] = d
    return out


def _open_v1(path: Path) -> int:
    """The previous open path, for the same-run baseline: parse metadata.json, then one
    ``TensorDict.load_memmap`` per shard and its small index arrays read eagerly."""
    from tensordict import TensorDict

    meta = json.loads((path / "metadata.json").read_text())
    tds = [TensorDict.load_memmap(str(path / "shards" / s["name"]), allow_pickle=False)
           for s in meta["shards"]]  # fmt: skip
    offsets = [td["pack_offsets"].numpy() for td in tds]
    lens = [td["pack_len"].numpy() for td in tds]
    return len(offsets) + len(lens)


def _per_pack_dirs(work: Path, n: int) -> Path:
    """n packs in the earlier layout: one TensorDict memmap directory per pack."""
    from tensordict import TensorDict

    d = work / f"per_pack_{n}"
    one = {
        "input_ids": torch.zeros(64, dtype=torch.int64),
        "labels": torch.zeros(64, dtype=torch.int64),
        "position_ids": torch.zeros(4, 64, dtype=torch.int64),
        "pixel_values": torch.zeros(16, 1536),
        "image_grid_thw": torch.ones(1, 3, dtype=torch.int64),
    }
    for i in range(n):
        TensorDict(one, batch_size=[]).memmap_(str(d / f"sample_{i:06d}"))
    return d


def _open_per_pack(d: Path) -> int:
    from tensordict import LazyStackedTensorDict, TensorDict

    dirs = sorted(d.iterdir())
    tds = [TensorDict.load_memmap(str(x), allow_pickle=False) for x in dirs]
    return len(LazyStackedTensorDict(*tds))


def _touch_shards(path: Path) -> float:
    """ms per shard of the deferred cost: a fresh open, then the first pack of every shard
    (maps the shard and checks its index; once per shard per process)."""
    from torchtitan_ext.vl.cache import VLCache

    fresh = VLCache.open(path)
    shards = len(fresh.metadata["shards"])
    t0 = time.perf_counter()
    for s in range(shards):
        fresh.pack_shape(int(fresh._starts[s]))
    return (time.perf_counter() - t0) * 1e3 / shards


def open_rows(args: BenchArgs, work: Path) -> list[Row]:
    """Open time at realistic shapes (8k-token packs, 1,024 rows per shard, ~43 packs per shard),
    ours vs the previous open path and the one-directory-per-pack layout, interleaved."""
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.dataset import CachedVLDataset

    default = "100,1000" if args.quick else "100,1000,10000"
    sizes = [int(s) for s in args.extra.get("open_sizes", default).split(",")]
    t0 = time.perf_counter()
    caches = _synth_caches(work, sizes)
    synth_s = time.perf_counter() - t0
    out: list[Row] = []
    per_pack_max = 100 if args.quick else 1000
    reps = max(5, args.repeats * 2)
    for n in sizes:
        path = caches[n]
        c = VLCache.open(path)
        info = {"packs": len(c), "shards": len(c.metadata["shards"]),
                "packs_per_shard": round(len(c) / len(c.metadata["shards"]), 1),
                "synth_build_s": round(synth_s, 1)}  # fmt: skip
        fns = {
            "ours": call(VLCache.open, path),
            "v1": call(_open_v1, path),
            "dataset": call(CachedVLDataset, path, 0, 1),
            "touch": lambda p=path: _touch_shards(p) / 1e3,
        }
        if n <= per_pack_max:
            d = _per_pack_dirs(work, n)
            fns["per_pack"] = call(_open_per_pack, d)
        t = interleave(fns, reps, args.warmup, args.guard())
        g = f"open {n}"
        ours = row_from(f"open {n} packs ours (VLCache.open)", t["ours"], "ms", 1e3, group=g,
                        info=info)  # fmt: skip
        v1 = row_from(f"baseline: open {n} packs, previous open path", t["v1"], "ms", 1e3,
                      group=g, info=info)  # fmt: skip
        ds = row_from(f"open {n} packs ours + CachedVLDataset", t["dataset"], "ms", 1e3,
                      group=g, info=info)  # fmt: skip
        touch = row_from(f"first touch of a shard ({n} packs)", t["touch"], "ms/shard", 1e3,
                         group=g, info=info,
                         note="deferred cost of the lazy open, once per shard per process")  # fmt: skip
        out += [ours, v1, ds, touch]
        compare(out, ours.case, v1.case)
        ours.target, ours.met = "<= 1.5x the previous path's time", ours.value <= 1.5 * v1.value
        if n == 10000:
            ds.target, ds.met = "< 50 ms", ds.value < 50
        if "per_pack" in t:
            pp = row_from(f"baseline: open {n} packs, one TensorDict directory per pack",
                          t["per_pack"], "ms", 1e3, group=g,
                          note="the earlier layout (one memmap directory per pack)")  # fmt: skip
            out.append(pp)
            compare(out, ds.case, pp.case)
    return out
