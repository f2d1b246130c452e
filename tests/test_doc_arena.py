"""The best-fit packer's document arena: snapshots that stay true while the arena moves on,
checkpoints that read back (with and without offsets), damaged layouts named, and a bounded size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_ext.text import packer_state
from torchtitan_ext.text.doc_arena import DocArena, layout
from torchtitan_ext.text.packing import BestFitPacker

BOS = 0


def _held(state: dict) -> dict[int, list[int]]:
    """What a checkpoint form holds, by insertion number."""
    lengths, offsets, tokens = layout(state)
    seqs = np.asarray(state["seqs"]).tolist()
    return {
        s: tokens[o : o + n].tolist()
        for s, o, n in zip(seqs, offsets.tolist(), lengths.tolist(), strict=True)
    }


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 9), st.integers(1, 60), st.booleans()), min_size=1, max_size=300
    ),
    min_capacity=st.integers(1, 64),
)
def test_every_state_still_holds_what_was_buffered_when_it_was_taken(ops, min_capacity):
    """Puts (some past int32), takes, re-layouts, slot growth and int64 promotion in any order:
    a state taken at any point still reads back, later, as exactly the documents buffered then
    (the arena never writes below a state's end; a re-layout makes a new array)."""
    rng = np.random.default_rng(len(ops))
    arena, live, seq = DocArena(min_capacity), {}, 0
    kept: list[tuple[dict, dict]] = []
    for op, n, wide in ops:
        if op < 6 or not live:  # put
            doc = rng.integers(-(2**31), 2**31, n).astype(np.int32)
            if wide and op == 5:
                doc = doc.astype(np.int64)
                doc[-1] = 2**40 + seq
            live[seq] = (arena.put(doc, seq), doc.tolist())
            seq += 1
        else:  # take one, the op-th oldest live
            s = sorted(live)[op % len(live)]
            slot, want = live.pop(s)
            assert arena.take(slot, len(want)).tolist() == want
        if op in (0, 7):
            kept.append((arena.state(), {s: d for s, (_, d) in live.items()}))
    kept.append((arena.state(), {s: d for s, (_, d) in live.items()}))
    for snap, want in kept:
        assert _held(snap) == want


def test_a_checkpoint_without_offsets_reads_as_documents_back_to_back():
    """Older checkpoints hold the documents back to back in key order, without ``offsets``:
    the same documents, and the same rows after a resume, as the current form."""
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[BOS], rng.integers(1, 99, rng.integers(1, 40))]) for _ in range(300)]
    docs = [d.astype(np.int32) for d in docs]
    a = BestFitPacker(32, BOS, buffer_docs=12)
    for d in docs[:150]:
        a.add(d)
        while a.ready():
            a.pop_row()
    new = a.state_dict()
    held = _held(new)
    keys = sorted((len(d), s) for s, d in held.items())
    old = {k: v for k, v in new.items() if k != "offsets"}
    old["lengths"] = np.array([n for n, _ in keys], dtype=np.int64)
    old["seqs"] = np.array([s for _, s in keys], dtype=np.int64)
    old["tokens"] = np.concatenate([held[s] for _, s in keys]).astype(np.int64)
    rows = []
    for state in (new, old):
        b = BestFitPacker(32, BOS, buffer_docs=12)
        b.load_state_dict(state)
        assert _held(b.state_dict()) == held
        out = []
        for d in docs[150:]:
            b.add(d)
            while b.ready():
                out.append(b.pop_row().tokens.tolist())
        rows.append(out)
    assert rows[0] == rows[1] and rows[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.update(offsets=s["offsets"] + 10**6), "outside"),
        (lambda s: s.update(offsets=s["offsets"] - 10**6), "outside"),
        (lambda s: s.update(offsets=s["offsets"][:-1]), "offsets for"),
        (lambda s: s.update(lengths=np.zeros_like(s["lengths"])), "empty"),
        (lambda s: s.update(seqs=s["seqs"][:-1]), "seqs for"),
        (lambda s: (s.pop("offsets"), s.update(tokens=s["tokens"][:-1])), "lengths sum"),
        # a sum past int64 must not wrap around into range
        (lambda s: s.update(lengths=np.full(s["lengths"].size, 2**62),
                            offsets=np.full(s["offsets"].size, 2**62)), "outside"),
        (lambda s: s.update(tokens=s["tokens"].reshape(1, -1)), "1-D"),
        (lambda s: s.update(tokens=s["tokens"].astype(np.float64) + 0.5), "integers"),
        (lambda s: s.update(tokens=s["tokens"] > 0), "integers"),
        (lambda s: s.update(tokens=s["tokens"].astype(np.uint64) + np.uint64(2**63)), "past int64"),
        (lambda s: s.update(lengths=s["lengths"].astype(np.float64)), "integers"),
        (lambda s: s.update(seqs=s["seqs"] * 0), "repeat"),
        (lambda s: s.update(next_seq=0), "next_seq"),
        (lambda s: s.update(kind=0.7), "kind must be an integer"),
    ],
)  # fmt: skip
def test_a_damaged_packer_checkpoint_is_refused_in_one_line(change, message):
    """Never cast or wrapped into something that loads: floats, bools, 2-D arrays, ids past
    int64, offsets whose sum overflows, repeated insertion numbers are named in one line."""
    p = BestFitPacker(16, BOS, buffer_docs=8)
    for i in range(40):
        p.add(np.array([BOS] + [1] * (i % 7 + 1), dtype=np.int32))
        while p.ready():
            p.pop_row()
    state = p.state_dict()
    change(state)
    with pytest.raises(ValueError, match=message) as e:
        BestFitPacker(16, BOS, buffer_docs=8).load_state_dict(state)
    assert "\n" not in str(e.value)


def test_the_checkpoint_stays_bounded_as_documents_come_and_go():
    """Documents taken leave holes; over 20,000 long-tailed documents a checkpoint's tokens stay
    under twice (the buffered tokens + 64 per document) — ``DocArena.state``'s invariant — and
    typically within the room a re-layout leaves (1.25x the buffered tokens + 64 per document:
    the re-layouts keep the holes few)."""
    rng = np.random.default_rng(1)
    p = BestFitPacker(512, BOS, buffer_docs=64)
    worst, ratios = 0.0, []
    for _ in range(20_000):
        doc = np.ones(int(np.clip(rng.lognormal(4.5, 1.2), 2, 5000)), dtype=np.int32)
        doc[0] = BOS
        p.add(doc)
        while p.ready():
            p.pop_row()
            st = packer_state.compact(packer_state.live(p))
            buffered = int(st["lengths"].sum())
            bound = 2 * (buffered + 64 * st["lengths"].size)
            worst = max(worst, st["tokens"].size / bound)
            ratios.append(st["tokens"].size / (1.25 * buffered + 64 * st["lengths"].size))
    assert 0 < worst <= 1.0, worst
    assert 0.5 < float(np.median(ratios)) <= 1.0, float(np.median(ratios))
