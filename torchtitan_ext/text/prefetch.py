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
* **Thread policy** (:mod:`torchtitan_ext.pipeline.priority`, ``thread_priority``) — by default the
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

Layout: this module is the public loader and its state; :mod:`~torchtitan_ext.text.producer`
holds the background producer, :mod:`~torchtitan_ext.pipeline.handoff` the ready queue,
:mod:`~torchtitan_ext.text.packer_state` the checkpoint encoding of the packer, and
:mod:`torchtitan_ext.threads` the shared error relay and bounded join. Measured (tokens per
CPU-second against torchtitan's loader, data-wait share, ``next()`` p50/p99, slow storage, thread
policies): ``python -m benchmarks text_loaders``, figures in ``benchmarks/RESULTS.md``. The
tokenizer engine, not the thread, buys tokens per core; the thread buys overlap.
"""

from __future__ import annotations

import logging
import os
import queue
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from torchtitan_ext.text.errors import OnBadInput, check_on_bad_input

# re-exported: the hand-off is tested through this module
from torchtitan_ext.pipeline.handoff import _ReadyQueue as _ReadyQueue
from torchtitan_ext.text.packer_state import decode_packer, encode_packer
from torchtitan_ext.text.packing import PACKING_MODES, BestFitPacker, ConcatSplitPacker, make_packer
from torchtitan_ext.text.parquet import ParquetSource
from torchtitan_ext.pipeline.priority import PRIORITY_MODES
from torchtitan_ext.text.producer import _End, _Failure, _Producer, _shutdown, _Snapshot
from torchtitan_ext.text.tokenize import TextTokenizer
from torchtitan_ext.threads import relay

logger = logging.getLogger(__name__)

STATE_VERSION = 3


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
            :mod:`torchtitan_ext.pipeline.priority`).
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
            raise relay(
                exc, f"the background thread {p.thread.name!r}", "PrefetchingParquetLoader.__next__"
            )
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
        as little-endian ``bytes``, cheap to take and to deepcopy every batch, and surviving
        torch.distributed.checkpoint (see :mod:`~torchtitan_ext.text.packer_state` for why)."""
        snap = self._snap.packer
        packer_state, self._doc_bytes = encode_packer(
            snap, self.packer, self.packing, self._doc_bytes
        )
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
        packer_state = decode_packer(state["packer"], state["packer_counters"])
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
