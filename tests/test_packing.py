"""Packers: BOS alignment, 100 % fill, best-fit choice, zero-discard, concat-split, exact state."""

from __future__ import annotations

from bisect import insort

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.text.packing import (
    _FINISH_CANDIDATES,
    BestFitPacker,
    ConcatSplitPacker,
    PackedRow,
    make_packer,
    row_to_example,
)

BOS = 0
EOS = 1


def _docs(rng: np.random.Generator, n: int, mean_len: float = 20.0) -> list[np.ndarray]:
    """BOS-prefixed documents with long-tailed lengths and unique content tokens."""
    out, nxt = [], 10
    for _ in range(n):
        k = int(rng.lognormal(np.log(mean_len), 1.0)) + 1
        out.append(np.concatenate([[BOS], np.arange(nxt, nxt + k)]).astype(np.int64))
        nxt += k
    return out


def _run(packer, docs, flush=True) -> list[PackedRow]:
    rows = []
    for d in docs:
        packer.add(d)
        while packer.ready():
            rows.append(packer.pop_row())
    while flush and packer.has_pending():
        rows.append(packer.pop_row(final=True))
    return rows


def _invariant(p) -> None:
    c, s = p.c, p.stats()
    assert (
        c.tokens_in + c.bos_inserted + c.boundary_tokens + c.tokens_carried
        == c.tokens_out + c.tokens_cropped + s["buffered_tokens"]
    )


def _segments(row: PackedRow) -> list[np.ndarray]:
    """Split a row at position resets."""
    starts = [i for i in range(row.valid) if row.positions[i] == 0] + [row.valid]
    return [row.tokens[a:b] for a, b in zip(starts, starts[1:], strict=False)]


@pytest.mark.parametrize("mode", ["crop", "zero_discard"])
def test_best_fit_rows_bos_aligned_full_and_positions(mode):
    rng = np.random.default_rng(0)
    docs = _docs(rng, 600)
    p = BestFitPacker(seq_len=48, bos_id=BOS, mode=mode, buffer_docs=16)
    rows = _run(p, docs)
    _invariant(p)
    assert p.stats()["buffered_tokens"] == 0
    for r in rows[:-1]:
        assert r.valid == 49 and r.tokens.shape == (49,)
        assert r.tokens[0] == BOS
        for seg in _segments(r):
            assert seg[0] == BOS  # every document piece starts with BOS ...
            assert np.all(np.diff(seg[1:]) == 1)  # ... and is a contiguous piece of a document
            # positions count up from 0 within the piece
        pos = r.positions
        starts = np.flatnonzero(pos == 0)
        assert np.all(r.tokens[starts] == BOS)
    if mode == "crop":
        assert p.c.tokens_cropped > 0 and p.c.bos_inserted == 0
    else:
        assert p.c.tokens_cropped == 0
        # zero discard: every source token appears exactly once in the output
        src = np.concatenate([d[1:] for d in docs])
        out = np.concatenate([r.tokens[: r.valid] for r in rows])
        out = out[out != BOS]
        assert np.array_equal(np.sort(out), np.sort(src))


def _reference_finish(buf, fits, rem, R):
    """The documented choice when something fits: the largest, unless no document would fit
    after it; then an exact finish among the next-largest, else the cheaper crop."""
    i = fits[-1]
    gap = rem - buf[i][0]
    others = [x[0] for j, x in enumerate(buf) if j != i]
    if gap == 0 or not others or gap >= min(others):
        return i
    for k in fits[::-1][1 : 1 + _FINISH_CANDIDATES]:
        if any(x[0] == rem - buf[k][0] for j, x in enumerate(buf) if j != k):
            return k
    longer = [j for j, x in enumerate(buf) if x[0] > rem]
    if longer and buf[longer[0]][0] <= R and buf[longer[0]][0] - rem < min(others) - gap:
        return longer[0]
    return i


def _reference_best_fit(docs, R, buffer_docs):
    """Straightforward linear-scan model of the documented rule, for differential testing."""
    buf: list[tuple[int, int, list[int]]] = []
    seq = 0
    rows = []
    for d in docs:
        insort(buf, (len(d), seq, list(d)))
        seq += 1
        while len(buf) >= buffer_docs and sum(x[0] for x in buf) >= R:
            row: list[int] = []
            while len(row) < R:
                rem = R - len(row)
                if not row and buf[-1][0] > R:
                    pick = len(buf) - 1
                else:
                    fits = [i for i, x in enumerate(buf) if x[0] <= rem]
                    pick = _reference_finish(buf, fits, rem, R) if fits else 0
                n, s, toks = buf.pop(pick)
                row += toks[:rem]
            rows.append(row)
    return rows


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    seq_len=st.integers(4, 80),
    buffer_docs=st.integers(1, 40),
)
def test_best_fit_matches_reference_rule(seed, seq_len, buffer_docs):
    docs = _docs(np.random.default_rng(seed), 150, mean_len=seq_len / 3)
    p = BestFitPacker(seq_len, BOS, buffer_docs=buffer_docs)
    ours = [r.tokens.tolist() for r in _run(p, docs, flush=False)]
    assert ours == _reference_best_fit(docs, seq_len + 1, buffer_docs)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cut=st.integers(0, 300),
    mode=st.sampled_from(["best_fit", "zero_discard", "concat_split"]),
    overlap=st.booleans(),
)
def test_state_round_trip_is_exact(seed, cut, mode, overlap):
    docs = _docs(np.random.default_rng(seed), 300)
    kw = dict(buffer_docs=8, boundary_id=EOS if mode == "concat_split" else None, overlap=overlap)
    full = make_packer(mode, 32, BOS, **kw)
    want = _run(full, docs)
    a = make_packer(mode, 32, BOS, **kw)
    got = _run(a, docs[:cut], flush=False)
    state = a.state_dict()
    b = make_packer(mode, 32, BOS, **kw)
    b.load_state_dict(state)
    got += _run(b, docs[cut:])
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.positions, y.positions)
        assert x.valid == y.valid
    assert b.stats() == full.stats()


@pytest.mark.parametrize("mode", ["best_fit", "zero_discard", "concat_split"])
@pytest.mark.parametrize("big", [False, True])
def test_int32_documents_stay_int32_and_ids_past_int32_still_resume(mode, big):
    """Our tokenizer's documents are int32 and stay so in the buffer, its checkpoint and after a
    resume (half the memory and copy); rows are int64 and equal to an int64 run's. A buffered
    document with an id past 2**31 makes the compact checkpoint int64, and it resumes exactly."""
    from torchtitan_ext.text import packer_state

    docs = _docs(np.random.default_rng(3), 120)
    feed = [d.astype(np.int32) for d in docs]
    if big:
        for i in range(52, 60):  # buffered at the cut (8 documents are)
            feed[i] = feed[i].astype(np.int64)
            feed[i][-1] = 2**40 + i  # its last token: still pending for concat-split too
    kw = dict(buffer_docs=8, boundary_id=EOS if mode == "concat_split" else None)
    want = _run(make_packer(mode, 32, BOS, **kw), docs if not big else feed)
    a = make_packer(mode, 32, BOS, **kw)
    got = _run(a, feed[:60], flush=False)
    compact = packer_state.compact(packer_state.live(a))
    assert compact["tokens"].dtype == (np.int64 if big else np.int32)
    b = make_packer(mode, 32, BOS, **kw)
    b.load_state_dict(compact)
    if not big:  # what b buffers is still int32: its own checkpoint says so
        again = packer_state.compact(packer_state.live(b))
        assert again["tokens"].size and again["tokens"].dtype == np.int32
    got += _run(b, feed[60:])
    assert all(r.tokens.dtype == np.int64 for r in got)
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert np.array_equal(x.tokens, y.tokens) and x.valid == y.valid


def test_state_is_plain_data_and_checks_kind():
    p = BestFitPacker(16, BOS, buffer_docs=4)
    _run(p, _docs(np.random.default_rng(1), 20), flush=False)
    sd = p.state_dict()
    for k, v in sd.items():
        assert isinstance(v, (int, np.ndarray, dict)), k
    with pytest.raises(ValueError, match="kind"):
        BestFitPacker(16, BOS, mode="zero_discard").load_state_dict(sd)
    with pytest.raises(ValueError, match="row_len"):
        BestFitPacker(17, BOS).load_state_dict(sd)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(lengths=s["lengths"].astype(np.float64)), "integers"),
        (lambda s: s.update(tokens=s["tokens"].astype(np.float64) + 0.5), "integers"),
        (lambda s: s.update(tokens=s["tokens"].reshape(1, -1)), "1-D"),
        # the sum still matches: only the check of each length catches it
        (lambda s: s.update(lengths=np.concatenate([s["lengths"], [5, -5]])), "negative"),
        (lambda s: s.update(tokens=s["tokens"][:-1]), "lengths sum"),
        (lambda s: s.update(row_len=str(s["row_len"])), "row_len must be an integer"),
    ],
)
def test_a_damaged_concat_split_state_is_refused_in_one_line(change, message):
    """Never cast into something that loads: floats, 2-D arrays, negative lengths, strings."""
    p = ConcatSplitPacker(seq_len=16, boundary_id=EOS)
    _run(p, _docs(np.random.default_rng(4), 7), flush=False)
    state = p.state_dict()
    assert state["lengths"].size, "the test needs pending segments"
    change(state)
    with pytest.raises(ValueError, match=message) as e:
        ConcatSplitPacker(seq_len=16, boundary_id=EOS).load_state_dict(state)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overlap", [False, True])
def test_concat_split_is_the_concatenation(overlap):
    docs = _docs(np.random.default_rng(2), 200)
    p = ConcatSplitPacker(seq_len=31, boundary_id=EOS, overlap=overlap)
    rows = _run(p, docs)
    _invariant(p)
    stream = np.concatenate([np.append(d, EOS) for d in docs])
    if overlap:
        # consecutive windows share one token; dropping it from all but the first recovers it
        out = np.concatenate(
            [rows[0].tokens[: rows[0].valid]] + [r.tokens[1 : r.valid] for r in rows[1:]]
        )
    else:
        out = np.concatenate([r.tokens[: r.valid] for r in rows])
    assert np.array_equal(out, stream)
    for r in rows:
        assert r.positions[0] == 0
        # position resets exactly after each EOS (and at the window start)
        for i in range(1, r.valid):
            assert (r.positions[i] == 0) == (r.tokens[i - 1] == EOS)
    assert p.c.tokens_cropped == 0


def test_row_to_example_shifts_and_masks_padding():
    p = BestFitPacker(seq_len=8, bos_id=BOS, buffer_docs=1, pad_id=2)
    p.add([BOS, 5, 6, 7])
    row = p.pop_row(final=True)
    assert row.valid == 4
    inp, labels, pos = row_to_example(row)
    assert inp.tolist() == [BOS, 5, 6, 7, 2, 2, 2, 2]
    assert labels.tolist() == [5, 6, 7] + [IGNORE_INDEX] * 5
    assert pos.tolist()[:4] == [0, 1, 2, 3]
    tokens, positions = row  # tuple-style unpacking (the packing contract)
    assert tokens is row.tokens and positions is row.positions


def test_over_long_documents_do_not_pile_up():
    """Documents longer than a row open a fresh row instead of waiting forever in the buffer.
    Without that rule the buffer fills up with them (all 15 slots after a few hundred
    documents, measured); with it, at most the few that arrived since the last row wait."""
    R = 33
    p = BestFitPacker(seq_len=R - 1, bos_id=BOS, buffer_docs=16)
    docs = _docs(np.random.default_rng(3), 2000, mean_len=20)
    assert sum(1 for d in docs if d.size > R) > 100  # the stream really has many of them
    most = 0
    for d in docs:
        p.add(d)
        while p.ready():
            p.pop_row()
        most = max(most, sum(1 for n, *_ in p._keys if n > R))
    assert most <= 4
    assert sum(1 for n, *_ in p._keys if n > R) <= 1  # and they drain as rows are made


def test_add_rejects_bad_documents():
    p = BestFitPacker(8, BOS)
    with pytest.raises(ValueError, match="BOS"):
        p.add([5, 6])
    with pytest.raises(ValueError, match="empty"):
        p.add([])
    with pytest.raises(RuntimeError, match="ready"):
        p.pop_row()
    with pytest.raises(ValueError, match="packing"):
        make_packer("nope", 8, BOS)


@pytest.mark.slow
def test_packing_benchmark_quick_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path))
    from benchmarks.common import BenchArgs
    from benchmarks.packing import run

    rows = {r.case: r for r in run(BenchArgs(quick=True, extra={"mb": "0.5", "batches": "40"}))}
    # the cached document lengths live beside the corpus: its directory still matches its
    # manifest, so the next benchmark reuses it instead of rebuilding it
    from benchmarks.text_corpus import CORPUS_VERSION
    from torchtitan_ext.data.cachedir import verify_manifest

    (corpus,) = [p for p in tmp_path.glob("bench_text_*") if p.is_dir()]
    assert verify_manifest(corpus, {"version": CORPUS_VERSION}) is None
    assert rows["fill % ours best-fit"].value == pytest.approx(100.0)
    assert rows["crop % ours zero-discard"].value == 0.0
    assert 0.0 < rows["crop % ours best-fit"].value < 100.0
