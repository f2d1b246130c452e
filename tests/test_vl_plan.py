"""Plans over a VL sample store: the packer's rules on lengths alone, pack-by-pack bitwise
equality with the packed cache of the same options, and resume (same and other DP degree) over
plan indices through the cached_vl loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchtitan_ext.loaders.vl import CachedVLDataLoader
from torchtitan_ext.vl.build import build_cache
from torchtitan_ext.vl.cache import VLCache
from torchtitan_ext.vl.packing import best_fit_packs
from torchtitan_ext.vl.plan import PlannedStore, PlanOptions, plan_packs

from .support.resume import LoaderSpec, assert_resume_exact

ROWS_PER_SHARD = 12


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("vl_plan")
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    try:
        from torchtitan_ext.vl.sample_data import sample_dataset_path

        data = sample_dataset_path(n=30, bad_rows=True, root=root / "data")
        store = build_cache(data, "train", root / "cache", 1024, 8, rows_per_shard=ROWS_PER_SHARD,
                            show_progress=False, store=True)  # fmt: skip
        yield {"root": root, "data": data, "cache_dir": root / "cache", "store": store}
    finally:
        mp.undo()


def test_plan_follows_the_packer_per_shard():
    rng = np.random.default_rng(0)
    shards = [rng.integers(1, 900, size=n) for n in (50, 0, 37, 1)]
    opts = PlanOptions.make(1000, 6, [256, 512])
    plan = plan_packs(shards, opts)
    k = 0
    for s, lens in enumerate(shards):
        keep = np.flatnonzero(lens <= 1000)
        for pack in best_fit_packs(lens[keep].tolist(), 1000, 6):
            m = plan.members[plan.offsets[k] : plan.offsets[k + 1]]
            assert plan.shard[k] == s and m.tolist() == keep[pack].tolist()
            tokens = int(lens[m].sum())
            assert plan.tokens[k] == tokens <= 1000
            assert plan.pack_len[k] == min(b for b in (256, 512, 1000) if b >= tokens)
            k += 1
    assert k == len(plan) and plan.too_long == 0
    assert sorted((int(plan.shard[i]), int(x)) for i in range(len(plan))
                  for x in plan.members[plan.offsets[i] : plan.offsets[i + 1]]) == sorted(
        (s, i) for s, lens in enumerate(shards) for i in range(len(lens)))  # fmt: skip
    short = plan_packs(shards, PlanOptions.make(300, 6, None))
    assert short.too_long == sum(int((x > 300).sum()) for x in shards)
    assert short.stats()["samples"] + short.too_long == sum(map(len, shards))


@pytest.mark.parametrize(("seq_len", "buffer_size", "buckets"),
                         [(1024, 8, [512, 768]), (400, 3, [256])])  # fmt: skip
def test_plan_equals_the_packed_cache(env, seq_len, buffer_size, buckets):
    """Pack i of the plan is bitwise pack i of the packed cache built with the same options
    (the second case leaves samples out as too_long), and the store was built only once."""
    packed = VLCache.open(build_cache(env["data"], "train", env["cache_dir"], seq_len,
                                      buffer_size, buckets=buckets, show_progress=False,
                                      rows_per_shard=ROWS_PER_SHARD))  # fmt: skip
    again = build_cache(env["data"], "train", env["cache_dir"], seq_len, buffer_size,
                        buckets=buckets, rows_per_shard=ROWS_PER_SHARD, show_progress=False,
                        store=True)  # fmt: skip
    assert again == env["store"]
    planned = PlannedStore.open(env["store"], PlanOptions.make(seq_len, buffer_size, buckets))
    assert len(planned) == len(packed) > 1
    assert planned.pack_lengths().tolist() == packed.pack_lengths().tolist()
    # the store keeps the sample too long for any of these plans (its very large image)
    assert planned.plan.too_long > 0
    for i in range(len(packed)):
        a, b = packed.pack(i), planned.pack(i)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (i, k)
        assert packed.pack_rows(i) == planned.pack_rows(i)


def _build(env, seq_len: int, workers: int = 0):
    def build(rank: int, world: int, infinite: bool):
        cfg = CachedVLDataLoader.Config(
            dataset_path=str(env["data"]), cache_dir=str(env["root"] / "loader"), buffer_size=4,
            buckets=[256], infinite=infinite, num_workers=workers, queue_size=2,
            build_if_missing=True,
        )  # fmt: skip
        return cfg.build(dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=seq_len,
                         local_batch_size=1)  # fmt: skip

    return build


def test_loader_reads_the_plan_and_resumes(env):
    """The loader plans the store for its own seq_len and resumes over plan indices, exactly at
    the same degree (in process and with workers) and elastically 2 -> 3 -> 1."""
    first = _build(env, 400)(0, 1, False)
    assert first.source == "cache" and VLCache.open(first.cache_path).is_store
    planned = first.reader.dataset.cache
    assert isinstance(planned, PlannedStore) and planned.plan.options.seq_len == 400
    ids = {}
    for i in range(len(planned)):
        p = planned.pack(i)
        ids[tuple(p["input_ids"][: int(p["num_tokens"])].tolist())] = i
    assert len(ids) == len(planned)
    first.close()

    def doc_ids(batch):
        inp, _ = batch
        pad = planned.special_tokens["pad_id"]
        out = []
        for row in inp["input"].tolist():
            while row and row[-1] == pad:
                row.pop()
            out.append(ids[tuple(row)])
        return out

    for workers in (0, 2):
        spec = LoaderSpec("cached_vl", _build(env, 400, workers), doc_ids, set(ids.values()),
                          steps=2)  # fmt: skip
        assert_resume_exact(spec, cuts=(3, 4))
    spec = LoaderSpec("cached_vl", _build(env, 400), doc_ids, set(ids.values()), steps=1)
    assert_resume_exact(spec, steps=1, dp_from=2, dp_to=(3, 1))
