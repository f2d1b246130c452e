"""Stage <-> Grain iterator adapters (``torchtitan_ext/pipeline/grain_adapter.py``): a Grain
pipeline under our Prefetch and checkpoint envelope, and our stage under Grain's thread prefetch,
each resuming exactly. Skipped where grain is not installed."""

from __future__ import annotations

import pytest

from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.grain_adapter import FromGrain, ToGrain
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Map

from .test_pipeline_core import Counter  # 0, 1, ..., n-1; state = the next value

grain = pytest.importorskip("grain")
gx = pytest.importorskip("grain.experimental")


def grain_pipeline():
    return iter(grain.MapDataset.range(50).shuffle(seed=3).map(lambda x: x * 2).to_iter_dataset())


def test_a_grain_pipeline_under_our_prefetch_resumes_exactly_through_the_envelope() -> None:
    p = Prefetch(FromGrain(grain_pipeline()), PrefetchOptions(queue_size=4))
    head = [p.next() for _ in range(7)]
    env = checkpoint.envelope("grain_toy", [p.state()])
    rest = list(p)
    p.close()
    assert sorted(head + rest) == list(range(0, 100, 2))
    q = Prefetch(FromGrain(grain_pipeline()), PrefetchOptions(queue_size=4))
    [st] = checkpoint.open_envelope(env, "grain_toy", 1)
    q.reset(st)
    assert list(q) == rest
    q.reset(None)
    assert [q.next() for _ in range(7)] == head
    q.close()


def test_our_stage_under_grains_thread_prefetch_resumes_exactly() -> None:
    it = gx.ThreadPrefetchDatasetIterator(ToGrain(Map(Counter(30), lambda x: x + 1)), 4)
    head = [next(it) for _ in range(5)]
    st = it.get_state()
    assert head == [1, 2, 3, 4, 5] and st == {"i": 5}
    rest = list(it)
    it.set_state(st)
    assert list(it) == rest == list(range(6, 31))
    it.close()
