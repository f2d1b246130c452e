"""Buffer slots for :mod:`~torchtitan_ext.device.staging`, keyed by shape signature.

A slot holds one batch's pinned host buffers (and, with ``device_buffers="pool"``, its device
buffers); :class:`_BufferPool` keeps a free list per signature, so bucketed shapes reuse their
slots, a new shape allocates, and least-recently-used signatures are evicted. The CUDA events on
a slot (``copy_done``, ``release_event``) are what keep a buffer from being refilled while a
copy out of it, or the consumer, may still read it (see the staging module's docstring).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_ext.threads import POLL_S as _POLL_S
from torchtitan_ext.threads import Stopped as _Stopped


@dataclass(eq=False)
class _Slot:
    sig: Any
    host: list[torch.Tensor | None]
    """Pinned host buffers per tensor leaf (None where not needed)."""
    dev: list[torch.Tensor | None]
    """Pre-allocated device buffers per tensor leaf (pool mode; None in allocator mode)."""
    norm: list[torch.Tensor | None]
    """Pre-allocated normalised outputs per tensor leaf (pool mode, normalised leaves only)."""
    nbytes: int = 0
    copy_done: Any = None
    """CUDA event recorded after the last copy out of ``host`` (None: nothing pending)."""
    release_event: Any = None
    """CUDA event recorded on the consumer stream when it let go of ``dev`` (pool mode)."""
    keepalive: Any = None
    """Source batch whose pinned tensors were copied directly; kept until ``copy_done``."""
    uses: int = 0


class _BufferPool:
    """Per-signature pools of at most ``per_signature`` slots; LRU eviction of free slots.

    ``acquire`` blocks while every slot of the signature is in use (handed out or queued);
    ``release`` returns a slot. Thread-safe; the allocation itself runs outside the lock.
    """

    def __init__(self, per_signature: int, max_signatures: int, stop: threading.Event):
        if per_signature < 1 or max_signatures < 1:
            raise ValueError("per_signature and max_signatures must be >= 1")
        self.per_signature = per_signature
        self.max_signatures = max_signatures
        self._stop = stop
        self._cond = threading.Condition()
        self._free: dict[Any, list[_Slot]] = {}
        self._count: dict[Any, int] = {}
        self._lru: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self.allocations = 0
        self.reuses = 0
        self.evictions = 0
        self.bytes_live = 0

    def acquire(self, sig: Any, alloc: Any) -> _Slot:
        with self._cond:
            while True:
                if self._stop.is_set():
                    raise _Stopped
                free = self._free.get(sig)
                if free:
                    slot = free.pop()
                    self.reuses += 1
                    self._touch(sig)
                    return slot
                if self._count.get(sig, 0) < self.per_signature:
                    self._count[sig] = self._count.get(sig, 0) + 1
                    self._touch(sig)
                    break
                self._cond.wait(_POLL_S)
        try:
            slot = alloc()
        except BaseException:
            with self._cond:
                self._count[sig] -= 1
            raise
        with self._cond:
            self.allocations += 1
            self.bytes_live += slot.nbytes
        return slot

    def _touch(self, sig: Any) -> None:
        self._lru[sig] = None
        self._lru.move_to_end(sig)
        while len(self._lru) > self.max_signatures:
            old, _ = self._lru.popitem(last=False)
            # Free slots go now; slots of `old` still in use are dropped when released.
            for s in self._free.pop(old, []):
                self._drop(s)
            self.evictions += 1

    def _drop(self, slot: _Slot) -> None:
        self._count[slot.sig] -= 1
        if not self._count[slot.sig]:
            del self._count[slot.sig]
        self.bytes_live -= slot.nbytes

    def release(self, slot: _Slot, release_event: Any = None) -> None:
        with self._cond:
            slot.release_event = release_event
            if slot.sig in self._lru:
                self._free.setdefault(slot.sig, []).append(slot)
            else:
                self._drop(slot)
            self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return sum(self._count.values()) - sum(len(v) for v in self._free.values())

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {
                "staging/buffer_allocations": self.allocations,
                "staging/buffer_reuses": self.reuses,
                "staging/buffer_evictions": self.evictions,
                "staging/buffer_signatures": len(self._lru),
                "staging/buffer_bytes": self.bytes_live,
            }
