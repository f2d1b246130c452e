"""The mix stage: weighted draws within binomial bounds, determinism, ends, exact and elastic resume,
bad mixtures named in one line (``torchtitan_ext/pipeline/mix.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.test_pipeline_core import Counter
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.mix import (
    BLOCK,
    Mix,
    MixtureError,
    SourceSpec,
    check_sources,
    resume_mix,
)
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Map


def specs(*weights: float, max_epochs: int | None = None) -> list[SourceSpec]:
    return [
        SourceSpec(name=f"s{k}", weight=w, path=f"/d{k}", max_epochs=max_epochs)
        for k, w in enumerate(weights)
    ]


def tagged(k: int, n: int = 10**9) -> Map:
    """Source ``k``'s chain: (k, i) for i = 0, 1, ..."""
    return Map(Counter(n), lambda i, k=k: (k, i))


def mix(weights, n=10**9, **kw) -> Mix:
    return Mix([tagged(k, n) for k in range(len(weights))], specs(*weights), seed=7, **kw)


def test_realised_shares_stay_within_binomial_bounds_over_every_window():
    w = np.array([0.6, 0.3, 0.1])
    m = mix(w)
    src = np.array([m.next()[0] for _ in range(3 * BLOCK + 100)])  # crosses block boundaries
    for n in (64, 512, 4096):
        counts = np.stack([np.convolve(src == k, np.ones(n), "valid") for k in range(3)])
        for k in range(3):
            sd = math.sqrt(n * w[k] * (1 - w[k]))
            worst = np.abs(counts[k] - n * w[k]).max()
            assert worst <= 5 * sd + 1, (n, k, worst, sd)
    # and not a fixed round-robin pattern: windows do vary
    assert len(set(np.convolve(src == 0, np.ones(64), "valid").tolist())) > 5


def test_draws_are_a_pure_function_of_seed_stream_and_index():
    def first(m: Mix, n: int = 300) -> list:
        return [m.next() for _ in range(n)]

    a, b, c = first(mix([1, 1, 2])), first(mix([1, 1, 2])), first(mix([1, 1, 2], stream=1))
    assert a == b and a != c
    # each source's items come in its own order, none skipped or repeated
    for k in range(3):
        got = [i for s, i in a if s == k]
        assert got == list(range(len(got)))


def test_exact_resume_through_the_checkpoint_envelope_is_bitwise():
    full = list(mix([3, 1], n=500))
    m = mix([3, 1], n=500)
    head = [m.next() for _ in range(123)]
    saved = checkpoint.decode(checkpoint.encode(m.state()))
    m2 = mix([3, 1], n=500)
    m2.reset(saved)
    assert head + list(m2) == full
    m2.reset(None)
    assert list(m2) == full


def test_under_prefetch_the_state_is_that_of_the_last_item_handed_over():
    p = Prefetch(mix([1, 2], n=100), PrefetchOptions(queue_size=4))
    head = [p.next() for _ in range(17)]
    st = p.state()
    assert sum(st["taken"]) == 17
    stats = p.get_stats()
    assert stats["sources"]["s0"]["items"] + stats["sources"]["s1"]["items"] == 17
    assert stats["taken"] == 17  # the chains' counters, summed
    assert stats["sources"]["s1"]["target"] == pytest.approx(2 / 3)
    p.close()
    m = mix([1, 2], n=100)
    m.reset(st)
    assert head + list(m) == list(mix([1, 2], n=100))


def test_all_exhausted_keeps_the_others_going_first_exhausted_stops():
    out = list(mix([1, 1], n=5))
    assert sorted(out) == [(k, i) for k in range(2) for i in range(5)]
    m = Mix([tagged(0, 5), tagged(1, 1000)], specs(1, 1), seed=7, stop="first_exhausted")
    out = list(m)
    assert sum(s == 0 for s, _ in out) == 5 and len(out) < 1000
    with pytest.raises(StopIteration):
        m.next()


def test_a_weight_zero_source_is_never_drawn():
    m = mix([1, 0, 1])
    assert all(s != 1 for s, _ in (m.next() for _ in range(2000)))


def test_elastic_resume_loses_and_repeats_no_item():
    """Each source's chain merged by the caller's per-source resume: here a counter source
    dealt round-robin, the simplest elastic chain; 2 ranks -> 3 -> 1."""

    class Dealt(Counter):
        """Items r, r + W, ...; state: the next index into the deal."""

        def __init__(self, n, rank, world):
            super().__init__(n)
            self.rank, self.world, self.base = rank, world, []

        def next(self):
            if self.base:
                if self.i < len(self.base):
                    self.i += 1
                    return self.base[self.i - 1]
                raise StopIteration
            j = self.rank + self.i * self.world
            if j >= self.n:
                raise StopIteration
            self.i += 1
            return j

        def state(self):
            return {"i": self.i, "left": self.left()}

        def left(self):
            if self.base:
                return list(self.base[self.i :])
            return list(range(self.rank + self.i * self.world, self.n, self.world))

        def reset(self, state=None):
            self.i = 0
            self.base = [] if state is None else list(state["left"])

    def build(rank, world):
        chains = [Map(Dealt(200 + 100 * k, rank, world), lambda i, k=k: (k, i)) for k in range(2)]
        return Mix(chains, specs(2, 1, max_epochs=1), seed=3, stream=rank)

    def merge(k, olds, rank, world):
        left = sorted(x for s in olds for x in s["left"])
        return {"i": 0, "left": left[rank::world]}

    seen: list[tuple[int, int]] = []
    ranks = [build(r, 2) for r in range(2)]
    for m in ranks:
        seen += [m.next() for _ in range(40)]
    for world, steps in ((3, 25), (1, None)):
        old = [checkpoint.decode(checkpoint.encode(m.state())) for m in ranks]
        ranks = []
        for r in range(world):
            m = build(r, world)
            m.reset(resume_mix(old, r, world, merge))
            ranks.append(m)
        for m in ranks:
            seen += list(m) if steps is None else [m.next() for _ in range(steps)]
    assert sorted(seen) == [(0, i) for i in range(200)] + [(1, i) for i in range(300)]
    assert sum(ranks[0].state()["taken"]) == len(seen)  # counters carried, totals reconcile


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ([SourceSpec(name="web", weight=-1, path="a")], "source 'web': weight must be"),
        ([SourceSpec(name="web", weight=float("nan"), path="a")], "source 'web': weight must be"),
        (
            [SourceSpec(name="a", weight=0, path="x"), SourceSpec(name="b", weight=0, path="y")],
            "weights of 'a', 'b' sum to 0",
        ),
        ([SourceSpec(name="a", path="x"), SourceSpec(name="a", path="y")], "used twice"),
        (
            [SourceSpec(name="a", path="d/x"), SourceSpec(name="b", path="./d//x")],
            "source 'b': path = './d//x' is source 'a''s data too",
        ),
        (
            [SourceSpec(name="a", dataset="hub/x"), SourceSpec(name="b", dataset="hub/x")],
            "list it once and give it the summed weight",
        ),
        ([SourceSpec(name="a")], "exactly one of 'path' and 'dataset'"),
        ([SourceSpec(name="a", path="x", max_epochs=0)], "max_epochs must be >= 1"),
        ([], "at least one source"),
    ],
)
def test_bad_mixtures_are_one_line_naming_the_source(bad, fragment):
    with pytest.raises(MixtureError) as e:
        check_sources(bad)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_one_path_read_two_ways_is_two_datasets():
    """Another split or column of the same files is other data, not a repeat."""
    check_sources([SourceSpec(name="a", path="x", split="train"), SourceSpec(name="b", path="x")])
    check_sources([SourceSpec(name="a", path="x"), SourceSpec(name="b", path="x", text_column="t")])


def test_a_checkpoint_of_another_mixture_names_what_was_added_and_removed():
    st = mix([1, 1]).state()
    other = Mix([tagged(0), tagged(1)], [specs(1)[0], SourceSpec(name="code", path="c")], seed=7)
    with pytest.raises(MixtureError, match="added 'code'; removed 's1'.*exclude_from_loading"):
        other.reset(st)
