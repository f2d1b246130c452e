"""The streaming text loader as two stages (:mod:`torchtitan_ext.pipeline.stage` contract); this
module holds the source, :mod:`~torchtitan_ext.text.stream_pack` the second:

==================  ===========================================================================
:class:`StreamDocs`  source: the documents of one slot's epoch stream, ``(doc_id, epoch, text)``
                    — the window / pieces / slot / block-shuffle arithmetic of
                    :mod:`~torchtitan_ext.text.stream_window`, or, after a resume at another
                    number of slots, this slot's share of what is left of an epoch
                    (:mod:`~torchtitan_ext.text.stream_elastic`). Bad records are counted or
                    raised here. State: ``epoch``, ``consumed`` (items of the slot's stream
                    taken, used or skipped), ``docs_used``, ``skips``, ``shard_level``,
                    ``history`` (the remainders being read; empty in a run that never changed
                    its degree).
:class:`~.stream_pack.PackBatches` tokenize (``encode_batch`` documents per Rust call), pack (concat-split
                    with an EOS boundary) and batch ``batch_size`` rows (``None``: single
                    samples). State: the source's, plus ``packer`` (pending tokens),
                    ``track`` (their ``[doc, epoch, left, length]``), ``ended`` and
                    ``row_tail`` (the last token of the last row emitted, -1 before any: a
                    re-deal at another degree puts it back in front of a document of which
                    only that label-only token was emitted, see stream_elastic).
==================  ===========================================================================

Invariant: a state is ints, strs, lists/dicts of them and the packer's two arrays
(:func:`~torchtitan_ext.text.stream_rows.as_json` makes it JSON), taken right after an item; :meth:`Stage.reset` to it makes the following items bitwise
the ones that followed it. The source signals the end of an epoch stream with one
:data:`EPOCH_END` item before it rolls over, so that the packer packs what it holds first (the
rows are the same whatever ``encode_batch`` is).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.text.columns import EMPTY, Rejected, as_text
from torchtitan_ext.text.errors import BadInputError, NoUsableDocuments, SkipLog
from torchtitan_ext.text.stream_elastic import epoch_pieces, piece_ids, remainder_ids, share
from torchtitan_ext.text.stream_source import MISSING, StreamSource
from torchtitan_ext.text.stream_window import Piece, piece_size

logger = logging.getLogger(__name__)

STATE_VERSION = 2
EPOCH_END = ("epoch_end",)
"""Item of :class:`StreamDocs` at the end of an epoch stream (then it rolls over)."""


class DocumentLimitReached(RuntimeError):
    """An infinite stream reached the end of its ``max_documents`` window. Replaying the window
    would be the ``take(N)`` repetition bug, so the stream stops loudly instead."""


@dataclass(kw_only=True)
class StreamOptions:
    """Options of :class:`StreamDocs` (the loader Config inherits them; TOML ``[dataloader]``)."""

    seed: int = 0
    """Shuffle seed; epoch e reshuffles with (seed, e). Give eval its own seed."""

    shuffle: bool = True
    """Permute shards per epoch and documents within blocks of ``shuffle_buffer``."""

    shuffle_buffer: int = 1000
    """Documents per within-slot shuffle block."""

    skip_first: int = 0
    """Global index (raw source order) of the first document: the eval offset."""

    max_documents: int | None = None
    """Window length in documents. Read once, never replayed: with ``infinite`` the stream
    raises DocumentLimitReached at its end; without, it ends."""

    infinite: bool = True
    """Loop over epochs forever (training) or read the data once. torchtitan's validator sets
    this to ``steps != -1``."""

    repeat_window: bool = False
    """With ``max_documents``: loop over the window in counted, reshuffled epochs (a train
    split [0, N) beside an eval window at skip_first=N) instead of raising at its end."""

    dataset_name: str | None = None
    """Hub dataset config name (``load_dataset(path, name)``); ignored for local files."""

    split: str = "train"
    """Hub split; for a local directory with split-named files it selects the files."""

    text_column: str = "text"
    """Column holding the document text."""

    format: str | None = None
    """Read local files as this format whatever their suffix: ``"parquet"``, ``"json"`` /
    ``"jsonl"``, ``"text"`` / ``"txt"``; None: by suffix (.parquet, .jsonl/.json, .txt)."""

    on_bad_input: Literal["error", "skip"] = "error"
    """``"error"``: raise naming file and row; ``"skip"``: count the record with its reason."""

    text_sample_by: Literal["line", "paragraph", "document"] = "paragraph"
    """For .txt sources: one document per "line", "paragraph" or "document" (file)."""


def open_source(source: Any, o: StreamOptions, load_kwargs: dict | None = None) -> StreamSource:
    """Locate and open ``source`` clipped to the options' window (errors name the files)."""
    return StreamSource(
        source,
        split=o.split,
        name=o.dataset_name,
        text_column=o.text_column,
        text_sample_by=o.text_sample_by,
        load_kwargs=dict(load_kwargs or {}),
        skip_first=o.skip_first,
        max_documents=o.max_documents,
        fmt=o.format,
    )


def slot_stats(state: State) -> dict[str, Any]:
    """Counters of one slot as of ``state`` (a :class:`StreamDocs` or :class:`PackBatches`
    state): a pure function, so a prefetching or multi-process stage reports exactly the
    position of the last batch handed over."""
    skips = {str(k): int(v) for k, v in state["skips"]["counts"].items()}
    out = {
        "epoch": int(state["epoch"]),
        "consumed": int(state["consumed"]),
        "docs_used": int(state["docs_used"]),
        "skipped": sum(skips.values()),
        "skips": skips,
    }
    if "packer" in state:
        out["buffered_tokens"] = sum(int(n) for n in state["packer"]["lengths"])
        # tokens of the documents read into the packer (EOS boundaries included); a state saved
        # before this counter existed starts it at 0
        out["tokens_read"] = int(state.get("tokens_read", 0))
    return out


class StreamDocs(Stage[Any]):
    """Documents ``(doc_id, epoch, text)`` of slot ``slot`` of ``nslots`` (see module doc)."""

    def __init__(
        self,
        source: StreamSource,
        options: StreamOptions,
        slot: int,
        nslots: int,
        *,
        max_epochs: int | None = None,
        label: str | None = None,
    ):
        """``max_epochs``: end the stream (StopIteration) after that many epochs, even when
        ``options.infinite`` (a mixture's per-source limit). ``label``: names the stream in
        its log lines and errors (a mixture's source name; None: the source path)."""
        if not 0 <= slot < nslots:
            raise ValueError(f"slot {slot} not in [0, {nslots})")
        self.src, self.o, self.slot, self.nslots = source, options, slot, nslots
        self.max_epochs, self.label = max_epochs, label
        self.block = max(1, int(options.shuffle_buffer)) if options.shuffle else 1
        self.reset(None)

    # ------------------------------------------------------------------ contract
    def state(self) -> State:
        return {
            "version": STATE_VERSION,
            "slot": self.slot,
            "num_slots": self.nslots,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "docs_used": self.docs_used,
            "skips": self.skips.state_dict(),
            "shard_level": self._level,
            "history": self.history,  # replaced, never mutated: shared safely
        }

    def reset(self, state: State | None = None) -> None:
        self.epoch, self.consumed, self.docs_used = 0, 0, 0
        self.skips = SkipLog()
        self.history: dict[str, Any] = {}
        self._it: Iterator[tuple[int, int, Any]] | None = None
        self._at_end = False
        self._dry = 0  # epoch ends since the last document returned
        self._level = int(self.src.shard_level(self.nslots))
        if state is None:
            return
        if int(state.get("version", -1)) != STATE_VERSION:
            raise ValueError(
                f"streaming state version {state.get('version')} is not {STATE_VERSION}"
            )
        if "slot" in state and (int(state["slot"]), int(state["num_slots"])) != (
            self.slot,
            self.nslots,
        ):
            raise ValueError(
                f"state is for slot {state['slot']}/{state['num_slots']} but this is slot "
                f"{self.slot}/{self.nslots}: resume needs the same dp_world_size and num_workers"
                " (or the loader's load_state_dict, which re-deals other degrees)"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.docs_used = int(state["docs_used"])
        self.skips.load_state_dict(state["skips"])
        self.history = dict(state.get("history", {}))

    def next(self) -> Any:
        while True:
            if self._it is None:
                self._it = self._stream()
            try:
                shard, row, ex = next(self._it)
            except StopIteration:
                if not self._at_end:
                    self._at_end = True
                    return EPOCH_END
                self._roll_over()
                continue
            self.consumed += 1
            text = self._text_of(ex, shard, row)
            if text is not None:
                self.docs_used += 1
                self._dry = 0
                return self.src.doc_id(shard, row), self.epoch, text

    def stats(self, state: State) -> dict[str, Any]:
        return slot_stats(state)

    # ------------------------------------------------------------------ reading
    def _stream(self) -> Iterator[tuple[int, int, Any]]:
        self._level = int(self.src.shard_level(self.nslots))
        if str(self.epoch) in self.history:
            return self._remainder_stream()
        return self.src.epoch_stream(
            self.epoch,
            self.consumed,
            self.slot,
            self.nslots,
            seed=self.o.seed,
            shuffle=self.o.shuffle,
            block_size=self.block,
            on_bad_input=self.o.on_bad_input,
            skips=self.skips,
        )

    def _remainder_stream(self) -> Iterator[tuple[int, int, Any]]:
        """This slot's share of what is left of the epoch, from its ``consumed``-th document:
        the pieces holding one of them are read in epoch order (see stream_elastic)."""
        o = self.o
        ordered = epoch_pieces(self.src.pieces, seed=o.seed, epoch=self.epoch, shuffle=o.shuffle)
        ids = piece_ids(ordered, [self._piece_rows(p) for p in ordered], self.src.doc_id)
        rest = remainder_ids(
            ids, self.history[str(self.epoch)], block=self.block, seed=o.seed, epoch=self.epoch
        )
        mine = share(rest, self.slot, self.nslots)[self.consumed :]
        wanted = set(mine.tolist())
        for p, pid in zip(ordered, ids, strict=True):
            if not wanted:
                return
            if not np.isin(pid, mine).any():
                continue
            for row, ex in self.src.rows(p, on_bad_input=o.on_bad_input, skips=self.skips):
                g = self.src.doc_id(p.shard, row)
                if g in wanted:
                    wanted.discard(g)
                    yield p.shard, row, ex

    def _piece_rows(self, p: Piece) -> int:
        """Rows of a piece; counts a shard without metadata (not cached in ``known``, whose
        contents decide shard-level reading and must not change under a running stream)."""
        n = piece_size(p, self.src.known)
        if n is None:
            full = Piece(p.shard, 0, None)
            n = sum(1 for _ in self.src.rows(full, on_bad_input="error", skips=None)) - p.lo
        return n

    def _roll_over(self) -> None:
        """The slot's epoch stream ended: StopIteration for a finite stream, else the next epoch.
        Raises at the end of a ``max_documents`` window that may not repeat, and when a whole
        epoch had no usable document."""
        o, where = self.o, f"slot {self.slot}/{self.nslots}"
        named = f"source {self.label!r} ({self.src.source})" if self.label else self.src.source
        prefix = f"source {self.label!r}: " if self.label else ""
        if self.max_epochs is not None and self.epoch + 1 >= self.max_epochs:
            raise StopIteration  # the source's max_epochs passes are done
        if o.max_documents is not None and o.infinite and not o.repeat_window:
            raise DocumentLimitReached(
                f"{named}: {where} reached the end of the max_documents="
                f"{o.max_documents} window (skip_first={o.skip_first}) in epoch {self.epoch}. "
                "A document limit is read once and never replayed; raise max_documents, lower "
                "the number of eval batches, or drop the limit for an endless stream."
            )
        if not o.infinite:
            raise StopIteration
        if self._dry >= 1:
            files = self.src.files or [str(self.src.source)]
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            raise NoUsableDocuments(
                f"{prefix}{where} got no usable documents in epoch {self.epoch} of {shown}: fewer "
                "documents than dp ranks x workers, or every record was skipped (skipped so "
                f"far: {self.skips.as_dict() or 'none'})"
            )
        if str(self.epoch) not in self.history:  # a remainder share may be empty: no alarm
            self._dry += 1
        self.epoch += 1
        self.consumed = 0
        self.history = {k: v for k, v in self.history.items() if int(k) >= self.epoch}
        self._it, self._at_end = None, False
        logger.info("%s: %s starts epoch %d", named, where, self.epoch)

    def _text_of(self, text: Any, shard: int, row: int) -> str | None:
        """The document text, or None after counting a skip (raises in error mode). Values are
        judged by :func:`~torchtitan_ext.text.columns.as_text`, as in the Parquet loader (UTF-8
        bytes are text); empty documents are always skipped and counted."""
        where_file = self.src.shard_name(shard)
        if text is MISSING:
            got = Rejected("missing_key", f"no column {self.o.text_column!r}")
        else:
            got = as_text(text)
            if type(got) is str:
                return got
            if got is EMPTY:
                self.skips.skip("empty", f"{where_file} row={row}")
                return None
        err = BadInputError(got.message, file=where_file, row=row, key=self.o.text_column)
        if self.o.on_bad_input == "error":
            raise err
        self.skips.skip(got.reason, err.location)
        return None
