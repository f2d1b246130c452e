"""The background threads of :class:`~torchtitan_ext.device.staging.AsyncDeviceLoader`.

One :class:`_Pipeline` per pass owns the threads, queues, buffer pool and copy stream; the
threads reference it, never the ``AsyncDeviceLoader``, so dropping the wrapper stops them (its
finaliser closes the pipeline). The **fetch thread** (:func:`_fetch_loop`) pulls batches and
snapshots the wrapped loader's state; the **stage thread** (:func:`_stage_loop`, staged mode
only) copies each batch into a buffer slot and on to the device (:func:`_stage`). Hand-offs are
stop-aware (:func:`torchtitan_ext.threads.put` / ``get``); an exception in a thread travels to
the consumer as an :class:`_Err` and is re-raised there. The algorithm and the buffer lifetime
rules are in the staging module's docstring.

The CUDA branches here (streams, pinned buffers, events, ``record_stream``) have not run on a
GPU: CI runs the slot machinery on the CPU (``mode="staged"``) with synchronous copies.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_ext import threads
from torchtitan_ext.device.buffers import _BufferPool, _Slot
from torchtitan_ext.device.nested import _flatten, _unflatten
from torchtitan_ext.threads import Stopped as _Stopped

if TYPE_CHECKING:
    from torchtitan_ext.device.staging import AsyncDeviceLoader

# The public module's name: users configure (and filter) the wrapper's logging under it.
logger = logging.getLogger("torchtitan_ext.device.staging")

_JOIN_TIMEOUT_S = 10.0


@dataclass(eq=False)
class _Item:
    seq: int
    batch: Any
    state: Any
    slot: _Slot | None = None
    event: Any = None
    fresh: list[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclass(eq=False)
class _End:
    state: Any


@dataclass(eq=False)
class _Err:
    exc: BaseException
    where: str


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches = 0
        self.wait_s = 0.0
        self.wait_max_s = 0.0
        self.waits: collections.deque[float] = collections.deque(maxlen=1024)
        self.fetch_s = 0.0
        self.snapshot_s = 0.0
        self.copy_s = 0.0
        self.h2d_bytes = 0
        self.normalized = 0
        self.normalize_passthrough = 0
        self.already_pinned = 0

    def add(self, name: str, v: float) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + v)


class _Pipeline:
    def __init__(self, owner: AsyncDeviceLoader, it: Iterator[Any], start_state: Any):
        self.it = it
        self.loader = owner.loader
        self.device = owner.device
        self.staged = owner.staged
        self.cuda = owner.device.type == "cuda"
        self.device_buffers = owner.device_buffers
        self.snapshot = owner._snapshot_enabled
        self.norm = owner.normalize
        self.keep_on_host = owner.keep_on_host
        self.transform = owner.device_transform
        self.stats = owner._stats
        self.stop = threading.Event()
        self.pool = _BufferPool(owner.num_buffers, owner.max_signatures, self.stop)
        self.ready: queue.Queue[Any] = queue.Queue(maxsize=owner.num_buffers)
        self.fetched: queue.Queue[Any] | None = queue.Queue(maxsize=1) if self.staged else None
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.start_state = start_state
        self.held: collections.deque[_Item] = collections.deque()
        self.finished = False
        self.failed: _Err | None = None
        self.threads: list[threading.Thread] = []
        out_q = self.fetched if self.staged else self.ready
        self.threads.append(
            threading.Thread(
                target=_fetch_loop, args=(self, out_q), name="AsyncDeviceLoader-fetch", daemon=True
            )
        )
        if self.staged:
            self.threads.append(
                threading.Thread(
                    target=_stage_loop, args=(self,), name="AsyncDeviceLoader-stage", daemon=True
                )
            )
        for t in self.threads:
            t.start()

    def put(self, q: queue.Queue[Any], item: Any) -> None:
        if not threads.put(q, item, self.stop):
            raise _Stopped

    def get(self, q: queue.Queue[Any]) -> Any:
        return threads.get(q, self.stop)

    def release_held(self, keep: int) -> None:
        """Consumer side: give back slots so that at most ``keep`` stay held."""
        ev = None
        while len(self.held) > keep:
            item = self.held.popleft()
            if item.slot is None:
                continue
            if self.cuda and ev is None:
                # Everything the consumer enqueued so far on its stream may read the buffers;
                # the copy stream waits on this event before overwriting them.
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
            self.pool.release(item.slot, ev)

    def close(self) -> None:
        self.stop.set()
        self.held.clear()  # slots are dropped with the pool; no consumer reads after close
        threads.join(
            self.threads, _JOIN_TIMEOUT_S, logger, "left to finish on their own as daemons"
        )
        # Drop queued batches (and their device memory) promptly.
        for q in (self.ready, self.fetched):
            while q is not None:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        if not self.alive_threads():
            # Release the wrapped iterator now (a DataLoader iterator shuts its workers down when
            # collected). If the fetch thread is still stuck inside next() we must keep it.
            self.it = iter(())

    def alive_threads(self) -> list[threading.Thread]:
        return [t for t in self.threads if t.is_alive()]


def _take_snapshot(p: _Pipeline) -> Any:
    if not p.snapshot:
        return None
    t0 = time.perf_counter()
    # deepcopy: a loader may return live references into its own mutable state.
    st = copy.deepcopy(p.loader.state_dict())
    p.stats.add("snapshot_s", time.perf_counter() - t0)
    return st


def _normalize_cpu(p: _Pipeline, batch: Any) -> Any:
    """Prefetch mode: normalise marked uint8 leaves in the fetch thread (no copies otherwise)."""
    leaves: list[Any] = []
    keys: list[Any] = []
    spec = _flatten(batch, leaves, keys)
    changed = False
    for i, (leaf, key) in enumerate(zip(leaves, keys, strict=True)):
        if isinstance(leaf, torch.Tensor) and key in p.norm.keys:
            if leaf.dtype == torch.uint8:
                leaves[i] = p.norm(leaf)
                p.stats.add("normalized", 1)
                changed = True
            else:
                p.stats.add("normalize_passthrough", 1)
    return _unflatten(spec, iter(leaves), batch) if changed else batch


def _fetch_loop(p: _Pipeline, out_q: queue.Queue[Any]) -> None:
    seq = 0
    try:
        while not p.stop.is_set():
            t0 = time.perf_counter()
            try:
                batch = next(p.it)
            except StopIteration:
                p.put(out_q, _End(_take_snapshot(p)))
                return
            p.stats.add("fetch_s", time.perf_counter() - t0)
            state = _take_snapshot(p)
            if not p.staged:
                if p.norm is not None:
                    batch = _normalize_cpu(p, batch)
                if p.transform is not None:
                    batch = p.transform(batch)
            p.put(out_q, _Item(seq, batch, state))
            seq += 1
    except _Stopped:
        return  # close() asked us to stop: nobody will read the queue any more
    except BaseException as e:  # relayed to the consumer, which re-raises it
        try:
            p.put(out_q, _Err(e, "fetch"))
        except _Stopped:
            return  # closing anyway; the consumer is gone


def _stage_loop(p: _Pipeline) -> None:
    assert p.fetched is not None
    try:
        if p.cuda:
            torch.cuda.set_device(p.device)
        while True:
            item = p.get(p.fetched)
            if isinstance(item, (_End, _Err)):
                p.put(p.ready, item)
                return
            try:
                _stage(p, item)
            except _Stopped:
                raise
            except BaseException as e:  # relayed to the consumer, which re-raises it
                p.put(p.ready, _Err(e, f"copy of batch #{item.seq}"))
                return
            p.put(p.ready, item)
    except _Stopped:
        return  # close() asked us to stop: nobody will read the queue any more


def _stage(p: _Pipeline, item: _Item) -> None:
    leaves: list[Any] = []
    keys: list[Any] = []
    paths: list[tuple[Any, ...]] = []
    spec = _flatten(item.batch, leaves, keys, paths)
    tidx = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor)
        and paths[i] not in p.keep_on_host
        and not (p.cuda and x.device == p.device)  # already there: pass through
    ]
    norm_of: dict[int, bool] = {}
    for i in tidx:
        if p.norm is not None and keys[i] in p.norm.keys:
            if leaves[i].dtype == torch.uint8:
                norm_of[i] = True
            else:
                p.stats.add("normalize_passthrough", 1)
    sig = (spec, tuple((i, tuple(leaves[i].shape), leaves[i].dtype) for i in tidx))
    pool_dev = p.device_buffers == "pool"

    def alloc() -> _Slot:
        n = len(leaves)
        slot = _Slot(sig, [None] * n, [None] * n, [None] * n)
        for i in tidx:
            x = leaves[i]
            if p.cuda:
                slot.host[i] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                slot.nbytes += x.numel() * x.element_size()
            if pool_dev:
                slot.dev[i] = torch.empty(x.shape, dtype=x.dtype, device=p.device)
                slot.nbytes += x.numel() * x.element_size()
                if norm_of.get(i):
                    slot.norm[i] = torch.empty(
                        p.norm.out_shape(x.shape), dtype=torch.float32, device=p.device
                    )
                    slot.nbytes += slot.norm[i].numel() * 4
        return slot

    slot = p.pool.acquire(sig, alloc)
    t0 = time.perf_counter()
    try:
        if slot.copy_done is not None:
            # The previous H2D copy out of this slot's pinned buffers must finish before we
            # overwrite them (CPU wait; normally long done).
            slot.copy_done.synchronize()
        slot.keepalive = None
        out = list(leaves)
        fresh: list[torch.Tensor] = []
        nbytes = 0
        stream_ctx = torch.cuda.stream(p.copy_stream) if p.cuda else _nullctx()
        with stream_ctx:
            if p.cuda and slot.release_event is not None:
                # Pool mode: don't overwrite device buffers the consumer may still be reading.
                p.copy_stream.wait_event(slot.release_event)
            slot.release_event = None
            for i in tidx:
                x = leaves[i]
                nbytes += x.numel() * x.element_size()
                if p.cuda:
                    if x.is_pinned():
                        src = x
                        p.stats.add("already_pinned", 1)
                        slot.keepalive = item.batch
                    else:
                        src = slot.host[i]
                        src.copy_(x)
                else:
                    src = x
                dst = slot.dev[i]
                if dst is None:
                    dst = torch.empty(x.shape, dtype=x.dtype, device=p.device)
                    fresh.append(dst)
                dst.copy_(src, non_blocking=p.cuda)
                if norm_of.get(i):
                    nout = slot.norm[i]
                    dst = p.norm(dst, out=nout)
                    if nout is None:
                        # Allocator mode: hand over the float result; the fresh uint8 copy is
                        # read only on the copy stream, so it needs no record_stream.
                        fresh[-1] = dst
                    p.stats.add("normalized", 1)
                out[i] = dst
            staged = _unflatten(spec, iter(out), item.batch)
            if p.transform is not None:
                staged = p.transform(staged)  # on the copy stream, before the event
                if p.cuda:
                    # Whatever the transform allocated lives on the copy stream as well: hand
                    # every device leaf over with record_stream (harmless for pooled buffers).
                    tl: list[Any] = []
                    _flatten(staged, tl, [])
                    fresh = [t for t in tl if isinstance(t, torch.Tensor) and t.is_cuda]
            if p.cuda:
                ev = torch.cuda.Event()
                ev.record(p.copy_stream)
                slot.copy_done = ev
                item.event = ev
        p.stats.add("copy_s", time.perf_counter() - t0)
        p.stats.add("h2d_bytes", nbytes)
        slot.uses += 1
        item.batch = staged
        item.fresh = fresh
    except BaseException:
        p.pool.release(slot)
        raise
    if pool_dev:
        item.slot = slot  # released by the consumer (see _Pipeline.release_held)
    else:
        # Allocator mode: only the pinned buffers are pooled; their reuse waits on copy_done.
        p.pool.release(slot)


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
