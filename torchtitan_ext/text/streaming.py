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
* Position. Each slot keeps ``(epoch, consumed)``; a second ``__iter__`` (persistent workers,
  a new DataLoader epoch, the next evaluation) *continues* the stream. The infinite stream
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
* State. Epoch, consumed, the packer's token buffer, the per-token document bookkeeping and
  the skip log: ints and lists of ints only (JSON-serialisable, no pickle). Resume = rebuild
  the slot's epoch stream, re-read (not re-tokenize) the ``consumed // B * B`` rows before the
  current block, permute that block, continue. Batches after a resume are bitwise identical to
  an uninterrupted run, after any number of chained restarts.
* Other degrees. A run resumed with another number of slots (DP ranks x workers) reads what is
  left of the interrupted epoch, dealt document by document to its slots, then continues with
  normal epochs: :mod:`~torchtitan_ext.text.stream_elastic`.

What ``datasets`` 4.7.0 itself does (checked while writing this; see tests/test_streaming.py for
the tests that pin *our* behaviour on each): ``split_dataset_by_node(ds, r, 3).skip(10)`` and
``split_dataset_by_node(ds.skip(10), r, 3)`` both skip 10 documents of the *global* stream and
keep the ranks disjoint (other releases were reported to hand every rank everything); a chained
unshuffled resume via its ``state_dict`` is correct; a shuffled stream's ``state_dict`` does
**not** restore the shuffle buffer ("The shuffle buffer will be refilled"), so its batches after
a resume differ from the uninterrupted run — the reason we own the shuffle.
Where the code is: :mod:`~torchtitan_ext.text.stream_stages` holds the two stages (documents
of a slot; tokenize + pack + batch) on the :mod:`torchtitan_ext.pipeline` contract;
:mod:`~torchtitan_ext.text.stream_window` the window / slot / block-shuffle arithmetic as pure
functions; :mod:`~torchtitan_ext.text.stream_source` locating and reading the files;
:mod:`~torchtitan_ext.text.stream_elastic` the resume at another degree; this module the
torch ``IterableDataset`` over the stages (one chain per DataLoader worker) for use without
torchtitan; :mod:`torchtitan_ext.loaders.streaming` the torchtitan loader.

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

from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_ext.pipeline.stage import State
from torchtitan_ext.text.stream_pack import PackBatches, PackOptions
from torchtitan_ext.text.stream_rows import Sample, as_json
from torchtitan_ext.text.stream_source import resolve_local_files
from torchtitan_ext.text.stream_stages import (
    STATE_VERSION,
    DocumentLimitReached,
    StreamDocs,
    StreamOptions,
    open_source,
)
from torchtitan_ext.text.stream_window import Piece, global_slot, worker_quota
from torchtitan_ext.text.tokenize import TextTokenizer

__all__ = [
    "STATE_VERSION",
    "DocumentLimitReached",
    "Piece",
    "StreamingTextDataset",
    "resolve_local_files",
]


def split_options(options: dict[str, Any]) -> tuple[StreamOptions, PackOptions]:
    """Keyword options -> the two stages' options dataclasses (an unknown name is a TypeError
    naming it)."""
    s_names = {f.name for f in fields(StreamOptions)}
    p_names = {f.name for f in fields(PackOptions)}
    unknown = sorted(set(options) - s_names - p_names)
    if unknown:
        raise TypeError(f"StreamingTextDataset: unknown options {unknown}")
    return (
        StreamOptions(**{k: v for k, v in options.items() if k in s_names}),
        PackOptions(**{k: v for k, v in options.items() if k in p_names}),
    )


class StreamingTextDataset(IterableDataset):
    """The stream as a torch ``IterableDataset`` (no torchtitan): in each DataLoader worker (or
    in the process, without workers) one chain :class:`StreamDocs` -> :class:`PackBatches`
    for slot ``dp_rank * num_workers + worker``; yields samples
    ``({"input", "positions"[, doc ids]}, labels)``.

    Args:
        source: local file, directory, glob (or a list of them) of Parquet / JSONL / text files,
            or a Hugging Face hub dataset id.
        tokenizer: a :class:`TextTokenizer`, a tokenizer directory/file, or torchtitan's
            ``HuggingFaceTokenizer``; it must have an EOS token (the document boundary).
        seq_len: model sequence length; rows are ``seq_len + 1`` tokens before the shift.
        dp_rank / dp_world_size: data-parallel coordinates of this process.
        batches_per_iter / batch_size: if set, each ``__iter__`` yields exactly the samples of
            ``batches_per_iter`` batches of a DataLoader (split across its workers) and returns.
        load_kwargs: extra ``load_dataset`` kwargs.
        **options: fields of :class:`StreamOptions` and :class:`PackOptions` (documented there).
    """

    def __init__(
        self,
        source: str | Sequence[str],
        tokenizer: Any,
        seq_len: int,
        *,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        batches_per_iter: int | None = None,
        batch_size: int = 1,
        load_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self.stream_options, self.pack_options = split_options(options)
        o = self.stream_options
        check_args(
            seq_len=seq_len,
            seed=o.seed,
            skip_first=o.skip_first,
            max_documents=o.max_documents,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
        if batches_per_iter is not None and (batches_per_iter < 1 or batch_size < 1):
            raise ValueError("batches_per_iter and batch_size must be >= 1")
        self.source = source
        self.tokenizer = TextTokenizer.coerce(tokenizer)
        if self.tokenizer.eos_id is None:
            raise ValueError(f"{self.tokenizer.source}: no EOS token; it is the document boundary")
        self.seq_len = seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batches_per_iter, self.batch_size = batches_per_iter, batch_size
        self._source = open_source(source, o, load_kwargs)
        self.n_shards = self._source.n_shards
        self._chain: PackBatches | None = None
        self._gen = 0

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_chain"] = None  # a live reader; a worker builds its own for its slot
        return d

    # ------------------------------------------------------------------ source facts
    def shard_name(self, shard: int) -> str:
        """The file behind a shard (packaged builders read one file per shard)."""
        return self._source.shard_name(shard)

    def num_documents(self) -> int:
        """Documents in the window (rows, including ones that will be skipped as bad)."""
        return self._source.num_documents()

    def _doc_id(self, shard: int, row: int) -> int:
        return self._source.doc_id(shard, row)

    def _epoch_stream(
        self, epoch: int, start: int, slot: int, nslots: int
    ) -> Iterator[tuple[int, int, Any]]:
        """The slot's shuffled epoch stream ``(shard, row, text value)`` from item ``start``."""
        docs = StreamDocs(self._source, self.stream_options, slot, nslots)
        docs.epoch, docs.consumed = epoch, start
        return docs._stream()

    # ------------------------------------------------------------------ chain / state
    @staticmethod
    def _slot() -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def chain(self) -> PackBatches:
        """This worker's chain (built on first use for its slot)."""
        slot, nslots = global_slot(self.dp_rank, self.dp_world_size, *self._slot())
        c = self._chain
        if c is None or (c.upstream.slot, c.upstream.nslots) != (slot, nslots):
            docs = StreamDocs(self._source, self.stream_options, slot, nslots)
            c = self._chain = PackBatches(docs, self.tokenizer, self.seq_len, self.pack_options)
        return c

    def state_dict(self) -> State:
        """This slot's state (ints, strs and lists; JSON-serialisable)."""
        return as_json(self.chain().state())

    def load_state_dict(self, state: State) -> None:
        self.chain().reset(state)
        self._gen += 1  # any generator alive from before the load stops

    def stats(self) -> dict[str, Any]:
        """Epoch, consumed, documents used, buffered tokens and skips of this slot."""
        c = self.chain()
        return c.stats(c.state())

    def __iter__(self) -> Iterator[Sample]:
        chain = self.chain()
        self._gen += 1
        gen = self._gen
        quota = None
        if self.batches_per_iter is not None:
            quota = worker_quota(self.batches_per_iter, self.batch_size, *self._slot())
        produced = 0
        while quota is None or produced < quota:
            if gen != self._gen:
                return  # a newer __iter__ or a load_state_dict took over this position
            try:
                sample = chain.next()
            except StopIteration:
                return
            produced += 1
            yield sample


def check_args(
    *,
    seq_len: int,
    seed: int,
    skip_first: int,
    max_documents: int | None,
    dp_rank: int,
    dp_world_size: int,
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
