"""The VL sample store: its key leaves the plan options out, it holds one unpadded sample per
entry with the packed cache's integrity machinery, and a loader re-plans it for a new pack length
without its source and without decoding an image."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest

from torchtitan_ext.loaders.vl import CachedVLDataLoader
from torchtitan_ext.vl.build import build_cache, config_from, resolve
from torchtitan_ext.vl.cache import VLCache, verify_cache
from torchtitan_ext.vl.inspect import main as inspect_main

SEQ = 1024
BUCKETS = [512, 768]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("vl_store")
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    try:
        from torchtitan_ext.vl.sample_data import sample_dataset_path

        data = sample_dataset_path(n=24, root=root / "data")
        store = build_cache(data, "train", root / "cache", SEQ, 8, buckets=BUCKETS,
                            rows_per_shard=10, show_progress=False, store=True)  # fmt: skip
        yield {"root": root, "data": data, "cache_dir": root / "cache", "store": store}
    finally:
        mp.undo()


def test_store_key_leaves_out_plan_options(env):
    def kdir(**kw):
        base = dict(seq_len=SEQ, buffer_size=8, buckets=BUCKETS, store=True, rows_per_shard=10)
        return resolve(config_from(env["data"], "train", **(base | kw)), env["cache_dir"]).kdir

    one = kdir()
    assert one == env["store"]
    assert kdir(seq_len=2048, buffer_size=64, buckets=None) == one
    assert kdir(max_samples=5) != one, "the rows read are part of the store"
    assert kdir(truncate=True) != kdir(truncate=True, seq_len=768), "a cut depends on seq_len"
    assert kdir(store=False) != one, "a packed cache is another directory"


def test_store_holds_unpadded_samples_and_checks_itself(env, capsys):
    store = VLCache.open(env["store"])
    assert store.is_store and store.metadata["config"]["store"] is True
    assert "seq_len" not in store.metadata["config"] and "buckets" not in store.metadata["config"]
    assert len(store) == store.metadata["counts"]["samples"] > 0
    rows = []
    for i in range(len(store)):
        p = store.pack(i)
        assert p["input_ids"].shape[0] == int(p["num_tokens"]) == int(p["seq_lens"].sum())
        assert len(p["seq_lens"]) == 1
        rows += store.pack_rows(i)
    assert rows == sorted(rows), "a store keeps its samples in row order"
    assert verify_cache(env["store"]) == []
    assert inspect_main(["--cache-dir", str(env["store"]), "--json"]) == 0
    assert '"store": true' in capsys.readouterr().out
    assert inspect_main(["--cache-dir", str(env["store"]), "--seq-len", "768", "--buckets", "512",
                         "--buffer-size", "8"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "plan: seq_len / buffer / buckets" in out and "768 / 8 / [512, 768]" in out
    assert "sample store" in out


def _loader(data, cache_dir, seq_len, **cfg):
    base = dict(dataset_path=str(data), cache_dir=str(cache_dir), buffer_size=8,
                buckets=[b for b in BUCKETS if b <= seq_len], infinite=False)  # fmt: skip
    return CachedVLDataLoader.Config(**(base | cfg)).build(
        dp_rank=0, dp_world_size=1, tokenizer=None, seq_len=seq_len, local_batch_size=1
    )


def test_replan_without_source_decodes_nothing(env, tmp_path, monkeypatch, caplog):
    """A store built once; the source moved away; a new pack length plans and trains from the
    store, with no image decoded and one line saying the source could not be re-checked."""
    data = tmp_path / "data"
    shutil.copytree(env["data"], data)
    first = _loader(data, tmp_path / "c", SEQ, build_if_missing=True)
    assert first.source == "cache" and VLCache.open(first.cache_path).is_store
    n_first = len(list(first))
    import torchtitan_ext.vl.processor as proc

    decoded = []
    real = proc.decode_image

    def counted(*a, **kw):
        decoded.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(proc, "decode_image", counted)
    present = _loader(data, tmp_path / "c", 768, build_if_missing=True)
    assert present.cache_path == first.cache_path and len(list(present)) > n_first
    assert decoded == [], "a new seq_len with the source present: a new plan, nothing decoded"
    shutil.move(str(data), str(tmp_path / "moved"))
    with caplog.at_level(logging.WARNING):
        again = _loader(data, tmp_path / "c", 768)
    assert again.cache_path == first.cache_path
    absent = [r.getMessage() for r in caplog.records if "absent" in r.getMessage()]
    assert len(absent) == 1 and "could not be re-checked" in absent[0]
    batches = list(again)
    assert len(batches) > n_first, "shorter packs: more of them"
    for inp, _ in batches:
        assert inp["input"].shape[1] in (512, 768)
    assert decoded == [], "no image is decoded to re-plan"

    with pytest.raises(FileNotFoundError, match="no sample store"):
        _loader(data, tmp_path / "c", 768, max_samples=5)


def test_too_long_samples_are_stored_and_left_out_by_the_plan(env):
    """A store keeps every sample whatever its length; a plan skips those above its seq_len."""
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    store = VLCache.open(env["store"])
    lens = np.concatenate([store.shard_sample_lengths(s) for s in range(store.num_shards)])
    cut = int(np.sort(lens)[len(lens) // 2])
    planned = PlannedStore.open(env["store"], PlanOptions.make(cut, 8, None))
    assert planned.plan.too_long == int((lens > cut).sum()) > 0
    assert int(planned.plan.tokens.max()) <= cut
