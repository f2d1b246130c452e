"""The best-fit packer's buffered documents, held in one append-only token array (the arena).

Why: a checkpoint must copy every buffered document (~1000 of them, ~200-450k tokens). Held as
~1000 separate arrays, that copy was a concatenation of arrays gone cold since they were added,
plus a Python pass over ~1000 keys: ~0.9 ms of the training loop's time per checkpoint on the
2-core VM. Held here, the packer's state is taken on the loader's thread after every batch with
no per-document work (~15 us), and what is left to the training loop's checkpoint is one
contiguous copy (``python -m benchmarks text_loaders``: "state snapshot ours").

Contract:

* :meth:`DocArena.put` copies a document to the end of the arena and gives it a *slot*;
  :meth:`DocArena.take` frees the slot and returns the document as a view. Tokens below
  :attr:`DocArena.end` are never written again: a document taken leaves a hole, and when the
  arena is full, :meth:`DocArena._relayout` copies the live documents into a *new* array. So a
  :meth:`DocArena.state` shares the token array safely, with no copy, for good.
* Tokens are ``int32`` (what our tokenizer makes) until a document holds an id past 2**31; the
  arena is then re-laid out as ``int64``.
* The checkpoint form (:meth:`DocArena.state`) is ``lengths`` / ``seqs`` / ``offsets`` of each
  buffered document into ``tokens``, the arena from its first buffered document to its end. The
  holes in between cost checkpoint bytes (the re-layout's room: ~1.2x the buffered tokens on the
  benchmark corpus, never over 2x (+ 128 per document)): the price of not gathering ~1000 pieces
  at checkpoint time. :func:`layout` reads that form back, validated; a state without
  ``offsets`` (documents back to back, as earlier releases wrote) reads too.

Cost to the packer, measured on the benchmark corpus's tokenized documents (2-core VM, the two
versions alternating, 3 runs each): 12.4 -> 19.1 us per 2049-token row (the copy into the arena,
a re-layout per ~40 rows), under 1 % of what the loader's thread spends per row; the loader's
tokens/s is unchanged within the noise.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from torchtitan_ext.text.packed_rows import fits_int32, int_array, token_array

_INT32 = np.dtype(np.int32)
ROOM_PER_DOC = 64
"""A re-layout leaves room for a quarter of the buffered tokens more and this many tokens per
buffered document: it then runs at most once per 64 tokens added per document it moves."""


class DocArena:
    """Buffered documents in one append-only array, with per-slot bookkeeping in arrays.

    The slot arrays are ``array.array`` (a scalar write costs a third of a numpy one; a
    snapshot copies them with one ``memcpy`` each and numpy reads them without a copy)."""

    def __init__(self, min_capacity: int) -> None:
        self._min = max(int(min_capacity), 16)
        self.tokens = np.empty(self._min, dtype=np.int32)
        self.end = 0
        self._cap = self._min  # tokens.size, as an int
        self._wide = False  # tokens are int64
        # By slot. A free slot has length 0 (a buffered document is never empty).
        self._len = array("q", bytes(8 * 16))
        self._seq = array("q", bytes(8 * 16))
        self._off = array("q", bytes(8 * 16))
        self._free = list(range(15, -1, -1))

    def put(self, doc: np.ndarray, seq: int) -> int:
        """Copy ``doc`` (1-D, non-empty) into the arena under insertion number ``seq``; its slot."""
        n = doc.size
        e = self.end
        if e + n > self._cap or not (self._wide or doc.dtype is _INT32 or fits_int32(doc)):
            self._relayout(n, self._wide or not fits_int32(doc))
            e = self.end
        if not self._free:
            self._grow_slots()
        slot = self._free.pop()
        self.tokens[e : e + n] = doc
        self.end = e + n
        self._len[slot] = n
        self._seq[slot] = seq
        self._off[slot] = e
        return slot

    def take(self, slot: int, n: int) -> np.ndarray:
        """Free ``slot`` (a document of ``n`` tokens) and return it: a view valid for good."""
        off = self._off[slot]
        self._len[slot] = 0
        self._free.append(slot)
        return self.tokens[off : off + n]

    def state(self) -> dict[str, np.ndarray]:
        """The checkpoint form, taken without per-document work (~15 us for 1000 documents):
        ``lengths`` (int32), ``seqs`` (int64), ``offsets`` (int64) of each buffered document, in
        slot order, into ``tokens``, a view of the arena from its first buffered document to its
        end (never written again: the state stays true while the arena moves on).

        Invariant: ``tokens`` holds at most twice (the buffered tokens + :data:`ROOM_PER_DOC` per
        document). A re-layout leaves room for far less; where documents taken since then (a
        stream's end, a run of long documents) left more holes, the documents are gathered
        instead (the slow path: one concatenation of the runs of adjacent documents)."""
        lens_all = np.frombuffer(self._len, dtype=np.int64)
        slots = np.flatnonzero(lens_all)
        offs = np.frombuffer(self._off, dtype=np.int64)[slots]
        lens = lens_all[slots]
        seqs = np.frombuffer(self._seq, dtype=np.int64)[slots]
        lo = int(offs.min()) if slots.size else self.end
        tokens = self.tokens[lo : self.end]
        if tokens.size > 2 * (int(lens.sum()) + ROOM_PER_DOC * int(slots.size)):
            order = np.argsort(offs, kind="stable")
            offs, lens, seqs = offs[order], lens[order], seqs[order]
            tokens, lo = _gather(self.tokens, offs, lens), 0
            offs = np.cumsum(lens) - lens
        return {
            "lengths": lens.astype(np.int32),
            "seqs": seqs,
            "offsets": offs - lo,
            "tokens": tokens,
        }

    @classmethod
    def holding(
        cls, tokens: np.ndarray, lengths: np.ndarray, seqs: np.ndarray, offsets: np.ndarray,
        min_capacity: int,
    ) -> DocArena:  # fmt: skip
        """An arena holding a checkpoint's documents (:func:`layout`'s output) in slots
        ``0..k-1``, in their order."""
        a = cls(min_capacity)
        k = int(lengths.size)
        a._wide = not fits_int32(tokens)
        a.tokens = np.empty(max(a._min, (3 * int(tokens.size)) // 2),
                            dtype=np.int64 if a._wide else np.int32)  # fmt: skip
        a.tokens[: tokens.size] = tokens
        a.end, a._cap = int(tokens.size), a.tokens.size
        slots = max(k, 16)
        for name, values in (("_len", lengths), ("_seq", seqs), ("_off", offsets)):
            arr = np.zeros(slots, dtype=np.int64)
            arr[:k] = values
            setattr(a, name, array("q", arr.tobytes()))
        a._free = list(range(slots - 1, k - 1, -1))
        return a

    def _grow_slots(self) -> None:
        old = len(self._len)
        for arr in (self._len, self._seq, self._off):
            arr.frombytes(bytes(8 * old))
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _relayout(self, extra: int, wide: bool) -> None:
        """Copy the live documents, in arena order, to the front of a new array (``int64`` if
        ``wide``) with room for ``extra`` more tokens, a quarter of the live ones and
        :data:`ROOM_PER_DOC` per document. Its cost is ~0.5 us per run of adjacent live
        documents (the copy itself is a ``memcpy``), so it must run rarely."""
        lens_all = np.frombuffer(self._len, dtype=np.int64)
        offs_all = np.frombuffer(self._off, dtype=np.int64)
        slots = np.flatnonzero(lens_all)
        slots = slots[np.argsort(offs_all[slots], kind="stable")]
        lens, offs = lens_all[slots], offs_all[slots]
        live = int(lens.sum())
        room = live + extra + (live + extra) // 4 + ROOM_PER_DOC * int(slots.size)
        new = np.empty(max(self._min, room), dtype=np.int64 if wide else np.int32)
        _gather(self.tokens, offs, lens, out=new[:live])
        offs_all[slots] = np.cumsum(lens) - lens
        self.tokens, self.end, self._cap, self._wide = new, live, new.size, wide


def _gather(
    tokens: np.ndarray, offs: np.ndarray, lens: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """The documents at ``offs`` / ``lens`` (in ascending ``offs``) of ``tokens``, back to back
    (into ``out`` if given, of their total length): one concatenation of the runs of adjacent
    documents (a run per hole, not per document)."""
    if not offs.size:
        return tokens[:0] if out is None else out
    starts = np.flatnonzero(offs[1:] != offs[:-1] + lens[:-1]) + 1
    starts = np.concatenate(([0], starts))
    runs = zip(offs[starts].tolist(), np.add.reduceat(lens, starts).tolist(), strict=True)
    return np.concatenate([tokens[o : o + n] for o, n in runs], out=out)


def layout(state: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(lengths, offsets, tokens)`` of a checkpoint form (int64, int64, the tokens' own int32
    or int64), checked: integers (``packed_rows.int_array``), every document non-empty and inside
    ``tokens``, or ValueError saying which is not. Without ``offsets`` the documents lie back to
    back and must fill ``tokens``."""
    lengths = int_array(state["lengths"], "lengths").astype(np.int64, copy=False)
    tokens = token_array(int_array(state["tokens"], "tokens"))
    if state.get("offsets") is None:
        if int(lengths.sum()) != tokens.size:
            raise ValueError(
                f"packer state: lengths sum {int(lengths.sum())} != {tokens.size} tokens"
            )
        offsets = np.cumsum(lengths) - lengths
    else:
        offsets = int_array(state["offsets"], "offsets").astype(np.int64, copy=False)
        if offsets.size != lengths.size:
            raise ValueError(
                f"packer state: {offsets.size} offsets for {lengths.size} document lengths"
            )
    n = tokens.size
    if lengths.size and (
        int(lengths.min()) < 1 or int(offsets.min()) < 0
        # each term <= n first, so that their sum cannot wrap around
        or int(lengths.max()) > n or int(offsets.max()) > n
        or int((offsets + lengths).max()) > n
    ):  # fmt: skip
        raise ValueError(f"packer state: a document lies outside its {n} tokens or is empty")
    return lengths, offsets, tokens
