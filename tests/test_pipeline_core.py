"""The stage contract's building blocks: Prefetch (state travels with its item, reset, errors,
end, close) and the checkpoint envelope (pickle-free round trip, one-line refusals)."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest
import torch

from torchtitan_ext.pipeline import checkpoint as ckpt
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions, host_arrays
from torchtitan_ext.pipeline.stage import Map, Stage


class Counter(Stage[int]):
    """0, 1, ..., n-1; state = next value; raises at ``fail_at``."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at, self.i = n, fail_at, 0

    def next(self) -> int:
        if self.i == self.fail_at:
            raise KeyError(f"bad row {self.i}")
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def state(self) -> dict:
        return {"i": self.i}

    def reset(self, state: dict | None = None) -> None:
        self.i = 0 if state is None else int(state["i"])

    def stats(self, state: dict) -> dict:
        return {"taken": state["i"]}


def test_prefetch_state_is_the_consumers_position_and_reset_replays() -> None:
    p = Prefetch(Map(Counter(20), lambda x: x * 10), PrefetchOptions(queue_size=4))
    assert [p.next() for _ in range(5)] == [0, 10, 20, 30, 40]
    st = p.state()
    assert st == {"i": 5}  # not where the thread got to
    assert p.get_stats()["taken"] == 5
    rest = list(p)
    assert rest == [x * 10 for x in range(5, 20)] and p.state() == {"i": 20}
    p.reset(st)
    assert list(p) == rest
    p.reset(None)
    assert p.next() == 0
    assert p.close() and p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.next()


def test_prefetch_relays_the_same_exception_with_a_note() -> None:
    p = Prefetch(Counter(10, fail_at=3), PrefetchOptions(queue_size=2), name="toy")
    assert [p.next() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad row 3") as ei:
        p.next()
    assert any("toy" in n for n in ei.value.__notes__)
    p.close()


def test_envelope_round_trip_is_pickle_free() -> None:
    states = [{"a": np.arange(5, dtype=np.int32), "b": [1, (2, 3)], "c": b"x"}, {"a": None}]
    env = ckpt.envelope("toy", states, "any")
    blob = repr(env)
    assert "ndarray" in blob and "pickle" not in blob
    back = ckpt.open_envelope(env, "toy", 3)
    assert back[0]["a"].dtype == np.int32 and back[0]["a"].tolist() == [0, 1, 2, 3, 4]
    assert back[0]["b"] == [1, [2, 3]] and back[1] == {"a": None}
    with pytest.raises(ckpt.LoaderStateError, match="written by 'toy'"):
        ckpt.open_envelope(env, "other", 2)
    same = ckpt.envelope("toy", states, "same")
    with pytest.raises(ckpt.LoaderStateError, match="saved by 2 DP ranks"):
        ckpt.open_envelope(same, "toy", 3)
    with pytest.raises(ckpt.LoaderStateError, match="not in this version's format"):
        ckpt.open_envelope({"dp_rank_0": {}, "world_size": 1}, "toy", 1)
    with pytest.raises(TypeError, match=r"toy.ranks\[0\].bad"):
        ckpt.envelope("toy", [{"bad": object()}])


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda e: e["global"].__setitem__("ranks", "junk"), "ranks are a str, not a list"),
        (lambda e: e["global"].__setitem__("ranks", ("junk",)), "rank 0's saved state is a str"),
        (lambda e: e["global"].__setitem__("ranks", ({},)), "rank 0's saved state lacks i"),
    ],
    ids=["ranks-str", "rank-str", "rank-missing-key"],
)
def test_a_damaged_envelope_is_one_line_naming_the_rank(damage, needle) -> None:
    """Before: a string's characters counted as ranks, a KeyError deep in a stage, or (VL) an
    empty state silently resumed from defaults."""
    env = ckpt.envelope("toy", [{"i": 3}])
    damage(env)
    with pytest.raises(ckpt.LoaderStateError, match=needle):
        ckpt.open_envelope(env, "toy", 1, like={"i": 0})


class FailsTwice(Counter):
    def state_after_error(self) -> dict:
        raise RuntimeError("no state either")


def test_prefetch_relays_the_first_error_when_state_after_error_fails_too() -> None:
    p = Prefetch(FailsTwice(10, fail_at=2), PrefetchOptions(queue_size=2), name="toy")
    assert [p.next(), p.next()] == [0, 1]
    with pytest.raises(KeyError, match="bad row 2") as ei:
        p.next()
    assert any("state_after_error() failed too" in n for n in ei.value.__notes__)
    p.close()


def _batch(i: int) -> tuple:
    """A batch like the text loaders': a dict of two tensors and a tensor, plus a numpy array."""
    return (
        {"input": torch.full((4, 8), i), "positions": torch.zeros(4, 8)},
        [torch.ones(3)],
        (np.full(5, i),),
    )


def test_host_arrays_finds_every_cpu_tensor_and_array() -> None:
    b = _batch(3)
    found = host_arrays(b)
    assert len(found) == 4 and all(isinstance(a, torch.Tensor | np.ndarray) for a in found)
    assert host_arrays(7) == [] and host_arrays({"a": "text"}) == []


def test_a_batch_the_consumer_drops_is_freed_by_the_thread_not_the_training_loop() -> None:
    """The consumer's ``del batch`` frees no memory (the thread still references its arrays);
    the thread frees it once the consumer is KEEP_HANDED items further on."""
    freed_in: dict[int, str] = {}
    p = Prefetch(Map(Counter(40), _batch), PrefetchOptions(queue_size=2))
    for i in range(6):
        batch = p.next()
        t = batch[0]["input"]
        assert int(t[0, 0]) == i
        weakref.finalize(t, lambda i=i: freed_in.setdefault(i, threading.current_thread().name))
        del batch, t  # the consumer is done with it: its tensor must survive for now
        assert i not in freed_in, f"batch {i} was freed on the training loop"
    for _ in range(20):
        p.next()
    p.close()
    assert set(range(6)) <= set(freed_in)
    assert all(name != threading.current_thread().name for name in freed_in.values()), freed_in
