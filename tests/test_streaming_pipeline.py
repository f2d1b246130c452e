"""streaming_text as stages: the batches are bitwise those of the loader before the stages, the
one checkpoint envelope resumes bitwise at the same degree, and at other DP degrees / worker
counts every document of the epoch is emitted exactly once (tests/support/resume.py)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.support import resume
from tests.test_streaming import WORDS, corpus, tokenizer, write_parquet  # noqa: F401
from torchtitan_ext.loaders.streaming import StreamingTextDataLoader
from torchtitan_ext.pipeline.checkpoint import LoaderStateError
from torchtitan_ext.text.diversity import DiversityMeter

SEQ, BATCH = 16, 4

# sha256[:16] of 60 batches of rank 1 of 2 (seq 16, batch 4, shuffle_buffer 8) over the
# ``corpus`` fixture, computed with the loader as it was before the stages (commit 7d73fd0,
# torchdata StatefulDataLoader over StreamingTextDataset).
BEFORE_STAGES = {
    (0, False): "b255a5229becfc9e",
    (0, True): "302a668de438d915",
    (2, False): "e117c75bcfbefd85",
    (2, True): "9ad06a1c6cb8ee37",
}


def digest(batches) -> str:
    h = hashlib.sha256()
    for x, y in batches:
        for k in sorted(x):
            h.update(k.encode())
            h.update(x[k].numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()[:16]


def config(src, tok, num_workers: int, **kw) -> StreamingTextDataLoader.Config:
    kw.setdefault("shuffle_buffer", 8)
    kw.setdefault("emit_doc_ids", True)
    return StreamingTextDataLoader.Config(
        dataset_path=src, tokenizer_path=tok.source, num_workers=num_workers, **kw
    )


def doc_starts(batch) -> list[int]:
    """Documents starting in a batch: offset 0, or offset 1 at a row's first input token (it
    began on the previous row's label-only last token)."""
    x, _ = batch
    ids, offs = x["doc_ids"], x["doc_offsets"]
    start = offs == 0
    start[:, 0] |= offs[:, 0] == 1
    return ids[start & (ids >= 0)].tolist()


def spec(src, tok, workers: dict[int, int] | int) -> resume.LoaderSpec:
    """``workers``: per DP degree (a dict) or for all: the worker count of each loader."""

    def build(rank: int, world: int, infinite: bool):
        nw = workers if isinstance(workers, int) else workers[world]
        cfg = config(src, tok, nw, infinite=infinite)
        return cfg.build(dp_rank=rank, dp_world_size=world, seq_len=SEQ, local_batch_size=BATCH)

    return resume.LoaderSpec("streaming_text", build, doc_starts, set(range(240)))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("emit", [False, True])
def test_batches_are_bitwise_those_before_the_stages(corpus, tokenizer, num_workers, emit):  # noqa: F811
    src, _ = corpus
    cfg = config(src, tokenizer, num_workers, emit_doc_ids=emit)
    dl = cfg.build(dp_rank=1, dp_world_size=2, seq_len=SEQ, local_batch_size=BATCH)
    got = resume.take(dl, 60)
    dl.close()
    assert digest(got) == BEFORE_STAGES[(num_workers, emit)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_degree_resume_is_bitwise(corpus, tokenizer, num_workers):  # noqa: F811
    """30 + 30 batches per rank cross the epoch boundary (about 56 batches per rank)."""
    src, _ = corpus
    resume.assert_resume_exact(spec(src, tokenizer, num_workers), 30, 2, 2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dp_2_to_3_to_1_mid_epoch_every_document_once(corpus, tokenizer, num_workers):  # noqa: F811
    src, _ = corpus
    resume.assert_resume_exact(spec(src, tokenizer, num_workers), 10, 2, (3, 1))


def test_worker_count_changes_too(corpus, tokenizer):  # noqa: F811
    """Slots = ranks x workers: 2 x 2 -> 3 x 1 (in-process) -> 1 x 2."""
    src, _ = corpus
    resume.assert_resume_exact(spec(src, tokenizer, {2: 2, 3: 0, 1: 2}), 8, 2, (3, 1))


def test_elastic_run_passes_the_diversity_check(corpus, tokenizer):  # noqa: F811
    """The DiversityMeter (scripts/verify_data_diversity.py) over a DP 2 -> 3 -> 1 pass: no
    duplicated document or token window, full coverage of the epoch."""
    src, _ = corpus
    sp = spec(src, tokenizer, 0)
    meter = DiversityMeter(num_documents=240)
    loaders = [sp.build(r, 2, False) for r in range(2)]
    for i, world in enumerate((2, 3, 1)):
        if i:
            saved = resume.save(sp, loaders)
            for ld in loaders:
                ld.close()
            loaders = [sp.build(r, world, False) for r in range(world)]
            for ld in loaders:
                ld.load_state_dict(saved)
        for r, ld in enumerate(loaders):
            for b in resume.take(ld, None if world == 1 else 10):
                meter.add_batch(b, rank=r)
    for ld in loaders:
        ld.close()
    rep = meter.report()
    assert rep.doc_duplicates == 0 and rep.window_duplicates == 0
    assert rep.coverage[0] == 1.0


def test_state_is_the_one_envelope_and_old_formats_are_refused(corpus, tokenizer):  # noqa: F811
    src, _ = corpus
    dl = config(src, tokenizer, 0).build(seq_len=SEQ, local_batch_size=BATCH)
    resume.take(dl, 3)
    env = dl.state_dict()
    assert set(env) == {"global"} and env["global"]["loader"] == "streaming_text"
    assert env["global"]["resumable_at"] == "any" and env["global"]["dp_world_size"] == 1
    arrays = env["global"]["ranks"][0]["workers"][0]["packer"]["tokens"]
    assert set(arrays) == {"__ndarray__", "shape", "data"}  # pickle-free: dtype, shape, bytes
    stats = dl.get_stats()
    assert stats["epoch"] == 0 and stats["docs_used"] > 0 and stats["skipped"] == 0
    dl.close()
    old = {"dp_rank_0": {"dataset_state": {"epoch": 0}}, "world_size": 1}
    fresh = config(src, tokenizer, 0).build(seq_len=SEQ, local_batch_size=BATCH)
    with pytest.raises(LoaderStateError, match="not in this version's format"):
        fresh.load_state_dict(old)
    fresh.close()


def test_batches_per_iter_continues_the_stream(corpus, tokenizer):  # noqa: F811
    src, _ = corpus
    ref = config(src, tokenizer, 0).build(seq_len=SEQ, local_batch_size=BATCH)
    whole = resume.take(ref, 15)
    ref.close()
    dl = config(src, tokenizer, 0, batches_per_iter=5).build(seq_len=SEQ, local_batch_size=BATCH)
    parts = [list(dl) for _ in range(3)]
    dl.close()
    assert [len(p) for p in parts] == [5, 5, 5]
    assert all(
        torch.equal(a[0]["input"], b[0]["input"])
        for a, b in zip([b for p in parts for b in p], whole, strict=True)
    )


class _Held:
    """A Stateful holding a checkpoint value (what torchtitan's checkpointer hands DCP)."""

    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return self.value

    def load_state_dict(self, value):
        self.value = value


def test_dcp_round_trip_at_another_degree(corpus, tokenizer, tmp_path):  # noqa: F811
    """torch.distributed.checkpoint builds its load request from the *loading* side's state: the
    saved ranks must come back whole when that side has another DP degree (or fewer keys)."""
    import torch.distributed.checkpoint as dcp

    src, _ = corpus
    sp = spec(src, tokenizer, 0)
    two = [sp.build(r, 2, False) for r in range(2)]
    for ld in two:
        resume.take(ld, 5)
    saved = resume.save(sp, two)
    dcp.save({"dataloader": _Held(saved)}, checkpoint_id=str(tmp_path / "ckpt"))
    three = [sp.build(r, 3, False) for r in range(3)]
    held = _Held(resume.save(sp, three))  # the template DCP loads into
    dcp.load({"dataloader": held}, checkpoint_id=str(tmp_path / "ckpt"))
    assert held.value["global"]["dp_world_size"] == 2
    for ld in three:
        ld.load_state_dict(held.value)
    first = [next(iter(ld))[0]["doc_ids"] for ld in three]
    for ld in two + three:
        ld.close()
    assert all(int(f.max()) >= 0 for f in first)


def _epoch_starts(batch) -> list[tuple[int, int]]:
    x, _ = batch
    offs = x["doc_offsets"]
    start = offs == 0
    start[:, 0] |= offs[:, 0] == 1
    start &= x["doc_ids"] >= 0
    return list(zip(x["doc_epochs"][start].tolist(), x["doc_ids"][start].tolist(), strict=True))


def _behind(ld, epoch: int) -> bool:
    """Some slot of this loader still has to emit a document start of an epoch < ``epoch``."""
    return any(
        st["epoch"] < epoch or any(t[1] < epoch and t[2] == t[3] for t in st["track"])
        for st in ld.rank_state()["workers"]
    )


def test_infinite_stream_changes_degree_while_its_slots_are_in_two_epochs(corpus, tokenizer):  # noqa: F811
    """DP 2 saved while one slot is already in epoch 1 and the other still in epoch 0, resumed
    at DP 3: epochs 0 and 1 each still hold every document exactly once."""
    src, _ = corpus
    sp = spec(src, tokenizer, 0)
    two = [sp.build(r, 2, True) for r in range(2)]
    its = [iter(ld) for ld in two]
    starts: list[tuple[int, int]] = []
    for _ in range(200):
        for it in its:
            starts += _epoch_starts(next(it))
        if len({ld.rank_state()["workers"][0]["epoch"] for ld in two}) == 2:
            break
    assert len({ld.rank_state()["workers"][0]["epoch"] for ld in two}) == 2
    saved = resume.save(sp, two)
    for ld in two:
        ld.close()
    three = [sp.build(r, 3, True) for r in range(3)]
    for ld in three:
        ld.load_state_dict(saved)
        it = iter(ld)
        for _ in range(400):
            if not _behind(ld, 2):
                break
            starts += _epoch_starts(next(it))
        ld.close()
    for e in (0, 1):
        got = sorted(d for ep, d in starts if ep == e)
        assert got == list(range(240)), f"epoch {e}: not every document exactly once"


# ------------------------------------------------------------------ long documents, re-dealt
LONG_DOCS, LONG_LEN = 48, 67  # every document 66 tokens + EOS: about 4 rows of 17 tokens


@pytest.fixture(scope="module")
def long_corpus(tokenizer, tmp_path_factory):  # noqa: F811
    """48 documents of exactly 66 tokens (+ EOS = 67) in 4 Parquet files. A batch is 4 rows of
    17 = 68 tokens, so after each slot's first batch its last row ends on the *first* token of
    a document (68 = 67 + 1): that token is only the row's label, the document's start never an
    input yet — the case a re-deal at another degree used to lose."""

    def ntok(text: str) -> int:
        return len(tokenizer.encode_arrays([text], add_bos=False)[0])

    docs = []
    for i in range(LONG_DOCS):
        text = f"doc{i}"
        for k in range(i, i + 400):  # append words that keep it within 66 tokens
            if ntok(text) == LONG_LEN - 1:
                break
            nxt = f"{text} {WORDS[k % len(WORDS)]}"
            text = nxt if ntok(nxt) <= LONG_LEN - 1 else text
        assert ntok(text) == LONG_LEN - 1, text
        docs.append(text)
    return write_parquet(tmp_path_factory.mktemp("long"), docs, 4)


@pytest.mark.parametrize("dp_to", [(3, 1), (1,)], ids=["dp2-3-1", "dp2-1"])
def test_long_documents_started_on_a_label_survive_a_redeal(long_corpus, tokenizer, dp_to):  # noqa: F811
    """Regression: a document whose first token closed a slot's last row (label only) continues
    at offset 1; at an unchanged degree that is its new row's first input (its start), but
    re-dealt at DP 3 or 1 it continued *inside* another slot's row and was never counted."""

    def build(rank: int, world: int, infinite: bool):
        cfg = config(long_corpus, tokenizer, 0, infinite=infinite)
        return cfg.build(dp_rank=rank, dp_world_size=world, seq_len=SEQ, local_batch_size=BATCH)

    two = [build(r, 2, False) for r in range(2)]
    for ld in two:
        resume.take(ld, 1)
    heads = [ld.rank_state()["workers"][0]["track"][0] for ld in two]
    for ld in two:
        ld.close()
    assert all(left == length - 1 == LONG_LEN - 1 for _, _, left, length in heads), heads
    sp = resume.LoaderSpec("streaming_text", build, doc_starts, set(range(LONG_DOCS)))
    resume.assert_resume_exact(sp, 1, 2, dp_to)
