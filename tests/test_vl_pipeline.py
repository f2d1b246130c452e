"""The VL loader on the one stage contract and the one checkpoint format: exact resume at the same
DP degree (in process under the Prefetch hand-off, and with DataLoader workers), every pack of an
epoch exactly once across DP 2 -> 3 -> 1, the envelope it writes, and counters that never count
the batches made ahead."""

from __future__ import annotations

import time
import warnings

import pytest

from torchtitan_ext.loaders.vl import CachedVLDataLoader
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.prefetch import Prefetch
from torchtitan_ext.vl.pack_source import OnlinePreprocessingWarning
from torchtitan_ext.vl.stages import CountBatches, WorkerBatches

from .support.resume import LoaderSpec, assert_resume_exact, save, take
from .support.vl_sample import sample_cache

SEQ = 1024
BUCKETS = [512, 768]
BATCH = 2


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with sample_cache(tmp_path_factory, "vl_pipeline", n=48, seq_len=SEQ, buckets=BUCKETS) as env:
        from torchtitan_ext.vl.cache import VLCache

        cache = VLCache.open(env["path"])
        pad = int(cache.special_tokens["pad_id"])
        # A pack is identified by its tokens without the trailing padding (a batch pads every
        # row to its longest pack): the "documents" of the resume harness.
        keys = {_strip(cache.pack(i)["input_ids"].tolist(), pad): i for i in range(len(cache))}
        assert len(keys) == len(cache), "the sample packs are distinct"
        yield {**env, "keys": keys, "pad": pad, "num_packs": len(cache)}


def _strip(row: list[int], pad: int) -> tuple[int, ...]:
    n = len(row)
    while n and row[n - 1] == pad:
        n -= 1
    return tuple(row[:n])


def build(env, dp_rank=0, dp_world_size=1, infinite=True, batch=BATCH, **cfg):
    base = dict(
        dataset_path=str(env["data"]),
        cache_dir=str(env["cache_dir"]),
        buffer_size=8,
        buckets=BUCKETS,
        queue_size=3,
    )
    base.update(cfg)
    return CachedVLDataLoader.Config(infinite=infinite, **base).build(
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        tokenizer=None,
        seq_len=SEQ,
        local_batch_size=batch,
    )


def spec(env, **cfg) -> LoaderSpec:
    def doc_ids(batch) -> list[int]:
        inp, _ = batch
        return [env["keys"][_strip(row.tolist(), env["pad"])] for row in inp["input"]]

    return LoaderSpec(
        name="cached_vl",
        build=lambda r, w, infinite: build(env, r, w, infinite, **cfg),
        doc_ids=doc_ids,
        epoch_docs=set(range(env["num_packs"])),
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_degree_resume_is_bitwise(env, num_workers):
    assert_resume_exact(spec(env, num_workers=num_workers), steps=3, dp_from=2, dp_to=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dp_2_3_1_reads_every_pack_of_the_epoch_once(env, num_workers):
    # one pack per batch and step: every phase reads some of the (few) packs of the epoch
    packs = spec(env, num_workers=num_workers, batch=1)
    assert env["num_packs"] > 2 + 3, "the epoch outlasts the first two phases"
    assert_resume_exact(packs, steps=1, dp_from=2, dp_to=(3, 1))


def test_the_top_stage_is_the_one_hand_off(env):
    """In process the chain runs under one Prefetch (device staging fuses into it); with workers
    the DataLoader's processes are one stage."""
    inproc, workers = build(env), build(env, num_workers=2)
    try:
        assert isinstance(inproc.pipeline, Prefetch)
        assert isinstance(workers.pipeline, CountBatches)
        assert isinstance(workers.pipeline.upstream, WorkerBatches)
    finally:
        inproc.close()
        workers.close()


def test_state_dict_is_the_envelope_at_any_degree(env):
    """Every rank writes the same envelope: its DP degree, resumable at any, every rank's
    position (identical), pickle-free; a state another loader wrote is refused in one line."""
    loaders = [build(env, r, 2) for r in range(2)]
    for ld in loaders:
        take(ld, 1)
    values = [ld.state_dict() for ld in loaders]
    assert values[0] == values[1]
    env_ = values[0][checkpoint.KEY]
    assert (env_["loader"], env_["dp_world_size"], env_["resumable_at"]) == ("cached_vl", 2, "any")
    positions = checkpoint.open_envelope(values[0], "cached_vl", 3)
    assert positions[0] == positions[1] == loaders[0].rank_state()
    assert positions[0]["cursor"] == BATCH * 2  # packs both ranks consumed in the epoch
    for ld in loaders:
        ld.close()
    other = checkpoint.envelope("parquet_prefetch", [positions[0]])
    with pytest.raises(checkpoint.LoaderStateError, match="written by 'parquet_prefetch'"):
        build(env).load_state_dict(other)
    split = checkpoint.envelope("cached_vl", [positions[0], {**positions[0], "cursor": 0}])
    with pytest.raises(checkpoint.LoaderStateError, match="different positions"):
        build(env).load_state_dict(split)


def test_counters_and_state_ignore_the_batches_made_ahead(env):
    """With the Prefetch queue full, the stats and the state are those of the batches handed
    over, not of those made ahead."""
    ld = build(env, shuffle=False)
    got = take(ld, 2)
    worker = ld.pipeline.worker
    deadline = time.monotonic() + 60  # a bound on a wait, not a timed assertion
    while worker.q.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.q.qsize() == 3, "the thread filled its queue"
    stats = ld.get_stats()
    assert stats["batches"] == 2 and stats["packs"] == 2 * BATCH
    assert stats["tokens"] + stats["pad_tokens"] == sum(int(b[0]["input"].numel()) for b in got)
    assert ld.rank_state()["cursor"] == 2 * BATCH
    ld.close()


def test_online_fallback_resumes_exactly(env, tmp_path):
    """The online fallback runs under the same Prefetch and resumes bitwise at DP 1 and 2 (its
    position: rows read, rows in the packer's buffer, global packs released)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OnlinePreprocessingWarning)
        cfg = dict(cache_dir=str(tmp_path / "none"), max_samples=24, buffer_size=4, seed=3)
        online = build(env, **cfg)
        assert online.source == "online" and isinstance(online.pipeline, Prefetch)
        online.close()
        for world in (1, 2):
            assert_resume_exact(online_spec(env, cfg), steps=2, dp_from=world, dp_to=world)


def online_spec(env, cfg) -> LoaderSpec:
    return LoaderSpec("cached_vl", lambda r, w, infinite: build(env, r, w, infinite, **cfg))


def test_a_finite_pass_restarts_at_the_next_epoch(env):
    """After ``infinite=False`` ends, the saved position is the next epoch's start; a loader
    resumed from it reads that epoch."""
    ld = build(env, infinite=False)
    first = take(ld, None)
    value = save(spec(env), [ld])
    assert ld.rank_state()["epoch"] == 1 and ld.rank_state()["cursor"] == 0
    again = build(env, infinite=False)
    again.load_state_dict(value)
    second, next_pass = take(again, None), take(ld, None)
    assert len(first) == len(second) == len(next_pass) > 0
    ids = spec(env).doc_ids
    assert [ids(b) for b in second] == [ids(b) for b in next_pass]
    assert [ids(b) for b in first] != [ids(b) for b in second]
    ld.close()
    again.close()


def test_a_state_keeps_the_packs_no_round_reached():
    """7 packs at DP 3 from cursor 2: one round (3 packs), 2 left that no round of 3 reaches. The
    state keeps them in the epoch (a DP 1 job reads them); at DP 3 loading it moves on."""
    from torchtitan_ext.vl.dataset import CachedVLDataset, advance, position

    assert advance(7, 3, 0, 2, 1, "drop") == (1, 0)
    assert position(7, 3, 0, 2, 1, "drop") == (0, 5)
    assert position(7, 3, 0, 2, 0, "drop") == (0, 2)
    assert position(7, 3, 0, 2, 2, "drop") == advance(7, 3, 0, 2, 2, "drop") == (1, 3)
    assert position(7, 1, 0, 2, 5, "drop") == (1, 0)  # nothing left: the next epoch
    assert position(7, 3, 0, 2, 2, "wrap") == (1, 0)

    class Packs:
        def __len__(self) -> int:
            return 7

        def pack(self, i: int) -> dict:
            return {}

    ds = CachedVLDataset(Packs(), 0, 3)
    ds.load_state_dict(ds.position_state(0, 5))
    assert (ds._epoch, ds._cursor) == (1, 0)
    one = CachedVLDataset(Packs(), 0, 1)
    one.load_state_dict(ds.position_state(0, 5))
    assert (one._epoch, one._cursor) == (0, 5)


@pytest.mark.parametrize("saved_ranks, loading_ranks", [(2, 1), (1, 3)])
def test_the_envelope_crosses_dcp_at_another_degree(tmp_path, saved_ranks, loading_ranks):
    """torch.distributed.checkpoint keeps the ranks' states as one value: a job at another DP
    degree (whose own envelope, the load template, has another number of ranks) reads them all."""
    import torch.distributed.checkpoint as dcp

    states = [{"epoch": 0, "cursor": 4 + r, "buffered": [r, 7]} for r in range(saved_ranks)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: one process"
        dcp.save({"dataloader": checkpoint.envelope("toy", states)}, checkpoint_id=str(tmp_path))
        mine = {"epoch": 9, "cursor": 9, "buffered": [0, 0]}  # this job's own, as a template
        template = {"dataloader": checkpoint.envelope("toy", [mine] * loading_ranks)}
        dcp.load(template, checkpoint_id=str(tmp_path))
    assert checkpoint.open_envelope(template["dataloader"], "toy", loading_ranks) == states
