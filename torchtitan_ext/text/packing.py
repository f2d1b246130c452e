"""Packing tokenized documents into fixed-length training rows, with explicit, resumable state.

Every packer emits rows of ``seq_len + 1`` tokens: the model input is ``row[:-1]`` and the labels
are ``row[1:]`` (see :func:`row_to_example`). Alongside the tokens each row carries ``positions``
that restart at 0 at every document start (and at the start of every row), which is what
torchtitan's block-causal masks (``positions`` in the batch) use to keep documents apart.

Modes
-----
``BestFitPacker(mode="crop")`` — BOS-aligned best-fit (the nanochat idea, made stable and
  finished like first-fit-decreasing): documents (each starting with BOS) wait in a buffer kept
  *sorted by length* (``bisect`` on a list of ``(length, seq)`` keys: an O(log n) search per
  document instead of nanochat's linear scan; the list insert/remove is a C memmove of n
  pointers, ~0.1 us at n=1000). Each step of a row with ``remaining`` free tokens takes:

  ====  ====================================  ================================================
  rule  when                                  take
  ====  ====================================  ================================================
  1     the row is empty and a document is    the longest one: it can never fit, and a fresh
        longer than a row                     row is the only place where its crop is least
                                              (``len - row``); without this rule over-long
                                              documents pile up and the crop rate climbs
  2     nothing fits                          the shortest, cropped to fill the row
  3     the largest document that fits        it (as first-fit-decreasing does: large first)
        leaves a gap another document fits,
        or no gap
  4     otherwise (the row's last step): one  that one; the document of the gap's length
        of the 16 next-largest fitting        follows, and the row is full with no crop
        documents leaves a gap equal to the
        length of another buffered document
  5     otherwise                             whichever crop loses less: the next-longer
                                              document now (its length - ``remaining``), or
                                              the largest that fits and then, by rule 2, the
                                              shortest (its length - the gap); a tie: the
                                              latter
  ====  ====================================  ================================================

  Among documents of equal length, one taken because it fits is the latest added; a cropped
  one (the shortest, the next-longer) is the earliest added.

  Every row starts with BOS and is 100 % full. Invariant: the only tokens lost are the part of
  an over-long document beyond its row (rule 1: the first-fit-decreasing bound's unavoidable
  crop) and each row's one finishing crop, which is never more than cropping the shortest after
  the largest that fits (the rule before rules 4-5) would lose from the same buffer. That
  finishing crop is what separates best-fit from the FFD bound (FFD leaves the gap as padding
  instead, which a 100 %-full row cannot). Rules 4-5 cut it from a mean of 90 tokens per row
  (rows not opened by an over-long document) to 14 on the benchmark corpus and from 121 to 16 on
  its min-length corpus (exact fills: 9 % -> 40 % of rows), for at most 16 O(1) lookups in a
  per-length count, on a row's last step only.
``BestFitPacker(mode="zero_discard")`` — the same, but a cropped tail re-enters the buffer as a
  new document with its own BOS (positions restart): no token is dropped; the price is one extra
  BOS per cut and documents split across rows.
``ConcatSplitPacker`` — plain concatenation (optionally with a boundary token such as EOS after
  each document) cut into consecutive windows of ``seq_len + 1``. Windows do **not** overlap by
  default, exactly like torchtitan's ``HuggingFaceTextDataset`` (it takes ``buffer[:seq_len+1]`` and
  drops those tokens); ``overlap=True`` keeps the last token of a window as the first of the next
  so that every token is a label once. Positions restart at each document start and at each
  window start (a document continued from the previous window restarts at 0: positions never
  exceed ``seq_len``, so RoPE caches sized to the sequence length stay valid).

Measured (``python -m benchmarks packing``, one run on a 2-core box shared with other jobs):
GPT-2 tokenizer, the long-tailed benchmark corpus (40 MB, median 404 tokens, 0.2 % of documents
past 8k tokens, 12.4 % of all tokens lying beyond the first row of their document), T=2048,
buffer 1000 documents, 8000 batches of 8 rows; crop/fill over batches 2667-8000 (steady state):

==============================  ========  ========  ==========================================
mode                            crop %    fill %    note
==============================  ========  ========  ==========================================
best-fit (crop)                 12.9      100       first 200 batches: 14.3; cropping the
                                                    shortest instead of rules 4-5: 15.4
best-fit (zero-discard)         0         100       +0.041 % extra BOS tokens
concat-split                    0         100       no document alignment
nanochat linear best-fit        28.0      100       first 200 batches: 1.8 (climbs: pile-up)
first-fit-decreasing bound      12.4      99.7      only the unavoidable over-long crop
==============================  ========  ========  ==========================================

On the benchmark's min-length corpus (lognormal lengths, none under 64 tokens, 13.8 % of tokens
beyond a row) best-fit crops 14.4 % against the FFD bound's 13.8 % (17.6 % cropping the
shortest).

Packing cost (best-fit, 1000-document buffer, ``int32`` documents, feeding included; ``python -m
benchmarks packing``, RESULTS.md): ~18-23 us per 2049-token row, of which ~7 us is copying each
document into the arena and re-laying it out (A/B on the benchmark corpus's tokenized documents:
12.4 -> 19.1 us); a pure-Python linear scan over the same buffer takes ~140 us.

State: ``state_dict()`` returns only ints and ``numpy`` arrays, never pickled objects: the
counters, and the buffered documents' lengths, insertion numbers and offsets into ``tokens``,
a part of the arena the packer keeps them in (:mod:`torchtitan_ext.text.doc_arena`: ``int32``
from our tokenizer, else ``int64``). It does no per-document work (~20 us for 1000 documents), so
it is also the snapshot a hot path takes (``snapshot`` is the same method). Rows after
``load_state_dict`` are bitwise identical to an uninterrupted run; it also reads states whose
documents lie back to back without offsets (those of earlier releases).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from torchtitan_ext.text.concat_split import ConcatSplitPacker
from torchtitan_ext.text.doc_arena import DocArena, layout
from torchtitan_ext.text.packed_rows import (
    PackedRow,
    RowCounters,
    as_doc,
    int_array,
    pct,
    row_to_example,
    whole,
)

__all__ = ["BestFitPacker", "ConcatSplitPacker", "PackedRow", "make_packer", "row_to_example"]

_MAXSEQ = 1 << 62  # larger than any insertion number: bisect sentinel
_FINISH_CANDIDATES = 16  # fitting documents tried for a row's last step (see the module docstring)

BestFitMode = Literal["crop", "zero_discard"]


class BestFitPacker:
    """BOS-aligned best-fit packing (``mode="crop"``) or its zero-discard variant.

    Usage (the consumer decides when to feed; ``ready()`` says when best-fit has enough choice)::

        packer = BestFitPacker(seq_len=2048, bos_id=tok.bos_id)
        for doc in docs:                       # each doc starts with BOS
            packer.add(doc)
            while packer.ready():
                tokens, positions = packer.pop_row()
    """

    def __init__(
        self,
        seq_len: int,
        bos_id: int,
        mode: BestFitMode = "crop",
        buffer_docs: int = 1000,
        pad_id: int | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if mode not in ("crop", "zero_discard"):
            raise ValueError(f"mode must be 'crop' or 'zero_discard', got {mode!r}")
        if buffer_docs < 1:
            raise ValueError(f"buffer_docs must be >= 1, got {buffer_docs}")
        self.seq_len = seq_len
        self.row_len = seq_len + 1
        self.bos_id = int(bos_id)
        self.mode: BestFitMode = mode
        self.buffer_docs = buffer_docs
        self.pad_id = int(pad_id if pad_id is not None else bos_id)
        # Sorted (length, seq, slot) keys; seq = insertion number makes keys unique and ties
        # deterministic (the most recently added of equal length is taken first); slot = where
        # the document lies in the arena.
        self._keys: list[tuple[int, int, int]] = []
        self._arena = DocArena(4 * self.row_len)
        self._next_seq = 0
        self._buffered_tokens = 0
        # Buffered documents per length below a row (derived from _keys, never checkpointed):
        # an O(1) "is there a document of exactly this length" for a row's last step.
        self._len_count = [0] * self.row_len
        self._arange = np.arange(self.row_len, dtype=np.int64)
        self.c = RowCounters()

    # ------------------------------------------------------------------ feeding
    def add(self, doc_ids: Sequence[int] | np.ndarray) -> None:
        """Buffer one tokenized document; it must start with BOS (rows are BOS-aligned)."""
        arr = as_doc(doc_ids)
        if arr.size == 0:
            raise ValueError("empty document (callers skip and count empty documents)")
        if arr[0] != self.bos_id:
            raise ValueError(
                f"document does not start with BOS id {self.bos_id} (got {int(arr[0])}); "
                "encode with add_bos=True"
            )
        self.c.docs_in += 1
        self.c.tokens_in += int(arr.size)
        self._insert(arr)

    def _insert(self, arr: np.ndarray) -> None:
        seq = self._next_seq
        self._next_seq += 1
        n = int(arr.size)
        insort(self._keys, (n, seq, self._arena.put(arr, seq)))
        self._buffered_tokens += n
        if n < self.row_len:
            self._len_count[n] += 1

    def ready(self) -> bool:
        """True when the buffer holds ``buffer_docs`` documents and at least a row of tokens."""
        return len(self._keys) >= self.buffer_docs and self._buffered_tokens >= self.row_len

    def has_pending(self) -> bool:
        """Anything buffered (a finite stream flushes with ``pop_row(final=True)`` while true)."""
        return bool(self._keys)

    # ------------------------------------------------------------------ packing
    def _finish(self, i: int, remaining: int, gap: int) -> int:
        """A row's last step: placing ``_keys[i]`` (the largest document that fits) would leave
        ``gap`` tokens that no buffered document fills, so the row ends with a crop. Returns the
        index of the document to take (rules 4 and 5 of the module docstring)."""
        keys = self._keys
        count = self._len_count
        # An exact finish: a large fitting document whose gap is the length of another one.
        for k in range(i - 1, max(i - 1 - _FINISH_CANDIDATES, -1), -1):
            g = remaining - keys[k][0]
            if count[g] > (g == keys[k][0]):  # a document of length g other than keys[k]
                return k
        # None: crop whichever wastes less, the next-longer document now (its length -
        # remaining) or, after keys[i], the shortest (its length - gap); a tie places keys[i].
        if i + 1 < len(keys) and keys[i + 1][0] - remaining < keys[1 if i == 0 else 0][0] - gap:
            return i + 1 if keys[i + 1][0] <= self.row_len else i
        return i

    def pop_row(self, final: bool = False) -> PackedRow:
        """Build one row. Without ``final`` the buffer must hold a row's worth of tokens; with
        ``final`` (end of a finite stream) a short last row is padded with ``pad_id``."""
        tokens = np.empty(self.row_len, dtype=np.int64)
        positions = np.empty(self.row_len, dtype=np.int64)
        valid = self.pop_row_into(tokens, positions, final)
        return PackedRow(tokens, positions, valid)

    def pop_row_into(self, tokens: np.ndarray, positions: np.ndarray, final: bool = False) -> int:
        """:meth:`pop_row` writing into caller-owned ``[seq_len + 1]`` arrays (e.g. rows of a
        batch, saving two allocations per row); returns the number of valid tokens."""
        R = self.row_len
        if not final and self._buffered_tokens < R:
            raise RuntimeError(
                f"pop_row: only {self._buffered_tokens} tokens buffered, need {R} (check ready())"
            )
        ar = self._arange
        filled = 0
        keys, take, count = self._keys, self._arena.take, self._len_count
        while filled < R and keys:
            remaining = R - filled
            if filled == 0 and keys[-1][0] > R:
                i = len(keys) - 1  # rule 1: over-long, a fresh row is where its crop is least
            else:
                i = bisect_right(keys, (remaining, _MAXSEQ, 0)) - 1  # the largest that fits
                if i < 0:
                    i = 0  # rule 2: nothing fits, crop the shortest
                elif (gap := remaining - keys[i][0]) and len(keys) > 1:
                    if gap < keys[1 if i == 0 else 0][0]:  # not rule 3: nothing fits after it
                        i = self._finish(i, remaining, gap)  # rules 4-5
            n, _, slot = keys.pop(i)
            doc = take(slot, n)
            self._buffered_tokens -= n
            if n < R:
                count[n] -= 1
            if n <= remaining:
                tokens[filled : filled + n] = doc
                positions[filled : filled + n] = ar[:n]
                filled += n
                continue
            tokens[filled:] = doc[:remaining]
            positions[filled:] = ar[:remaining]
            filled = R
            self.c.docs_cropped += 1
            if self.mode == "zero_discard":
                # The tail becomes a new document with its own BOS: nothing is dropped.
                tail = np.empty(n - remaining + 1, dtype=doc.dtype)
                tail[0] = self.bos_id
                tail[1:] = doc[remaining:]
                self.c.bos_inserted += 1
                self._insert(tail)
            else:
                self.c.tokens_cropped += n - remaining
        return self.c.finish_row(tokens, positions, filled, R, self.pad_id)

    # ------------------------------------------------------------------ state / stats
    def state_dict(self) -> dict[str, Any]:
        """The state, as plain ints and arrays (see ``doc_arena.DocArena.state``: no per-document
        work, ~20 us for 1000 buffered documents, so it is also what a hot path snapshots).
        Immutable: the arrays are fresh, and ``tokens`` is a part of the arena never written
        again."""
        return {
            "kind": 0 if self.mode == "crop" else 1,
            "row_len": self.row_len,
            "next_seq": self._next_seq,
            "counters": self.c.state(),
            **self._arena.state(),
        }

    snapshot = state_dict

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict` (or an earlier release's: no ``offsets``); a state
        of another kind or row length, or a damaged one, is refused in one line (ValueError)."""
        kind = 0 if self.mode == "crop" else 1
        got_kind, row_len = whole(state, "kind"), whole(state, "row_len")
        if got_kind != kind or row_len != self.row_len:
            raise ValueError(
                f"packer state is for kind={got_kind} row_len={row_len}, "
                f"this packer is kind={kind} row_len={self.row_len}"
            )
        lengths, offsets, tokens = layout(state)
        seqs = int_array(state["seqs"], "seqs").astype(np.int64, copy=False)
        next_seq = whole(state, "next_seq")
        if seqs.size != lengths.size:
            raise ValueError(f"packer state: {seqs.size} seqs for {lengths.size} documents")
        if seqs.size and (np.unique(seqs).size != seqs.size or int(seqs.max()) >= next_seq):
            raise ValueError(f"packer state: insertion numbers repeat or reach next_seq={next_seq}")
        self._arena = DocArena.holding(tokens, lengths, seqs, offsets, 4 * self.row_len)
        self._keys = sorted(zip(lengths.tolist(), seqs.tolist(), range(lengths.size), strict=True))
        self._buffered_tokens = int(lengths.sum())
        self._len_count = [0] * self.row_len
        for n in lengths.tolist():
            if n < self.row_len:
                self._len_count[n] += 1
        self._next_seq = next_seq
        self.c.load(state["counters"])

    def stats(self) -> dict[str, float]:
        c = self.c
        return {
            **c.state(),
            "buffered_docs": len(self._keys),
            "buffered_tokens": self._buffered_tokens,
            "crop_pct": pct(c.tokens_cropped, c.tokens_in),
            "fill_pct": pct(c.tokens_out, c.rows * self.row_len),
        }


PackingMode = Literal["best_fit", "zero_discard", "concat_split"]
PACKING_MODES: tuple[str, ...] = ("best_fit", "zero_discard", "concat_split")


def make_packer(
    mode: str,
    seq_len: int,
    bos_id: int | None,
    *,
    buffer_docs: int = 1000,
    pad_id: int | None = None,
    boundary_id: int | None = None,
    overlap: bool = False,
) -> BestFitPacker | ConcatSplitPacker:
    """Build a packer from a config string: ``best_fit`` | ``zero_discard`` | ``concat_split``."""
    if mode in ("best_fit", "zero_discard"):
        if bos_id is None:
            raise ValueError(f"packing={mode!r} needs a tokenizer with a BOS token")
        return BestFitPacker(
            seq_len,
            bos_id,
            mode="crop" if mode == "best_fit" else "zero_discard",
            buffer_docs=buffer_docs,
            pad_id=pad_id,
        )
    if mode == "concat_split":
        return ConcatSplitPacker(
            seq_len,
            boundary_id=boundary_id,
            overlap=overlap,
            pad_id=pad_id if pad_id is not None else (bos_id or 0),
        )
    raise ValueError(f"packing must be one of {PACKING_MODES}, got {mode!r}")
