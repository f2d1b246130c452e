"""The background producer of :class:`~torchtitan_ext.text.prefetch.PrefetchingParquetLoader`.

One :class:`_Producer` per run of the thread: it reads chunks from the
:class:`~torchtitan_ext.text.parquet.ParquetSource`, tokenizes them, packs rows and queues
finished batches, each with a :class:`_Snapshot` of its state right after that batch, on the
:class:`~torchtitan_ext.pipeline.handoff._ReadyQueue`. The end of a finite pass travels as an
:class:`_End`, an exception as a :class:`_Failure` that the loader re-raises
(:func:`torchtitan_ext.threads.relay`). The pipeline's invariants are in the prefetch module's
docstring.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchtitan_ext import threads
from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.text.errors import SkipLog
from torchtitan_ext.pipeline.handoff import _ReadyQueue
from torchtitan_ext.text.packing import BestFitPacker, ConcatSplitPacker
from torchtitan_ext.text.parquet import ParquetSource
from torchtitan_ext.pipeline.priority import ThreadGroupPriority
from torchtitan_ext.text.tokenize import TextTokenizer

# The public module's name: users configure (and filter) the loader's logging under it.
logger = logging.getLogger("torchtitan_ext.text.prefetch")

# Releases the GIL and offers the CPU (no-op where the OS has no sched_yield); see _Producer._feed.
_yield_cpu = getattr(os, "sched_yield", lambda: None)


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
        stuck = threads.join(
            [self.thread],
            timeout,
            logger,
            "it and its Parquet read-ahead threads keep running as daemons",
        )
        return not stuck


def _shutdown(producer_ref: list[_Producer | None], timeout: float = 10.0) -> bool:
    p = producer_ref[0]
    producer_ref[0] = None
    return p.stop(timeout) if p is not None else True
