"""The packer's part of the Parquet loader's state, in two forms, and its re-deal to other ranks.

* **Live** (:func:`live`) — what the tokenize + pack stage's ``state()`` holds after every batch,
  taken on the loader's thread, off the training loop. For the best-fit packers it is their
  ``state_dict()``, compact already (:mod:`torchtitan_ext.text.doc_arena`: no per-document
  work, ~15-20 us); for concat-split its few pending segments (arrays the packer never
  modifies, shared).
* **Compact** (:func:`compact`) — what a checkpoint holds: ``int32`` tokens (``int64`` only for
  ids past 2**31; documents from our tokenizer are ``int32`` already) and the documents'
  lengths (``int32``); for the best-fit packers also their insertion numbers and offsets
  (``int64``) into ``tokens``, a part of the arena that keeps the holes taken documents left in
  it. Every rank's state is gathered at checkpoint time, so its size matters: about 4 bytes per
  buffered token (x ~1.2 for the holes on the benchmark corpus, never over 2x + 128 tokens per
  document) + 20 bytes per document — ~1.0 MB for the benchmark's 1000 documents of ~220
  tokens, ~0.1 MB for concat-split's short pending run.

:meth:`~torchtitan_ext.text.packing.BestFitPacker.load_state_dict` takes either, after
:func:`compact`. For a resume at another DP degree, :func:`items` lists what a rank holds and
:func:`from_items` builds a packer state from items dealt to a new rank (``elastic.redeal``):

============================  ===============================================================
packing                       one item is
============================  ===============================================================
best_fit, zero_discard        one buffered document (in insertion order; a zero-discard tail
                              is a document of its own, starting with its BOS)
concat_split                  the whole pending run of one old rank (its segments, in order):
                              its head may be the rest of a document already started, which
                              must stay in front of what followed it
============================  ===============================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from torchtitan_ext.text.doc_arena import layout
from torchtitan_ext.text.packed_rows import fits_int32
from torchtitan_ext.text.packing import BestFitPacker, ConcatSplitPacker


def live(packer: BestFitPacker | ConcatSplitPacker) -> dict[str, Any]:
    """A shallow, immutable capture of ``packer`` (a tree of ints, lists and arrays)."""
    snap = packer.snapshot()
    if isinstance(packer, BestFitPacker):
        return snap  # already the compact form: see torchtitan_ext.text.doc_arena
    return {
        "kind": 2,
        "row_len": packer.row_len,
        "segs": snap["segs"],
        "counters": snap["counters"],
    }


def _small(tokens: np.ndarray) -> np.ndarray:
    """``tokens`` as ``int32`` where every id fits (our tokenizer's are ``int32`` already)."""
    return tokens.astype(np.int32 if fits_int32(tokens) else np.int64, copy=False)


def compact(ps: dict[str, Any]) -> dict[str, Any]:
    """The compact form of a live (or already compact) packer state.

    Taken once per checkpoint, on the training loop, so it does no per-document work: the
    best-fit packers' live form is compact already, and concat-split's takes one concatenation
    of its few pending segments."""
    if "segs" not in ps:
        return ps
    pieces = ps["segs"]
    return {
        "kind": int(ps["kind"]),
        "row_len": int(ps["row_len"]),
        "counters": dict(ps["counters"]),
        "lengths": np.array([x.size for x in pieces], dtype=np.int32),
        "tokens": _small(np.concatenate(pieces) if pieces else np.zeros(0, np.int32)),
    }


def items(ps: dict[str, Any]) -> list[Any]:
    """What a rank's packer holds, as items to re-deal (see the module docstring's table)."""
    ps = compact(ps)
    lengths, offsets, tokens = layout(ps)
    pieces = [tokens[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]
    if int(ps["kind"]) == 2:
        return [pieces] if pieces else []
    seqs = [int(s) for s in np.asarray(ps["seqs"])]
    return [d for _, d in sorted(zip(seqs, pieces, strict=True), key=lambda x: x[0])]


def from_items(
    held: Sequence[Any], kind: int, row_len: int, counters: dict[str, int]
) -> dict[str, Any]:
    """The compact packer state holding ``held`` (items of :func:`items`, in order)."""
    out: dict[str, Any] = {"kind": kind, "row_len": row_len, "counters": dict(counters)}
    if kind == 2:
        pieces = [seg for run in held for seg in run]
    else:  # insertion numbers 0..k-1 in the dealt order
        pieces = list(held)
        out["next_seq"] = len(held)
        out["seqs"] = np.arange(len(held), dtype=np.int64)
    out["lengths"] = np.array([x.size for x in pieces], dtype=np.int32)
    out["tokens"] = _small(np.concatenate(pieces) if pieces else np.zeros(0, np.int64))
    return out
