"""AsyncDeviceLoader on the one pipeline: fused into a loader's Prefetch, or over its own one.

The toy loader here is what a text loader looks like on the pipeline contract: a source stage
(state = one int), a Map that builds torchtitan ``(input_dict, labels)`` batches, topped by a
:class:`~torchtitan_ext.pipeline.prefetch.Prefetch` exposed as ``.pipeline``, with
``rank_state()`` / ``load_state_dict(envelope)`` through :mod:`torchtitan_ext.pipeline.checkpoint`.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from tests.support.resume import LoaderSpec, assert_resume_exact, same, take
from torchtitan_ext.device.staging import AsyncDeviceLoader, wrap_for_device
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Map, Stage

B, T = 2, 16


class CountingSource(Stage[int]):
    """Items 0, 1, 2, ... (``n`` of them, or endless); counts its ``state()`` calls; raises a
    kept exception object at ``fail_at``."""

    def __init__(self, n: int | None = None, fail_at: int | None = None, seed: int = 0) -> None:
        self.n, self.fail_at, self.seed = n, fail_at, seed
        self.i = 0
        self.state_calls = 0
        self.made = 0
        self.raised: BaseException | None = None

    def next(self) -> int:
        if self.n is not None and self.i >= self.n:
            raise StopIteration
        if self.i == self.fail_at:
            self.raised = ValueError(f"corrupt row {self.i}")
            raise self.raised
        self.i += 1
        self.made += 1
        return self.seed + self.i - 1

    def state(self) -> dict[str, int]:
        self.state_calls += 1
        return {"i": self.i}

    def reset(self, state: dict[str, int] | None = None) -> None:
        self.i = 0 if state is None else int(state["i"])


def make_batch(i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(3, 1000, (B, T + 1), generator=g)
    return {"input": x[:, :-1], "positions": torch.arange(T).repeat(B, 1)}, x[:, 1:]


class ToyTextLoader:
    """A Prefetch-topped loader with the torchtitan adapter's calls (see the module doc)."""

    name = "toy_text"

    def __init__(
        self,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        n: int | None = None,
        fail_at: int | None = None,
        queue_size: int = 4,
    ) -> None:
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.src = CountingSource(None if infinite else (n or 40), fail_at, seed=1000 * dp_rank)
        self.pipeline = Prefetch(
            Map(self.src, make_batch), PrefetchOptions(queue_size=queue_size), name="toy-prefetch"
        )
        self.state_dict_calls = 0

    def __iter__(self) -> ToyTextLoader:
        return self

    def __next__(self):
        return self.pipeline.next()

    def rank_state(self):
        return self.pipeline.state()

    def state_dict(self):
        self.state_dict_calls += 1
        return checkpoint.envelope(self.name, [self.rank_state()])

    def load_state_dict(self, sd) -> None:
        states = checkpoint.open_envelope(sd, self.name, self.dp_world_size)
        self.pipeline.reset(states[self.dp_rank])

    def close(self) -> None:
        self.pipeline.close()


class ListLoader:
    """A plain stateful loader (no Prefetch): the own hand-off."""

    def __init__(self, n: int = 12) -> None:
        self.n, self.i = n, 0
        self.state_dict_calls = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return make_batch(self.i - 1)

    def state_dict(self):
        self.state_dict_calls += 1
        return {"i": self.i}

    def load_state_dict(self, sd) -> None:
        self.i = int(sd["i"])


# Library threads started once per process on first use, not ours: the thread policy's probe,
# tqdm's monitor (HF datasets' progress bars, started by the streaming loader's first read).
_NOT_OURS = ("sched-idle-probe", "tqdm_monitor")


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name not in _NOT_OURS}


def _wait_until(pred, timeout: float = 30.0) -> None:
    """Wait for a condition (generous: the CI box may be loaded; nothing here is timed)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    before = _threads()
    yield
    gc.collect()
    _wait_until(lambda: not (_threads() - before))


STAGED = [
    pytest.param({"mode": "staged"}, id="staged-allocator"),
    pytest.param({"mode": "staged", "device_buffers": "pool", "hold": 2}, id="staged-pool"),
    pytest.param({}, id="auto"),
]


# --------------------------------------------------------------------------------- fused mode


@pytest.mark.parametrize("opts", STAGED)
def test_fused_adds_no_thread_and_one_state_per_batch(opts):
    ld = ToyTextLoader()
    w = AsyncDeviceLoader(ld, "cpu", **opts)
    before = _threads()
    got = [next(w) for _ in range(10)]
    assert len(got) == 10
    added = _threads() - before
    assert [t.name for t in added] == ["toy-prefetch"]  # the loader's own thread, nothing else
    assert w.threads_alive() == list(added)
    # one state per item made (+1 when the Prefetch was built), none asked of the adapter;
    # waited for: the thread runs ahead and takes its state right after each item
    src = ld.src
    _wait_until(lambda: src.made > 10 and src.state_calls == src.made + 1)
    assert ld.state_dict_calls == 0
    assert w.state() is ld.pipeline.state() and w.rank_state() == {"i": 10}
    assert w.state_dict() == checkpoint.envelope("toy_text", [{"i": 10}])
    w.close()
    assert not w.threads_alive()


@pytest.mark.parametrize("opts", STAGED)
def test_fused_batches_bitwise_the_unstaged_ones(opts):
    plain = ToyTextLoader(infinite=False, n=13)
    expected = list(plain)
    plain.close()
    ld = ToyTextLoader(infinite=False, n=13)
    with AsyncDeviceLoader(ld, "cpu", **opts) as w:
        # clone: pool mode reuses a batch's buffers once `hold` more were requested
        got = [({k: v.clone() for k, v in d.items()}, lab.clone()) for d, lab in w]
        with pytest.raises(StopIteration):
            next(w)
        assert w.fused
        if opts.get("mode") == "staged":
            s = w.get_stats()
            assert s["staging/fused"] == 1 and s["staging/buffer_allocations"] >= 1
            assert s["staging/buffer_reuses"] == 13 - s["staging/buffer_allocations"]
    assert len(got) == len(expected) == 13
    for g, e in zip(got, expected, strict=True):
        assert same(g, e)
    ld.close()


def test_fused_staged_copies_are_distinct_and_auto_is_a_pass_through():
    ld = ToyTextLoader()
    seen = []
    ld.pipeline.set_then(lambda b: seen.append(b) or b)  # the loader's own then is kept
    with AsyncDeviceLoader(ld, "cpu", mode="staged") as w:
        b = next(w)
    assert b[1] is not seen[0][1] and b[1].data_ptr() != seen[0][1].data_ptr()
    assert same(b, seen[0])
    assert ld.pipeline.then is not None  # restored on close: the loader's own then
    ld.pipeline.set_then(None)
    with AsyncDeviceLoader(ld, "cpu") as w:
        assert ld.pipeline.then is None  # nothing to do on the CPU: not even installed
        b = next(w)
    assert same(b, make_batch(1))
    ld.close()


def test_fused_wrapping_a_running_loader_continues_exactly():
    ld = ToyTextLoader()
    head = [next(ld) for _ in range(3)]
    _wait_until(lambda: ld.src.made > 3)  # items made ahead, without staging
    w = AsyncDeviceLoader(ld, "cpu", mode="staged")
    tail = [next(w) for _ in range(3)]
    for i, b in enumerate(head + tail):
        assert same(b, make_batch(i))
    w.close()
    assert same(next(ld), make_batch(6))  # the loader goes on after close, unstaged
    ld.close()


@pytest.mark.parametrize("world", [1, 2])
def test_fused_resume_exact_through_the_harness(world):
    spec = LoaderSpec(
        name="toy_text",
        build=lambda r, w, inf: AsyncDeviceLoader(
            ToyTextLoader(r, w, inf), "cpu", mode="staged", keep_on_host={(1,)}
        ),
    )
    assert_resume_exact(spec, steps=6, dp_from=world, dp_to=world)


@pytest.mark.parametrize("opts", STAGED)
def test_fused_errors_relayed_as_the_same_object_across_one_thread(opts):
    ld = ToyTextLoader(fail_at=3)
    w = AsyncDeviceLoader(ld, "cpu", **opts)
    for i in range(3):
        assert same(next(w), make_batch(i))
    with pytest.raises(ValueError, match="corrupt row 3") as ei:
        next(w)
    assert ei.value is ld.src.raised
    relays = [n for n in ei.value.__notes__ if n.startswith("(raised in")]
    assert relays == [relays[0]] and "'toy-prefetch'" in relays[0]  # one hand-off crossed
    with pytest.raises(RuntimeError, match="after an error"):
        next(w)
    assert w.rank_state() == {"i": 3}  # after the last good batch
    w.close()

    boom = KeyError("grid_thw")

    def transform(batch):
        raise boom

    ld2 = ToyTextLoader()
    with AsyncDeviceLoader(ld2, "cpu", **opts, device_transform=transform) as w2:
        with pytest.raises(KeyError) as ei2:
            next(w2)
    assert ei2.value is boom and any("in the copy of batch #0" in n for n in boom.__notes__)
    ld.close()
    ld2.close()


def test_fused_close_joins_the_thread_and_is_idempotent():
    ld = ToyTextLoader()
    w = AsyncDeviceLoader(ld, "cpu", mode="staged")
    next(w)
    (t,) = w.threads_alive()
    w.close()
    assert not t.is_alive() and not w.threads_alive()
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(w)
    assert same(next(iter(w)), make_batch(1))  # iter() reopens, exactly where it was
    w.close()
    ld.close()


@pytest.mark.parametrize("hold", [1, 3])
def test_fused_pool_never_refills_a_held_batch_and_never_waits(hold):
    ld = ToyTextLoader(queue_size=2)
    w = AsyncDeviceLoader(ld, "cpu", mode="staged", device_buffers="pool", hold=hold)
    held: list[tuple[int, tuple]] = []
    for i in range(25):
        held = [*held, (i, next(w))][-hold:]
        time.sleep(0.002)  # give the thread every chance to overwrite something
        for j, b in held:
            assert same(b, make_batch(j)), f"batch {j} overwritten while held"
    s = w.get_stats()
    assert s["staging/buffer_allocations"] <= 2 + hold + 1  # depth + hold + 1: all in use at once
    assert s["staging/buffer_reuses"] > 0
    w.close()
    ld.close()


# --------------------------------------------------------------------------- own hand-off


@pytest.mark.parametrize("opts", STAGED)
def test_own_hand_off_is_one_thread_and_one_snapshot_per_batch(opts):
    ld = ListLoader(30)
    before = _threads()
    w = wrap_for_device(ld, "cpu", enabled=True, num_buffers=3, **opts)
    for i in range(5):
        assert same(next(w), make_batch(i))
    assert [t.name for t in _threads() - before] == ["AsyncDeviceLoader"]  # was fetch + stage
    assert isinstance(w, AsyncDeviceLoader) and not w.fused
    # one snapshot per batch pulled (+1 when the hand-off was built), none by state_dict();
    # waited for: the thread runs ahead and snapshots right after each pull
    _wait_until(lambda: ld.i > 5 and ld.state_dict_calls == ld.i + 1)
    assert w.state_dict() == {"i": 5} and ld.state_dict_calls == ld.i + 1
    w.close()
    assert not (_threads() - before)


@pytest.mark.slow
def test_text_staging_benchmark_quick_smoke():
    """The benchmark's counts (not its timings), over the real Parquet loader and the toy:
    fused staging adds no thread to the loader's own and takes one snapshot per batch; the
    former wrapper (when the history is there) adds one or two threads and takes two."""
    from benchmarks.common import BenchArgs
    from benchmarks.text_staging import run

    args = BenchArgs(repeats=1, warmup=0, quick=True, extra={"priorities": "adaptive"})
    rows = {r.case: r for r in run(args)}
    for loader in ("", "toy, "):
        assert rows[f"threads added: {loader}loader alone, adaptive"].value == 0
        for name in ("fused, auto", "fused, staged"):
            key = f"{loader}{name}, adaptive"
            if f"threads added: {key}" not in rows:
                continue  # the toy runs fused, staged only
            assert rows[f"threads added: {key}"].value == 0
            assert rows[f"threads added: {key}"].info["fused"] == 1.0
            assert round(rows[f"snapshots per batch: {key}"].value, 1) == 1.0
        key = f"{loader}before, staged, adaptive"
        if f"threads added: {key}" in rows:
            assert rows[f"threads added: {key}"].value in (1, 2)
            # per batch the source made meanwhile: short runs skew it by the loader's lead
            assert rows[f"snapshots per batch: {key}"].value > 1.5


# ------------------------------------------------------------ the real text job's adapter, fused
def test_parquet_adapter_is_staged_fused_across_finite_passes(tmp_path):
    """The torchtitan adapter of the Parquet loader exposes its Prefetch as ``.pipeline``, so
    staging runs its copy there: no thread of its own, the unstaged batches bitwise, the
    adapter's state (nothing gathered), and ``iter()`` after a finished pass starts a new one
    although the batches bypassed the adapter's ``__next__``."""
    from tests.support.loader_specs import PQ_SEQ_LEN, parquet_id_corpus
    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader

    data, tok_dir, _ = parquet_id_corpus(tmp_path)

    def build():
        cfg = PrefetchingParquetDataLoader.Config(
            dataset_path=str(data), tokenizer_path=str(tok_dir), val_files="none",
            infinite=False, queue_size=2, seed=3,
        )  # fmt: skip
        return cfg.build(dp_rank=0, dp_world_size=1, tokenizer=None, seq_len=PQ_SEQ_LEN,
                         local_batch_size=2)  # fmt: skip

    plain = build()
    want = list(plain)
    plain.close()
    ld = build()
    assert ld.pipeline is ld.loader.pipeline
    before = _threads()
    w = AsyncDeviceLoader(ld, "cpu", mode="staged")
    assert w.fused
    for _ in range(2):  # two passes: iter() restarts the finished one
        got = list(w)
        assert ld.loader.done
        assert len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
        assert all(t.name.startswith("parquet-") for t in _threads() - before)
    assert w.rank_state() is not None and w.state_dict() == ld.state_dict()
    w.close()
    ld.close()


# ------------------------------------------------------- the package's own text loaders under it
@pytest.mark.parametrize("loader,workers", [("parquet_prefetch", 0), ("streaming_text", 0)])
def test_text_adapters_are_fused_no_thread_added(tmp_path, loader, workers):
    """torchtitan's text adapters expose their Prefetch as ``.pipeline``: staging adds no
    thread over them (before, it ran its own hand-off and snapshotted their state_dict())."""
    from tests.support.loader_specs import BUILDERS, Variant

    spec = BUILDERS[loader](Variant(staging=False, workers=workers), tmp_path)
    plain = spec.build(0, 1, True)
    take(plain, 3)
    alone = {t.name for t in threading.enumerate()}
    plain.close()
    inner = spec.build(0, 1, True)
    staged = wrap_for_device(inner, torch.device("cpu"), enabled=True)
    take(staged, 3)
    with_staging = {t.name for t in threading.enumerate()}
    staged.close()
    inner.close()  # fused: closing the wrapper leaves the loader usable
    assert not {n for n in with_staging - alone if "AsyncDeviceLoader" in n}, with_staging - alone


def test_own_hand_off_never_builds_the_envelope_per_batch(tmp_path):
    """Over an adapter it cannot fuse with (streaming_text with worker processes) staging
    snapshots ``rank_state()`` per batch; ``state_dict()`` (whose gather is a collective at
    DP > 1) runs only when a checkpoint asks, on the caller's thread."""
    from tests.support.loader_specs import BUILDERS, Variant

    spec = BUILDERS["streaming_text"](Variant(staging=False, workers=2), tmp_path)
    loader = spec.build(0, 1, True)
    calls = []
    original = loader.state_dict
    loader.state_dict = lambda *a, **k: (
        calls.append(threading.current_thread().name),
        original(*a, **k),
    )[1]  # noqa: E501
    staged = wrap_for_device(loader, torch.device("cpu"), enabled=True, mode="staged")
    got = take(staged, 4)  # a second iter() below continues: nothing made ahead is dropped
    assert len(got) == 4 and calls == []
    value = staged.state_dict()
    assert calls == [threading.current_thread().name]
    fresh = spec.build(0, 1, True)
    fresh.load_state_dict(value)
    assert same(take(fresh, 2), take(staged, 2))
    staged.close()
    fresh.close()
    loader.close()
