"""AsyncDeviceLoader: overlap batch loading and the host-to-device copy with the training step.

A stage on the one pipeline contract (:mod:`torchtitan_ext.pipeline.stage`: ``next``, ``state``,
``reset``, ``close``) whose background work is the one hand-off,
:class:`~torchtitan_ext.pipeline.prefetch.Prefetch`. Two arrangements, picked by the loader:

=============  =====================================  ======================================
               **fused** (loader topped by Prefetch)  **own hand-off** (any other loader)
=============  =====================================  ======================================
who            the loader, or its torchtitan adapter, a VL ``DataLoader``, any torchtitan
               exposes a ``Prefetch`` as              ``BaseDataLoader``, a list ...
               ``.pipeline`` (or *is* one)
threads added  none: the copy is installed as that    one: ``Prefetch(LoaderStage(loader))``
               Prefetch's ``then`` and runs in its    (:mod:`~torchtitan_ext.device.source`)
               thread, after its state snapshot       with the copy as ``then``
snapshots      one per batch, the Prefetch's (the     one per batch: ``deepcopy(loader.
               loader's own)                          state_dict())`` in the thread
depth          the loader's ``queue_size`` (its       ``num_buffers``
               queue holds batches already staged)
state          ``state()`` is the Prefetch's;         ``state()`` is the snapshot of the
               ``state_dict``, ``load_state_dict``    last batch handed out;
               are the wrapped loader's               ``state_dict()`` a copy of it
=============  =====================================  ======================================

The fused convention: a loader exposing ``.pipeline`` promises that its batches are
``pipeline.next()``, that its ``state_dict()`` is made from ``pipeline.state()`` and that its
``__iter__`` does no more than (possibly) reset the pipeline; the wrapper then takes batches
from the Prefetch directly. Either way the state travels with its batch, so a resume replays
exactly the batches that were in flight (made but not consumed).

The copy, its buffer slots and their lifetime (``device_buffers="allocator"``: no contract;
``"pool"``: a batch is valid until ``hold`` further batches were requested) are described in
:mod:`~torchtitan_ext.device.h2d`. Device memory: at most ``depth + hold + 1`` staged batches
exist at once (queued, held, being copied); in fused mode lower the loader's ``queue_size`` to
bound it.

Without CUDA (``device="cpu"``, ``mode="auto"``) there are no copies: fused, the wrapper adds
nothing (the very same batch objects); otherwise it is a prefetching wrapper. ``mode="staged"``
on CPU runs the slot machinery with synchronous copies (how CI tests it).

Iteration follows ``torch.utils.data.DataLoader``: ``iter()`` starts a new pass (own hand-off:
``iter(loader)`` again, dropping what was prefetched; fused: ``iter(loader)``, the loader
decides); a finite loader ends with ``StopIteration`` (again on every later ``next()`` until
``iter()``). An error of the loader or the copy is re-raised as the *same* exception object
(:func:`torchtitan_ext.threads.relay`); the next ``next()`` then raises ``RuntimeError`` until
``iter()`` / ``load_state_dict`` restarts. One consumer thread at a time. torchtitan 0.3.0
needs its labels on the host: wrap with ``keep_on_host={(1,)}``. ``close()`` stops and joins
the thread (fused: restores the Prefetch's previous ``then``, the loader stays usable), waiting
up to 10 s for one stuck inside the loader's ``next()`` before logging where it is blocked.

Measured: ``python -m benchmarks staging`` (wrapper overhead, overlap, PCIe bytes, GPU step) and
``python -m benchmarks text_staging`` (fused vs the former two-thread wrapper: threads,
snapshots, ``next()`` p50/p99); figures in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import atexit
import collections
import copy
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

# re-exported: the pool is tested through this module
from torchtitan_ext.device.buffers import _BufferPool as _BufferPool
from torchtitan_ext.device.buffers import _Slot as _Slot
from torchtitan_ext.device.h2d import _Copier, _CopySpec, _Staged, _Stats
from torchtitan_ext.device.normalize import PixelNormalize as PixelNormalize
from torchtitan_ext.device.source import LoaderStage
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage, State

__all__ = ["AsyncDeviceLoader", "PixelNormalize", "wrap_for_device"]

_JOIN_TIMEOUT_S = 10.0
"""How long ``close()`` waits for the thread (one stuck in the loader's ``next()`` is left)."""


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


def _prefetch_of(loader: Any) -> Prefetch | None:
    """The Prefetch topping ``loader`` (fused mode): the loader itself or its ``.pipeline``."""
    if isinstance(loader, Prefetch):
        return loader
    top = getattr(loader, "pipeline", None)
    return top if isinstance(top, Prefetch) else None


def _chain(prev: Callable[[Any], Any] | None, copier: _Copier) -> Callable[[Any], Any]:
    """The copy after whatever ``then`` the loader's Prefetch already had."""
    if prev is None:
        return copier
    return lambda item: copier(prev(item))


class AsyncDeviceLoader(Stage[Any]):
    """Wrap any iterable of (nested) tensor batches; yield them staged on ``device``.

    Args:
        loader: an iterable yielding torchtitan ``(input_dict, labels)`` tuples, dicts, or any
            nesting of dict/list/tuple with tensor (and non-tensor) leaves. Topped by a
            :class:`~torchtitan_ext.pipeline.prefetch.Prefetch` (itself one, or exposing one as
            ``.pipeline``): fused mode, no thread of our own (see the module docstring).
        device: target device; ``"cuda"``/``"cuda:N"`` or ``"cpu"``.
        num_buffers: batches staged ahead by the wrapper's own hand-off (fused mode: the
            loader's ``queue_size`` instead).
        normalize: a :class:`PixelNormalize` (or ``True`` for Qwen3-VL defaults) to normalise
            uint8 pixel tensors right after the copy; ``None`` leaves tensors untouched.
        mode: ``"auto"`` stages through pinned memory and a copy stream on CUDA and only
            prefetches on CPU; ``"staged"`` forces the slot machinery (CPU: synchronous copies);
            ``"prefetch"`` never copies.
        device_buffers: ``"allocator"`` (record_stream, no lifetime contract) or ``"pool"``
            (pre-allocated, valid until ``hold`` more batches are requested). See module doc.
        hold: pool mode only: batches the consumer may hold at once (torchtitan: grad-accum
            steps x PP microbatches).
        max_signatures: distinct shape signatures kept pooled (LRU beyond that).
        snapshot_state: own hand-off: snapshot ``loader.state_dict()`` after each pull
            (``None``: iff the loader has ``state_dict``). Needed for an exact ``state_dict()``.
        keep_on_host: paths of tensor leaves that are *not* copied (returned as they are), e.g.
            ``{(1,)}`` for the labels of a torchtitan ``(input_dict, labels)`` batch. A path is
            the tuple of dict keys / sequence indices from the batch root.
        device_transform: ``batch -> batch`` applied to each batch once it is on the device
            (after ``normalize``), in the background thread on the copy stream (no copy: on
            the host). E.g. the VL collate's ``finish_on_device``. Must be thread-safe and must
            not synchronise with the consumer.
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
        self.num_buffers = num_buffers
        self.max_signatures = max_signatures
        self.keep_on_host = frozenset(tuple(k) for k in keep_on_host)
        self.device_transform = device_transform
        self.normalize = PixelNormalize() if normalize is True else (normalize or None)
        has_state = callable(getattr(loader, "state_dict", None))
        self._snapshot_enabled = has_state if snapshot_state is None else bool(snapshot_state)
        if self._snapshot_enabled and not has_state:
            raise TypeError(f"snapshot_state=True but {type(loader).__name__} has no state_dict()")
        self._fused = _prefetch_of(loader)
        # Own hand-off over one of this package's loader adapters (``rank_state()`` +
        # ``state_dict(rank_state=)``, e.g. a loader whose workers are processes): the snapshot
        # per batch is its rank state (cheap, no collective); the checkpoint envelope, whose
        # gather IS a collective at DP > 1, is made from it only when state_dict() is called,
        # on the caller's thread, never per batch in ours.
        self._rank_states = (
            self._fused is None
            and self._snapshot_enabled
            and callable(getattr(loader, "rank_state", None))
        )
        depth = self._fused.queue_size if self._fused is not None else num_buffers
        self._stats = _Stats()
        self._copier: _Copier | None = None
        if self.staged or self.normalize is not None or device_transform is not None:
            spec = _CopySpec(
                device=self.device,
                staged=self.staged,
                device_buffers=device_buffers,
                per_signature=depth + hold + 1,  # all that can be in use: never waits
                max_signatures=max_signatures,
                normalize=self.normalize,
                keep_on_host=self.keep_on_host,
                transform=device_transform,
            )
            self._copier = _Copier(spec, self._stats)
        self._pf: Prefetch | None = self._fused  # the hand-off next() reads
        self._prev_then: Callable[[Any], Any] | None = None
        self._installed = False
        self._held: collections.deque[_Staged] = collections.deque()
        self._failed: BaseException | None = None
        self._closed = False
        self._closed_state: tuple[State] | None = None  # own hand-off: the state at close()
        _LIVE.add(self)
        self._install()

    @property
    def fused(self) -> bool:
        """Whether the copy runs in the wrapped loader's own Prefetch (no thread of ours)."""
        return self._fused is not None

    # -- the hand-off ----------------------------------------------------------------------------

    def _install(self) -> None:
        """Fused: put the copy on the loader's Prefetch (stops its thread; exact, see set_then)."""
        if self._fused is not None and self._copier is not None and not self._installed:
            self._prev_then = self._fused.then
            self._fused.set_then(_chain(self._prev_then, self._copier))
            self._installed = True

    def _hand_off(self) -> Prefetch:
        if self._pf is None:
            self._pf = Prefetch(
                LoaderStage(
                    self.loader, self._snapshot_enabled, self._stats, rank_states=self._rank_states
                ),
                # "normal": the loader may start processes or threads from this one (a
                # DataLoader's workers at a new epoch), which would inherit an idle policy
                PrefetchOptions(queue_size=self.num_buffers, thread_priority="normal"),
                name="AsyncDeviceLoader",
                then=self._copier,
            )
        return self._pf

    def _restart(self) -> None:
        """Forget an error / a close before a new pass or a load."""
        self._failed = None
        self._closed = False
        self._closed_state = None
        self._held.clear()  # slots of the previous pass: dropped with its pool
        self._install()

    def _release_held(self, keep: int) -> None:
        """Give pool slots back so that at most ``keep`` stay held."""
        ev = None
        while len(self._held) > keep:
            item = self._held.popleft()
            if self.device.type == "cuda" and ev is None:
                # Everything the consumer enqueued so far on its stream may read the buffers;
                # the copy stream waits on this event before overwriting them.
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
            item.pool.release(item.slot, ev)  # type: ignore[union-attr]

    def _take(self, item: _Staged) -> Any:
        if item.event is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(item.event)
            for t in item.fresh:
                t.record_stream(cur)  # allocator mode: no reuse before the consumer is done
        item.fresh = []
        if item.slot is not None:
            self._held.append(item)
        return item.batch

    # -- the stage contract -----------------------------------------------------------------

    def __iter__(self) -> AsyncDeviceLoader:
        if (
            self._rank_states
            and self._pf is not None
            and not (self._closed or self._failed is not None or self._pf.done)
        ):
            # one of this package's adapters: its stream continues across iter(), so a pass in
            # progress goes on, and the batches made ahead are not dropped (they would be lost)
            return self
        self._restart()
        if self._fused is not None:
            iter(self.loader)  # type: ignore[call-overload]  # the loader decides what a pass is
        else:
            pf = self._hand_off()
            pf.reset(None)
            pf.start()  # the first batches are made while the caller sets up, as a DataLoader
        return self

    def next(self) -> Any:
        if self._closed:
            raise RuntimeError("AsyncDeviceLoader is closed; call iter() to start a new pass")
        if self._failed is not None:
            raise RuntimeError(
                "AsyncDeviceLoader stopped after an error in its background thread; "
                "call iter() or load_state_dict() to restart"
            ) from self._failed
        pf = self._pf if self._pf is not None else self._hand_off()
        if self._held:
            self._release_held(self.hold - 1)  # only pool mode holds slots
        t0 = time.perf_counter()
        got = False
        try:
            item = pf.next()
            got = True
        except StopIteration:
            self._release_held(0)
            raise
        except Exception as e:  # relayed by the Prefetch as the same object, with its note
            self._failed = e
            raise
        finally:
            self._stats.consumer_waited(time.perf_counter() - t0, got)
        return self._take(item) if isinstance(item, _Staged) else item

    def state(self) -> State:
        """Own hand-off: the wrapped loader's state right after the last batch handed out (a
        snapshot). Fused: the loader's Prefetch's state (the same, taken by that stage)."""
        if self._closed_state is not None:
            return self._closed_state[0]
        return self._hand_off().state()

    def reset(self, state: State | None = None) -> None:
        self._restart()
        self._hand_off().reset(state)

    def stats(self, state: State) -> dict[str, Any]:
        return self._pf.stats(state) if self._fused is not None else {}

    def close(self) -> None:
        """Stop and join the background thread and drop prefetched batches. Idempotent.
        Fused: the loader's Prefetch gets its previous ``then`` back and stays usable."""
        self._held.clear()  # slots are dropped with the pool; no consumer reads after close
        if self._fused is not None:
            # stops the thread that ran our copy (or fed us); the loader restarts it later
            # from the state of the last batch it returned
            self._fused.set_then(self._prev_then if self._installed else self._fused.then)
            self._installed = False
        elif self._pf is not None:
            self._closed_state = (self._pf.state(),)
            self._pf.close(_JOIN_TIMEOUT_S)
            self._pf = None
        self._closed = True

    # -- torchtitan's calls ------------------------------------------------------------------

    def __next__(self) -> Any:
        return self.next()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's state as of the last batch handed out (in-flight batches are
        made again after a resume). Fused: the loader's own ``state_dict()``."""
        if not self._snapshot_enabled:
            raise RuntimeError(
                f"state_dict(): {type(self.loader).__name__} has no state_dict() "
                "(or snapshot_state=False), so in-flight batches cannot be accounted for"
            )
        if self._fused is not None:
            return self.loader.state_dict()  # type: ignore[attr-defined]
        if self._rank_states:
            return self.loader.state_dict(rank_state=copy.deepcopy(self.state()))  # type: ignore[attr-defined]
        return copy.deepcopy(self.state())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Drop prefetched batches and resume the wrapped loader at ``state_dict``."""
        if not callable(getattr(self.loader, "load_state_dict", None)):
            raise TypeError(f"{type(self.loader).__name__} has no load_state_dict()")
        self._restart()
        if self._fused is not None:
            self.loader.load_state_dict(state_dict)  # type: ignore[attr-defined]
        elif self._rank_states:
            # the loader reads the envelope itself (any DP degree); our thread must not run
            # meanwhile, and the next hand-off starts from the loaded position
            if self._pf is not None:
                self._pf.close(_JOIN_TIMEOUT_S)
                self._pf = None
            self.loader.load_state_dict(state_dict)  # type: ignore[attr-defined]
        else:
            self._hand_off().reset(state_dict)

    def rank_state(self) -> State:
        """This DP rank's state for the one checkpoint envelope, as of the last batch handed out:
        fused, the wrapped loader's ``rank_state()``; own hand-off over a loader that has one,
        its snapshot. Other loaders have only ``state_dict()``."""
        if self._rank_states:
            return self.state()
        if self._fused is None:
            raise TypeError(
                f"rank_state(): {type(self.loader).__name__} is not topped by a Prefetch; "
                "use state_dict()"
            )
        return self.loader.rank_state()  # type: ignore[attr-defined]

    def get_stats(self) -> dict[str, Any]:
        """Wrapped loader's ``get_stats()`` (if any) plus ``staging/*`` keys."""
        inner = getattr(self.loader, "get_stats", None)
        out: dict[str, Any] = dict(inner()) if callable(inner) else {}
        out.update(self._stats.as_dict(own_hand_off=self._fused is None))
        w = self._pf.worker if self._pf is not None else None
        out["staging/queue_depth"] = w.q.qsize() if w is not None else 0
        if self._copier is not None and self._copier.pool is not None:
            out.update(self._copier.pool.stats())
        return out

    def threads_alive(self) -> list[threading.Thread]:
        """The background thread feeding us, while it runs (fused: the loader's Prefetch's)."""
        w = self._pf.worker if self._pf is not None else None
        return [w.thread] if w is not None and w.thread.is_alive() else []

    def __enter__(self) -> AsyncDeviceLoader:
        return self

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
    ``normalize=True`` or ``device_transform=`` the collate's on-device finisher. A loader topped
    by a Prefetch (``.pipeline``) is staged in that stage's thread (fused mode).
    """
    if not enabled:
        return loader
    return AsyncDeviceLoader(loader, device, **opts)
