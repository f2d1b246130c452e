"""Tests for torchtitan_ext.device.staging (AsyncDeviceLoader) and device.normalize."""

from __future__ import annotations

import collections
import gc
import logging
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO
from tests.support.resume import LoaderSpec, assert_resume_exact
from torchtitan_ext.device.normalize import normalize_pixels, normalized_shape
from torchtitan_ext.device.staging import (
    AsyncDeviceLoader,
    PixelNormalize,
    _BufferPool,
    _Slot,
    wrap_for_device,
)

# ----------------------------------------------------------------------------------- helpers

Pair = collections.namedtuple("Pair", "a b")


def _tt_batch(i: int, b: int = 2, t: int = 8) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 1000, (b, t), generator=g)
    return {"input": x, "positions": torch.arange(t).repeat(b, 1)}, torch.roll(x, -1, 1)


def _nested_batch(i: int) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    return {
        "pixel": torch.randint(0, 256, (3, 4), dtype=torch.uint8, generator=g),
        "nested": [torch.randn(2, generator=g), (torch.randn(1, 3, generator=g), "tag")],
        "pair": Pair(torch.tensor([i]), None),
        "meta": {"n": i, "ids": torch.arange(i + 1)},
    }


def _assert_same(a, b) -> None:
    """Same structure and types; tensors bitwise equal (dtype, shape, bytes)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(
            a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b
        )
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


class CounterLoader:
    """A stateful loader whose whole state is an int: the index of the next batch."""

    def __init__(self, n: int | None = 20, fail_at: int | None = None):
        self.n, self.i, self.fail_at = n, 0, fail_at
        self.pulled = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.n is not None and self.i >= self.n:
            raise StopIteration
        if self.fail_at is not None and self.i == self.fail_at:
            _raise_bad_batch(self.i)
        b = _tt_batch(self.i)
        self.i += 1
        self.pulled += 1
        return b

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, sd):
        self.i = int(sd["i"])

    def get_stats(self):
        return {"inner/pulled": self.pulled}


def _raise_bad_batch(i: int):
    raise ValueError(f"corrupt row {i}")


def _our_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("AsyncDeviceLoader")}


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    before = _our_threads()
    yield
    if _our_threads() - before:
        gc.collect()  # only when needed: a full collection costs ~0.3 s with transformers loaded
    deadline = time.monotonic() + 5
    while _our_threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (_our_threads() - before), f"leaked threads: {_our_threads() - before}"


def _wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# ------------------------------------------------------------------------------ transparency


@pytest.mark.parametrize("mode", ["auto", "staged"])
@pytest.mark.parametrize("make", [_tt_batch, _nested_batch])
def test_cpu_transparent_bitwise(mode, make):
    data = [make(i) for i in range(7)]
    with AsyncDeviceLoader(data, "cpu", num_buffers=3, mode=mode) as w:
        got = list(w)
    assert len(got) == len(data)
    for g, d in zip(got, data, strict=True):
        _assert_same(g, d)
    if mode == "auto":  # no copies at all: the very same leaf tensor objects

        def leaves(x):
            if isinstance(x, torch.Tensor):
                return [x]
            if isinstance(x, dict):
                return [t for v in x.values() for t in leaves(v)]
            if isinstance(x, (list, tuple)):
                return [t for v in x for t in leaves(v)]
            return []

        for g, d in zip(got, data, strict=True):
            assert all(a is b for a, b in zip(leaves(g), leaves(d), strict=True))


def test_staged_cpu_copies_are_distinct_tensors():
    data = [_tt_batch(i) for i in range(3)]
    with AsyncDeviceLoader(data, "cpu", mode="staged") as w:
        got = list(w)
    assert got[1][1] is not data[1][1]
    assert got[1][1].data_ptr() != data[1][1].data_ptr()


@settings(max_examples=15, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5)), min_size=1, max_size=12),
    nb=st.integers(1, 4),
    mode=st.sampled_from(["auto", "staged"]),
    pool=st.booleans(),
)
def test_property_any_shapes_roundtrip(shapes, nb, mode, pool):
    data = [
        (
            {"input": torch.full(s, i, dtype=torch.int64), "pixel_values": torch.zeros(s[1], 6)},
            torch.full(s, -i),
        )
        for i, s in enumerate(shapes)
    ]
    with AsyncDeviceLoader(
        data, "cpu", num_buffers=nb, mode=mode, device_buffers="pool" if pool else "allocator"
    ) as w:
        # clone inside the loop: pool mode reuses buffers after `hold` (=1) more batches
        got = [({k: v.clone() for k, v in d.items()}, lab.clone()) for d, lab in w]
    for g, d in zip(got, data, strict=True):
        _assert_same(g, d)
    assert len(got) == len(data)


# ----------------------------------------------------------------------------- iteration API


def test_finite_loader_stops_and_stays_stopped_then_reiterates():
    data = [_tt_batch(i) for i in range(4)]
    w = AsyncDeviceLoader(data, "cpu")
    it = iter(w)
    assert len([next(it) for _ in range(4)]) == 4
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert len(list(w)) == 4  # a new pass, like a DataLoader epoch
    # break early, then re-iterate: the new pass starts from the beginning of the list
    for i, _b in enumerate(w):
        if i == 1:
            break
    _assert_same(next(iter(w)), data[0])
    w.close()
    assert not w.threads_alive()


def test_next_without_iter_starts_a_pass_and_close_is_idempotent():
    w = AsyncDeviceLoader([_tt_batch(0)], "cpu")
    _assert_same(next(w), _tt_batch(0))
    w.close()
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(w)
    assert len(list(w)) == 1  # iter() reopens
    w.close()


def test_wrap_for_device_and_stats_passthrough():
    inner = CounterLoader(5)
    assert wrap_for_device(inner, "cpu", enabled=False) is inner
    w = wrap_for_device(inner, "cpu", enabled=True, num_buffers=2)
    assert isinstance(w, AsyncDeviceLoader)
    list(w)
    s = w.get_stats()
    assert s["inner/pulled"] == 5 and s["staging/batches"] == 5
    assert {"staging/queue_depth", "staging/consumer_wait_ms_mean", "staging/copy_ms_mean"} <= set(
        s
    )
    w.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_buffers"):
        AsyncDeviceLoader([], "cpu", num_buffers=0)
    with pytest.raises(ValueError, match="mode"):
        AsyncDeviceLoader([], "cpu", mode="fast")
    with pytest.raises(ValueError, match="cuda and cpu"):
        AsyncDeviceLoader([], "meta")
    with pytest.raises(TypeError, match="no state_dict"):
        AsyncDeviceLoader([], "cpu", snapshot_state=True)
    with pytest.raises(RuntimeError, match="no state_dict"):
        AsyncDeviceLoader([], "cpu").state_dict()


# ---------------------------------------------------------------------------- resume exactness


def _wrapper_spec(make_inner, mode="auto") -> LoaderSpec:
    """An :class:`AsyncDeviceLoader` (3 buffers) over ``make_inner()`` for the resume harness:
    the wrapper's own ``state_dict()`` is what is saved."""
    return LoaderSpec(
        "staging",
        lambda rank, world, infinite: AsyncDeviceLoader(
            make_inner(), "cpu", num_buffers=3, mode=mode
        ),
        state=lambda loaders: loaders[0].state_dict(),
    )


@pytest.mark.parametrize("mode", ["auto", "staged"])
@pytest.mark.parametrize("consumed", [0, 3, 7])
def test_resume_exact_with_batches_in_flight(mode, consumed):
    ref = [b for b in CounterLoader(12)]
    events: list[str] = []

    def check(w, event):
        events.append(event)
        if event == "save":
            # let the background thread run ahead so that batches are really in flight
            _wait_until(lambda: w.loader.i >= min(12, consumed + 3))
            assert w.loader.i > consumed
            assert w.state_dict() == {"i": consumed}
        elif event == "load":
            assert w.state_dict() == {"i": consumed}
        elif event == "end":
            assert w.state_dict() == {"i": 12}  # after StopIteration: the exhausted state

    got = assert_resume_exact(
        _wrapper_spec(lambda: CounterLoader(12), mode),
        cuts=(consumed, None),
        infinite=False,
        check=check,
    )
    assert events.count("save") == events.count("load") == 1
    assert len(got[0]) == 12
    for g, r in zip(got[0], ref, strict=True):  # and the wrapper is transparent
        _assert_same(g, r)


def test_load_state_dict_on_the_same_wrapper_restarts_the_thread():
    ref = list(CounterLoader(10))
    w = AsyncDeviceLoader(CounterLoader(10), "cpu", num_buffers=4)
    it = iter(w)
    for _ in range(6):
        next(it)
    w.load_state_dict({"i": 2})
    assert not w.threads_alive()  # stopped; restarts on the next iteration
    got = list(w)
    for g, r in zip(got, ref[2:], strict=True):
        _assert_same(g, r)
    assert len(got) == 8
    w.close()


def test_state_snapshot_is_a_copy_not_a_live_reference():
    class Live(CounterLoader):
        def __init__(self):
            super().__init__(6)
            self.st = {"i": 0}

        def __next__(self):
            b = super().__next__()
            self.st["i"] = self.i  # mutated in place after every pull
            return b

        def state_dict(self):
            return self.st

    w = AsyncDeviceLoader(Live(), "cpu", num_buffers=3)
    it = iter(w)
    next(it)
    _wait_until(lambda: w.loader.i >= 4)
    assert w.state_dict() == {"i": 1}
    w.close()


# ------------------------------------------------------------------------------- exceptions


@pytest.mark.parametrize("mode", ["auto", "staged"])
def test_loader_exception_reraised_with_traceback(mode):
    w = AsyncDeviceLoader(CounterLoader(10, fail_at=3), "cpu", mode=mode)
    it = iter(w)
    for _ in range(3):
        next(it)
    with pytest.raises(ValueError, match="corrupt row 3") as ei:
        next(it)
    frames = [f.name for f in traceback.extract_tb(ei.value.__traceback__)]
    assert "_raise_bad_batch" in frames  # the background thread's frames are kept
    assert any("background thread 'AsyncDeviceLoader'" in n for n in ei.value.__notes__)
    with pytest.raises(RuntimeError, match="after an error") as ei2:
        next(it)
    assert isinstance(ei2.value.__cause__, ValueError)
    assert not w.threads_alive()
    # a resume after the failure works (state = after the last good batch)
    assert w.state_dict() == {"i": 3}
    w.close()


def test_copy_thread_exception_reraised():
    bad = [{"pixel_values": torch.zeros(2, 7, dtype=torch.uint8)}]  # 7 % 3 channels != 0
    w = AsyncDeviceLoader(bad, "cpu", mode="staged", normalize=True)
    with pytest.raises(ValueError, match="not a multiple of channels") as ei:
        next(iter(w))
    assert any("copy of batch #0" in n for n in ei.value.__notes__)
    w.close()


def test_close_reports_a_fetch_thread_stuck_in_the_wrapped_loader(monkeypatch, caplog):
    """A wrapped loader whose next() never returns: close() gives up after its join timeout,
    logs the thread with where it is blocked, and the thread ends once the loader returns."""
    from torchtitan_ext.device import staging

    release = threading.Event()

    def hangs():
        yield {"input": torch.zeros(2)}
        release.wait()  # the second next() blocks here
        yield {"input": torch.ones(2)}

    monkeypatch.setattr(staging, "_JOIN_TIMEOUT_S", 0.3)
    w = AsyncDeviceLoader(hangs(), "cpu", snapshot_state=False)
    next(w)
    time.sleep(0.1)
    (thread,) = w.threads_alive()
    try:
        with caplog.at_level(logging.ERROR, logger="torchtitan_ext.pipeline.prefetch"):
            t0 = time.monotonic()
            w.close()
            assert time.monotonic() - t0 < 2
        msg = "\n".join(r.getMessage() for r in caplog.records)
        assert "'AsyncDeviceLoader' did not stop within 0.3 s" in msg
        assert "in hangs" in msg  # where it is blocked
        assert thread.is_alive()
    finally:
        release.set()
    _wait_until(lambda: not thread.is_alive())


def test_no_threads_left_after_break_gc_and_context_manager():
    before = set(threading.enumerate())
    w = AsyncDeviceLoader(CounterLoader(None), "cpu", num_buffers=2)  # infinite
    for i, _ in enumerate(w):
        if i == 5:
            break
    assert w.threads_alive()
    del w, _
    gc.collect()
    _wait_until(lambda: set(threading.enumerate()) <= before)
    with AsyncDeviceLoader(CounterLoader(None), "cpu", mode="staged") as w2:
        next(iter(w2))
    assert not w2.threads_alive()
    assert set(threading.enumerate()) <= before


@pytest.mark.parametrize("mode", ["auto", "staged"])
def test_interpreter_exit_stops_the_threads(mode):
    """A wrapper never closed, its thread blocked on a full queue: at interpreter exit the thread
    is stopped and joined, not killed mid-copy as a daemon. The check runs in the last atexit
    handler (registered first), after the wrapper's and the Prefetch's own."""
    script = textwrap.dedent(
        f"""
        import atexit, itertools, threading, time
        def report():
            alive = [t.name for t in threading.enumerate() if t.name == "AsyncDeviceLoader"]
            print("at exit; threads alive:", alive, flush=True)
        atexit.register(report)
        import torch
        from torchtitan_ext.device import staging
        batches = ({{"input": torch.full((2, 4), i)}} for i in itertools.count())
        w = staging.AsyncDeviceLoader(batches, "cpu", num_buffers=2, mode={mode!r})
        next(w)
        q = w._pf.worker.q
        deadline = time.monotonic() + 30
        while q.qsize() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the thread has its next batch and waits in put()
        print("ok" if q.qsize() == 2 and w.threads_alive() else "queue never filled", flush=True)
        # no close(): the interpreter exits with the thread blocked on a full queue
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == ["ok", "at exit; threads alive: []"]


# ------------------------------------------------------------------------- buffer pool logic


def _mk(sig):
    return lambda: _Slot(sig, [], [], [], nbytes=10)


def test_pool_reuses_per_signature_and_allocates_new_shapes():
    stop = threading.Event()
    p = _BufferPool(per_signature=2, max_signatures=2, stop=stop)
    a = p.acquire("A", _mk("A"))
    p.release(a)
    assert p.acquire("A", _mk("A")) is a and p.reuses == 1 and p.allocations == 1
    b = p.acquire("A", _mk("A"))  # a is in use: second slot for A
    assert b is not a and p.allocations == 2
    c = p.acquire("B", _mk("B"))
    assert p.allocations == 3 and p.stats()["staging/buffer_signatures"] == 2
    for s in (a, b, c):
        p.release(s)
    p.acquire("C", _mk("C"))  # third signature evicts LRU "A" (its two free slots)
    assert p.evictions == 1 and p.stats()["staging/buffer_bytes"] == 20
    assert p.acquire("A", _mk("A")) is not a  # re-allocated after eviction


def test_pool_blocks_when_signature_exhausted_until_release():
    stop = threading.Event()
    p = _BufferPool(per_signature=1, max_signatures=4, stop=stop)
    a = p.acquire("A", _mk("A"))
    got = []
    t = threading.Thread(target=lambda: got.append(p.acquire("A", _mk("A"))))
    t.start()
    time.sleep(0.15)
    assert not got  # blocked: the only slot is held
    p.release(a)
    t.join(5)
    assert got == [a]


def test_staged_pool_mode_reuses_buffers_for_bucketed_shapes():
    shapes = [(2, 8), (2, 16), (2, 8), (2, 16), (2, 8), (2, 32), (2, 8)] * 3
    data = [({"input": torch.full(s, i)}, torch.full(s, i)) for i, s in enumerate(shapes)]
    w = AsyncDeviceLoader(data, "cpu", num_buffers=2, mode="staged", device_buffers="pool")
    ptrs = collections.defaultdict(set)
    for i, (d, lab) in enumerate(w):
        assert int(d["input"][0, 0]) == i and lab.shape == shapes[i]
        ptrs[tuple(lab.shape)].add(lab.data_ptr())
    s = w.get_stats()
    # at most depth + hold + 1 slots per distinct shape (all that can be in use), the rest reuse
    assert all(len(v) <= 2 + 1 + 1 for v in ptrs.values())
    assert s["staging/buffer_allocations"] <= 4 * 3
    assert s["staging/buffer_reuses"] == len(shapes) - s["staging/buffer_allocations"]
    w.close()


@pytest.mark.parametrize("hold", [1, 3])
def test_pool_mode_never_refills_a_held_buffer(hold):
    """Batches stay intact while held (up to `hold` outstanding), even with a fast producer."""
    data = [({"input": torch.full((4, 4), i)}, torch.full((4, 4), -i)) for i in range(30)]
    w = AsyncDeviceLoader(
        data, "cpu", num_buffers=1, mode="staged", device_buffers="pool", hold=hold
    )
    held = collections.deque()
    reused = False
    for i, (d, lab) in enumerate(w):
        held.append((i, d, lab))
        if len(held) > hold:
            held.popleft()
        time.sleep(0.002)  # give the stage thread every chance to overwrite something
        for j, dj, lj in held:
            assert int(dj["input"].unique()) == j and int(lj.unique()) == -j
        reused |= w.get_stats()["staging/buffer_reuses"] > 0
    assert reused
    w.close()


# ---------------------------------------------------------------------------- normalisation


def _hf_reference(values_u8: np.ndarray, mean, std) -> np.ndarray:
    """transformers' PIL-backend rescale + normalize on a channel-first [C, H, W] uint8 image."""
    from transformers.image_transforms import normalize, rescale
    from transformers.image_utils import ChannelDimension

    x = rescale(values_u8, 1 / 255, input_data_format=ChannelDimension.FIRST)
    return normalize(x, mean, std, input_data_format=ChannelDimension.FIRST)


@pytest.mark.parametrize(
    "mean,std",
    [
        ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    ],
)
def test_normalize_exhaustive_all_uint8_values(mean, std):
    img = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()  # [C, 1, 256]
    ref = _hf_reference(img, list(mean), list(std))  # [C, 1, 256] float32
    x = torch.from_numpy(img.reshape(1, 3 * 256))  # one row, [C, 1, K] with K = 256
    y = normalize_pixels(x, mean, std, temporal_patch_size=1)
    assert y.dtype == torch.float32
    assert torch.equal(
        y.view(3, 256).view(torch.int32), torch.from_numpy(ref.reshape(3, 256)).view(torch.int32)
    )
    # and why it is written as a division: multiplying by 1/255 is not bit-exact
    xf = torch.arange(256, dtype=torch.uint8).float()
    assert not torch.equal(xf * (1 / 255), xf / 255)


def test_normalize_layout_matches_qwen2vl_pil_processor():
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil
    from transformers.image_utils import SizeDict

    proc = Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 64 * 64, "longest_edge": 256 * 256},
    )
    rng = np.random.default_rng(0)
    for h, w in [(70, 100), (50, 33)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        pv = proc(images=img, return_tensors="pt")["pixel_values"]
        # the same resize, then the processor's own patchify with one frame, kept in uint8
        arr = np.asarray(img).transpose(2, 0, 1)
        size = SizeDict(
            shortest_edge=proc.size["shortest_edge"], longest_edge=proc.size["longest_edge"]
        )
        r = proc.resize(arr, size=size, resample=proc.resample, factor=32)
        assert r.dtype == np.uint8
        p1, _, _ = proc.patchify(r, 16, 2, 1)
        u8 = torch.from_numpy(p1.astype(np.uint8))
        assert u8.shape[1] == 768 and pv.shape == (u8.shape[0], 1536)
        y = normalize_pixels(u8, (0.5,) * 3, (0.5,) * 3, temporal_patch_size=2)
        assert torch.equal(y.view(torch.int32), pv.view(torch.int32))
        # per-channel expansion, not [row, row]: the two layouts differ
        assert not torch.equal(y, normalize_pixels(u8, (0.5,) * 3, (0.5,) * 3, 1).repeat(1, 2))
        # input already expanded (input_temporal == T) gives the same result
        y2 = normalize_pixels(
            u8.view(-1, 3, 1, 256).expand(-1, 3, 2, 256).reshape(-1, 1536),
            (0.5,) * 3,
            (0.5,) * 3,
            2,
            input_temporal=2,
        )
        assert torch.equal(y, y2)


def test_normalize_shapes_and_errors():
    x = torch.zeros(2, 5, 768, dtype=torch.uint8)  # torchtitan-style padded [N_img, patches, D]
    assert normalize_pixels(x).shape == (2, 5, 1536)
    assert normalized_shape((0, 768), 3, 2) == (0, 1536)
    assert normalize_pixels(torch.zeros(0, 768, dtype=torch.uint8)).shape == (0, 1536)
    with pytest.raises(TypeError, match="uint8"):
        normalize_pixels(torch.zeros(1, 768))
    with pytest.raises(ValueError, match="input_temporal"):
        normalize_pixels(torch.zeros(1, 768, dtype=torch.uint8), input_temporal=3)
    out = torch.empty(1, 1536)
    assert normalize_pixels(torch.zeros(1, 768, dtype=torch.uint8), out=out) is out
    with pytest.raises(ValueError, match="out must be"):
        normalize_pixels(torch.zeros(1, 768, dtype=torch.uint8), out=torch.empty(1, 768))


@pytest.mark.parametrize("mode", ["auto", "staged"])
def test_loader_normalises_marked_uint8_leaves_only(mode):
    g = torch.Generator().manual_seed(0)
    data = [
        (
            {
                "input": torch.arange(4).view(1, 4),
                "pixel_values": torch.randint(0, 256, (6, 768), dtype=torch.uint8, generator=g),
                "other_u8": torch.ones(2, dtype=torch.uint8),
            },
            torch.zeros(1, 4),
        ),
        (
            {"input": torch.arange(4).view(1, 4), "pixel_values": torch.zeros(2, 1536)},
            torch.zeros(1, 4),
        ),
    ]
    with AsyncDeviceLoader(data, "cpu", mode=mode, normalize=PixelNormalize()) as w:
        got = list(w)
        s = w.get_stats()
    assert torch.equal(got[0][0]["pixel_values"], normalize_pixels(data[0][0]["pixel_values"]))
    assert got[0][0]["other_u8"].dtype == torch.uint8
    _assert_same(got[1], data[1])  # float pixels pass through untouched
    assert s["staging/normalized"] == 1 and s["staging/normalize_passthrough"] == 1


# ------------------------------------------------------------------------------------ CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("device_buffers", ["allocator", "pool"])
def test_cuda_bitwise_and_event_discipline(device_buffers):
    """A slow consumer kernel reads each batch while the copier races ahead: no corruption."""
    data = [({"input": torch.full((256, 1024), i)}, torch.full((256, 1024), -i)) for i in range(24)]
    w = AsyncDeviceLoader(data, "cuda", num_buffers=2, device_buffers=device_buffers)
    sums = []
    for d, lab in w:
        assert d["input"].is_cuda
        torch.cuda._sleep(2_000_000)  # keep the consumer stream busy before it reads
        sums.append(d["input"].sum() - lab.sum())
    torch.cuda.synchronize()
    exp = [2 * i * 256 * 1024 for i in range(24)]
    assert [int(s) for s in sums] == exp
    w.close()


@pytest.mark.cuda
def test_cuda_normalize_matches_cpu_bitwise():
    x = torch.randint(0, 256, (64, 768), dtype=torch.uint8)
    data = [{"pixel_values": x}]
    with AsyncDeviceLoader(data, "cuda", normalize=True) as w:
        (b,) = list(w)
    assert torch.equal(
        b["pixel_values"].cpu().view(torch.int32), normalize_pixels(x).view(torch.int32)
    )


@pytest.mark.cuda
def test_cuda_pinned_sources_and_pool_reuse():
    data = [
        ({"input": torch.full((8, 64), i).pin_memory()}, torch.full((8, 64), i)) for i in range(10)
    ]
    with AsyncDeviceLoader(data, "cuda", device_buffers="pool") as w:
        vals = [int(d["input"][0, 0]) for d, _ in w]
        s = w.get_stats()
    assert vals == list(range(10))
    assert s["staging/already_pinned"] == 10 and s["staging/buffer_reuses"] >= 7


def test_keep_on_host_passes_leaves_through_uncopied():
    data = [_tt_batch(i) for i in range(3)]
    with AsyncDeviceLoader(data, "cpu", mode="staged", keep_on_host={(1,), (0, "positions")}) as w:
        got = list(w)
    for g, d in zip(got, data, strict=True):
        _assert_same(g, d)
        assert g[1] is d[1] and g[0]["positions"] is d[0]["positions"]
        assert g[0]["input"] is not d[0]["input"]


def test_state_dict_before_iteration_is_the_loaders():
    inner = CounterLoader(5)
    inner.i = 2
    w = AsyncDeviceLoader(inner, "cpu")
    assert w.state_dict() == {"i": 2}
    it = iter(w)
    assert w.state_dict() == {"i": 2}  # pass started, nothing handed out yet
    _assert_same(next(it), _tt_batch(2))
    assert w.state_dict() == {"i": 3}
    w.close()


@pytest.mark.slow
def test_benchmark_quick_smoke():
    from benchmarks.common import BenchArgs
    from benchmarks.staging import run

    rows = {r.case: r for r in run(BenchArgs(repeats=1, warmup=0, quick=True))}
    assert rows["H2D bytes/VL batch: uint8 [N,768] pixels"].ratio > 7  # 8x on pixels alone
    gpu = rows["GPU step time text: staged / resident"]
    if not torch.cuda.is_available():
        assert gpu.info == {"skipped": "no CUDA"} and gpu.met is None


class _TokenDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = torch.arange(i, i + 9)
        return {"input": x[:-1]}, x[1:]


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_resume_exact_over_torchdata_stateful_dataloader(workers):
    """The loader torchtitan wraps: resume from the wrapper's state replays in-flight batches."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make():
        return StatefulDataLoader(
            _TokenDataset(),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(7),
        )

    def check(w, event):
        if event == "save":
            time.sleep(0.2)  # let the fetch thread run ahead

    ref = list(make())  # default_collate yields [input_dict, labels] lists
    got = assert_resume_exact(_wrapper_spec(make), cuts=(4, None), infinite=False, check=check)
    assert len(got[0]) == len(ref)
    for g, r in zip(got[0], ref, strict=True):  # and the wrapper is transparent
        _assert_same(g, r)


@pytest.mark.parametrize("mode", ["auto", "staged"])
def test_device_transform_runs_after_normalize(mode):
    seen_dtypes = []

    def zero_pad(batch):
        d, lab = batch
        seen_dtypes.append(d["pixel_values"].dtype)
        d = dict(d)
        d["pixel_values"] = d["pixel_values"].clone()
        d["pixel_values"][:, d["n"] :] = 0  # pad rows back to exactly 0
        return d, lab

    px = torch.randint(0, 256, (2, 5, 768), dtype=torch.uint8)
    data = [({"pixel_values": px, "n": 3}, torch.zeros(2))]
    with AsyncDeviceLoader(data, "cpu", mode=mode, normalize=True, device_transform=zero_pad) as w:
        ((d, _),) = list(w)
    exp = normalize_pixels(px)
    exp[:, 3:] = 0
    assert seen_dtypes == [torch.float32] and torch.equal(d["pixel_values"], exp)

    def boom(batch):
        raise KeyError("grid_thw")

    with AsyncDeviceLoader(data, "cpu", mode=mode, device_transform=boom) as w:
        with pytest.raises(KeyError, match="grid_thw"):
            next(iter(w))
