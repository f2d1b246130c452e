"""torchtitan glue: StreamingTextDataLoader (registry name "streaming_text") and the example
train config with an eval offset."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from tests.support.resume import LoaderSpec, assert_resume_exact
from tests.test_streaming import corpus, same, take, tokenizer  # noqa: F401
from torchtitan_ext.loaders.streaming import StreamingTextDataLoader
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.registry import get_loader_config

REPO = Path(__file__).resolve().parents[1]


def build(cfg, rank=0, world=1, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("local_batch_size", 4)
    return cfg.build(dp_rank=rank, dp_world_size=world, **kw)


def test_registry_and_batch_format(corpus, tokenizer):  # noqa: F811
    src, _ = corpus
    cls = get_loader_config("streaming_text")
    assert cls is StreamingTextDataLoader.Config
    cfg = cls(dataset_path=src, tokenizer_path=tokenizer.source)
    dl = build(cfg, snapshot_every_n_steps=1, max_context_length=99)  # unknown kwargs accepted
    x, y = next(iter(dl))
    assert set(x) == {"input", "positions"}
    assert x["input"].shape == x["positions"].shape == y.shape == (4, 16)
    assert x["input"].dtype == y.dtype == torch.long
    assert torch.equal(x["input"][:, 1:], y[:, :-1])
    # the validator's replace(config.dataloader, infinite=...) works on this Config
    assert dataclasses.replace(cfg, infinite=False).infinite is False


def test_torchtitan_tokenizer_is_accepted(corpus, tokenizer):  # noqa: F811
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    src, _ = corpus
    tt_tok = HuggingFaceTokenizer(tokenizer_path=str(Path(tokenizer.source).parent))
    dl = build(StreamingTextDataLoader.Config(dataset_path=src), tokenizer=tt_tok)
    ref = build(StreamingTextDataLoader.Config(dataset_path=src, tokenizer_path=tokenizer.source))
    assert same(take(iter(dl), 3), take(iter(ref), 3))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_is_pickle_free_and_resumes(corpus, tokenizer, num_workers):  # noqa: F811
    src, _ = corpus
    cfg = StreamingTextDataLoader.Config(
        dataset_path=src, tokenizer_path=tokenizer.source, num_workers=num_workers
    )
    saved = []

    def state(loaders):
        # what the gather of two ranks makes (one process cannot run it): rank 0 read nothing yet
        (dl,) = loaders
        state = checkpoint.envelope(
            "streaming_text", [build(cfg, rank=0, world=2).rank_state(), dl.rank_state()]
        )
        assert set(state) == {"global"} and state["global"]["loader"] == "streaming_text"
        pickle.loads(pickle.dumps(state))  # plain values only (a class would still load here)
        assert _plain(state), "ints, floats, strs, bytes, lists, tuples and dicts only"
        saved.append(state)
        return state

    def check(dl, event):
        if event == "end":
            stats = dl.get_stats()
            assert stats["epoch"] == 0 and stats["skipped"] == 0 and stats["docs_used"] > 0

    # rank 1 of 2: 12 batches, save, a fresh rank 1 resumes: 18 more == batches 12..29
    spec = LoaderSpec(
        "streaming_text", lambda rank, world, infinite: build(cfg, rank=1, world=2), state=state
    )
    assert_resume_exact(spec, cuts=(12, 18), check=check)
    (state,) = saved
    build(cfg, rank=1, world=3).load_state_dict(state)  # another degree: re-dealt
    build(cfg).load_state_dict({})  # an empty state is a fresh start


def _plain(tree) -> bool:
    if isinstance(tree, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return all(_plain(v) for v in tree)
    return tree is None or isinstance(tree, (bool, int, float, str, bytes))


def test_missing_tokenizer_and_source(corpus):  # noqa: F811
    src, _ = corpus
    with pytest.raises(ValueError, match="tokenizer"):
        build(StreamingTextDataLoader.Config(dataset_path=src))
    with pytest.raises(ValueError, match="dataset_path"):
        build(StreamingTextDataLoader.Config(), tokenizer="x")


@pytest.mark.slow
def test_example_train_config_has_eval_offset(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path / "cache"))
    from torchtitan_ext.config import load_config

    cfg = load_config(REPO / "train_configs" / "streaming_text_cpu.toml")
    train, ev = cfg.dataloader, cfg.validator.dataloader
    assert isinstance(train, StreamingTextDataLoader.Config)
    assert isinstance(ev, StreamingTextDataLoader.Config)
    assert train.skip_first == 0 and ev.skip_first == 1000 and ev.seed != train.seed
    assert cfg.validator.enable and cfg.validator.steps > 0
    # build both as torchtitan would (the validator forces infinite = steps != -1)
    ev_cfg = dataclasses.replace(ev, infinite=True)
    kw = {"tokenizer": cfg.hf_assets_path, "seq_len": 64, "local_batch_size": 2}
    ev_dl = ev_cfg.build(dp_rank=0, dp_world_size=1, **kw)
    assert ev_dl.num_documents() == 300
    first = ev_dl.source.pieces[0]
    assert ev_dl.source.doc_id(first.shard, first.lo) == 1000
    x, _ = next(iter(ev_dl))
    tr_cfg = dataclasses.replace(train, num_workers=0)
    tr = tr_cfg.build(dp_rank=0, dp_world_size=1, **kw)
    assert tr.num_documents() == 1000
    assert not torch.equal(x["input"], next(iter(tr))[0]["input"])


def test_checkpoint_through_dcp(corpus, tokenizer, tmp_path):  # noqa: F811
    """torchtitan's checkpointer saves the loader with torch.distributed.checkpoint: our nested
    state (ints, lists) must survive a DCP save/load and resume bitwise."""
    import torch.distributed.checkpoint as dcp

    src, _ = corpus
    cfg = StreamingTextDataLoader.Config(dataset_path=src, tokenizer_path=tokenizer.source)
    ref = take(iter(build(cfg)), 20)
    dl = build(cfg)
    it = iter(dl)
    take(it, 7)
    dcp.save({"dataloader": dl}, checkpoint_id=str(tmp_path / "ckpt"))
    dl2 = build(cfg)
    dcp.load({"dataloader": dl2}, checkpoint_id=str(tmp_path / "ckpt"))
    assert same(take(iter(dl2), 13), ref[7:])
