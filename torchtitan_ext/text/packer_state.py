"""The packer's part of the Parquet loader's state, in two forms, and its re-deal to other ranks.

* **Live** (:func:`live`) — what the tokenize + pack stage's ``state()`` holds after every batch:
  shallow (~28 us for 1000 buffered documents, measured on the 2-core VM, in the loader's thread,
  off the training loop; the previous producer's snapshot took ~9 us); the document arrays
  are shared with the packer, which never modifies them after insertion.
* **Compact** (:func:`compact`) — what a checkpoint holds: the buffered documents concatenated
  as ``int32`` (``int64`` only for ids past 2**31; documents from our tokenizer are ``int32``
  already), their lengths (``int32``) and, for the
  best-fit packers, their insertion numbers (``int64``). Every rank's state is gathered at
  checkpoint time, so its size matters: about 4 bytes per buffered token + 12 per document —
  ~1.8 MB for 1000 documents of ~450 tokens (half the int64 size), ~0.1 MB for concat-split's
  short pending run.

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
from itertools import chain
from typing import Any

import numpy as np

from torchtitan_ext.text.packing import BestFitPacker, ConcatSplitPacker

_I32 = np.iinfo(np.int32)


def live(packer: BestFitPacker | ConcatSplitPacker) -> dict[str, Any]:
    """A shallow, immutable capture of ``packer`` (a tree of ints, lists and arrays)."""
    snap = packer.snapshot()
    if isinstance(packer, BestFitPacker):
        docs = snap["docs"]  # by insertion number, in insertion order (C-speed copies)
        return {
            "kind": 0 if packer.mode == "crop" else 1,
            "row_len": packer.row_len,
            "next_seq": snap["next_seq"],
            "keys": snap["keys"],
            "doc_seqs": list(docs),
            "docs": list(docs.values()),
            "counters": snap["counters"],
        }
    return {
        "kind": 2,
        "row_len": packer.row_len,
        "segs": snap["segs"],
        "counters": snap["counters"],
    }


def _small(tokens: np.ndarray) -> np.ndarray:
    if tokens.dtype == np.int32:  # every piece was int32 (our tokenizer's documents)
        return tokens
    if tokens.size and (int(tokens.max()) > _I32.max or int(tokens.min()) < _I32.min):
        return tokens.astype(np.int64)
    return tokens.astype(np.int32)


def compact(ps: dict[str, Any]) -> dict[str, Any]:
    """The compact form of a live (or already compact) packer state.

    Taken once per checkpoint, on the training loop, so it avoids per-document Python work:
    the keys become one array, documents are looked up by C-level ``map``, and ``int32``
    documents are concatenated without a range check (~0.3 ms for 1000 documents of ~330
    tokens on the 2-core VM, against ~0.75 ms with per-key lookups and an ``int64`` pass)."""
    if "tokens" in ps:
        return ps
    out = {"kind": int(ps["kind"]), "row_len": int(ps["row_len"]), "counters": dict(ps["counters"])}
    if "docs" in ps:  # best-fit: the documents in key order (length, insertion number)
        keys = ps["keys"]
        flat_keys = np.fromiter(chain.from_iterable(keys), dtype=np.int64, count=2 * len(keys))
        lengths, seqs = flat_keys[0::2], flat_keys[1::2]
        by_seq = dict(zip(ps["doc_seqs"], ps["docs"], strict=True))
        pieces = list(map(by_seq.__getitem__, seqs.tolist()))
        out["lengths"] = lengths.astype(np.int32)
    else:
        pieces = ps["segs"]
        out["lengths"] = np.array([x.size for x in pieces], dtype=np.int32)
    out["tokens"] = _small(np.concatenate(pieces) if pieces else np.zeros(0, np.int32))
    if "docs" in ps:
        out["next_seq"] = int(ps["next_seq"])
        out["seqs"] = seqs.copy()
    return out


def _split(ps: dict[str, Any]) -> list[np.ndarray]:
    lengths = np.asarray(ps["lengths"], dtype=np.int64)
    tokens = np.asarray(ps["tokens"], dtype=np.int64)
    if int(lengths.sum()) != tokens.size:
        raise ValueError(f"packer state: lengths sum {int(lengths.sum())} != {tokens.size} tokens")
    return np.split(tokens, np.cumsum(lengths)[:-1]) if lengths.size else []


def items(ps: dict[str, Any]) -> list[Any]:
    """What a rank's packer holds, as items to re-deal (see the module docstring's table)."""
    ps = compact(ps)
    pieces = _split(ps)
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
    else:  # insertion numbers 0..k-1 in the dealt order; keys sorted by (length, seq)
        order = sorted(range(len(held)), key=lambda i: (held[i].size, i))
        pieces = [held[i] for i in order]
        out["next_seq"] = len(held)
        out["seqs"] = np.array(order, dtype=np.int64)
    out["lengths"] = np.array([x.size for x in pieces], dtype=np.int32)
    out["tokens"] = _small(np.concatenate(pieces) if pieces else np.zeros(0, np.int64))
    return out
