"""VL sample store + plan: plan build time for 1k / 100k / 1M stored sample lengths, and a re-plan (a new seq_len over an existing store) vs the full rebuild of a packed cache for that seq_len, on the shipped sample set.

Cases (baselines measured in the same run, interleaved with what they are compared to):

* **plan**: ``plan_packs`` over simulated stored lengths (1,024 samples per shard, as a default
  store; lengths 60-2,000 tokens, a VQA/chat mix with one to a few images), ``seq_len`` 8192,
  ``buffer_size`` 64, buckets 4096,6144: seconds per plan and µs per sample. The baseline row
  is the packer alone (``best_fit_packs`` over the same lengths, one call per shard): the plan's
  cost over the packer is its numpy bookkeeping.
* **replan**: the shipped ``sample`` set (``--set rows=N``, default 300; quick 48). Baseline: a
  full rebuild of the packed cache for a new ``seq_len`` (``build_cache(..., force=True)``:
  decode, resize, patchify, tokenise, pack, write, hash), in process. Candidate: the plan of a
  new ``seq_len`` over the store already built (``PlannedStore.open``: open + checks + plan; no
  image decoded). Interleaved, the ratio is paired per round.

Options (``--set key=value``): ``sizes`` (comma list, default 1000,100000,1000000; quick
1000,100000), ``rows`` (replan rows).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import BenchArgs, Row, compare, interleave, row_from

SEQ = 8192
BUFFER = 64
BUCKETS = [4096, 6144]
PER_SHARD = 1024


def _lengths(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(60, 2000, size=n, dtype=np.int64)
    return [lens[a : a + PER_SHARD] for a in range(0, n, PER_SHARD)]


def _plan_rows(args: BenchArgs) -> list[Row]:
    from torchtitan_ext.vl.packing import best_fit_packs
    from torchtitan_ext.vl.plan import PlanOptions, plan_packs

    sizes = args.extra.get("sizes", "1000,100000" if args.quick else "1000,100000,1000000")
    opts = PlanOptions.make(SEQ, BUFFER, BUCKETS)
    out: list[Row] = []
    for n in (int(x) for x in sizes.split(",")):
        shards = _lengths(n)
        lists = [s.tolist() for s in shards]

        def plan(shards=shards) -> dict:
            p = plan_packs(shards, opts)
            return {"packs": len(p), "fill_pct": p.stats()["fill_pct"]}

        def packer(lists=lists) -> None:
            for x in lists:
                for _ in best_fit_packs(x, SEQ, BUFFER):
                    pass

        reps = 3 if n >= 1_000_000 else max(args.repeats, 3)
        t = interleave({"plan": plan, "packer": packer}, reps, args.warmup, args.guard())
        info = {"samples": n, "shards": len(shards), **t["plan"].results[-1]}
        g = f"plan{n}"
        base = f"packer alone (best_fit_packs per shard), {n:,} samples"
        out.append(row_from(base, t["packer"], "s", group=g, info=info))
        name = f"plan build, {n:,} samples"
        out.append(row_from(name, t["plan"], "s", group=g, info=info,
                            note=f"{1e6 * min(t['plan'].samples) / n:.2f} us/sample at best"))  # fmt: skip
        compare(out, name, base)
        if n >= 1_000_000:
            out[-1].target, out[-1].met = "seconds for 1M samples", out[-1].value < 10
    return out


def _replan_rows(args: BenchArgs, work: Path) -> list[Row]:
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    n = int(args.extra.get("rows", 48 if args.quick else 300))
    data = sample_dataset_path(n=n, root=work / "data")
    store = build_cache(data, "train", work / "c", 1024, 8, show_progress=False, store=True)
    k = {"i": 0}
    lengths = (768, 1024, 1536, 2048)

    def rebuild() -> None:
        seq = lengths[k["i"] % len(lengths)]
        build_cache(data, "train", work / "packed", seq, 8, force=True, show_progress=False)

    def replan() -> dict:
        seq = lengths[k["i"] % len(lengths)]
        k["i"] += 1
        p = PlannedStore.open(store, PlanOptions.make(seq, 8, None))
        return {"packs": len(p)}

    import torch

    threads = torch.get_num_threads()
    t = interleave({"rebuild": rebuild, "replan": replan}, max(args.repeats, 3), args.warmup,
                   args.guard())  # fmt: skip
    torch.set_num_threads(threads)
    info = {"rows": n, "seq_lens": list(lengths)}
    base = f"full rebuild of the packed cache for a new seq_len, {n} sample rows"
    name = f"re-plan of the sample store for a new seq_len, {n} sample rows"
    out = [
        row_from(base, t["rebuild"], "s", group="replan", info=info,
                 note="decode, resize, patchify, tokenise, pack, write, hash; in process"),
        row_from(name, t["replan"], "s", group="replan", info=info,
                 note="open + checks + plan from the stored lengths; no image decoded"),
    ]  # fmt: skip
    compare(out, name, base)
    return out


def run(args: BenchArgs) -> list[Row]:
    work = Path(tempfile.mkdtemp(prefix="vl_plan_bench_"))
    old = os.environ.get("TORCHTITAN_EXT_CACHE")
    os.environ.setdefault("TORCHTITAN_EXT_CACHE", str(work / "home"))
    t0 = time.perf_counter()
    try:
        rows = _plan_rows(args) + _replan_rows(args, work)
        for r in rows:
            r.info.setdefault("case_wall_s", round(time.perf_counter() - t0, 1))
        return rows
    finally:
        if old is None:
            os.environ.pop("TORCHTITAN_EXT_CACHE", None)
        shutil.rmtree(work, ignore_errors=True)
