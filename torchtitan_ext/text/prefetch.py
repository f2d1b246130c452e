"""PrefetchingParquetLoader: Parquet row groups -> background read, batched tokenization and
BOS-aligned packing -> bounded queue of ready batches -> ``({"input", "positions"}, labels)``.

Why a thread (not processes). The expensive step, tokenization, runs in Rust (the proven
tiktoken engine of :class:`~torchtitan_ext.text.tokenize.TextTokenizer`, or ``tokenizers``'
``encode_batch``) and releases the GIL, and so do pyarrow's Parquet reads; one background thread
therefore overlaps them with the training loop, on another core, without pickling documents
across processes. What a thread does cost is contention with the training thread for the GIL and
the CPUs; the hand-off below and the thread policy are built to keep that off the training loop.

Pipeline and its invariants:

* **Producer thread** — iterates :class:`~torchtitan_ext.text.parquet.ParquetSource` chunks (up to
  ``chunk_rows`` documents of one row group), encodes each chunk in one call with BOS prefixed (as
  an id, never a formatted ``"<|bos|>"`` string), feeds the packer
  (:mod:`torchtitan_ext.text.packing`), and appends finished ``[B, seq_len + 1]`` batches, as
  tensors, to a bounded queue of ``queue_size`` batches (backpressure, bounded memory).
* **Hand-off** (:class:`_ReadyQueue`) — ``__next__`` is a ``deque`` pop: it never wakes the
  producer (``queue.Queue.get`` does, and that wake-up cost the training loop 2-5 ms stalls, see
  the class), does no tokenizing, packing, copying or freeing (the snapshot it drops is freed by
  the producer): 3-10 us median. A producer that finds the queue full sleeps on its own timer
  until the consumer, at its measured rate, has taken it down to half, then refills it in a burst.
* **Thread policy** (:mod:`torchtitan_ext.text.priority`, ``thread_priority``) — by default the
  producer and readers run at ``SCHED_IDLE`` while the queue is full and at the normal policy
  once it runs low, so that a waking training thread preempts them instead of queueing behind
  them; used only where the process may switch back (``CAP_SYS_NICE``).
* **Errors** — any exception in the thread is put on the queue and re-raised by ``__next__`` as
  the *same* exception object: its traceback still holds the producer's frames (plus the
  consumer's), and a note names the thread. Bad input (``BadInputError``) therefore surfaces with
  file / row group / row.
* **Shutdown** — ``close()``, ``with loader:`` and a ``weakref.finalize`` (which also runs at
  interpreter exit) set a stop event, clear the queue, and join the thread. Every loop of the
  producer and of the source checks the event (also a sleep on a full queue and a wait for a
  read), and the source's read-ahead threads end with the producer (reads not started are
  cancelled), so ``close()`` waits at most for the reads in flight; a thread still alive after
  its timeout (a read that never returns) is logged with where it is blocked. The thread holds
  no reference to the loader, so dropping the loader stops it too.
* **End of data** — a finite pass ends with the state after its last row (the counts include
  rows read after the last batch); an endless stream whose whole epoch yields no usable document
  raises :class:`~torchtitan_ext.text.errors.NoUsableDocuments` from ``next()``.
* **Exact resume** — with every batch the producer queues a *snapshot* of its state right after
  that batch: the source cursor (epoch, row group, row) of the last chunk it read, a shallow copy
  of the packer's buffer (~20 us for 1000 documents; the document arrays are shared, never
  copied), and its counters. The consumer's state is the snapshot of the last batch it took, so
  whatever is still in the queue is simply produced again after a resume. ``load_state_dict``
  restores the packer and restarts the producer from that cursor: the batches that follow are
  bitwise identical to an uninterrupted run. ``state_dict()`` holds only ints and int64 arrays as
  little-endian ``bytes`` — nothing pickled by us — is cheap to take and to deepcopy every batch,
  and survives torch.distributed.checkpoint (see :meth:`PrefetchingParquetLoader.state_dict`).
* **Read-ahead** — ``read_ahead`` helper threads read the next row groups concurrently (pyarrow,
  GIL released, ``use_threads=False``) while the producer tokenizes, hiding slow storage.
* **One core** — by default the loader sets ``TOKENIZERS_PARALLELISM=false`` (unless the user set
  it): the Rust tokenizer's thread pool otherwise spans every core, and the training loop, waking
  from a step, then waits for a time slice (measured: p99 ``next()`` 8-17 ms instead of <1 ms on a
  2-core machine, with no gain in tokens/s there). ``tokenizer_parallelism=True`` opts out.

Measured (``python -m benchmarks text_loaders``; shared 2-core VM, GPT-2 tokenizer, 40 MB
long-tailed corpus, B=8, T=2048; ranges over three full runs):

* Tokens per CPU-second: 3.67-3.71 M, vs torchtitan 0.3.0's ``HuggingFaceTextDataLoader``
  0.94-1.0 M (3.70-3.89x); with the ``tokenizers`` engine 1.33-1.42 M (the engine, not the
  thread, buys tokens per core: the thread buys overlap).
* Data-wait with a consumer at 50 % of capacity (GC handled as torchtitan's trainer does): wait
  share 0.06-0.13 % (synchronous loader ~40 %, torchtitan 26-37 %, torchtitan with one worker
  process 1.8-2.8 %), ``next()`` p50 3-8 us, p99 16-43 us; the training loop loses no measurable
  time outside ``next()``. With 50 ms per row-group read (slow storage, hidden by read-ahead):
  0.05-0.13 %, p99 11-34 us. At the normal thread policy (no ``CAP_SYS_NICE``): 0.06-0.34 %,
  p99 0.015-0.13 ms, and the loop loses 0.5-0.9 % of its time outside ``next()``.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.text.errors import OnBadInput, SkipLog, check_on_bad_input
from torchtitan_ext.text.packing import PACKING_MODES, BestFitPacker, ConcatSplitPacker, make_packer
from torchtitan_ext.text.parquet import ParquetSource
from torchtitan_ext.text.priority import PRIORITY_MODES, ThreadGroupPriority
from torchtitan_ext.text.tokenize import TextTokenizer

logger = logging.getLogger(__name__)

STATE_VERSION = 3
# Releases the GIL and offers the CPU (no-op where the OS has no sched_yield); see _Producer._feed.
_yield_cpu = getattr(os, "sched_yield", lambda: None)


def _to_bytes(values: Any) -> bytes:
    """int64 values as little-endian bytes (our checkpoint encoding of variable-length arrays)."""
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def _from_bytes(blob: bytes) -> np.ndarray:
    if not isinstance(blob, (bytes, bytearray)) or len(blob) % 8:
        raise ValueError(f"loader state: expected int64 bytes, got {type(blob).__name__}")
    return np.frombuffer(blob, dtype="<i8").astype(np.int64)


@dataclass
class _Snapshot:
    """Producer state right after one batch (immutable once queued)."""

    cursor: tuple[int, int, int]
    packer: dict[str, Any]
    counters: dict[str, int]
    skips: dict[str, int]


@dataclass
class _Batch:
    inputs: dict[str, torch.Tensor]  # "input", "positions": [B, T]
    labels: torch.Tensor  # [B, T]
    snap: _Snapshot


def _to_batch(
    tokens: np.ndarray, positions: np.ndarray, valid: list[int]
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """[B, T+1] packed rows -> torchtitan's (inputs, labels), contiguous int64 tensors."""
    R = tokens.shape[1]
    labels = tokens[:, 1:].copy()
    for i, v in enumerate(valid):
        if v < R:
            # label j predicts token j+1, which is padding once j+1 >= valid
            labels[i, max(v - 1, 0) :] = IGNORE_INDEX
    inputs = {
        "input": torch.from_numpy(tokens[:, :-1].copy()),
        "positions": torch.from_numpy(positions[:, :-1].copy()),
    }
    return inputs, torch.from_numpy(labels)


class _ReadyQueue:
    """Bounded single-producer / single-consumer hand-off whose ``get`` never wakes the producer.

    Why not ``queue.Queue``: its ``get`` notifies a producer blocked on a full queue, so the
    training loop itself wakes the background thread, from inside ``next()``. Traced with
    ``perf sched`` on a 2-vCPU VM: the woken producer soon holds the GIL, the training thread
    blocks on it, and when the producer drops it (entering Rust) the kernel queues the training
    thread on the *producer's* CPU while the other CPU idles: runnable-but-waiting stalls of
    2-5 ms a few times per 100 steps, plus ~20-60 us per ``get`` for the cross-CPU wake-up.

    Here ``get`` is a ``deque`` pop (atomic under the GIL) and blocks, on a condition that the
    producer signals, only when the queue is empty. A producer that finds the queue full sleeps
    on its own timer, for about the time the consumer needs (at its measured rate) to bring the
    queue down to ``low`` batches, then refills it in one burst: few wake-ups, none of them
    caused by the training loop.
    """

    # Longest single producer sleep: bounds how stale the rate estimate can get and how long a
    # stop can go unnoticed (a stop also ends the sleep at once).
    MAX_SLEEP_S = 0.05

    def __init__(self, maxsize: int, priority: ThreadGroupPriority) -> None:
        self.maxsize = maxsize
        self.low = maxsize // 2  # refill once this many (or fewer) remain
        # Below the refill point on purpose: reaching `low` is the normal cycle; falling well
        # under it means the producer is not keeping up at idle priority.
        self.promote_at = self.low // 2
        # Adaptive policy of the producer's threads (see torchtitan_ext.text.priority): idle once
        # the queue is full, normal again as soon as get() finds it below the low watermark.
        self.priority = priority
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._last_get: float | None = None
        self._interval: float | None = None  # EMA of the seconds between two gets

    def qsize(self) -> int:
        return len(self._items)

    def get(self, timeout: float) -> Any:
        """Next item; ``queue.Empty`` if none arrived within ``timeout`` seconds."""
        now = time.perf_counter()
        if self._last_get is not None:
            dt = now - self._last_get
            self._interval = dt if self._interval is None else 0.8 * self._interval + 0.2 * dt
        self._last_get = now
        if self.priority.idle and len(self._items) <= self.promote_at:
            self.priority.set_idle(False)  # falling behind: the producer needs a full share of CPU
        try:
            return self._items.popleft()
        except IndexError:
            pass  # empty: wait for the producer's signal below
        with self._cond:
            while not self._items:
                if not self._cond.wait(timeout):
                    raise queue.Empty
            return self._items.popleft()

    def put(self, item: Any, stop: threading.Event) -> bool:
        """Append ``item`` (False, without appending, once ``stop`` is set)."""
        if len(self._items) >= self.maxsize:
            while (excess := len(self._items) - self.low) > 0:
                # Half the expected drain time, then look again: the rate may have changed.
                est = 0.5 * excess * self._interval if self._interval else 0.001
                if stop.wait(min(max(est, 0.0005), self.MAX_SLEEP_S)):
                    return False
        if stop.is_set():
            return False
        self._items.append(item)
        with self._cond:
            self._cond.notify()
        if len(self._items) >= self.maxsize and not self.priority.idle:
            self.priority.set_idle(True)  # ahead: run only on CPU time nobody else wants
        return True

    def clear(self) -> None:
        self._items.clear()


@dataclass
class _End:
    """The (finite) source is exhausted and every row has been emitted. ``snap``: the state at
    the end of the pass, which counts the rows read (and skipped) after the last batch."""

    snap: _Snapshot


@dataclass
class _Failure:
    exc: BaseException
    snap: _Snapshot | None = None
    """The state when the error was raised, where it is one a batch boundary could have had
    (between chunks, no row of the next batch taken): its counts include the rows read up to
    the error. None otherwise."""


class _Producer:
    """Owns the thread, stop event, queue and (while running) the packer. Holds no reference to
    the loader, so the loader can be garbage-collected, which runs its finalizer, which stops us."""

    def __init__(
        self,
        source: ParquetSource,
        tokenizer: TextTokenizer,
        packer: BestFitPacker | ConcatSplitPacker,
        snap: _Snapshot,
        batch_size: int,
        queue_size: int,
        add_eos: bool,
        name: str,
        thread_priority: str = "adaptive",
    ) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.packer = packer
        self.cursor = snap.cursor
        self.counters = dict(snap.counters)
        self.skips = SkipLog()
        self.skips.load_state_dict({"counts": snap.skips, "examples": {}})
        self.batch_size = batch_size
        self.add_eos = add_eos
        self.priority = ThreadGroupPriority(thread_priority)
        self.q = _ReadyQueue(queue_size, self.priority)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.busy_s = 0.0  # time spent reading + tokenizing + packing (for get_stats)
        self._ended = False  # the (finite) source is exhausted
        self._between_batches = False
        # Snapshots the consumer has moved past. Freeing one (a list and a dict of ~buffer_docs
        # entries) took ~35 us of the training loop's next(); appended here instead, they are
        # freed by this thread.
        self.retired: collections.deque = collections.deque()

    def start(self) -> None:
        self.thread.start()

    def _put(self, item: Any) -> bool:
        # Returns False once stop() was called, even when the consumer has gone away and nobody
        # will ever make room in the queue.
        return self.q.put(item, self.stop_event)

    def _feed(self, chunk: Any) -> None:
        if chunk.texts:
            # Before each Rust call: a training thread that woke up while we held the GIL, and
            # that the kernel queued on *our* CPU when we let go of it, runs now rather than
            # after our time slice (up to a 4 ms tick). Measured at the normal thread policy on
            # 2 cores: worst next() 0.1-1.1 ms instead of 2-4.4 ms, and the loop's time lost
            # outside next() 0.7 % instead of 1.3-2.4 %, at the same tokens/s.
            _yield_cpu()
            encoded = self.tokenizer.encode_arrays(chunk.texts, add_bos=True, add_eos=self.add_eos)
            add = self.packer.add
            ntok = 0
            for arr in encoded:
                ntok += arr.size
                add(arr)
            self.counters["docs_read"] += len(encoded)
            self.counters["tokens_read"] += ntok
        self.counters["rows_read"] += chunk.rows_read
        for reason, loc, n in chunk.skips:
            self.skips.skip(reason, loc, n)
        self.cursor = chunk.cursor_after

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            self.cursor, self.packer.snapshot(), dict(self.counters), self.skips.as_dict()
        )

    def _run(self) -> None:
        self.priority.join_current_thread()
        chunks = self.source.iter_chunks(
            self.cursor, thread_init=self.priority.join_current_thread, stop=self.stop_event
        )
        self._between_batches = False  # see _Failure.snap
        try:
            B, R = self.batch_size, self.packer.row_len
            while not self.stop_event.is_set():
                self.retired.clear()
                t0 = time.perf_counter()
                tokens = np.empty((B, R), dtype=np.int64)
                positions = np.empty((B, R), dtype=np.int64)
                valid = [R] * B
                n = self._fill(chunks, tokens, positions, valid)
                if n is None:  # stopped
                    return
                if n == 0:
                    self._put(_End(self._snapshot()))
                    return
                if n < B:
                    # End of a finite pass: the missing rows are all padding (labels ignored),
                    # so batch shapes never change (torch.compile, fixed-shape buffers).
                    tokens[n:] = self.packer.pad_id
                    positions[n:] = 0
                    valid[n:] = [0] * (B - n)
                self.counters["batches"] += 1
                snap = self._snapshot()
                self.busy_s += time.perf_counter() - t0
                # Tensors are built here too: the consumer's next() is just a queue get.
                inputs, labels = _to_batch(tokens, positions, valid)
                if not self._put(_Batch(inputs, labels, snap)):
                    return
        except BaseException as e:  # noqa: BLE001 - relayed to the consumer, which re-raises it
            self._put(_Failure(e, self._snapshot() if self._between_batches else None))
        finally:
            # Closing the generator now stops its read-ahead thread even while the relayed
            # exception (whose traceback references this frame) is still alive.
            chunks.close()
            self.priority.leave_current_thread()
            self.priority.close()

    def _fill(
        self, chunks: Iterator[Any], tokens: np.ndarray, positions: np.ndarray, valid: list[int]
    ) -> int | None:
        """Pack rows into ``tokens``/``positions`` (reading and feeding chunks as needed); the
        number of rows filled (fewer than the batch only at the end of a finite pass), or None
        once stopped."""
        packer, n = self.packer, 0
        while n < len(valid):
            if packer.ready() or (self._ended and packer.has_pending()):
                valid[n] = packer.pop_row_into(tokens[n], positions[n], final=self._ended)
                n += 1
            elif self._ended:
                break
            else:
                self._between_batches = n == 0
                chunk = next(chunks, None)
                self._between_batches = False
                if self.stop_event.is_set():
                    return None  # the source ended because of the stop, not the data
                if chunk is None:
                    self._ended = True
                else:
                    self._feed(chunk)
        return n

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the thread (and, through the source, its read-ahead threads); True once it has
        ended. A thread still alive after ``timeout`` is logged with where it is blocked (a
        read that never returns cannot be interrupted from Python) and False is returned."""
        self.stop_event.set()  # also ends a producer's sleep on a full queue
        self.q.clear()
        if threading.current_thread() is self.thread or not self.thread.is_alive():
            return True
        self.thread.join(timeout)
        if not self.thread.is_alive():
            return True
        frame = sys._current_frames().get(self.thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else "?"
        logger.error(
            "prefetch thread %r did not stop within %.0f s (it and its Parquet read-ahead "
            "threads keep running as daemons); it is blocked at:\n%s",
            self.thread.name,
            timeout,
            stack,
        )
        return False


def _shutdown(producer_ref: list[_Producer | None], timeout: float = 10.0) -> bool:
    p = producer_ref[0]
    producer_ref[0] = None
    return p.stop(timeout) if p is not None else True


class PrefetchingParquetLoader:
    """Iterator of packed batches from Parquet shards, read, tokenized and packed in a
    background thread.

    Each ``next()`` returns ``({"input": LongTensor[B, T], "positions": LongTensor[B, T]},
    labels LongTensor[B, T])`` with labels shifted by one and ``-100`` on padding. Infinite by
    default; with ``infinite=False`` it makes one pass (the last batch is padded to ``B`` rows with
    ignored labels, so shapes never change) and then raises ``StopIteration``.

    Args:
        path: a directory, glob or list of Parquet shards (see :mod:`torchtitan_ext.text.parquet`).
        tokenizer: a :class:`TextTokenizer` or anything ``TextTokenizer.coerce`` accepts.
        seq_len: tokens per row fed to the model (rows are packed to ``seq_len + 1``).
        batch_size: rows per batch (torchtitan's ``local_batch_size``).
        text_column: the Parquet column holding the documents.
        split: ``"train"`` or ``"val"``; ``val_files`` picks the validation files.
        dp_rank / dp_world_size: this rank's share (row groups dealt round-robin).
        seed / shuffle: per-epoch row-group order of this rank.
        infinite: cycle epochs forever (training) or make one pass (validation).
        packing: ``"best_fit"`` | ``"zero_discard"`` | ``"concat_split"``.
        buffer_docs: documents the best-fit packer keeps to choose from.
        queue_size: ready batches the queue holds (backpressure bound).
        chunk_rows: documents per tokenization call (small: the Python work between two
            GIL-releasing Rust calls is what the training loop can wait behind).
        on_bad_input: ``"error"`` or ``"skip"`` (see :mod:`torchtitan_ext.text.errors`).
        add_eos: also append EOS to every document.
        read_delay_s: sleep this long per row-group read (simulates slow storage; benchmarks).
        read_ahead: row groups read ahead by a helper thread (0: read inline).
        tokenizer_parallelism: ``False`` (default) sets ``TOKENIZERS_PARALLELISM=false`` for the
            process unless it is already set, so that tokenization runs on the loader's thread
            only instead of a Rust thread pool that spans every core (see the module docstring).
        thread_priority: OS scheduling policy of the producer and reader threads:
            ``"adaptive"`` (``SCHED_IDLE`` while the queue is full, normal when it runs low; only
            where the process may switch back, else normal), ``"idle"`` or ``"normal"`` (see
            :mod:`torchtitan_ext.text.priority`).
    """

    def __init__(
        self,
        path: Any,
        tokenizer: Any,
        *,
        seq_len: int,
        batch_size: int,
        text_column: str = "text",
        split: str = "train",
        val_files: str = "auto",
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        infinite: bool = True,
        packing: str = "best_fit",
        buffer_docs: int = 1000,
        queue_size: int = 8,
        chunk_rows: int = 8,
        on_bad_input: OnBadInput = "error",
        add_eos: bool = False,
        read_delay_s: float = 0.0,
        read_ahead: int = 4,
        tokenizer_parallelism: bool = False,
        thread_priority: str = "adaptive",
    ) -> None:
        if packing not in PACKING_MODES:
            raise ValueError(f"packing must be one of {PACKING_MODES}, got {packing!r}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if thread_priority not in PRIORITY_MODES:
            raise ValueError(
                f"thread_priority must be one of {PRIORITY_MODES}, got {thread_priority!r}"
            )
        self.thread_priority = thread_priority
        # Process-wide on purpose (the library has no per-call switch); an explicit user setting
        # wins. Measured on 2 cores: with the pool, the training loop's next() waited 2-4 % of
        # the time with p99 8-17 ms (pool threads occupying both cores when it woke up); on the
        # loader's thread alone, 0.2-0.4 % and p99 0.1-0.4 ms, at the same tokens/s.
        os.environ.setdefault(
            "TOKENIZERS_PARALLELISM", "true" if tokenizer_parallelism else "false"
        )
        self.tokenizer = TextTokenizer.coerce(tokenizer)
        if self.tokenizer.bos_id is None:
            raise ValueError(
                f"{self.tokenizer.source}: the tokenizer has no BOS token; BOS-aligned packing "
                "needs one (pass bos_token when loading it)"
            )
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.packing = packing
        self.buffer_docs = buffer_docs
        self.queue_size = queue_size
        self.add_eos = add_eos
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.source = ParquetSource(
            path,
            text_column=text_column,
            split=split,
            val_files=val_files,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            seed=seed,
            shuffle=shuffle,
            infinite=infinite,
            on_bad_input=check_on_bad_input(on_bad_input),
            chunk_rows=chunk_rows,
            read_delay_s=read_delay_s,
            read_ahead=read_ahead,
        )
        self.packer = self._new_packer()
        self._snap = _Snapshot(
            (0, 0, 0),
            self.packer.snapshot(),
            {"rows_read": 0, "docs_read": 0, "tokens_read": 0, "batches": 0},
            {},
        )
        self._done = False  # StopIteration has been raised
        self._doc_bytes: dict[int, bytes] = {}  # state_dict() cache: insertion number -> blob
        self._wait_s = 0.0
        self._producer_ref: list[_Producer | None] = [None]
        self._finalizer = weakref.finalize(self, _shutdown, self._producer_ref)

    def _new_packer(self) -> BestFitPacker | ConcatSplitPacker:
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else self.tokenizer.bos_id
        return make_packer(
            self.packing,
            self.seq_len,
            self.tokenizer.bos_id,
            buffer_docs=self.buffer_docs,
            pad_id=pad,
            boundary_id=None,  # add_eos already appends EOS in the tokenizer call
        )

    # ------------------------------------------------------------------ thread control
    def _ensure_started(self) -> _Producer:
        p = self._producer_ref[0]
        if p is None:
            if not self._finalizer.alive:
                raise RuntimeError("PrefetchingParquetLoader is closed")
            # The producer works on its own packer, restored from the consumer's snapshot.
            packer = self._new_packer()
            packer.load_state_dict(self.packer.state_from_snapshot(self._snap.packer))
            p = _Producer(
                self.source,
                self.tokenizer,
                packer,
                self._snap,
                self.batch_size,
                self.queue_size,
                self.add_eos,
                name=f"parquet-prefetch-{self.source.split}-dp{self.dp_rank}",
                thread_priority=self.thread_priority,
            )
            self._producer_ref[0] = p
            p.start()
        return p

    def _stop_producer(self) -> None:
        _shutdown(self._producer_ref)

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the background thread and its read-ahead threads (idempotent), waiting up to
        ``timeout`` seconds: True once they have all ended. One still running then (a read that
        never returns cannot be interrupted from Python) is logged as an error with where it is
        blocked, and False is returned. The loader cannot be iterated afterwards."""
        if self._finalizer.detach() is None:
            return True  # already closed
        return _shutdown(self._producer_ref, timeout)

    def __enter__(self) -> PrefetchingParquetLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if self._done:
            raise StopIteration
        p = self._ensure_started()
        t0 = time.perf_counter()
        while True:
            try:
                item = p.q.get(0.5)
                break
            except queue.Empty:
                if not p.thread.is_alive():
                    raise RuntimeError(
                        f"prefetch thread {p.thread.name} ended without a result"
                    ) from None
        self._wait_s += time.perf_counter() - t0
        if isinstance(item, _Failure):
            exc = item.exc
            self._stop_producer()
            if item.snap is not None:  # the counts include the rows read up to the error
                self._snap = item.snap
            exc.add_note(
                f"(raised in the background thread {p.thread.name!r}; re-raised by "
                f"PrefetchingParquetLoader.__next__)"
            )
            raise exc
        if isinstance(item, _End):
            self._done = True
            self._stop_producer()
            self._snap = item.snap  # rows read (and skipped) after the last batch count too
            if item.snap.counters["docs_read"] == 0:
                logger.warning(
                    "%s: the pass ended without a usable document (%d rows read, skipped: %s)",
                    self.source.describe(),
                    item.snap.counters["rows_read"],
                    item.snap.skips,
                )
            raise StopIteration
        p.retired.append(self._snap)  # freed by the producer, not here (see _Producer)
        self._snap = item.snap
        return item.inputs, item.labels

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict[str, float]:
        """Counters for logging (cheap; safe to call every step). Data counters are as of the
        last batch returned by ``next()`` (exact, and preserved across a resume)."""
        p = self._producer_ref[0]
        c = self._snap.counters
        pc = self._snap.packer["counters"]
        return {
            "queue_depth": p.q.qsize() if p is not None else 0,
            "queue_capacity": self.queue_size,
            "thread_alive": bool(p is not None and p.thread.is_alive()),
            "rows_read": c["rows_read"],
            "docs_read": c["docs_read"],
            "tokens_read": c["tokens_read"],
            "docs_skipped": sum(self._snap.skips.values()),
            "files_skipped": len(self.source.unreadable_files),  # on_bad_input="skip" only
            "tokens_cropped": pc["tokens_cropped"],
            "crop_pct": 100.0 * pc["tokens_cropped"] / max(pc["tokens_in"], 1),
            "fill_pct": 100.0 * pc["tokens_out"] / max(pc["rows"] * (self.seq_len + 1), 1),
            "consumer_wait_ms": self._wait_s * 1e3,
            "producer_busy_ms": (p.busy_s * 1e3) if p is not None else 0.0,
            # 1 while the loader's threads run at SCHED_IDLE; policy changes of this producer
            "threads_idle": int(p is not None and p.priority.idle),
            "priority_switches": p.priority.switches if p is not None else 0,
            "batches": c["batches"],
            "epoch": self._snap.cursor[0],
        }

    @property
    def skip_counts(self) -> dict[str, int]:
        """Skipped records per reason, as of the last batch returned."""
        return dict(self._snap.skips)

    @property
    def skip_examples(self) -> dict[str, list[str]]:
        """The first few locations per skip reason seen by the running producer (informational)."""
        p = self._producer_ref[0]
        out = {k: list(v) for k, v in p.skips.examples.items()} if p is not None else {}
        if self.source.unreadable_files:
            out["unreadable_file"] = list(self.source.unreadable_files)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Pickle-free resume state as of the last batch returned: ints, and int64 arrays stored
        as little-endian ``bytes`` (one blob per buffered document).

        Why bytes rather than lists of ints or tensors: wrappers such as ``AsyncDeviceLoader``
        take ``deepcopy(state_dict())`` after *every* batch. ``bytes`` are immutable, so that
        copy shares them (a list of ~450k ints would cost ~30 ms under the GIL per batch), and
        the per-document blobs are cached across batches: only the ~40 documents that entered
        the buffer since the last call are serialised (~0.2 ms per call for 1000 buffered
        documents). Tensors cannot be used because torch.distributed.checkpoint loads them in
        place into a fresh loader's template, whose buffer has a different size."""
        snap = self._snap.packer
        if "keys" in snap:  # best-fit: per-document blobs, cached by insertion number
            keys, docs, cache = snap["keys"], snap["docs"], self._doc_bytes
            blobs: list[bytes] = []
            fresh: dict[int, bytes] = {}
            for _, seq in keys:
                b = cache.get(seq)
                if b is None:
                    b = _to_bytes(docs[seq])
                fresh[seq] = b
                blobs.append(b)
            self._doc_bytes = fresh
            packer_state: dict[str, Any] = {
                "kind": 0 if self.packing == "best_fit" else 1,
                "row_len": self.seq_len + 1,
                "next_seq": int(snap["next_seq"]),
                "lengths": _to_bytes([k[0] for k in keys]),
                "seqs": _to_bytes([k[1] for k in keys]),
                "docs": blobs,
            }
        else:  # concat-split: a short buffer, serialised whole
            ps = self.packer.state_from_snapshot(snap)
            packer_state = {
                "kind": 2,
                "row_len": self.seq_len + 1,
                "lengths": _to_bytes(ps["lengths"]),
                "tokens": _to_bytes(ps["tokens"]),
            }
        return {
            "version": STATE_VERSION,
            "cursor": list(self._snap.cursor),
            "done": int(self._done),
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "packer": packer_state,
            "packer_counters": dict(snap["counters"]),
            "counters": dict(self._snap.counters),
            "skips": dict(self._snap.skips),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`; the next batch is the one that followed it."""
        if int(state["version"]) != STATE_VERSION:
            raise ValueError(f"loader state version {state['version']} != {STATE_VERSION}")
        for key, mine in (
            ("dp_rank", self.dp_rank),
            ("dp_world_size", self.dp_world_size),
            ("seq_len", self.seq_len),
            ("batch_size", self.batch_size),
        ):
            if int(state[key]) != mine:
                raise ValueError(
                    f"loader state has {key}={int(state[key])}, this loader has {key}={mine}: "
                    "a resumed data stream cannot change it"
                )
        self._stop_producer()  # restarted lazily from the restored snapshot
        ps = state["packer"]
        packer_state: dict[str, Any] = {
            "kind": int(ps["kind"]),
            "row_len": int(ps["row_len"]),
            "lengths": _from_bytes(ps["lengths"]),
            "counters": state["packer_counters"],
        }
        if "docs" in ps:
            packer_state["next_seq"] = int(ps["next_seq"])
            packer_state["seqs"] = _from_bytes(ps["seqs"])
            docs = [_from_bytes(b) for b in ps["docs"]]
            packer_state["tokens"] = np.concatenate(docs) if docs else np.zeros(0, np.int64)
        else:
            packer_state["tokens"] = _from_bytes(ps["tokens"])
        packer = self._new_packer()
        packer.load_state_dict(packer_state)  # validates kind / row length / sizes
        self._snap = _Snapshot(
            tuple(int(x) for x in state["cursor"]),  # type: ignore[arg-type]
            packer.snapshot(),
            {k: int(v) for k, v in state["counters"].items()},
            {str(k): int(v) for k, v in state["skips"].items()},
        )
        self._done = bool(int(state["done"]))
        self._doc_bytes = {}
