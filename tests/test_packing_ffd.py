"""Best-fit's row finish (rules 4-5 of ``text/packing.py``): crop within a point of the
first-fit-decreasing bound, never more than cropping the shortest, exact across a resume."""

from __future__ import annotations

from bisect import bisect_right

import numpy as np
import pytest

from torchtitan_ext.text import packer_state
from torchtitan_ext.text.packing import BestFitPacker

SEQ_LEN = 512
R = SEQ_LEN + 1
BUFFER = 200


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    """Fixed synthetic document lengths (with BOS): lognormal, median 125 tokens, sigma 1.0,
    none under 16 — the benchmark's min-length corpus at a quarter of its scale."""
    x = np.random.default_rng(0).lognormal(np.log(125), 1.0, 12_000)
    return x[x >= 16][:4000].astype(np.int64)


def _feed(p: BestFitPacker, it, zeros: np.ndarray) -> None:
    while not p.ready():
        p.add(zeros[: next(it)])


def _shortest_rule_crop(lengths: list[int]) -> int:
    """Tokens one row loses under the rule before rules 4-5 (largest that fits, else crop the
    shortest; over-long documents open a row), from a buffer of these sorted lengths."""
    buf = list(lengths)
    if buf[-1] > R:
        return buf[-1] - R
    rem = R
    while rem > 0 and buf:
        i = bisect_right(buf, rem) - 1
        n = buf.pop(i if i >= 0 else 0)
        if n > rem:
            return n - rem
        rem -= n
    return 0


def test_steady_state_crop_within_one_point_of_the_ffd_bound(lengths):
    """First-fit-decreasing over the same stream loses only what lies beyond the first row of
    an over-long document (everything else it places; it pads instead of cropping). Best-fit at
    100 % fill must stay within 1 point of that. Cropping the shortest lost 17.1 % here (FFD
    bound 13.8 %)."""
    zeros = np.zeros(int(lengths.max()) + 1, dtype=np.int64)
    it = iter(np.tile(lengths, 50).tolist())
    p = BestFitPacker(SEQ_LEN, 0, buffer_docs=BUFFER)
    tokens, positions = np.empty(R, np.int64), np.empty(R, np.int64)
    for row in range(4000):
        if row == 1000:  # steady state: the buffer's mix has settled
            c0 = p.c.state()
        _feed(p, it, zeros)
        assert p.pop_row_into(tokens, positions) == R  # 100 % fill
        assert tokens[0] == 0  # BOS first
    c1 = p.c.state()
    cropped = c1["tokens_cropped"] - c0["tokens_cropped"]
    crop_pct = 100 * cropped / (cropped + c1["tokens_out"] - c0["tokens_out"])
    ffd_pct = 100 * np.clip(lengths - R, 0, None).sum() / lengths.sum()
    assert crop_pct <= ffd_pct + 1.0, (crop_pct, ffd_pct)


def test_each_row_loses_no_more_than_cropping_the_shortest(lengths):
    """The stated invariant, row by row from the same buffer; and in steady state the finishing
    crops (rows not opened by an over-long document) lose well under half of what cropping the
    shortest would have."""
    zeros = np.zeros(int(lengths.max()) + 1, dtype=np.int64)
    it = iter(np.tile(lengths, 5).tolist())
    p = BestFitPacker(SEQ_LEN, 0, buffer_docs=BUFFER)
    ours = shortest = 0
    for _ in range(1500):
        _feed(p, it, zeros)
        before = _shortest_rule_crop([n for n, *_ in p._keys])
        finishing = p._keys[-1][0] <= R  # not a row opened by an over-long document
        c0 = p.c.tokens_cropped
        p.pop_row()
        lost = p.c.tokens_cropped - c0
        assert lost <= before
        if p.c.rows > 500 and finishing:  # steady state
            ours += lost
            shortest += before
    assert ours < 0.5 * shortest, (ours, shortest)


@pytest.mark.parametrize("via", ["state_dict", "compact", "redeal"])
def test_resume_is_exact_with_the_finish(lengths, via):
    """A resumed packer rebuilds its per-length count, so it finishes rows exactly as the
    uninterrupted one (the count is derived state, never checkpointed)."""
    ns = np.tile(lengths, 2)
    flat = np.arange(1, int(ns.sum()) + 1, dtype=np.int64)  # every token unique ...
    docs = np.split(flat, np.cumsum(ns)[:-1])
    for d in docs:
        d[0] = 0  # ... after its document's BOS

    def run(p: BestFitPacker, todo: list[np.ndarray], rows: int) -> list[list[int]]:
        out = []
        for d in todo:
            p.add(d)
            while p.ready() and len(out) < rows:
                out.append(p.pop_row().tokens.tolist())
        return out

    want = run(BestFitPacker(SEQ_LEN, 0, buffer_docs=BUFFER), docs, 2000)
    a = BestFitPacker(SEQ_LEN, 0, buffer_docs=BUFFER)
    cut = 3000
    got = run(a, docs[:cut], 2000)
    if via == "state_dict":
        state = a.state_dict()
    elif via == "compact":
        state = packer_state.compact(packer_state.live(a))
    else:  # one rank's items re-dealt to one rank: renumbered, insertion order kept
        ps = packer_state.compact(packer_state.live(a))
        held = packer_state.items(ps)
        state = packer_state.from_items(held, int(ps["kind"]), R, ps["counters"])
    b = BestFitPacker(SEQ_LEN, 0, buffer_docs=BUFFER)
    b.load_state_dict(state)
    got += run(b, docs[cut:], 2000 - len(got))
    assert got == want
