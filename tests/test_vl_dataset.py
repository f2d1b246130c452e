"""CachedVLDataset: global-order sharding, equal steps, exact/elastic resume, workers, collate.

Most sharding/state tests run on an in-memory fake cache (the dataset only needs ``len`` and
``pack(i)``); the tests at the end build a real tiny cache with ``build_cache`` from the shipped
sample set (``vl/sample_data.py``) and check, on it, the documented order and DP sharding,
resume, DataLoader workers, and that opening and resuming read no pack data.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from torchtitan_ext.vl.collate import (
    PackCollator,
    PixelNorm,
    collate_hf,
    collate_torchtitan,
    finish_on_device,
)
from torchtitan_ext.vl.dataset import (
    CachedVLDataset,
    advance,
    locate,
    rounds_left,
)

from .support.opens import needs_inotify, watch_opens
from .support.vl_order import documented_order

SPECIAL = {
    "image_pad_id": 7,
    "video_pad_id": 8,
    "vision_start_id": 5,
    "vision_end_id": 6,
    "pad_id": 0,
    "im_start_id": 3,
    "im_end_id": 4,
}


class FakeCache:
    """N packs; pack i has one 2x2-merge image of 4 patches and bucket length 8 or 12."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def pack(self, i: int) -> dict[str, torch.Tensor]:
        length = 8 if i % 2 == 0 else 12
        ids = torch.full((length,), 100 + i, dtype=torch.int64)
        ids[-2:] = SPECIAL["pad_id"]
        pos = torch.arange(length).repeat(4, 1)
        pos[:, -2:] = 0
        return {
            "input_ids": ids,
            "labels": torch.where(ids == 0, -100, ids),
            "position_ids": pos,
            "seq_lens": torch.tensor([length - 2], dtype=torch.int32),
            "pixel_u8": torch.full((4, 768), i % 256, dtype=torch.uint8),
            "image_grid_thw": torch.tensor([[1, 2, 2]]),
            "num_tokens": torch.tensor(length - 2),
        }


def take(ds, n: int) -> list[int]:
    it = iter(ds)
    return [int(next(it)["pack_index"]) for _ in range(n)]


# ----------------------------------------------------------------------------------- arithmetic


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    w=st.integers(1, 5),
    cursor=st.integers(0, 40),
    steps=st.integers(0, 30),
    wrap=st.booleans(),
)
def test_advance_matches_locate(n, w, cursor, steps, wrap):
    """Walking k items with ``locate`` and jumping with ``advance`` agree for every rank."""
    rem = "wrap" if wrap else "drop"
    if rem == "drop" and n < w:
        with pytest.raises(ValueError):
            advance(n, w, 0, 0, rounds_left(n, w, 0, rem) + 1, rem)
        return
    cursor = min(cursor, n)
    e1, c1 = advance(n, w, 0, cursor, steps, rem)
    for r in range(w):
        assert locate(n, w, r, 0, cursor, steps, rem) == locate(n, w, r, e1, c1, 0, rem)


@pytest.mark.parametrize("n,w", [(10, 1), (10, 2), (10, 3), (7, 4), (16, 4), (5, 5)])
@pytest.mark.parametrize("remainder", ["drop", "wrap"])
def test_epoch_is_disjoint_complete_and_equal(n, w, remainder):
    cache = FakeCache(n)
    per_rank = []
    for r in range(w):
        ds = CachedVLDataset(cache, r, w, infinite=False, seed=3, remainder=remainder)
        per_rank.append([int(p["pack_index"]) for p in ds])
    counts = {len(x) for x in per_rank}
    assert len(counts) == 1, "every rank must get the same number of packs"
    seen = list(itertools.chain(*per_rank))
    perm = documented_order(n, 3, 0)
    # rounds of w packs, rank r taking the r-th of each; "wrap" completes the last round from
    # the start of the permutation
    rounds = n // w if remainder == "drop" else -(-n // w)
    for r in range(w):
        assert per_rank[r] == [perm[(k * w + r) % n] for k in range(rounds)]
    if remainder == "drop":
        assert len(seen) == len(set(seen)) == (n // w) * w
        assert set(seen) == set(perm[: (n // w) * w])
    else:
        assert set(seen) == set(range(n))
        assert len(seen) == -(-n // w) * w


def test_drop_refuses_more_ranks_than_packs():
    with pytest.raises(ValueError, match="wrap"):
        CachedVLDataset(FakeCache(3), 0, 4, remainder="drop")
    ds = CachedVLDataset(FakeCache(3), 3, 4, remainder="wrap", infinite=False)
    assert len(list(ds)) == 1


def test_reshuffles_per_epoch_and_is_deterministic():
    n = 12
    a = take(CachedVLDataset(FakeCache(n), 0, 1, seed=5), 3 * n)
    b = take(CachedVLDataset(FakeCache(n), 0, 1, seed=5), 3 * n)
    assert a == b
    epochs = [a[i * n : (i + 1) * n] for i in range(3)]
    assert all(sorted(e) == list(range(n)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert take(CachedVLDataset(FakeCache(n), 0, 1, seed=6), n) != epochs[0]
    assert take(CachedVLDataset(FakeCache(n), 0, 1, shuffle=False), n) == list(range(n))


def test_finite_iteration_moves_to_next_epoch():
    ds = CachedVLDataset(FakeCache(6), 0, 1, infinite=False, seed=1)
    e0 = [int(p["pack_index"]) for p in ds]
    e1 = [int(p["pack_index"]) for p in ds]
    assert e0 == documented_order(6, 1, 0)
    assert e1 == documented_order(6, 1, 1)


# --------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("k", [0, 1, 5, 11, 12, 25])
def test_resume_exact(k):
    n = 12
    full = take(CachedVLDataset(FakeCache(n), 1, 2, seed=2), 30)
    ds = CachedVLDataset(FakeCache(n), 1, 2, seed=2)
    it = iter(ds)
    first = [int(next(it)["pack_index"]) for _ in range(k)]
    state = ds.state_dict()
    assert all(type(v) is int for v in state.values()), "state must be plain ints"
    ds2 = CachedVLDataset(FakeCache(n), 1, 2, seed=2)
    ds2.load_state_dict(state)
    assert first + take(ds2, 30 - k) == full


def _consume(w: int, n_cache: int, state, steps: int):
    """Every rank of a DP=w job reads ``steps`` packs from ``state``; returns (packs, state)."""
    got, states = [], []
    for r in range(w):
        ds = CachedVLDataset(FakeCache(n_cache), r, w, seed=9)
        if state:
            ds.load_state_dict(state)
        it = iter(ds)
        got.append([(int(p["pack_index"])) for p in itertools.islice(it, steps)])
        states.append(ds.state_dict())
    assert all(
        (s["epoch"], s["cursor"]) == (states[0]["epoch"], states[0]["cursor"]) for s in states
    ), "all ranks must agree on the global state"
    return got, states[0]


@pytest.mark.parametrize("w_before,w_after", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 1)])
def test_elastic_resume_no_repeat_no_skip(w_before, w_after):
    n = 24
    steps_before = 5 // w_before + 1
    before, state = _consume(w_before, n, None, steps_before)
    assert state["epoch"] == 0 and state["cursor"] == steps_before * w_before
    left = rounds_left(n, w_after, state["cursor"], "drop")
    after, state2 = _consume(w_after, n, state, left)
    seen = list(itertools.chain(*before, *after))
    perm = documented_order(n, 9, 0)
    assert len(seen) == len(set(seen)), "no pack repeated within the epoch"
    # Exactly the global order's prefix: nothing skipped except the final remainder < w_after.
    assert set(seen) == set(perm[: len(seen)])
    assert n - len(seen) < w_after
    assert (state2["epoch"], state2["cursor"]) == (1, 0)


def test_state_mismatch_is_refused():
    ds = CachedVLDataset(FakeCache(10), 0, 1, seed=1)
    take(ds, 3)
    st_ = ds.state_dict()
    with pytest.raises(ValueError, match="num_packs"):
        CachedVLDataset(FakeCache(11), 0, 1, seed=1).load_state_dict(st_)
    with pytest.raises(ValueError, match="seed"):
        CachedVLDataset(FakeCache(10), 0, 1, seed=2).load_state_dict(st_)


# -------------------------------------------------------------------------------------- workers


def _ids(batch) -> list[int]:
    # input_ids of the fake packs are 100 + pack index (pad at the end)
    return [int(row[0]) - 100 for row in batch["input_ids"]]


@pytest.mark.parametrize("num_workers", [2, 3])
def test_workers_give_the_single_process_order(num_workers):
    n, b = 20, 2
    coll = PackCollator("hf", SPECIAL, normalize_on="device")
    ref = CachedVLDataset(FakeCache(n), 0, 1, infinite=False, seed=4, block_size=b)
    ref_ids = [i for batch in DataLoader(ref, batch_size=b, collate_fn=coll) for i in _ids(batch)]
    ds = CachedVLDataset(FakeCache(n), 0, 1, infinite=False, seed=4, block_size=b)
    dl = DataLoader(ds, batch_size=b, collate_fn=coll, num_workers=num_workers)
    got = [i for batch in dl for i in _ids(batch)]
    assert got == ref_ids == documented_order(n, 4, 0)


def test_stateful_dataloader_workers_resume_bitwise():
    """torchdata's StatefulDataLoader stores one dataset state per worker; resume is exact."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    n, b, k = 15, 2, 4

    def make():
        ds = CachedVLDataset(FakeCache(n), 1, 2, seed=8, block_size=b)
        coll = PackCollator("hf", SPECIAL, normalize_on="device")
        return StatefulDataLoader(ds, batch_size=b, collate_fn=coll, num_workers=2)

    full_it = iter(make())
    full = [next(full_it) for _ in range(10)]
    dl = make()
    it = iter(dl)
    for _ in range(k):
        next(it)
    state = dl.state_dict()
    dl2 = make()
    dl2.load_state_dict(state)
    rest = list(itertools.islice(iter(dl2), 10 - k))
    for a, b_ in zip(full[k:], rest, strict=True):
        assert a.keys() == b_.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b_[key]), key


def test_worker_state_refuses_other_layout():
    ds = CachedVLDataset(FakeCache(10), 0, 1)
    bad = ds.state_dict() | {"num_workers": 2, "worker_id": 1, "yielded": 3}
    with pytest.raises(ValueError, match="per-worker"):
        CachedVLDataset(FakeCache(10), 0, 1).load_state_dict(bad)


# -------------------------------------------------------------------------------------- collate


def test_collate_formats_on_fake_packs():
    cache = FakeCache(4)
    packs = [cache.pack(0), cache.pack(1)]  # lengths 8 and 12 -> padded to 12
    hf = collate_hf(packs, pad_id=0, normalize_on="collate")
    assert hf["input_ids"].shape == (2, 12) and hf["position_ids"].shape == (4, 2, 12)
    assert hf["pixel_values"].shape == (8, 1536) and hf["pixel_values"].dtype == torch.float32
    assert hf["use_cache"] is False and "attention_mask" not in hf
    assert (hf["labels"][0, 8:] == -100).all() and (hf["input_ids"][0, 8:] == 0).all()
    inp, labels = collate_torchtitan(packs, special_tokens=SPECIAL, normalize_on="collate")
    assert inp["input"].shape == labels.shape == (2, 12)
    assert torch.equal(labels[:, :-1], hf["labels"][:, 1:]) and (labels[:, -1] == -100).all()
    assert inp["mrope_positions"].shape == (2, 12, 3)
    mrope = inp["mrope_positions"].permute(2, 0, 1)
    assert torch.equal(mrope[:, 0, :6], hf["position_ids"][1:, 0, :6])  # real tokens: the cache's
    assert torch.equal(mrope[:, 1, :10], hf["position_ids"][1:, 1, :10])
    # padding (2 + 4 rows in pack 0, 2 in pack 1) numbered 0, 1, ... like MultiModalCollator
    assert torch.equal(mrope[:, 0, 6:], torch.arange(6).expand(3, 6))
    assert torch.equal(mrope[:, 1, 10:], torch.arange(2).expand(3, 2))
    assert torch.equal(inp["positions"], hf["position_ids"][0])
    assert inp["pixel_values"].shape == (2, 4, 1536)
    assert torch.equal(inp["pixel_values"].reshape(-1, 1536), hf["pixel_values"])
    assert inp["special_tokens"] == {
        "image_id": 7,
        "video_id": 8,
        "vision_start_id": 5,
        "vision_end_id": 6,
        "pad_id": 0,
    }
    # device normalisation gives the same bits as collate normalisation
    dev = finish_on_device(collate_torchtitan(packs, special_tokens=SPECIAL, normalize_on="device"))
    assert torch.equal(dev[0]["pixel_values"], inp["pixel_values"])
    dev_hf = finish_on_device(collate_hf(packs, pad_id=0, normalize_on="device"))
    assert torch.equal(dev_hf["pixel_values"], hf["pixel_values"])


def test_torchtitan_pixels_pad_per_image():
    cache = FakeCache(2)
    p = cache.pack(0)
    p["pixel_u8"] = torch.cat(
        [torch.full((4, 768), 10, dtype=torch.uint8)] * 1
        + [torch.full((16, 768), 20, dtype=torch.uint8)]
    )
    p["image_grid_thw"] = torch.tensor([[1, 2, 2], [1, 4, 4]])
    inp, _ = collate_torchtitan([p], special_tokens=SPECIAL, normalize_on="collate")
    assert inp["pixel_values"].shape == (2, 16, 1536)
    assert (inp["pixel_values"][0, 4:] == 0).all(), "padding rows are exactly zero"
    norm = PixelNorm()
    assert torch.allclose(
        inp["pixel_values"][0, 0, 0], torch.tensor((10 / 255 - norm.mean[0]) / 0.5)
    )
    dev, _ = finish_on_device(
        collate_torchtitan([p], special_tokens=SPECIAL, normalize_on="device")
    )
    assert torch.equal(dev["pixel_values"], inp["pixel_values"])


def test_pixel_norm_from_metadata():
    md = {"processor": {"image": {"mean": [0.1, 0.2, 0.3], "std": [1, 2, 3], "merge_size": 2}}}
    n = PixelNorm.from_metadata(md)
    assert n.mean == (0.1, 0.2, 0.3) and n.std == (1.0, 2.0, 3.0) and n.temporal_patch_size == 2


class ExplodingCache(FakeCache):
    def pack(self, i: int):
        raise AssertionError("pack data was read")


def test_construction_and_state_read_no_pack_data():
    ds = CachedVLDataset(ExplodingCache(10_000), 1, 4, seed=1)
    assert ds.num_packs == 10_000 and ds.packs_per_epoch() == 2_500
    ds.load_state_dict(ds.state_dict() | {"cursor": 400})
    assert ds.pack_index_of(0) == (0, documented_order(10_000, 1, 0)[401])


def test_pickled_dataset_reopens_lazily(tmp_path, monkeypatch):
    import pickle

    import torchtitan_ext.vl.dataset as mod

    opened = []
    monkeypatch.setattr(mod, "_open_cache", lambda p: opened.append(p) or FakeCache(5))
    (tmp_path / "metadata.json").write_text("{}")
    ds = CachedVLDataset(tmp_path, 0, 1)
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker receives
    assert clone._cache is None and len(opened) == 1
    assert len(take(clone, 3)) == 3 and len(opened) == 2


def test_resolve_cache_dir(tmp_path):
    from torchtitan_ext.vl.dataset import resolve_cache_dir

    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_cache_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not a VL cache"):
        resolve_cache_dir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metadata.json").write_text("{}")
    assert resolve_cache_dir(tmp_path) == tmp_path / "a"
    assert resolve_cache_dir(tmp_path / "a") == tmp_path / "a"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metadata.json").write_text("{}")
    with pytest.raises(ValueError, match="2 caches"):
        resolve_cache_dir(tmp_path)


def test_is_stateful_for_dcp_and_torchdata():
    from torch.distributed.checkpoint.stateful import Stateful
    from torchdata.stateful_dataloader import Stateful as TDStateful

    ds = CachedVLDataset(FakeCache(4), 0, 1)
    assert isinstance(ds, Stateful) and isinstance(ds, TDStateful)


# ------------------------------------------------------------------------------ a real cache


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    from .support.vl_sample import sample_cache

    with sample_cache(tmp_path_factory, "vl_dataset", n=24, buckets=None) as env:
        from torchtitan_ext.vl.cache import VLCache

        yield {**env, "cache": VLCache.open(env["path"])}


def _same_pack(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], want[k]) for k in want)


def test_real_cache_ranks_read_the_documented_order(real):
    """DP=2 over a cache built from the sample set: rank r's k-th pack is
    ``VLCache.pack(randperm(N, seed)[2k + r])``, tensors and all; the ranks are disjoint."""
    cache, n = real["cache"], len(real["cache"])
    assert n >= 4, "the fixture needs a few packs"
    perm = documented_order(n, 5, 0)
    seen = []
    for r in range(2):
        got = list(CachedVLDataset(real["path"], r, 2, infinite=False, seed=5))
        assert len(got) == n // 2
        for k, p in enumerate(got):
            assert int(p["pack_index"]) == perm[2 * k + r]
            assert _same_pack(p, cache.pack(perm[2 * k + r]))
        seen += [int(p["pack_index"]) for p in got]
    assert len(set(seen)) == len(seen) == 2 * (n // 2)


def test_real_cache_resume_and_workers(real):
    """A state saved after k packs resumes with the same packs; a DataLoader with 2 workers
    (each re-opening the cache) serves the single-process order."""
    path, n = real["path"], len(real["cache"])
    full = take(CachedVLDataset(path, 0, 1, seed=2), 2 * n)
    ds = CachedVLDataset(path, 0, 1, seed=2)
    it = iter(ds)
    head = [int(next(it)["pack_index"]) for _ in range(3)]
    ds2 = CachedVLDataset(path, 0, 1, seed=2)
    ds2.load_state_dict(ds.state_dict())
    assert head + take(ds2, 2 * n - 3) == full
    assert full == documented_order(n, 2, 0) + documented_order(n, 2, 1)
    coll = PackCollator("hf", real["cache"].special_tokens, normalize_on="device")
    one = CachedVLDataset(path, 0, 1, infinite=False, seed=2, block_size=2)
    two = CachedVLDataset(path, 0, 1, infinite=False, seed=2, block_size=2)
    a = list(DataLoader(one, batch_size=2, collate_fn=coll))
    b = list(DataLoader(two, batch_size=2, collate_fn=coll, num_workers=2))
    assert len(a) == len(b) == -(-n // 2)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x["pixel_values"], y["pixel_values"]) for x, y in zip(a, b, strict=True))


@needs_inotify
def test_real_cache_open_and_resume_read_no_pack_data(real):
    """Constructing the dataset, saving and loading its state and locating its next packs open
    no data file of the cache (only the manifest's shard meta.json); the first pack does."""
    shards = sorted(d for d in (real["path"] / "shards").iterdir() if d.is_dir())
    with watch_opens(shards) as opened:
        ds = CachedVLDataset(real["path"], 1, 2, seed=3)
        ds.load_state_dict(ds.state_dict() | {"cursor": 2})
        ds.pack_index_of(5)
        assert {name for _, name in opened()} == {"meta.json"}
        next(iter(ds))
        assert any(name.endswith(".memmap") for _, name in opened())
