"""StreamingTextDataset: an infinite, never-repeating, exactly resumable text stream on top of
Hugging Face ``datasets`` streaming (``load_dataset(..., streaming=True)``).

Why it exists. A classic streaming bug: a loader wraps ``take(N)`` in a persistent-worker
DataLoader, every new ``__iter__`` rebuilds ``take(N)`` and replays the same N documents forever
(the loss falls as the model memorises them). Its cousins in ``datasets``-based loaders: a resume that restarts at zero on the second
restart, ``skip`` after ``split_dataset_by_node`` handing every rank everything, epochs shrinking
after a resume, a shuffle buffer silently refilled differently after a resume. This class makes
that family impossible by construction: **Hugging Face only reads rows; the position is ours**.

Algorithm
---------
* Source. ``load_dataset(builder, data_files=..., streaming=True)`` for local Parquet / JSONL /
  text files (or any hub id). Its ``n_shards`` (one per file for the packaged builders) are the
  unit of reading: shard ``i`` is read with ``ds.shard(n_shards, i)`` and rows are numbered by us.
* Window. Documents are numbered in raw source order (files in order, rows in order): the global
  document index ``g``. ``skip_first`` and ``max_documents`` select the window
  ``[skip_first, skip_first + max_documents)``; shard row counts come from Parquet footers (free)
  or a counting pass over the rows of the shards *up to the window's end* (other formats; a hub
  stream with ``skip_first=100000`` counts its first shards, not the whole dataset).
  Shards are clipped to the window into *pieces* ``(shard, lo, hi)``.
* Epochs. Epoch ``e`` permutes the pieces with ``numpy.random.default_rng([seed, e])``. A global
  *slot* is ``dp_rank * num_workers + worker_id`` out of ``S = dp_world_size * num_workers``.
  If ``len(pieces) % S == 0`` and the pieces have (nearly, 5 %) equal sizes, each slot reads the
  pieces ``perm[slot::S]`` (shard-level: each file is read by one slot; unequal pieces would let
  the slots' epochs drift apart); otherwise every slot reads all pieces in ``perm`` order and keeps
  the rows whose epoch-stream index ``j`` has ``j % S == slot`` (example-level; every slot reads
  the whole window, an ``S``-fold read amplification: give the source a multiple of ``S`` files).
  Either way each document of the window goes to exactly one slot per epoch. Within a slot,
  consecutive blocks of ``shuffle_buffer`` documents are permuted with
  ``default_rng([seed, e, slot, block])`` — a *block* shuffle, not a reservoir: the position
  ``k`` inside a slot's epoch stream is addressable (block ``k // B``, offset ``k % B``), which is
  what makes resume exact without saving a shuffle buffer.
* Position. Each slot (i.e. each DataLoader worker process, since a dataset object lives in its
  worker) keeps ``(epoch, consumed)``; ``__iter__`` resumes from it, so a second ``__iter__``
  (persistent workers, a new DataLoader epoch) *continues* the stream. The infinite stream
  moves to epoch ``e + 1`` when the slot's epoch stream ends — never back to an old position.
* Limit. A ``max_documents`` window is read **once**: with ``infinite=False`` the stream ends
  (the last partial row is padded, labels -100); with ``infinite=True`` reaching the end of the
  window raises :class:`DocumentLimitReached` instead of replaying it (the ``take()`` bug) —
  unless ``repeat_window=True`` explicitly asks for counted, reshuffled epochs over the window
  (a train split ``[0, N)`` beside an eval window at ``skip_first=N``).
* Packing. Documents are encoded in batches (``tokenizers`` Rust ``encode_batch_fast``), joined
  with an EOS boundary and cut into non-overlapping ``seq_len + 1`` windows by
  :class:`~torchtitan_ext.text.packing.ConcatSplitPacker` (``input = row[:-1]``,
  ``labels = row[1:]``, ``positions`` restarting at each document start and at each row start).
* State. ``state_dict()`` = epoch, consumed, the packer's token buffer, the per-token document
  bookkeeping and the skip log: ints and lists of ints only (JSON-serialisable, no pickle).
  Resume = rebuild the slot's epoch stream, re-read (not re-tokenize) the ``consumed // B * B``
  rows before the current block, permute that block, continue. Batches after a resume are
  bitwise identical to an uninterrupted run, after any number of chained restarts.

What ``datasets`` 4.7.0 itself does (checked while writing this; see tests/test_streaming.py for
the tests that pin *our* behaviour on each): ``split_dataset_by_node(ds, r, 3).skip(10)`` and
``split_dataset_by_node(ds.skip(10), r, 3)`` both skip 10 documents of the *global* stream and
keep the ranks disjoint (other releases were reported to hand every rank everything); a chained
unshuffled resume via its ``state_dict`` is correct; a shuffled stream's ``state_dict`` does
**not** restore the shuffle buffer ("The shuffle buffer will be refilled"), so its batches after
a resume differ from the uninterrupted run — the reason we own the shuffle.
Where the code is: this module holds the dataset (arguments, position and state, tokenizing and
packing); :mod:`~torchtitan_ext.text.stream_window` the window / slot / block-shuffle arithmetic
as pure functions; :mod:`~torchtitan_ext.text.stream_source` locating and reading the files.

Cost: measured by ``python -m benchmarks streaming`` (tokens per CPU-second against torchtitan
0.3.0's ``HuggingFaceTextDataLoader`` over the same files and tokenizer, shuffle off, the first
batch after a resume); the figures are in ``benchmarks/RESULTS.md`` (section *streaming*). Most
of our time is the tokenizer's ``encode_batch_fast`` (batches of ``encode_batch`` documents), the
rest packing and bookkeeping (about 90 % / 10 %, profiled on the 2-core development box with the
benchmark's 40 MB corpus). A resume re-reads rows without tokenizing them, so it costs at most
one slot-epoch of reading; on a hub-scale stream the re-read is bounded by the position inside
the current shard-epoch of the slot, read over the network: give such sources many shards.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_ext.text.columns import EMPTY, Rejected, as_text
from torchtitan_ext.text.errors import (
    BadInputError,
    NoUsableDocuments,
    SkipLog,
    check_on_bad_input,
)
from torchtitan_ext.text.packing import ConcatSplitPacker
from torchtitan_ext.text.stream_rows import (
    Sample,
    make_sample,
    packer_from_json,
    packer_to_json,
    take_doc_ids,
)
from torchtitan_ext.text.stream_source import MISSING, StreamSource, resolve_local_files
from torchtitan_ext.text.stream_window import Piece, global_slot, worker_quota
from torchtitan_ext.text.tokenize import TextTokenizer

__all__ = [
    "STATE_VERSION",
    "DocumentLimitReached",
    "Piece",
    "StreamingTextDataset",
    "resolve_local_files",
]

logger = logging.getLogger(__name__)

STATE_VERSION = 1


class DocumentLimitReached(RuntimeError):
    """An infinite stream reached the end of its ``max_documents`` window. Replaying the window
    would be the ``take(N)`` repetition bug, so the stream stops loudly instead."""


class StreamingTextDataset(IterableDataset):
    """Infinite, sharded, exactly resumable token stream over HF ``datasets`` streaming.

    Yields ``({"input": LongTensor[seq_len], "positions": LongTensor[seq_len]}, labels)`` (plus
    ``"doc_ids"`` / ``"doc_epochs"`` / ``"doc_offsets"`` per input token when ``emit_doc_ids``:
    global document index, epoch it was read in, token offset inside it; debugging only —
    torchtitan would pass them to the model as kwargs).

    Args:
        source: local file, directory, glob (or a list of them) of Parquet / JSONL / text files,
            or a Hugging Face hub dataset id (then ``name``/``split`` apply).
        tokenizer: a :class:`TextTokenizer`, a tokenizer directory/file, or torchtitan's
            ``HuggingFaceTokenizer``; it must have an EOS token (the document boundary).
        seq_len: model sequence length; rows are ``seq_len + 1`` tokens before the shift.
        seed: shuffle seed; epoch ``e`` uses ``[seed, e]``. Give eval its own seed.
        shuffle: permute shard order per epoch and documents within blocks of ``shuffle_buffer``.
        shuffle_buffer: block size (documents) of the within-slot shuffle.
        skip_first: first global document index of the window (eval offset).
        max_documents: window length; ``None`` = to the end of the source. See module docstring.
        infinite: loop over epochs forever (``True``) or read the window once (``False``).
        repeat_window: with ``max_documents`` and ``infinite``: loop over the window in reshuffled,
            counted epochs (a train split ``[0, N)`` of one stream) instead of raising
            :class:`DocumentLimitReached` at its end. Explicit opt-in, so that a limit alone never
            repeats anything.
        dp_rank / dp_world_size: data-parallel coordinates of this process.
        text_column: the column holding the document text.
        name / split: hub dataset config and split; for a local directory with split-named files
            (``train-*.parquet``) the split also selects the files.
        on_bad_input: ``"error"`` raises :class:`BadInputError` naming file and row; ``"skip"``
            counts the record in :attr:`skips` with its reason. Empty documents are always
            skipped and counted (reason ``"empty"``).
        add_bos: prefix each document with BOS (torchtitan's loader does; default off: the EOS
            boundary already separates documents).
        encode_batch: documents tokenized per ``encode_batch_fast`` call.
        batches_per_iter / batch_size: if set, each ``__iter__`` yields exactly the samples of
            ``batches_per_iter`` batches of a DataLoader (split across its workers) and returns:
            a fixed-size evaluation or DataLoader "epoch". The next ``__iter__`` continues.
        text_sample_by: for ``.txt`` sources: "line" | "paragraph" | "document" (HF text builder).
        load_kwargs: extra ``load_dataset`` kwargs.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        tokenizer: Any,
        seq_len: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        skip_first: int = 0,
        max_documents: int | None = None,
        infinite: bool = True,
        repeat_window: bool = False,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        text_column: str = "text",
        name: str | None = None,
        split: str = "train",
        on_bad_input: str = "error",
        add_bos: bool = False,
        encode_batch: int = 32,
        batches_per_iter: int | None = None,
        batch_size: int = 1,
        emit_doc_ids: bool = False,
        text_sample_by: str = "paragraph",
        load_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        _check_args(
            seq_len=seq_len,
            seed=seed,
            skip_first=skip_first,
            max_documents=max_documents,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batches_per_iter=batches_per_iter,
            batch_size=batch_size,
        )
        self.source = source
        self.tokenizer = TextTokenizer.coerce(tokenizer)
        if self.tokenizer.eos_id is None:
            raise ValueError(f"{self.tokenizer.source}: no EOS token; it is the document boundary")
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_buffer = max(1, int(shuffle_buffer)) if shuffle else 1
        self.skip_first = skip_first
        self.max_documents = max_documents
        self.infinite = infinite
        self.repeat_window = repeat_window
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.text_column = text_column
        self.name = name
        self.split = split
        self.on_bad_input = check_on_bad_input(on_bad_input)
        self.add_bos = add_bos
        self.encode_batch = max(1, encode_batch)
        self.batches_per_iter = batches_per_iter
        self.batch_size = batch_size
        self.emit_doc_ids = emit_doc_ids
        self.text_sample_by = text_sample_by
        self.load_kwargs = dict(load_kwargs or {})

        self._open_source()
        self._reset_position()

    # ------------------------------------------------------------------ source
    def _open_source(self) -> None:
        """Locate the files, read what their metadata gives for free (Parquet footers), open the
        Hugging Face stream and clip its shards to the window. Errors name the files."""
        self._source = StreamSource(
            self.source,
            split=self.split,
            name=self.name,
            text_column=self.text_column,
            text_sample_by=self.text_sample_by,
            load_kwargs=self.load_kwargs,
            skip_first=self.skip_first,
            max_documents=self.max_documents,
        )
        self.n_shards = self._source.n_shards
        self._files = self._source.files

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_doc_iter"] = None  # a live generator; rebuilt from (epoch, consumed)
        return d

    def shard_name(self, shard: int) -> str:
        """The file behind a shard (packaged builders read one file per shard)."""
        return self._source.shard_name(shard)

    def num_documents(self) -> int:
        """Documents in the window (rows, including ones that will be skipped as bad). Counts
        every shard of the window that has no metadata."""
        return self._source.num_documents()

    def _doc_id(self, shard: int, row: int) -> int:
        return self._source.doc_id(shard, row)

    def _epoch_stream(
        self, epoch: int, start: int, slot: int, nslots: int
    ) -> Iterator[tuple[int, int, Any]]:
        """The slot's shuffled epoch stream ``(shard, row, text value)`` from item ``start`` on
        (block shuffle; see the module docstring)."""
        return self._source.epoch_stream(
            epoch,
            start,
            slot,
            nslots,
            seed=self.seed,
            shuffle=self.shuffle,
            block_size=self.shuffle_buffer,
            on_bad_input=self.on_bad_input,
            skips=self.skips,
        )

    # ------------------------------------------------------------------ position / state
    def _reset_position(self) -> None:
        self.epoch = 0
        self.consumed = 0  # items of the slot's epoch stream already taken (used or skipped)
        self.ended = False
        self.docs_used = 0
        self.skips = SkipLog()
        self._packer = ConcatSplitPacker(
            self.seq_len, boundary_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id or 0
        )
        # Per buffered segment: [doc_id, epoch, tokens left, segment length] (doc_ids etc.).
        self._track: deque[list[int]] = deque()
        self._doc_iter = None
        self._gen = 0
        self._slot_loaded: tuple[int, int] | None = None

    @staticmethod
    def _slot() -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def _global_slot(self) -> tuple[int, int]:
        return global_slot(self.dp_rank, self.dp_world_size, *self._slot())

    def state_dict(self) -> dict[str, Any]:
        """Pickle-free state of this slot (ints and lists of ints/str)."""
        slot, nslots = self._global_slot()
        return {
            "version": STATE_VERSION,
            "slot": slot,
            "num_slots": nslots,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "ended": int(self.ended),
            "docs_used": self.docs_used,
            "packer": packer_to_json(self._packer),
            "track": [list(map(int, t)) for t in self._track],
            "skips": self.skips.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("version", -1)) != STATE_VERSION:
            raise ValueError(f"StreamingTextDataset state version {state.get('version')} unknown")
        slot, nslots = self._global_slot()
        if (int(state["slot"]), int(state["num_slots"])) != (slot, nslots):
            raise ValueError(
                f"state is for slot {state['slot']}/{state['num_slots']} but this is slot "
                f"{slot}/{nslots}: resume needs the same dp_world_size and num_workers"
            )
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        self.ended = bool(state["ended"])
        self.docs_used = int(state["docs_used"])
        packer_from_json(self._packer, state["packer"])
        self._track = deque([int(v) for v in t] for t in state["track"])
        self.skips.load_state_dict(state["skips"])
        self._doc_iter = None  # rebuilt from (epoch, consumed) on the next read
        self._gen += 1  # any generator alive from before the load stops

    def stats(self) -> dict[str, Any]:
        ps = self._packer.stats()
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "docs_used": self.docs_used,
            "rows": int(ps["rows"]),
            "buffered_tokens": int(ps["buffered_tokens"]),
            "skipped": self.skips.total,
            "skips": self.skips.as_dict(),
        }

    # ------------------------------------------------------------------ iteration
    def _text_of(self, text: Any, shard: int, row: int) -> str | None:
        """The document text, or None after counting a skip (raises in error mode). Values are
        judged by :func:`~torchtitan_ext.text.columns.as_text`, as in the Parquet loader (UTF-8
        bytes are text); empty documents are always skipped and counted."""
        where_file = self.shard_name(shard)
        if text is MISSING:
            got = Rejected("missing_key", f"no column {self.text_column!r}")
        else:
            got = as_text(text)
            if type(got) is str:
                return got
            if got is EMPTY:
                self.skips.skip("empty", f"{where_file} row={row}")  # harmless: always skipped
                return None
        err = BadInputError(got.message, file=where_file, row=row, key=self.text_column)
        if self.on_bad_input == "error":
            raise err
        self.skips.skip(got.reason, err.location)
        return None

    def _next_docs(self, slot: int, nslots: int) -> bool:
        """Read up to ``encode_batch`` documents into the packer. False at the end of a finite
        stream. Moves to the next epoch (infinite) when the slot's epoch stream ends."""
        texts: list[str] = []
        ids: list[int] = []
        epoch_ends = 0  # epoch ends reached in this call with nothing accepted
        while len(texts) < self.encode_batch:
            if self._doc_iter is None:
                self._doc_iter = self._epoch_stream(self.epoch, self.consumed, slot, nslots)
            try:
                shard, row, ex = next(self._doc_iter)
            except StopIteration:
                if texts:
                    break  # pack what we have first; the epoch ends on the next call
                if not self._next_epoch(slot, nslots, epoch_ends):
                    return False
                epoch_ends += 1
                continue
            self.consumed += 1
            text = self._text_of(ex, shard, row)
            if text is not None:
                texts.append(text)
                ids.append(self._doc_id(shard, row))
        if texts:
            self._pack(texts, ids)
        return True

    def _next_epoch(self, slot: int, nslots: int, epoch_ends: int) -> bool:
        """The slot's epoch stream ended: False for a finite stream, else move to the next
        epoch. Raises at the end of a ``max_documents`` window that may not repeat, and when a
        whole epoch had no usable document (``epoch_ends`` already reached in the same call)."""
        if self.max_documents is not None and self.infinite and not self.repeat_window:
            raise DocumentLimitReached(
                f"{self.source}: rank {self.dp_rank} slot {slot}/{nslots} reached the end "
                f"of the max_documents={self.max_documents} window (skip_first="
                f"{self.skip_first}) in epoch {self.epoch}. A document limit is read once "
                "and never replayed; raise max_documents, lower the number of eval "
                "batches, or drop the limit for an endless stream."
            ) from None
        if not self.infinite:
            return False
        # Reaching an epoch end twice in one call with nothing accepted means a whole epoch of
        # this slot had no usable document: stop instead of spinning forever.
        if epoch_ends >= 1:
            files = self._files or [str(self.source)]
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise NoUsableDocuments(
                f"slot {slot} of {nslots} (dp_rank {self.dp_rank}) got no usable "
                f"documents in epoch {self.epoch} of {shown}: fewer documents than dp "
                f"ranks x workers, or every record was skipped (skipped so far: "
                f"{self.skips.as_dict() or 'none'})"
            ) from None
        self.epoch += 1
        self.consumed = 0
        self._doc_iter = None
        logger.info("%s: slot %d/%d starts epoch %d", self.source, slot, nslots, self.epoch)
        return True

    def _pack(self, texts: list[str], ids: list[int]) -> None:
        """Tokenize a batch of documents into the packer and its per-token bookkeeping."""
        encoded = self.tokenizer.encode_arrays(texts, add_bos=self.add_bos, add_eos=False)
        for doc, did in zip(encoded, ids, strict=True):
            self._packer.add(doc)
            n = len(doc) + 1  # +1: the EOS boundary
            self._track.append([did, self.epoch, n, n])
        self.docs_used += len(texts)

    def _row_doc_ids(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return take_doc_ids(self._track, n)

    def _sample(self, final: bool) -> Sample:
        row = self._packer.pop_row(final=final)
        ids = self._row_doc_ids(row.valid)  # consumed even when not emitted
        return make_sample(row, ids if self.emit_doc_ids else None, self.seq_len)

    def _quota(self) -> int | None:
        """Samples this worker yields per ``__iter__`` (None: unbounded)."""
        if self.batches_per_iter is None:
            return None
        return worker_quota(self.batches_per_iter, self.batch_size, *self._slot())

    def __iter__(self) -> Iterator[Sample]:
        slot, nslots = self._global_slot()
        # The document iterator (if any) stays: its position always equals ``consumed``, so a
        # second __iter__ continues without re-reading. Only load_state_dict drops it.
        self._gen += 1
        gen = self._gen
        quota = self._quota()
        produced = 0
        while quota is None or produced < quota:
            if gen != self._gen:
                return  # a newer __iter__ or a load_state_dict took over this dataset's position
            if self.ended:
                return
            while not self._packer.ready():
                if not self._next_docs(slot, nslots):
                    self.ended = True
                    break
            if self.ended:
                if self._packer.has_pending():
                    produced += 1
                    yield self._sample(final=True)
                return
            produced += 1
            yield self._sample(final=False)


def _check_args(
    *,
    seq_len: int,
    seed: int,
    skip_first: int,
    max_documents: int | None,
    dp_rank: int,
    dp_world_size: int,
    batches_per_iter: int | None,
    batch_size: int,
) -> None:
    """One-line errors for impossible arguments, before the tokenizer or any file is opened."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if skip_first < 0:
        raise ValueError(f"skip_first must be >= 0, got {skip_first}")
    if max_documents is not None and max_documents < 1:
        raise ValueError(f"max_documents must be >= 1 or None, got {max_documents}")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} not in [0, dp_world_size={dp_world_size})")
    if batches_per_iter is not None and (batches_per_iter < 1 or batch_size < 1):
        raise ValueError("batches_per_iter and batch_size must be >= 1")
