"""The host-to-device copy of :class:`~torchtitan_ext.device.staging.AsyncDeviceLoader`.

:class:`_Copier` is the ``then`` of a :class:`~torchtitan_ext.pipeline.prefetch.Prefetch`: it
runs in that stage's thread, once per batch, right after the batch's state was taken, and
returns a :class:`_Staged` (the batch on the device, plus what the consumer must wait on and
give back). It owns no thread and no queue. The consumer side (wait on the event, hand fresh
tensors to the consumer stream, release pool slots) is ``AsyncDeviceLoader.next``.

The copy (CUDA, or ``mode="staged"``): flatten the batch (nested dicts / lists / tuples;
non-tensor leaves and ``keep_on_host`` paths pass through as the same objects), pick a *buffer slot* keyed by the batch's shape signature
(:mod:`~torchtitan_ext.device.buffers`: bucketed shapes reuse their slots, LRU eviction past
``max_signatures``), copy each tensor into the slot's pinned host buffer (skipped when already
pinned), issue ``non_blocking`` copies on a dedicated copy stream, normalise uint8
``pixel_values`` there (:func:`~torchtitan_ext.device.normalize.normalize_pixels`), run
``device_transform``, record a CUDA event. The consumer (``next()``) makes its *current* stream
wait on that event (a GPU-side wait) and returns the same structure as the wrapped loader.

Buffer lifetime (a buffer is never refilled while the consumer may still read it):

* ``device_buffers="allocator"`` (default): device tensors come from PyTorch's caching
  allocator on the copy stream and are handed over with ``Tensor.record_stream``; batches may
  be kept as long as wanted.
* ``device_buffers="pool"``: device tensors are pre-allocated per slot and reused. When the
  consumer asks for a batch it records an event on its stream; the slot handed out ``hold``
  requests earlier is released with it, and the copy stream waits on it before overwriting.
  Contract: a batch is valid until ``hold`` further batches have been requested (torchtitan
  0.3.0's ``train_step`` fetches all ``gradient_accumulation_steps x pp_microbatches`` batches
  first, so ``hold`` must be at least that).

One buffer pool per *run* of the thread: a Prefetch drops the items still queued when it stops
(reset, load, close), and with them the pool slots they held, so the first call from a new thread
starts a new pool (:meth:`_Copier._new_run`); slots the consumer still holds from the old one are
released into it and dropped with it.

The pool never blocks the thread: in pool mode it allows ``depth + hold + 1`` slots per shape
signature (the Prefetch queue, the consumer's held batches and the one being made), which is
the most that can be in use at once. Blocking there would make the consumer's ``next()`` wake
the thread through the pool's condition, the wake-up the ready queue is built to avoid.

The CUDA branches (streams, pinned buffers, events, ``record_stream``) have not run on a GPU in
CI: the slot machinery runs on the CPU with ``mode="staged"`` (synchronous copies).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_ext.device.buffers import _BufferPool, _Slot
from torchtitan_ext.device.nested import _flatten, _unflatten


@dataclass(frozen=True)
class _CopySpec:
    """What the copy does (fixed for a wrapper's lifetime)."""

    device: torch.device
    staged: bool
    """Copy through buffer slots (CUDA, or ``mode="staged"`` on CPU); else only normalise /
    transform on the host."""
    device_buffers: str
    per_signature: int
    max_signatures: int
    normalize: Any  # PixelNormalize | None (kept untyped: staging imports this module)
    keep_on_host: frozenset[tuple[Any, ...]]
    transform: Callable[[Any], Any] | None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(eq=False)
class _Staged:
    """One staged batch on its way to the consumer."""

    batch: Any
    event: Any = None
    """CUDA event recorded on the copy stream after the copy (None on CPU)."""
    slot: _Slot | None = None
    """Pool mode: the slot whose device buffers ``batch`` lives in (released by the consumer)."""
    pool: _BufferPool | None = None
    fresh: list[torch.Tensor] = field(default_factory=list)
    """Allocator mode: device tensors to hand to the consumer stream (``record_stream``)."""


class _Stats:
    """Counters written by the copy (in the thread, under ``lock``) and by the consumer (its
    own fields, without); read by ``get_stats``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches = 0
        self.wait_s = 0.0
        self.wait_max_s = 0.0
        self.waits: collections.deque[float] = collections.deque(maxlen=1024)
        self.fetch_s = 0.0
        self.snapshot_s = 0.0
        self.snapshots = 0
        self.copy_s = 0.0
        self.h2d_bytes = 0
        self.normalized = 0
        self.normalize_passthrough = 0
        self.already_pinned = 0

    def add(self, name: str, v: float) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + v)

    def as_dict(self, own_hand_off: bool) -> dict[str, Any]:
        """The ``staging/*`` keys of ``get_stats()`` (pull and snapshot times exist only when
        the wrapper runs the loader itself)."""
        with self.lock:
            n = max(self.batches, 1)
            waits = sorted(self.waits)
            out: dict[str, Any] = {
                "staging/batches": self.batches,
                "staging/consumer_wait_ms_mean": 1e3 * self.wait_s / n,
                "staging/consumer_wait_ms_p99": 1e3 * waits[int(0.99 * (len(waits) - 1))]
                if waits
                else 0.0,
                "staging/consumer_wait_ms_max": 1e3 * self.wait_max_s,
                "staging/copy_ms_mean": 1e3 * self.copy_s / n,
                "staging/h2d_bytes": self.h2d_bytes,
                "staging/normalized": self.normalized,
                "staging/normalize_passthrough": self.normalize_passthrough,
                "staging/already_pinned": self.already_pinned,
                "staging/fused": int(not own_hand_off),
            }
            if own_hand_off:
                out["staging/fetch_ms_mean"] = 1e3 * self.fetch_s / n
                out["staging/snapshot_ms_mean"] = 1e3 * self.snapshot_s / max(self.snapshots, 1)
        return out

    def consumer_waited(self, w: float, got_batch: bool) -> None:
        # No lock: only the consumer writes these (each store is atomic under the GIL), and
        # this runs on every next() of the training loop.
        self.wait_s += w
        if w > self.wait_max_s:
            self.wait_max_s = w
        self.waits.append(w)
        self.batches += got_batch


class _Copier:
    """``then(batch)`` of the hand-off: the staged batch (see the module docstring)."""

    def __init__(self, spec: _CopySpec, stats: _Stats) -> None:
        self.spec = spec
        self.stats = stats
        self.copy_stream = torch.cuda.Stream(spec.device) if spec.cuda else None
        self.pool: _BufferPool | None = None
        self._thread: threading.Thread | None = None
        self._seq = 0

    def _new_run(self) -> None:
        self._thread = threading.current_thread()
        self.pool = _BufferPool(
            self.spec.per_signature, self.spec.max_signatures, threading.Event()
        )
        self._seq = 0
        if self.spec.cuda:
            torch.cuda.set_device(self.spec.device)

    def __call__(self, batch: Any) -> Any:
        if threading.current_thread() is not self._thread:
            self._new_run()
        seq, self._seq = self._seq, self._seq + 1
        try:
            if self.spec.staged:
                return _stage(self, batch)
            return _host_only(self, batch)
        except BaseException as e:
            e.add_note(f"(AsyncDeviceLoader: in the copy of batch #{seq} of this pass)")
            raise


def _host_only(c: _Copier, batch: Any) -> Any:
    """No copy (CPU ``auto``, ``prefetch``): normalise marked uint8 leaves, then the transform."""
    norm = c.spec.normalize
    if norm is not None:
        leaves: list[Any] = []
        keys: list[Any] = []
        spec = _flatten(batch, leaves, keys)
        changed = False
        for i, (leaf, key) in enumerate(zip(leaves, keys, strict=True)):
            if isinstance(leaf, torch.Tensor) and key in norm.keys:
                if leaf.dtype == torch.uint8:
                    leaves[i] = norm(leaf)
                    c.stats.add("normalized", 1)
                    changed = True
                else:
                    c.stats.add("normalize_passthrough", 1)
        if changed:
            batch = _unflatten(spec, iter(leaves), batch)
    return c.spec.transform(batch) if c.spec.transform is not None else batch


def _alloc(c: _Copier, sig: Any, leaves: list[Any], tidx: list[int], norm_of: set[int]) -> _Slot:
    s, n = c.spec, len(leaves)
    slot = _Slot(sig, [None] * n, [None] * n, [None] * n)
    for i in tidx:
        x = leaves[i]
        if s.cuda:
            slot.host[i] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            slot.nbytes += x.numel() * x.element_size()
        if s.device_buffers == "pool":
            slot.dev[i] = torch.empty(x.shape, dtype=x.dtype, device=s.device)
            slot.nbytes += x.numel() * x.element_size()
            if i in norm_of:
                slot.norm[i] = torch.empty(
                    s.normalize.out_shape(x.shape), dtype=torch.float32, device=s.device
                )
                slot.nbytes += slot.norm[i].numel() * 4
    return slot


def _stage(c: _Copier, batch: Any) -> _Staged:
    """Copy the tensor leaves of ``batch`` into a slot and on to the device."""
    s = c.spec
    leaves: list[Any] = []
    keys: list[Any] = []
    paths: list[tuple[Any, ...]] = []
    spec = _flatten(batch, leaves, keys, paths)
    tidx = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor)
        and paths[i] not in s.keep_on_host
        and not (s.cuda and x.device == s.device)  # already there: pass through
    ]
    norm_of: set[int] = set()
    if s.normalize is not None:
        for i in tidx:
            if keys[i] in s.normalize.keys:
                if leaves[i].dtype == torch.uint8:
                    norm_of.add(i)
                else:
                    c.stats.add("normalize_passthrough", 1)
    sig = (spec, tuple((i, tuple(leaves[i].shape), leaves[i].dtype) for i in tidx))
    pool = c.pool
    assert pool is not None
    slot = pool.acquire(sig, lambda: _alloc(c, sig, leaves, tidx, norm_of))
    t0 = time.perf_counter()
    try:
        out = _copy_into(c, slot, batch, spec, leaves, tidx, norm_of)
    except BaseException:
        pool.release(slot)
        raise
    c.stats.add("copy_s", time.perf_counter() - t0)
    slot.uses += 1
    if s.device_buffers == "pool":
        out.slot, out.pool = slot, pool  # released by the consumer
    else:
        pool.release(slot)  # only the pinned buffers are pooled; their reuse waits on copy_done
    return out


def _copy_into(
    c: _Copier,
    slot: _Slot,
    batch: Any,
    spec: Any,
    leaves: list[Any],
    tidx: list[int],
    norm_of: set[int],
) -> _Staged:
    s = c.spec
    if slot.copy_done is not None:
        # The previous H2D copy out of this slot's pinned buffers must finish before we
        # overwrite them (CPU wait; normally long done).
        slot.copy_done.synchronize()
    slot.keepalive = None
    out = list(leaves)
    fresh: list[torch.Tensor] = []
    nbytes = 0
    event = None
    ctx = torch.cuda.stream(c.copy_stream) if s.cuda else contextlib.nullcontext()
    with ctx:
        if s.cuda and slot.release_event is not None:
            # Pool mode: don't overwrite device buffers the consumer may still be reading.
            c.copy_stream.wait_event(slot.release_event)
        slot.release_event = None
        for i in tidx:
            x = leaves[i]
            nbytes += x.numel() * x.element_size()
            src = x
            if s.cuda:
                if x.is_pinned():
                    c.stats.add("already_pinned", 1)
                    slot.keepalive = batch
                else:
                    src = slot.host[i]
                    src.copy_(x)
            dst = slot.dev[i]
            if dst is None:
                dst = torch.empty(x.shape, dtype=x.dtype, device=s.device)
                fresh.append(dst)
            dst.copy_(src, non_blocking=s.cuda)
            if i in norm_of:
                nout = slot.norm[i]
                dst = s.normalize(dst, out=nout)
                if nout is None:
                    # Allocator mode: hand over the float result; the fresh uint8 copy is read
                    # only on the copy stream, so it needs no record_stream.
                    fresh[-1] = dst
                c.stats.add("normalized", 1)
            out[i] = dst
        staged = _unflatten(spec, iter(out), batch)
        if s.transform is not None:
            staged = s.transform(staged)  # on the copy stream, before the event
            if s.cuda:
                # Whatever the transform allocated lives on the copy stream as well: hand every
                # device leaf over with record_stream (harmless for pooled buffers).
                tl: list[Any] = []
                _flatten(staged, tl, [])
                fresh = [t for t in tl if isinstance(t, torch.Tensor) and t.is_cuda]
        if s.cuda:
            event = torch.cuda.Event()
            event.record(c.copy_stream)
            slot.copy_done = event
    c.stats.add("h2d_bytes", nbytes)
    return _Staged(staged, event=event, fresh=fresh)
