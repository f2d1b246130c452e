"""Planned-store packs in the torchtitan layout: the pixels are copied once, from the store's
memory maps straight into the per-image padded batch (``vl/pixel_rows.py``), and every batch is
bitwise the packed cache's (formats, normalisation sites, batch sizes, DataLoader workers)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from tests.test_vl_loader import same
from torchtitan_ext.loaders.vl import CachedVLDataLoader
from torchtitan_ext.vl.build import build_cache
from torchtitan_ext.vl.cache import VLCache
from torchtitan_ext.vl.collate import PackCollator, PixelNorm
from torchtitan_ext.vl.collate_torchtitan import _pad_per_image
from torchtitan_ext.vl.pixel_rows import PixelRows
from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

SEQ, BUFFER, BUCKETS, ROWS_PER_SHARD = 1024, 8, [512, 768], 12


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A sample store and the packed cache of the same rows and options (several shards)."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("vl_plan_tt")
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    try:
        from torchtitan_ext.vl.sample_data import sample_dataset_path

        data = sample_dataset_path(n=40, root=root / "data")
        kw = dict(buckets=BUCKETS, rows_per_shard=ROWS_PER_SHARD, show_progress=False)
        store = build_cache(data, "train", root / "cache", SEQ, BUFFER, store=True, **kw)
        packed = build_cache(data, "train", root / "cache", SEQ, BUFFER, **kw)
        planned = PlannedStore.open(store, PlanOptions.make(SEQ, BUFFER, BUCKETS))
        cache = VLCache.open(packed)
        assert len(planned) == len(cache) > 4 and cache.num_shards > 1
        yield {"root": root, "store": store, "packed": packed, "planned": planned, "cache": cache}
    finally:
        mp.undo()


def _collator(env, fmt: str, on: str) -> PackCollator:
    c = env["cache"]
    return PackCollator(fmt, c.special_tokens, PixelNorm.from_metadata(c.metadata), on)


def _batches(env, fmt: str, on: str, b: int):
    """(packed-cache batch, planned batch) of packs ``i .. i+b-1`` read as the loader reads
    them (``copy_pixels = not copies_pixels``), the last batch spanning two store shards."""
    coll = _collator(env, fmt, on)
    copy = not coll.copies_pixels
    n = len(env["cache"])
    for i in range(0, n - b + 1, b):
        idx = range(i, i + b)
        yield (coll([env["cache"].pack(j, copy_pixels=copy) for j in idx]),
               coll([env["planned"].pack(j, copy_pixels=copy) for j in idx]))  # fmt: skip


@pytest.mark.parametrize("fmt", ["torchtitan", "hf", "qwen3_vl"])
@pytest.mark.parametrize("on", ["collate", "device"])
@pytest.mark.parametrize("b", [1, 3])
def test_planned_batches_equal_the_packed_cache(env, fmt, on, b):
    shards = {int(env["planned"].plan.shard[i]) for i in range(len(env["planned"]))}
    assert len(shards) > 1
    n = 0
    for want, got in _batches(env, fmt, on, b):
        assert same(want, got)
        n += 1
    assert n >= 2


def test_a_planned_pack_for_a_copying_collate_leaves_its_pixels_in_the_store(env):
    """``copy_pixels=False``: ``pixel_u8`` is per-sample views of the store's map whose rows are
    the materialised pack's bitwise; every other key is the same tensor."""
    planned = env["planned"]
    maps = [planned.store.shard_arrays(s)["pixels"] for s in range(planned.store.num_shards)]
    for i in range(len(planned)):
        full, rows = planned.pack(i), planned.pack(i, copy_pixels=False)
        assert full.keys() == rows.keys()
        px = rows.pop("pixel_u8")
        assert isinstance(px, PixelRows) and px.shape == tuple(full["pixel_u8"].shape)
        assert all(any(np.shares_memory(s, m) for m in maps) for s in px.segments)
        assert torch.equal(px.tensor(), full.pop("pixel_u8"))
        assert same(full, rows)


def test_the_pixels_are_copied_once(env, monkeypatch):
    """Fetch + torchtitan collate of planned packs gathers no pixel rows (no concatenate / cat
    of uint8 patch rows): each image's rows go from the store's map into the output buffer.
    The earlier read gathered each pack's pixels into one array first (``np.concatenate`` in
    ``PlannedStore.pack``; ``torch.cat`` across packs), then copied them again."""
    planned, dim = env["planned"], env["planned"].store.shard_arrays(0)["pixels"].shape[1]
    gathered: list[tuple[int, ...]] = []

    def is_pixels(x) -> bool:
        return x.ndim == 2 and x.shape[0] > 0 and x.shape[1] == dim and x.dtype in (
            np.uint8, torch.uint8)  # fmt: skip

    def spy(real):
        def wrapped(parts, *a, **kw):
            out = real(parts, *a, **kw)
            if is_pixels(out):
                gathered.append(tuple(out.shape))
            return out

        return wrapped

    for on in ("device", "collate"):
        coll = _collator(env, "torchtitan", on)
        assert coll.copies_pixels
        monkeypatch.setattr(np, "concatenate", spy(np.concatenate))
        monkeypatch.setattr(torch, "cat", spy(torch.cat))
        inp, _ = coll([planned.pack(j, copy_pixels=not coll.copies_pixels) for j in (0, 1, 2)])
        monkeypatch.undo()
        assert inp["pixel_values"].shape[0] > 3
        assert gathered == [], f"pixel rows gathered before the padding copy: {gathered}"


def test_pixel_rows_ranges_and_pickling(env):
    a = np.arange(5 * 4, dtype=np.uint8).reshape(5, 4)
    b = np.arange(100, 100 + 3 * 4, dtype=np.uint8).reshape(3, 4)
    rows = PixelRows.of([a[1:4], torch.from_numpy(b), np.zeros((0, 4), np.uint8)], 4)
    want = np.concatenate([a[1:4], b])
    assert rows.shape == (6, 4) and len(rows.segments) == 2
    for lo in range(7):
        for hi in range(lo, 7):
            assert np.array_equal(rows[lo:hi], want[lo:hi]), (lo, hi)
    assert np.shares_memory(rows[0:3], a) and np.shares_memory(rows[3:6], b)
    assert torch.equal(rows.tensor(), torch.from_numpy(want))
    assert PixelRows.of([], 4).tensor().shape == (0, 4)
    # pickles as its rows, never the whole map it views
    planned = env["planned"]
    px = planned.pack(0, copy_pixels=False)["pixel_u8"]
    blob = pickle.dumps(px)
    mapped = planned.store.shard_arrays(int(planned.plan.shard[0]))["pixels"].nbytes
    assert len(blob) < px.shape[0] * px.shape[1] + 4096 < mapped
    assert torch.equal(pickle.loads(blob).tensor(), px.tensor())


def test_pad_per_image_takes_rows_or_a_tensor(env):
    pack = env["planned"].pack(1, copy_pixels=False)
    grid, ms = pack["image_grid_thw"], env["planned"].spatial_merge_size
    a = _pad_per_image(pack["pixel_u8"], grid, ms)
    b = _pad_per_image(pack["pixel_u8"].tensor(), grid, ms)
    assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b)
    with pytest.raises(ValueError):  # fewer rows than the grids say: as for a tensor
        _pad_per_image(PixelRows.of(pack["pixel_u8"].segments[:-1], a.shape[-1]), grid, ms)


def _loader(env, path, workers: int, on: str) -> CachedVLDataLoader:
    cfg = CachedVLDataLoader.Config(
        cache_path=str(path), buffer_size=BUFFER, buckets=BUCKETS, infinite=False,
        num_workers=workers, batch_format="torchtitan", normalize_on=on,
    )  # fmt: skip
    return cfg.build(dp_rank=0, dp_world_size=1, tokenizer=None, seq_len=SEQ,
                     local_batch_size=2)  # fmt: skip


@pytest.mark.parametrize(("workers", "on"), [(0, "device"), (2, "collate")])
def test_the_loader_over_the_store_gives_the_packed_cache_batches(env, workers, on):
    """The cached_vl loader over the store (pixels left in it: ``copy_pixels`` False) and over
    the packed cache give the same epoch of torchtitan batches, in process and with workers."""
    a, b = _loader(env, env["store"], workers, on), _loader(env, env["packed"], workers, on)
    assert isinstance(a.reader.dataset.cache, PlannedStore)
    assert a.reader.dataset.copy_pixels is False
    got, want = list(a), list(b)
    a.close(), b.close()
    assert len(got) == len(want) >= 2
    for x, y in zip(got, want, strict=True):
        assert same(x, y)


def test_planned_video_packs_collate_as_the_packed_cache(tmp_path_factory):
    """Packs holding video (``video_u8`` stays a tensor) read with ``copy_pixels=False``: every
    format and normalisation site gives the packed cache's batch, or the same one error."""
    from tests.test_vl_video_cache import SEQ as VSEQ
    from tests.test_vl_video_cache import write_video_rows

    root = tmp_path_factory.mktemp("vl_plan_tt_video")
    data = write_video_rows(root / "data")
    kw = dict(show_progress=False, buckets=None)
    store = build_cache(data, "train", root / "cache", VSEQ, 8, store=True, **kw)
    cache = VLCache.open(build_cache(data, "train", root / "cache", VSEQ, 8, **kw))
    planned = PlannedStore.open(store, PlanOptions.make(VSEQ, 8, None))
    assert len(planned) == len(cache)
    videos = 0
    for fmt in ("torchtitan", "hf", "qwen3_vl"):
        for on in ("collate", "device"):
            coll = PackCollator(fmt, cache.special_tokens, PixelNorm.from_metadata(cache.metadata),
                                on)  # fmt: skip
            for i in range(len(cache)):
                want, got = (_collate_or_error(coll, src.pack(i, copy_pixels=False))
                             for src in (cache, planned))  # fmt: skip
                assert same(want, got), (fmt, on, i)
                videos += "video_u8" in planned.pack(i)
    assert videos > 0


def _collate_or_error(coll: PackCollator, pack):
    try:
        return coll([pack])
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("on", ["collate", "device"])
def test_a_batch_mixing_packed_and_planned_packs(env, on):
    """A mixture may batch a packed cache's pack (a tensor view) with a planned one (rows in
    the store): the batch is that of the two packed-cache packs."""
    coll, cache, planned = _collator(env, "torchtitan", on), env["cache"], env["planned"]
    n = len(cache)
    want = coll([cache.pack(0, copy_pixels=False), cache.pack(n - 1, copy_pixels=False)])
    got = coll([cache.pack(0, copy_pixels=False), planned.pack(n - 1, copy_pixels=False)])
    assert same(want, got)
