"""cached_vl mixtures (``[[dataloader.sources]]``): the global mixed order of packs
(``vl/mix_position.py``), the loader over one cache per source (``vl/mix_reader.py``), its
per-source stats and its one-line errors (the tiny Qwen3-VL trained on a mixture:
``tests/test_vl_mixture_train.py``).

Exact and elastic resume run in the one harness: the ``cached_vl_mix`` builder of
``tests/support/loader_specs.py`` in ``tests/test_resume_matrix.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.resume import same, take
from tests.support.vl_sample import sample_cache
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.mix import MixtureError, SourceSpec
from torchtitan_ext.vl.dataset import epoch_permutation
from torchtitan_ext.vl.mix_position import MixPlan, MixPos, Walker, rank_items

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ the global order
def plan(
    lens: tuple[int, ...] = (40, 7, 100),
    p: tuple[float, ...] = (0.6, 0.3, 0.1),
    limits: tuple[int | None, ...] | None = None,
    **kw: Any,
) -> MixPlan:
    return MixPlan(lens=lens, p=p, limits=limits or (None,) * len(lens), seed=5, **kw)


def sequence(walker: Walker, n: int, pos: MixPos | None = None) -> list[tuple[int, int]]:
    """The first ``n`` (source, pack) items of the global sequence (one rank of one)."""
    pos = pos or MixPos.start(len(walker.plan.lens))
    out = []
    for item, _ in rank_items(walker, pos, 1, 0, "drop"):
        out.append((item.source, item.index))
        if len(out) == n:
            break
    return out


def test_order_is_a_pure_function_of_seed_and_weights() -> None:
    a, b = sequence(Walker(plan()), 3000), sequence(Walker(plan()), 3000)
    assert a == b
    other = MixPlan(lens=(40, 7, 100), p=(0.6, 0.3, 0.1), limits=(None,) * 3, seed=6)
    assert sequence(Walker(other), 3000) != a


def test_shares_within_binomial_bounds_over_windows_of_packs() -> None:
    """Counts of each source over sliding windows of N packs stay within 5 binomial standard
    deviations of N * weight (the draws are i.i.d. per pack)."""
    p = (0.6, 0.3, 0.1)
    src = np.array([k for k, _ in sequence(Walker(plan(p=p)), 12_000)])
    for n in (200, 2000):
        for start in range(0, len(src) - n + 1, n // 2):
            counts = np.bincount(src[start : start + n], minlength=3)
            for k, w in enumerate(p):
                sd = math.sqrt(n * w * (1 - w))
                assert abs(counts[k] - n * w) <= 5 * sd + 1, (n, start, k, counts[k])


def test_each_source_reads_its_own_epochs_in_its_single_source_order() -> None:
    """Source k's n-th item is position n % len of its epoch n // len's permutation: a small
    source repeats (each epoch reshuffled), every pack once per epoch."""
    walker = Walker(plan())
    seq = sequence(walker, 3000)
    for k, n in enumerate(walker.plan.lens):
        mine = [i for s, i in seq if s == k]
        assert len(mine) > 2 * n or k == 2
        for e in range(len(mine) // n):
            perm = epoch_permutation(n, 5, e, True).tolist()
            assert mine[e * n : (e + 1) * n] == perm


def test_running_counts_resume_the_sequence_anywhere() -> None:
    """A position (pass, draws, items, counts) taken anywhere continues the same sequence."""
    walker = Walker(plan())
    full = sequence(walker, 900)
    pos = MixPos.start(3)
    for _, after in zip(range(437), rank_items(walker, pos, 1, 0, "drop"), strict=False):
        pos = after[1]
    assert sum(pos.counts) == pos.items == 437
    assert sequence(Walker(plan()), 463, pos) == full[437:]


@pytest.mark.parametrize("limits", [None, (130, None, None)], ids=["endless", "one-ends"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_ranks_deal_the_global_sequence_round_by_round(world: int, limits: Any) -> None:
    """Rank r of W reads item r of every round of W (at 8 ranks by numpy while no source can
    end within the round; item by item around the round where one ends)."""
    full = sequence(Walker(plan(limits=limits)), 60 * world)
    ranks = []
    for r in range(world):
        walker = Walker(plan(limits=limits))
        items = rank_items(walker, MixPos.start(3), world, r, "drop")
        ranks.append([(it.source, it.index) for it, _ in (next(items) for _ in range(60))])
    assert [ranks[i % world][i // world] for i in range(60 * world)] == full


def test_max_epochs_all_exhausted_passes_over_an_ended_source() -> None:
    walker = Walker(plan(lens=(5, 50), p=(0.5, 0.5), limits=(10, None)))
    seq = sequence(walker, 400)
    assert sum(s == 0 for s, _ in seq) == 10  # two epochs of 5, then only source 1
    assert len(seq) == 400 and all(s == 1 for s, _ in seq[-300:])


def test_max_epochs_first_exhausted_ends_the_stream() -> None:
    walker = Walker(plan(lens=(5, 50), p=(0.5, 0.5), limits=(5, None), stop="first_exhausted"))
    seq = sequence(walker, 400)
    assert sum(s == 0 for s, _ in seq) == 5 and len(seq) < 40


def test_a_finite_pass_reads_every_pack_of_every_source_once() -> None:
    walker = Walker(plan(lens=(9, 4), p=(0.7, 0.3), limits=(9, 4), passes=True))
    seq = sequence(walker, 100)
    assert sorted(seq) == sorted([(0, i) for i in range(9)] + [(1, i) for i in range(4)])


# ------------------------------------------------------------------------------ the loader
N_VQA, N_CHAT = 24, 16


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A VQA sample cache (built) and chat sample data (its cache built by the first mixture
    loader), under one TORCHTITAN_EXT_CACHE."""
    from torchtitan_ext.vl.sample_chat import chat_sample_path
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    with sample_cache(tmp_path_factory, "mix", n=N_VQA) as e:
        e["chat"] = chat_sample_path(n=N_CHAT, root=e["root"] / "data")
        e["vqa2"] = sample_dataset_path(n=8, root=e["root"] / "data2")
        e["uncached"] = sample_dataset_path(n=4, root=e["root"] / "data3")  # never built
        e["home"] = os.environ["TORCHTITAN_EXT_CACHE"]
        build(e, mix(e), build_if_missing=True).close()  # the chat cache
        yield e


def mix(e: Any, vqa: float = 3, chat: float = 1, **extra: Any) -> list[SourceSpec]:
    out = [
        SourceSpec(name="vqa", weight=vqa, path=str(e["data"])),
        SourceSpec(name="chat", weight=chat, path=str(e["chat"]), format="messages"),
    ]
    return out + [SourceSpec(name=n, **kw) for n, kw in extra.items()]


def build(e: Any, sources: list[SourceSpec] | None, rank: int = 0, world: int = 1, **kw: Any):
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    kw.setdefault("buffer_size", 8)
    kw.setdefault("buckets", [512, 768])
    if sources is None:
        kw.setdefault("dataset_path", str(e["data"]))
    cfg = CachedVLDataLoader.Config(sources=sources, cache_dir=str(e["cache_dir"]), **kw)
    return cfg.build(
        dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=1024, local_batch_size=2
    )


def test_per_source_stats_in_the_mix_shape(env: Any) -> None:
    ld = build(env, mix(env))
    try:
        take(ld, 5)
        st = ld.get_stats()
    finally:
        ld.close()
    src = st["sources"]
    assert list(src) == ["vqa", "chat"]
    for key in ("packs", "tokens", "images", "patches"):
        assert sum(s[key] for s in src.values()) == st[key], key
    assert st["packs"] == 10 and src["vqa"]["packs"] > 0 and src["chat"]["packs"] > 0
    assert src["vqa"]["target"] == 0.75 and src["chat"]["target"] == 0.25
    assert math.isclose(src["vqa"]["share"] + src["chat"]["share"], 1.0)
    assert src["vqa"]["items"] == src["vqa"]["packs"] and src["vqa"]["ended"] is False


def test_without_sources_the_loader_is_the_single_source_one(env: Any) -> None:
    from torchtitan_ext.vl.reader import VLReader

    ld = build(env, None)
    try:
        assert type(ld.reader) is VLReader and "sources" not in ld.get_stats()
    finally:
        ld.close()


def test_workers_give_the_in_process_batches_and_stats(env: Any) -> None:
    a, b = build(env, mix(env)), build(env, mix(env), num_workers=2)
    try:
        x, y = take(a, 6), take(b, 6)
        assert same(x, y)
        sa, sb = a.get_stats()["sources"], b.get_stats()["sources"]
        assert sa == sb
    finally:
        a.close()
        b.close()


def _decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every image decode (the builder's ``decode_image``)."""
    import torchtitan_ext.vl.processor as proc

    calls: list[int] = []
    real = proc.decode_image

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(proc, "decode_image", counted)
    return calls


def test_reweighting_or_adding_a_source_decodes_no_image_of_the_others(
    env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    # the added source is this test's own (n=5 is no other test's data): under random order
    # another test may already have built the shared "vqa2" store
    added_path = sample_dataset_path(n=5, root=tmp_path / "added")
    calls = _decodes(monkeypatch)
    build(env, mix(env, vqa=1, chat=5), build_if_missing=True).close()
    assert calls == [], "re-weighting re-processed images"
    extra = {"vqa2": {"weight": 1.0, "path": str(added_path)}}
    ld = build(env, mix(env, **extra), build_if_missing=True)
    ld.close()
    assert len(ld.reader.cache_paths) == 3
    added = len(calls)
    assert added > 0  # the new source's cache was built (the count can fail)
    calls.clear()
    build(env, [mix(env, **extra)[2]], build_if_missing=True).close()
    assert calls == []  # and that was all: the new source alone decodes nothing more


def test_new_weights_and_seq_len_train_with_the_sources_moved_away(
    env: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """After the first build the source data may go: each source's store is found by the
    identity it records, a new mixture and a new pack length are only a new plan, and no image
    is decoded."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    # its own VQA data (the shared ones' stores are other tests' business), the shared chat data
    paths = {"vqa": sample_dataset_path(n=6, root=tmp_path / "own"), "chat": env["chat"]}

    def sources(vqa: float, chat: float) -> list[SourceSpec]:
        return [
            SourceSpec(name="vqa", weight=vqa, path=str(paths["vqa"])),
            SourceSpec(name="chat", weight=chat, path=str(paths["chat"]), format="messages"),
        ]

    build(env, sources(1, 1), build_if_missing=True).close()  # both sample stores exist
    calls = _decodes(monkeypatch)
    moved = {k: tmp_path / f"moved-{k}" for k in paths}
    for k, dst in moved.items():
        paths[k].rename(dst)
    try:
        assert not paths["vqa"].exists() and not paths["chat"].exists()
        cfg = CachedVLDataLoader.Config(
            sources=sources(1, 4), cache_dir=str(env["cache_dir"]), buffer_size=4,
            buckets=[512, 768],
        )  # fmt: skip
        ld = cfg.build(dp_rank=0, dp_world_size=1, tokenizer=None, seq_len=768, local_batch_size=2)
        try:
            batches = take(ld, 4)
            st = ld.get_stats()
        finally:
            ld.close()
    finally:
        for k, dst in moved.items():
            dst.rename(paths[k])
    assert len(batches) == 4 and st["packs"] == 8
    assert st["sources"]["chat"]["target"] == 0.8
    assert calls == [], "a re-plan decoded images"


def _one_line(exc: pytest.ExceptionInfo, *parts: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg


def test_bad_mixtures_are_one_line_before_any_cache_is_built(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchtitan_ext.vl.build as vlbuild

    def no_build(*a: Any, **k: Any) -> Any:
        raise AssertionError("a cache was built")

    monkeypatch.setattr(vlbuild, "build_cache", no_build)
    dup = [SourceSpec(name="a", path="x"), SourceSpec(name="a", path="y")]
    with pytest.raises(MixtureError) as e:
        build(env, dup, build_if_missing=True)
    _one_line(e, "source 'a'", "used twice")
    with pytest.raises(MixtureError) as e:
        build(env, [SourceSpec(name="web", weight=-1, path="x")], build_if_missing=True)
    _one_line(e, "source 'web'", "weight")
    with pytest.raises(MixtureError) as e:
        build(env, mix(env), cache_path=str(env["path"]))
    _one_line(e, "cache_path", "a mixture finds each source's cache")
    with pytest.raises(MixtureError) as e:
        build(env, mix(env, other={"path": str(env["uncached"])}))
    _one_line(e, "source 'other'", "no VL cache", "build_if_missing")
    with pytest.raises(MixtureError) as e:
        build(env, mix(env, other={"path": str(env["uncached"]), "split": "nope"}))
    _one_line(e, "source 'other'", "split 'nope'")
    with pytest.raises(MixtureError) as e:
        build(env, mix(env, gone={"path": str(env["root"] / "missing")}), build_if_missing=True)
    _one_line(e, "source 'gone'")


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        ('[[dataloader.sources]]\nname = "vqa"\ndataset = "sample_chat"\n', ("'vqa'", "twice")),
        ('[[dataloader.sources]]\nname = "t"\npath = "/x"\ntext_column = "a"\n', ("'t'",)),
    ],
    ids=["duplicate", "text_column"],
)
def test_preflight_refuses_a_bad_mixture_before_the_model(
    tmp_path: Path, extra: str, needles: tuple[str, ...]
) -> None:
    """The example config with one defect: ``preflight.run`` (the launcher runs it before the
    model is built) raises one line naming the file and the source."""
    from torchtitan_ext import preflight
    from torchtitan_ext.config import load_config
    from torchtitan_ext.toml_config import ConfigError

    text = (ROOT / "train_configs" / "qwen3_vl_mixture_tiny_cpu.toml").read_text()
    if extra.startswith("[["):
        text += "\n" + extra
    else:
        text = text.replace("[dataloader]\n", "[dataloader]\n" + extra, 1)
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        preflight.run(load_config(f), str(f))
    _one_line(e, "bad.toml", *needles)


def test_a_source_with_no_packs_is_one_line(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.plan import PlannedStore

    chat = str(env["chat"].name).replace("_", "-")
    for cls in (VLCache, PlannedStore):  # a packed cache, or a sample store's plan
        real = cls.__len__
        monkeypatch.setattr(
            cls, "__len__", lambda c, real=real: 0 if chat in c.path.name else real(c)
        )
    with pytest.raises(MixtureError) as e:
        build(env, mix(env))
    _one_line(e, "source 'chat'", "holds no packs")


def test_sources_of_different_processors_are_one_line_naming_both(
    env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchtitan_ext.vl.cache import VLCache

    real = VLCache.open.__func__  # type: ignore[attr-defined]
    chat = str(env["chat"].name).replace("_", "-")

    def other_template(cls: Any, path: Any) -> Any:
        c = real(cls, path)
        if chat in Path(path).name:
            c.metadata = {**c.metadata, "processor": {"chat_template": "another"}}
        return c

    monkeypatch.setattr(VLCache, "open", classmethod(other_template))
    with pytest.raises(MixtureError) as e:
        build(env, mix(env))
    _one_line(e, "'vqa' and 'chat'", "processor, tokenizer or chat template")


def _saved(ld: Any) -> dict[str, Any]:
    return checkpoint.envelope("cached_vl", [ld.rank_state()], "any")


def test_the_position_names_its_mixture_as_mix_state_does(env: Any) -> None:
    """The checkpointed position carries ``Mix.state``'s keys (tools that look for a mixture in
    a loader's state find it) and plain values only."""
    from torchtitan_ext.pipeline.mix import Mix

    ld = build(env, mix(env))
    try:
        take(ld, 3)
        pos = ld.rank_state()
    finally:
        ld.close()

    class Empty:  # a chain, for Mix.state()'s keys
        def state(self) -> dict:
            return {}

    mix_keys = set(Mix([Empty()], [SourceSpec(name="a", path="x")], seed=0).state())  # type: ignore[list-item]
    assert mix_keys <= set(pos), mix_keys - set(pos)
    assert pos["names"] == ["vqa", "chat"] and sum(pos["taken"]) == pos["items"] == 6
    assert json.loads(json.dumps(pos)) == pos


def test_a_checkpoint_of_another_mixture_is_one_line(env: Any) -> None:
    ld = build(env, mix(env))
    take(ld, 2)
    saved = _saved(ld)
    ld.close()
    other = mix(env, vqa2={"path": str(env["vqa2"])})
    for sources, parts in [
        (other, ("added 'vqa2'", "--checkpoint.exclude_from_loading dataloader")),
        (mix(env)[:1], ("removed 'chat'",)),
        (None, ("removed 'vqa', 'chat'",)),
    ]:
        ld = build(env, sources, build_if_missing=True)
        try:
            with pytest.raises(MixtureError) as e:
                ld.load_state_dict(saved)
            _one_line(e, *parts)
        finally:
            ld.close()
    single = build(env, None)
    take(single, 1)
    plain = _saved(single)
    single.close()
    ld = build(env, mix(env))
    try:
        with pytest.raises(MixtureError) as e:
            ld.load_state_dict(plain)
        _one_line(e, "single-source", "exclude_from_loading")
    finally:
        ld.close()


def test_reweighting_keeps_the_caches_and_changes_only_the_order(env: Any) -> None:
    a, b = build(env, mix(env, vqa=3)), build(env, mix(env, vqa=1, chat=3))
    try:
        assert a.reader.cache_paths == b.reader.cache_paths
        take(a, 20), take(b, 20)
        sa, sb = a.get_stats()["sources"], b.get_stats()["sources"]
        assert sa["vqa"]["packs"] > sb["vqa"]["packs"]
    finally:
        a.close()
        b.close()
