"""The streaming text loader's second stage: tokenize, pack and batch a slot's documents.

:class:`PackBatches` reads :class:`~torchtitan_ext.text.stream_stages.StreamDocs` (the source;
its module docstring has both stages' table, states and invariant), tokenizes ``encode_batch``
documents per Rust call, packs them concat-split with an EOS boundary and emits rows, or
batches of ``batch_size`` rows. :class:`PackOptions` are its options (the loader Config inherits
them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.text.packing import ConcatSplitPacker
from torchtitan_ext.text.stream_rows import (
    make_sample,
    packer_from_state,
    packer_state,
    take_doc_ids,
)
from torchtitan_ext.text.stream_stages import EPOCH_END, StreamDocs, slot_stats
from torchtitan_ext.text.tokenize import TextTokenizer


@dataclass(kw_only=True)
class PackOptions:
    """Options of :class:`PackBatches` (the loader Config inherits them)."""

    add_bos: bool = False
    """Prefix each document with BOS (documents are always followed by the EOS boundary)."""

    encode_batch: int = 32
    """Documents per batched tokenizer call."""

    emit_doc_ids: bool = False
    """Debug: add per-token ``doc_ids``/``doc_epochs``/``doc_offsets`` to each batch (for
    scripts/verify_data_diversity.py). Never for training: torchtitan passes extra keys to
    the model."""


class PackBatches(Stage[Any]):
    """Tokenize + concat-split pack + batch over :class:`StreamDocs` (see the module doc).

    Yields ``({"input", "positions"[, "doc_ids", "doc_epochs", "doc_offsets"]}, labels)``:
    ``[batch_size, seq_len]`` tensors, or one sample (``[seq_len]``) with ``batch_size=None``.
    At the end of a finite stream the last row is padded (labels -100) and the last batch may
    be short."""

    def __init__(
        self,
        upstream: StreamDocs,
        tokenizer: TextTokenizer,
        seq_len: int,
        options: PackOptions,
        batch_size: int | None = None,
    ) -> None:
        if tokenizer.eos_id is None:
            raise ValueError(f"{tokenizer.source}: no EOS token; it is the document boundary")
        self.upstream, self.tok, self.seq_len, self.o = upstream, tokenizer, seq_len, options
        self.batch_size = batch_size
        self.encode_batch = max(1, int(options.encode_batch))
        self._reset_packer()

    def _reset_packer(self) -> None:
        tok = self.tok
        self.packer = ConcatSplitPacker(
            self.seq_len, boundary_id=tok.eos_id, pad_id=tok.pad_id or 0
        )
        self.track: deque[list[int]] = deque()
        self.ended = False
        self.row_tail = -1  # last token of the last row emitted (-1: none yet)
        self.tokens_read = 0

    def state(self) -> State:
        return {
            **self.upstream.state(),
            "ended": int(self.ended),
            "packer": packer_state(self.packer),
            "track": [list(t) for t in self.track],
            "row_tail": self.row_tail,
            "tokens_read": self.tokens_read,
        }

    def reset(self, state: State | None = None) -> None:
        self.upstream.reset(state)
        self._reset_packer()
        if state is not None:
            packer_from_state(self.packer, state["packer"])
            self.track = deque([int(v) for v in t] for t in state["track"])
            self.ended = bool(int(state["ended"]))
            self.row_tail = int(state.get("row_tail", -1))
            self.tokens_read = int(state.get("tokens_read", 0))

    def stats(self, state: State) -> dict[str, Any]:
        return slot_stats(state)

    def next(self) -> Any:
        rows = []
        want = self.batch_size or 1
        while len(rows) < want and not self.ended:
            while not self.packer.ready():
                if not self._fill():
                    self.ended = True
                    break
            if self.ended:
                if self.packer.has_pending():
                    rows.append(self._sample(final=True))
                break
            rows.append(self._sample(final=False))
        if not rows:
            raise StopIteration
        if self.batch_size is None:
            return rows[0]
        x = {k: torch.stack([r[0][k] for r in rows]) for k in rows[0][0]}
        return x, torch.stack([r[1] for r in rows])

    def _fill(self) -> bool:
        """Read up to ``encode_batch`` documents (fewer at an epoch end) into the packer; False
        at the end of a finite stream."""
        texts: list[str] = []
        meta: list[tuple[int, int]] = []
        while len(texts) < self.encode_batch:
            try:
                item = self.upstream.next()
            except StopIteration:
                if texts:
                    break
                return False
            if item is EPOCH_END:
                if texts:
                    break
                continue
            did, epoch, text = item
            texts.append(text)
            meta.append((did, epoch))
        encoded = self.tok.encode_arrays(texts, add_bos=self.o.add_bos, add_eos=False)
        for doc, (did, epoch) in zip(encoded, meta, strict=True):
            self.packer.add(doc)
            n = len(doc) + 1  # +1: the EOS boundary
            self.track.append([did, epoch, n, n])
            self.tokens_read += n
        return True

    def _sample(self, final: bool) -> Any:
        row = self.packer.pop_row(final=final)
        if row.valid:
            self.row_tail = int(row.tokens[row.valid - 1])
        ids = take_doc_ids(self.track, row.valid)  # consumed even when not emitted
        return make_sample(row, ids if self.o.emit_doc_ids else None, self.seq_len)
