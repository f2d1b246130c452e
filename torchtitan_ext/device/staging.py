"""AsyncDeviceLoader: overlap batch loading and the host-to-device copy with the training step.

Algorithm (torch-async's decoupled pipeline, with threads instead of processes):

* **fetch thread** pulls ``next(iterator)`` from the wrapped loader, snapshots the wrapped
  loader's ``state_dict()`` right after the pull (so the snapshot travels with its batch) and puts
  the pair on a bounded queue.
* **stage thread** (CUDA, or ``mode="staged"``) flattens the batch (nested dicts / lists /
  tuples; non-tensor leaves pass through untouched), picks a *buffer slot* keyed by the batch's
  shape signature from a pool (a free queue per shape; bucketed shapes reuse their slots, a new
  shape allocates, least-recently-used shapes are evicted past ``max_signatures``), copies each
  tensor into the slot's pinned host buffer (skipped when the source is already pinned), issues
  ``non_blocking`` copies into device memory on a dedicated copy stream, normalises uint8
  ``pixel_values`` there (:func:`~torchtitan_ext.device.normalize.normalize_pixels`), records a
  CUDA event and puts the batch on the *ready* queue.
* **consumer** (``__next__``) takes the next ready batch, makes its *current* stream wait on the
  copy event (a GPU-side wait, the CPU never blocks) and returns the same structure as the
  wrapped loader.

Buffer lifetime (a buffer is never refilled while the consumer may still read it):

* ``device_buffers="allocator"`` (default): device tensors come from PyTorch's caching allocator
  on the copy stream and are handed over with ``Tensor.record_stream(consumer_stream)``, so the
  allocator reuses their memory only after the consumer's queued work on them has finished. No
  contract for the caller: batches may be kept as long as wanted. After warm-up these
  allocations are cache hits (microseconds).
* ``device_buffers="pool"``: device tensors are pre-allocated per slot and reused. When the
  consumer asks for a batch it records an event on its current stream; the slot handed out
  ``hold`` requests earlier is released with that event and the copy stream waits on it before
  overwriting the slot. Contract: a batch is valid until ``hold`` further batches have been
  requested. torchtitan 0.3.0's ``train_step`` fetches all ``gradient_accumulation_steps x
  pp_microbatches`` batches *before* running any of them, so ``hold`` must be at least that.
* Pinned host buffers are always pooled; before a slot's host buffer is rewritten the stage
  thread waits (CPU) for that slot's previous copy-done event.

Without CUDA (``device="cpu"``, ``mode="auto"``) there are no streams, pins or copies: it is a
transparent prefetching wrapper (the fetch thread runs ahead by ``num_buffers`` batches and the
very same tensor objects are returned). ``mode="staged"`` on CPU runs the full slot machinery
with synchronous copies, which is how CI tests the pool logic.

State: ``state_dict()`` returns the wrapped loader's state snapshotted right after the *last
batch handed to the consumer* was pulled, so a resume replays exactly the batches that were in
flight (prefetched but not consumed). Snapshot cost is one ``state_dict()`` + ``deepcopy`` per
batch in the fetch thread (off the critical path); measured in the benchmark. Snapshots are
taken only when the wrapped loader has ``state_dict`` (``snapshot_state=None``).

Iteration semantics follow ``torch.utils.data.DataLoader``: ``iter()`` starts a new pass
(``iter(loader)`` on the wrapped loader) and discards whatever the previous pass had prefetched;
a finite loader ends with ``StopIteration`` (again on every later ``next()`` until ``iter()``);
``next()`` without ``iter()`` starts a pass. Errors raised by the wrapped loader or the copy are
re-raised in the consumer as the *same* exception object (type preserved, e.g. for
``DataloaderExhaustedError``; background traceback kept, with a note naming the thread); the
next ``next()`` then raises ``RuntimeError`` until ``iter()``/``load_state_dict`` restarts.
One consumer thread at a time. Only ``torch.Tensor`` leaves are staged; other leaves (ints,
strings, numpy arrays) and leaves listed in ``keep_on_host`` pass through as the same objects.
torchtitan 0.3.0 needs its labels on the host (``train_step`` accumulates
``(labels != -100).sum()`` into a CPU tensor): wrap with ``keep_on_host={(1,)}``.
Stopping is cooperative: ``close()`` waits up to 10 s for a fetch thread stuck inside the wrapped
loader's ``next()``; past that the (daemon) thread is logged with where it is blocked and left to
finish on its own (:func:`torchtitan_ext.threads.join`).

Layout: this module is the public wrapper; :mod:`~torchtitan_ext.device.pipeline` holds the
fetch and stage threads, :mod:`~torchtitan_ext.device.buffers` the slot pool and
:mod:`~torchtitan_ext.device.nested` the batch flattening. Measured cost (wrapper overhead per
batch, overlap of loading with the step, PCIe bytes of uint8 vs float pixels; the GPU target is a
CUDA-only case): ``python -m benchmarks staging``, figures in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import atexit
import copy
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

# re-exported: the pool is tested through this module
from torchtitan_ext.device.buffers import _BufferPool as _BufferPool
from torchtitan_ext.device.buffers import _Slot as _Slot
from torchtitan_ext.device.normalize import (
    QWEN3_VL_MEAN,
    QWEN3_VL_STD,
    normalize_pixels,
    normalized_shape,
)
from torchtitan_ext.device.pipeline import _End, _Err, _Pipeline, _Stats
from torchtitan_ext.threads import Stopped as _Stopped
from torchtitan_ext.threads import relay

__all__ = ["AsyncDeviceLoader", "PixelNormalize", "wrap_for_device"]


@dataclass(frozen=True)
class PixelNormalize:
    """Which uint8 tensors to normalise right after the copy, and how."""

    keys: tuple[str, ...] = ("pixel_values",)
    """Dict keys (at any nesting depth) whose uint8 tensors are normalised; other dtypes pass
    through unchanged (counted in stats as ``staging/normalize_passthrough``)."""
    mean: tuple[float, ...] = QWEN3_VL_MEAN
    """Per-channel mean (Qwen3-VL: 0.5)."""
    std: tuple[float, ...] = QWEN3_VL_STD
    """Per-channel std (Qwen3-VL: 0.5)."""
    temporal_patch_size: int = 2
    """Frames per output row; stored rows with ``input_temporal=1`` are expanded per channel."""
    input_temporal: int = 1
    """Frames per stored uint8 row (1: [N, 768] for P=16; equal to temporal_patch_size: none)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return normalize_pixels(
            x,
            self.mean,
            self.std,
            self.temporal_patch_size,
            input_temporal=self.input_temporal,
            out=out,
        )

    def out_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return normalized_shape(
            shape, len(self.mean), self.temporal_patch_size, self.input_temporal
        )


# --------------------------------------------------------------------------------------------
# public wrapper
# --------------------------------------------------------------------------------------------

_LIVE: weakref.WeakSet[AsyncDeviceLoader] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # Stop background threads before the interpreter (and CUDA) tear down under them.
    for w in list(_LIVE):
        try:
            w.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit; nothing to report to
            pass


class AsyncDeviceLoader:
    """Wrap any iterable of (nested) tensor batches; yield them staged on ``device``.

    Args:
        loader: an iterable yielding torchtitan ``(input_dict, labels)`` tuples, dicts, or any
            nesting of dict/list/tuple with tensor (and non-tensor) leaves.
        device: target device; ``"cuda"``/``"cuda:N"`` or ``"cpu"``.
        num_buffers: prefetch depth (ready-queue size) and buffer slots per shape signature.
        normalize: a :class:`PixelNormalize` (or ``True`` for Qwen3-VL defaults) to normalise
            uint8 pixel tensors right after the copy; ``None`` leaves tensors untouched.
        mode: ``"auto"`` stages through pinned memory and a copy stream on CUDA and only
            prefetches on CPU; ``"staged"`` forces the slot machinery (CPU: synchronous copies);
            ``"prefetch"`` never copies (the background thread only runs the loader).
        device_buffers: ``"allocator"`` (record_stream, no lifetime contract) or ``"pool"``
            (pre-allocated, valid until ``hold`` more batches are requested). See module doc.
        hold: pool mode only: batches the consumer may hold at once (torchtitan: grad-accum
            steps x PP microbatches). ``num_buffers`` is raised to ``hold + 1`` if smaller.
        max_signatures: distinct shape signatures kept pooled (LRU beyond that).
        snapshot_state: snapshot ``loader.state_dict()`` after each pull (``None``: iff the
            loader has ``state_dict``). Needed for an exact ``state_dict()``.
        keep_on_host: paths of tensor leaves that are *not* copied (returned as they are), e.g.
            ``{(1,)}`` for the labels of a torchtitan ``(input_dict, labels)`` batch. A path is
            the tuple of dict keys / sequence indices from the batch root.
        device_transform: ``batch -> batch`` applied to each batch once it is on the device
            (after ``normalize``), in the stage thread on the copy stream (prefetch mode: in
            the fetch thread). E.g. the VL collate's ``finish_on_device`` (normalise and
            re-zero pad rows). Must be thread-safe and must not synchronise with the consumer.
    """

    def __init__(
        self,
        loader: Iterable[Any],
        device: str | torch.device,
        num_buffers: int = 2,
        normalize: PixelNormalize | bool | None = None,
        *,
        mode: Literal["auto", "staged", "prefetch"] = "auto",
        device_buffers: Literal["allocator", "pool"] = "allocator",
        hold: int = 1,
        max_signatures: int = 8,
        snapshot_state: bool | None = None,
        keep_on_host: Iterable[tuple[Any, ...]] = (),
        device_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        if num_buffers < 1:
            raise ValueError(f"num_buffers must be >= 1, got {num_buffers}")
        if hold < 1:
            raise ValueError(f"hold must be >= 1, got {hold}")
        if mode not in ("auto", "staged", "prefetch"):
            raise ValueError(f"mode must be 'auto', 'staged' or 'prefetch', got {mode!r}")
        if device_buffers not in ("allocator", "pool"):
            raise ValueError(
                f"device_buffers must be 'allocator' or 'pool', got {device_buffers!r}"
            )
        self.loader = loader
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"AsyncDeviceLoader: device {self.device} but CUDA is unavailable"
                )
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type != "cpu":
            raise ValueError(f"AsyncDeviceLoader supports cuda and cpu devices, got {self.device}")
        self.staged = mode == "staged" or (mode == "auto" and self.device.type == "cuda")
        self.device_buffers = device_buffers
        self.hold = hold
        if self.staged and device_buffers == "pool":
            num_buffers = max(num_buffers, hold + 1)  # else the stage thread would starve
        self.num_buffers = num_buffers
        self.max_signatures = max_signatures
        self.keep_on_host = frozenset(tuple(k) for k in keep_on_host)
        self.device_transform = device_transform
        self.normalize = PixelNormalize() if normalize is True else (normalize or None)
        has_state = callable(getattr(loader, "state_dict", None))
        self._snapshot_enabled = has_state if snapshot_state is None else bool(snapshot_state)
        if self._snapshot_enabled and not has_state:
            raise TypeError(f"snapshot_state=True but {type(loader).__name__} has no state_dict()")
        self._stats = _Stats()
        self._pipe: _Pipeline | None = None
        self._state: Any = None
        self._state_valid = False
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        _LIVE.add(self)

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> AsyncDeviceLoader:
        self._start()
        return self

    def _start(self) -> _Pipeline:
        self._stop_pipe()
        self._closed = False
        start_state = copy.deepcopy(self.loader.state_dict()) if self._snapshot_enabled else None
        it = iter(self.loader)
        self._pipe = _Pipeline(self, it, start_state)
        self._state, self._state_valid = start_state, True
        # The finaliser references the pipeline only, so the wrapper can be collected and its
        # threads stopped when the caller drops it without close().
        self._finalizer = weakref.finalize(self, _Pipeline.close, self._pipe)
        return self._pipe

    def __next__(self) -> Any:
        p = self._pipe
        if p is None:
            if self._closed:
                raise RuntimeError("AsyncDeviceLoader is closed; call iter() to start a new pass")
            p = self._start()
        if p.failed is not None:
            raise RuntimeError(
                f"AsyncDeviceLoader stopped after an error in its {p.failed.where} thread; "
                "call iter() or load_state_dict() to restart"
            ) from p.failed.exc
        if p.finished:
            raise StopIteration
        keep = self.hold - 1 if self.device_buffers == "pool" else 0
        p.release_held(keep)
        t0 = time.perf_counter()
        try:
            item = p.get(p.ready)
        except _Stopped:
            # close() ran concurrently (another thread or interpreter exit).
            raise RuntimeError("AsyncDeviceLoader was closed while waiting for a batch") from None
        w = time.perf_counter() - t0
        st = self._stats
        with st.lock:
            st.wait_s += w
            st.wait_max_s = max(st.wait_max_s, w)
            st.waits.append(w)
        if isinstance(item, _End):
            p.finished = True
            p.release_held(0)
            self._state = item.state
            self._stop_pipe(keep_finished=True)
            raise StopIteration
        if isinstance(item, _Err):
            p.failed = item
            self._stop_pipe(keep_finished=True)
            raise relay(
                item.exc,
                f"AsyncDeviceLoader's background {item.where} thread",
                "AsyncDeviceLoader.__next__",
            )
        if item.event is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(item.event)
            for t in item.fresh:
                t.record_stream(cur)  # allocator mode: no reuse before the consumer is done
        item.fresh = []
        p.held.append(item)
        self._state = item.state
        with st.lock:
            st.batches += 1
        return item.batch

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Wrapped loader's state as of the last batch handed out (in-flight batches replay)."""
        if not self._snapshot_enabled:
            raise RuntimeError(
                f"state_dict(): {type(self.loader).__name__} has no state_dict() "
                "(or snapshot_state=False), so in-flight batches cannot be accounted for"
            )
        if not self._state_valid:
            return copy.deepcopy(self.loader.state_dict())  # nothing started yet
        return copy.deepcopy(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stop the pipeline (dropping prefetched batches), forward, restart on next iteration."""
        self._stop_pipe()
        fn = getattr(self.loader, "load_state_dict", None)
        if not callable(fn):
            raise TypeError(f"{type(self.loader).__name__} has no load_state_dict()")
        fn(state_dict)
        self._state_valid = False

    # -- stats / lifecycle ---------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Wrapped loader's ``get_stats()`` (if any) plus ``staging/*`` keys."""
        inner = getattr(self.loader, "get_stats", None)
        out: dict[str, Any] = dict(inner()) if callable(inner) else {}
        st = self._stats
        with st.lock:
            n = max(st.batches, 1)
            waits = sorted(st.waits)
            out.update(
                {
                    "staging/batches": st.batches,
                    "staging/consumer_wait_ms_mean": 1e3 * st.wait_s / n,
                    "staging/consumer_wait_ms_p99": 1e3 * waits[int(0.99 * (len(waits) - 1))]
                    if waits
                    else 0.0,
                    "staging/consumer_wait_ms_max": 1e3 * st.wait_max_s,
                    "staging/fetch_ms_mean": 1e3 * st.fetch_s / n,
                    "staging/snapshot_ms_mean": 1e3 * st.snapshot_s / n,
                    "staging/copy_ms_mean": 1e3 * st.copy_s / n,
                    "staging/h2d_bytes": st.h2d_bytes,
                    "staging/normalized": st.normalized,
                    "staging/normalize_passthrough": st.normalize_passthrough,
                    "staging/already_pinned": st.already_pinned,
                }
            )
        p = self._pipe
        out["staging/queue_depth"] = p.ready.qsize() if p is not None else 0
        if p is not None:
            out.update(p.pool.stats())
        return out

    def _stop_pipe(self, keep_finished: bool = False) -> None:
        p = self._pipe
        if p is None:
            return
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        p.close()
        if not keep_finished:
            self._pipe = None

    def close(self) -> None:
        """Stop the background threads and drop prefetched batches. Idempotent."""
        self._stop_pipe()
        self._closed = True

    def threads_alive(self) -> list[threading.Thread]:
        """Background threads still running (for tests and leak checks)."""
        return self._pipe.alive_threads() if self._pipe is not None else []

    def __enter__(self) -> AsyncDeviceLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown: modules may be gone already
            pass

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


def wrap_for_device(
    loader: Iterable[Any], device: str | torch.device, enabled: bool, **opts: Any
) -> Iterable[Any]:
    """Integration hook: ``AsyncDeviceLoader(loader, device, **opts)`` if ``enabled`` else ``loader``.

    For torchtitan 0.3.0's trainer pass ``keep_on_host={(1,)}`` (its ``train_step`` sums the
    labels into a CPU tensor before moving them) and, for VL batches built with uint8 pixels,
    ``normalize=True`` or ``device_transform=`` the collate's on-device finisher.
    """
    if not enabled:
        return loader
    return AsyncDeviceLoader(loader, device, **opts)
