"""``ConcatSplitPacker``: plain concatenation cut into rows (``packing = "concat_split"`` and the
streaming loader's packer); the modes table and the shared invariant are in ``text/packing.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from torchtitan_ext.text.packed_rows import (
    PackedRow,
    RowCounters,
    as_doc,
    int_array,
    pct,
    token_array,
    whole,
)


class ConcatSplitPacker:
    """Concatenate documents (optionally each followed by ``boundary_id``) and cut windows of
    ``seq_len + 1`` tokens. ``overlap=False`` (default) matches torchtitan's HuggingFaceTextDataset."""

    def __init__(
        self,
        seq_len: int,
        boundary_id: int | None = None,
        overlap: bool = False,
        pad_id: int = 0,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len
        self.row_len = seq_len + 1
        self.boundary_id = boundary_id
        self.overlap = overlap
        self.pad_id = int(pad_id)
        # Pending document segments, in order; each restarts positions at 0.
        self._segs: list[np.ndarray] = []
        self._head = 0  # index of the first live segment (popping from the front is O(1))
        self._buffered_tokens = 0
        self._arange = np.arange(self.row_len, dtype=np.int64)
        self.c = RowCounters()

    def add(self, doc_ids: Sequence[int] | np.ndarray) -> None:
        arr = as_doc(doc_ids)
        if arr.size == 0 and self.boundary_id is None:
            raise ValueError("empty document (callers skip and count empty documents)")
        self.c.docs_in += 1
        self.c.tokens_in += int(arr.size)
        if self.boundary_id is not None:
            arr = np.append(arr, np.asarray(self.boundary_id, dtype=arr.dtype))
            self.c.boundary_tokens += 1
        self._segs.append(arr)
        self._buffered_tokens += int(arr.size)

    def ready(self) -> bool:
        return self._buffered_tokens >= self.row_len

    def has_pending(self) -> bool:
        # With overlap, a lone carried-over token is not new data worth a row.
        return self._buffered_tokens > (1 if self.overlap and self.c.rows else 0)

    def pop_row(self, final: bool = False) -> PackedRow:
        tokens = np.empty(self.row_len, dtype=np.int64)
        positions = np.empty(self.row_len, dtype=np.int64)
        valid = self.pop_row_into(tokens, positions, final)
        return PackedRow(tokens, positions, valid)

    def pop_row_into(self, tokens: np.ndarray, positions: np.ndarray, final: bool = False) -> int:
        R = self.row_len
        if not final and self._buffered_tokens < R:
            raise RuntimeError(
                f"pop_row: only {self._buffered_tokens} tokens buffered, need {R} (check ready())"
            )
        filled = 0
        split_last = False  # the row ended inside a segment (its rest is still queued)
        while filled < R and self._head < len(self._segs):
            seg = self._segs[self._head]
            take = min(int(seg.size), R - filled)
            tokens[filled : filled + take] = seg[:take]
            positions[filled : filled + take] = self._arange[:take]
            filled += take
            if take == seg.size:
                self._segs[self._head] = None  # type: ignore[call-overload]
                self._head += 1
            else:
                self._segs[self._head] = seg[take:]
                split_last = True
            self._buffered_tokens -= take
        if self.overlap and filled == R:
            # Carry the last token over as the first of the next window: it was a label here and
            # becomes an input there, so every token is a label exactly once. If its document
            # continues, the carried token joins that piece (one position run, not two).
            carry = tokens[-1:].copy()
            if split_last:
                self._segs[self._head] = np.concatenate([carry, self._segs[self._head]])
            elif self._head > 0:
                self._head -= 1
                self._segs[self._head] = carry
            else:
                self._segs.insert(0, carry)
            self._buffered_tokens += 1
            self.c.tokens_carried += 1
        if self._head > 1024 and self._head * 2 > len(self._segs):
            self._segs = self._segs[self._head :]
            self._head = 0
        return self.c.finish_row(tokens, positions, filled, R, self.pad_id)

    def snapshot(self) -> dict[str, Any]:
        """Cheap immutable capture (segments are replaced, never modified in place)."""
        return {
            "segs": [x for x in self._segs[self._head :] if x is not None],
            "counters": self.c.state(),
        }

    def state_from_snapshot(self, snap: dict[str, Any]) -> dict[str, Any]:
        live = snap["segs"]
        return {
            "kind": 2,
            "row_len": self.row_len,
            "lengths": np.array([x.size for x in live], dtype=np.int64),
            "tokens": np.concatenate(live) if live else np.zeros(0, dtype=np.int64),
            "counters": dict(snap["counters"]),
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state_from_snapshot(self.snapshot())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a :meth:`state_dict`; a state of another kind or row length, or a damaged
        one (not integers, negative lengths, lengths not summing to the tokens), is refused in
        one line (ValueError)."""
        kind, row_len = whole(state, "kind"), whole(state, "row_len")
        if kind != 2 or row_len != self.row_len:
            raise ValueError(
                f"packer state is for kind={kind} row_len={row_len}, "
                f"this packer is kind=2 row_len={self.row_len}"
            )
        lengths = int_array(state["lengths"], "lengths").astype(np.int64, copy=False)
        flat = token_array(int_array(state["tokens"], "tokens"))
        if lengths.size and int(lengths.min()) < 0:
            raise ValueError("packer state: a segment length is negative")
        if int(lengths.sum()) != flat.size:
            raise ValueError(
                f"packer state: lengths sum {int(lengths.sum())} != {flat.size} tokens"
            )
        self._segs = []
        off = 0
        for n in lengths.tolist():
            self._segs.append(flat[off : off + n].copy())
            off += n
        self._head = 0
        self._buffered_tokens = int(flat.size)
        self.c.load(state["counters"])

    def stats(self) -> dict[str, float]:
        c = self.c
        return {
            **c.state(),
            "buffered_docs": len(self._segs) - self._head,
            "buffered_tokens": self._buffered_tokens,
            "crop_pct": pct(c.tokens_cropped, c.tokens_in),
            "fill_pct": pct(c.tokens_out, c.rows * self.row_len),
        }
