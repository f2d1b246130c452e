"""The torchtitan-facing VL loader: cache resolution (use / build / force / online fallback),
batch formats and bucket shapes, exact resume with workers, elastic resume through DCP, the
online fallback's own resume, and the TOML configs."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from pathlib import Path

import pytest
import torch

from torchtitan_ext.loaders.vl import CachedVLDataLoader, OnlinePreprocessingWarning
from torchtitan_ext.pipeline.checkpoint import LoaderStateError
from torchtitan_ext.vl.collate import finish_on_device

from .support.resume import LoaderSpec, assert_resume_exact
from .support.vl_order import documented_order
from .support.vl_sample import sample_cache

REPO = Path(__file__).resolve().parents[1]
SEQ = 1024
BUCKETS = [512, 768]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with sample_cache(tmp_path_factory, "vl_loader", n=48, seq_len=SEQ, buckets=BUCKETS) as env:
        yield env


def make(env, dp_rank=0, dp_world_size=1, batch=2, **cfg):
    base = dict(
        dataset_path=str(env["data"]),
        cache_dir=str(env["cache_dir"]),
        buffer_size=8,
        buckets=BUCKETS,
    )
    base.update(cfg)
    return CachedVLDataLoader.Config(**base).build(
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        tokenizer=None,
        seq_len=SEQ,
        local_batch_size=batch,
        snapshot_every_n_steps=1,
    )


def plain(x) -> bool:
    """Only ints / strings / lists (tuples) / dicts of those (no pickled bytes, no objects)."""
    if isinstance(x, dict):
        return all(isinstance(k, str) and plain(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(plain(v) for v in x)
    return isinstance(x, (int, str)) and not isinstance(x, bool)


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_uses_existing_cache_and_torchtitan_format(env):
    dl = make(env, infinite=False)
    assert dl.source == "cache" and dl.cache_path == env["path"]
    batches = list(dl)
    assert batches, "an epoch has batches"
    shapes = set()
    for inp, labels in batches:
        assert set(inp) >= {"input", "positions", "mrope_positions", "pixel_values", "grid_thw"}
        assert inp["special_tokens"]["image_id"] == dl.special_tokens["image_pad_id"]
        b, length = inp["input"].shape
        shapes.add((b, length))
        assert labels.shape == (b, length) and inp["positions"].shape == (b, length)
        assert inp["mrope_positions"].shape == (b, length, 3)
        assert inp["pixel_values"].dtype == torch.float32 and inp["pixel_values"].shape[-1] == 1536
        assert inp["pixel_values"].shape[0] == inp["grid_thw"].shape[0]
    # Every batch has one of the configured bucket shapes (batch dim: 2, or 1 for an odd tail).
    lengths = {length for _, length in shapes}
    assert lengths <= set(BUCKETS + [SEQ]), shapes
    assert len(lengths) <= 3
    assert {b for b, _ in shapes} <= {1, 2}
    stats = dl.get_stats()
    assert stats["packs"] == len(dl.dataset.cache)  # DP=1: the whole epoch, every pack once
    assert stats["online"] == 0.0 and stats["batches"] == len(batches)


def test_counts_distinct_shapes_over_an_epoch(env):
    dl = make(env, infinite=False, batch=1, batch_format="hf")
    shapes = [tuple(b["input_ids"].shape) for b in dl]
    cache = dl.dataset.cache
    assert len(shapes) == len(cache)  # batch 1, DP 1: every pack once
    expected = {(1, cache.pack_shape(i)) for i in range(len(cache))}
    assert set(shapes) == expected and len(set(shapes)) <= len(BUCKETS) + 1


def test_hf_format_and_device_normalisation(env):
    a = next(iter(make(env, batch_format="hf", normalize_on="collate")))
    b = next(iter(make(env, batch_format="hf", normalize_on="device")))
    assert b["pixel_values"].dtype == torch.uint8 and b["pixel_values"].shape[-1] == 768
    assert a["position_ids"].shape[0] == 4 and a["use_cache"] is False
    assert same(finish_on_device(b), a)
    c = next(iter(make(env, normalize_on="device")))
    d = next(iter(make(env, normalize_on="collate")))
    assert same(finish_on_device(c), d)


def _own_state(loaders):
    """The loader's own ``state_dict()`` (one rank), checked pickle-free, for the harness."""
    (dl,) = loaders
    state = dl.state_dict()
    assert plain(state), state
    return state


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_bitwise_with_workers(env, num_workers):
    k, total = 3, 8
    spec = LoaderSpec(
        "cached_vl",
        lambda rank, world, infinite: make(env, num_workers=num_workers),
        state=_own_state,
    )
    (full,) = assert_resume_exact(spec, cuts=(k, total - k))
    # the worker count does not change the data either
    other = list(itertools.islice(iter(make(env, num_workers=2 - num_workers)), total))
    assert all(same(x, y) for x, y in zip(full, other, strict=True))


def _pack_ids(dl, steps):
    """Cache pack indices of the next `steps` batches (identified by their token rows)."""
    cache = dl.dataset.cache
    by_tokens = {tuple(cache.pack(i)["input_ids"].tolist()): i for i in range(len(cache))}
    out = []
    for inp, _ in itertools.islice(iter(dl), steps):
        for row in inp["input"]:
            length = int(row.numel())
            # a batch pads to its longest pack: strip the extra padding to find the pack
            for key, idx in by_tokens.items():
                if len(key) <= length and tuple(row[: len(key)].tolist()) == key:
                    if all(t == dl.collate.pad_id for t in row[len(key) :].tolist()):
                        out.append(idx)
                        break
    return out


def test_elastic_resume_through_dcp(env, tmp_path):
    """DP=2 -> DP=1 and DP=1 -> DP=2 through torch.distributed.checkpoint, no repeat/skip."""
    import torch.distributed.checkpoint as dcp

    n = len(make(env).dataset.cache)
    # DP=2 for 2 steps of 1 pack, then save (every rank writes the same global state).
    r0, r1 = make(env, 0, 2, batch=1), make(env, 1, 2, batch=1)
    seen = _pack_ids(r0, 2) + _pack_ids(r1, 2)
    dcp.save({"dataloader": r0}, checkpoint_id=str(tmp_path / "ck2"))
    # ... resume at DP=1 and read the rest of the epoch.
    one = make(env, 0, 1, batch=1)
    dcp.load({"dataloader": one}, checkpoint_id=str(tmp_path / "ck2"))
    assert one.rank_state()["cursor"] == 4
    rest = n - 4
    seen += _pack_ids(one, rest)
    assert sorted(seen) == list(range(n)), "DP=2 -> DP=1: every pack exactly once in the epoch"
    # DP=1 -> DP=2: save after 3 packs at DP=1 and resume both ranks of DP=2.
    one = make(env, 0, 1, batch=1)
    seen = _pack_ids(one, 3)
    dcp.save({"dataloader": one}, checkpoint_id=str(tmp_path / "ck1"))
    ranks = [make(env, r, 2, batch=1) for r in range(2)]
    for r in ranks:
        dcp.load({"dataloader": r}, checkpoint_id=str(tmp_path / "ck1"))
    per_rank = (n - 3) // 2
    for r in ranks:
        seen += _pack_ids(r, per_rank)
    assert len(seen) == len(set(seen)) == 3 + 2 * per_rank
    assert n - len(seen) < 2


def test_online_fallback_warns_and_matches_format(env, tmp_path):
    with pytest.warns(OnlinePreprocessingWarning, match="slow"):
        dl = make(env, cache_dir=str(tmp_path / "none"), max_samples=20, num_workers=2)
    assert dl.source == "online" and dl.num_workers == 0
    inp, labels = next(iter(dl))
    assert inp["input"].shape[1] in BUCKETS + [SEQ]
    assert set(inp) == set(next(iter(make(env)))[0])
    assert dl.get_stats()["online"] == 1.0


def test_online_resume_exact_and_equal_steps(env):
    from torchtitan_ext.vl.online import OnlineVLDataset

    def ds(rank=0, world=1):
        return OnlineVLDataset(
            env["data"],
            "train",
            seq_len=SEQ,
            buffer_size=4,
            buckets=BUCKETS,
            max_samples=24,
            dp_rank=rank,
            dp_world_size=world,
            seed=1,
            infinite=False,
        )

    def state(loaders):
        (a,) = loaders
        st = a.state_dict()
        assert plain(st)
        return st

    spec = LoaderSpec("online_vl", lambda rank, world, infinite: ds(), state=state)
    (got,) = assert_resume_exact(spec, cuts=(2, None), infinite=False)  # 2 packs, then the rest
    counts = [len(list(ds(r, 2))) for r in range(2)]
    assert counts[0] == counts[1] == len(got) // 2


def test_build_if_missing_and_force(env, tmp_path, monkeypatch):
    import torchtitan_ext.vl.build as cache_mod

    calls = []
    real = cache_mod.build_cache

    def spy(*a, **kw):
        calls.append(kw.get("force"))
        return real(*a, **kw)

    monkeypatch.setattr(cache_mod, "build_cache", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnlinePreprocessingWarning)
        dl = make(env, cache_dir=str(tmp_path / "c"), max_samples=12, build_if_missing=True)
    assert dl.source == "cache" and calls == [False]
    again = make(env, cache_dir=str(tmp_path / "c"), max_samples=12, build_if_missing=True)
    assert calls == [False], "an existing cache is reused, not rebuilt"
    assert again.cache_path == dl.cache_path
    make(env, cache_dir=str(tmp_path / "c"), max_samples=12, force_preprocess=True)
    assert calls == [False, True]
    with pytest.warns(OnlinePreprocessingWarning):
        off = make(env, cache_dir=str(tmp_path / "c"), max_samples=12, use_preprocessed_cache=False)
    assert off.source == "online"


def test_bad_config_values_are_named(env):
    with pytest.raises(ValueError, match="batch_format"):
        make(env, batch_format="jax")
    with pytest.raises(ValueError, match="normalize_on"):
        make(env, normalize_on="gpu")
    with pytest.raises(FileNotFoundError, match="cache_path"):
        make(env, cache_path=str(env["root"]))
    with pytest.raises(ValueError, match="dataloader.dataset is required"):
        make(env, dataset_path=None)


def test_config_fields_documented_and_validator_replace():
    """Every Config field is a stage option, declared (with a docstring) in exactly one options
    dataclass the Config inherits: spelled and defaulted once."""
    import ast
    import inspect
    import textwrap

    cfg = CachedVLDataLoader.Config()
    names = {f.name for f in dataclasses.fields(cfg)}
    assert {"infinite", "cache_dir", "use_preprocessed_cache", "force_preprocess"} <= names
    assert {"queue_size", "thread_priority"} <= names  # the Prefetch hand-off's
    assert dataclasses.replace(cfg, infinite=False).infinite is False
    declared: dict[str, list[str]] = {}
    for base in CachedVLDataLoader.Config.__mro__[1:]:
        if not base.__module__.startswith("torchtitan_ext."):
            continue  # torchtitan's own Config bases
        body = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                documented = i + 1 < len(body) and isinstance(body[i + 1], ast.Expr)
                assert documented, f"{base.__name__}.{node.target.id} has no docstring"
                declared.setdefault(node.target.id, []).append(base.__name__)
    assert names == set(declared), names ^ set(declared)
    assert all(len(v) == 1 for v in declared.values()), declared


@pytest.mark.parametrize(
    "name", ["qwen3_vl_tiny_cpu.toml", "qwen3_vl_real.toml", "qwen3_vl_8b.toml"]
)
def test_toml_configs_parse(name):
    import tomllib

    table = tomllib.loads((REPO / "train_configs" / name).read_text())
    dl = dict(table["dataloader"])
    assert dl.pop("name") == "cached_vl"
    cfg = CachedVLDataLoader.Config(**dl)  # every key is a field of our Config
    assert cfg.batch_format == "qwen3_vl"


def test_tiny_toml_builds_the_loader(env, tmp_path):
    import tomllib

    table = tomllib.loads((REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml").read_text())
    dl = dict(table["dataloader"])
    dl.pop("name")
    dl.update(cache_dir=str(tmp_path / "c"), dataset="sample", max_samples=16)
    loader = CachedVLDataLoader.Config(**dl).build(
        dp_rank=0,
        dp_world_size=1,
        tokenizer=None,
        seq_len=table["training"]["seq_len"],
        local_batch_size=table["training"]["local_batch_size"],
    )
    input_dict, labels = next(iter(loader))
    assert input_dict["input"].shape[1] in [*dl["buckets"], table["training"]["seq_len"]]
    assert input_dict["position_ids"].shape[0] == 4 and labels.shape == input_dict["input"].shape


@pytest.mark.parametrize("num_workers", [0, 2])
def test_finite_pass_moves_state_to_next_epoch(env, num_workers):
    dl = make(env, infinite=False, num_workers=num_workers, batch=2)
    first = [inp["input"] for inp, _ in dl]
    st = dl.rank_state()
    assert (st["epoch"], st["cursor"]) == (1, 0)
    second = [inp["input"] for inp, _ in dl]
    cache = dl.dataset.cache
    n = len(cache)
    by_tokens = {tuple(cache.pack(i)["input_ids"].tolist()): i for i in range(n)}

    def ids(batches):
        out = []
        for b in batches:
            for row in b:
                r = row.tolist()
                out += [
                    i
                    for key, i in by_tokens.items()
                    if tuple(r[: len(key)]) == key
                    and all(t == dl.collate.pad_id for t in r[len(key) :])
                ][:1]
        return out

    assert ids(first) == documented_order(n, 0, 0)
    assert ids(second) == documented_order(n, 0, 1)


@pytest.mark.parametrize("fmt", ["torchtitan", "hf"])
def test_async_device_loader_finishes_device_batches(env, fmt):
    """AsyncDeviceLoader with the loader's finisher == CPU normalisation, bit for bit."""
    from torchtitan_ext.device.staging import AsyncDeviceLoader

    dev = make(env, batch_format=fmt, normalize_on="device")
    wrapped = AsyncDeviceLoader(dev, "cpu", device_transform=dev.finish_on_device)
    it = iter(wrapped)  # once: a second iter() starts a new pass (prefetched batches dropped)
    got = [next(it) for _ in range(3)]
    ref = list(itertools.islice(iter(make(env, batch_format=fmt, normalize_on="collate")), 3))
    assert all(same(a, b) for a, b in zip(got, ref, strict=True))
    wrapped.close()


def test_online_counts_skips_that_reconcile(env, tmp_path):
    """Bad rows are skipped with the builder's reasons; packed + skipped = rows read."""
    from torchtitan_ext.vl.online import OnlineVLDataset
    from torchtitan_ext.vl.sample_data import BAD_ROW_REASONS, sample_dataset_path

    data = sample_dataset_path(n=12, bad_rows=True, root=tmp_path)
    ds = OnlineVLDataset(
        data, "train", seq_len=SEQ, buffer_size=4, buckets=BUCKETS, infinite=False, shuffle=False
    )
    packs = list(ds)
    samples = sum(len(p["seq_lens"]) for p in packs)
    skipped = sum(ds.skips.values())
    assert samples == ds.rows_ok and ds.rows_ok + skipped == ds.num_rows
    expected = {r for r in BAD_ROW_REASONS.values() if r is not None}
    assert set(ds.skips) <= expected and skipped >= 1


def test_state_from_the_other_source_is_refused(env, tmp_path):
    """A state saved reading the cache does not load into a loader on the online fallback (their
    orders differ), nor the other way; a value not in the one checkpoint format (torchtitan's
    per-rank {"dp_rank_r": ...}) is refused in one line; the previous release's bare
    {"global": position} still loads."""
    cached = make(env)
    it = iter(cached)
    next(it)
    state = cached.state_dict()
    with pytest.warns(OnlinePreprocessingWarning):
        online = make(env, cache_dir=str(tmp_path / "none"), max_samples=12)
    with pytest.raises(ValueError, match="saved from the cache source .* reads from the online"):
        online.load_state_dict(state)
    with pytest.raises(ValueError, match="saved from the online source .* reads from the cache"):
        make(env).load_state_dict(online.state_dict())
    position = cached.rank_state()
    for bad in ({"step": 3}, {"dp_rank_0": position}):
        with pytest.raises(LoaderStateError, match="not in this version's format") as e:
            make(env).load_state_dict(bad)
        assert "\n" not in str(e.value)
    legacy = make(env)
    legacy.load_state_dict({"global": position, "world_size": 1})
    assert same(next(iter(legacy)), next(it))
