"""Elastic resume of the streaming loader: pure functions from saved slot states to who reads
what next, when a run resumes with another number of slots (DP ranks x workers).

The model is :mod:`torchtitan_ext.pipeline.elastic` with **single documents as units**
(``Unit(g, 0, 1)``, ``g`` the document id): an epoch's *document order* is every row of the
window in the epoch's piece order (:func:`epoch_doc_ids`). What a slot had read is not a prefix
of that order (the block shuffle permutes inside blocks, and shard-level slots own whole pieces),
so the first change of degree inside an epoch is stated against the slots' own streams:

==================  ===========================================================================
``base``            ``[nslots, shard_level, [consumed per slot]]``: the epoch was read by
                    ``nslots`` slots in the normal way (:func:`slot_stream_ids`); slot ``s`` took
                    the first ``consumed[s]`` items of its block-shuffled stream (-1: all).
``phases``          each later change inside the same epoch: an :class:`~torchtitan_ext.pipeline.
                    elastic.Phase` (``[[units_done, 0] per slot]``, -1: all) over the remainder.
==================  ===========================================================================

:func:`remainder_ids` replays them: the documents nobody has read, in epoch order. A slot of
the new run reads ``deal(remainder, slot, nslots)`` in that order — *without* the within-block
shuffle (cost: the rest of an interrupted epoch is less shuffled), reading every piece that
holds one of its documents (cost: up to an ``nslots``-fold read of the rest of that epoch,
tokenizing only its own documents), then continues with normal epochs at its new degree.

Documents a slot had read but not yet emitted (the packer's pending segments with their
per-token ``[doc, epoch, left, length]`` track entries) are dealt to the new slots **one item
per document segment** (:func:`~torchtitan_ext.pipeline.elastic.redeal`): balanced, and a
document whose start was already emitted keeps its offsets, so a document is counted once,
where it starts (offset 0, or offset 1 at a row's first input after a label-only offset 0).
One exception: a document of which only its first token was emitted, as the label-only last
token of the slot's last row, would continue at offset 1 *inside* another slot's row, where
its start never shows; it is re-dealt whole instead, its first token (the slot's saved
``row_tail``) put back in front (:func:`_held`).

Cost of the computation: it materialises the epoch's document ids (8 bytes each) and, per
change, one ``Unit`` per remaining document; it needs every shard's row count (Parquet footers,
else one counting pass over the window at resume). Rows skipped as unreadable are assumed
readable by this arithmetic (a skipped shard tail makes the remainder name rows nobody can
read; they are simply not found).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from torchtitan_ext.pipeline.elastic import Phase, Unit, deal, redeal, remainder
from torchtitan_ext.text.stream_window import Piece

ALL = -1
"""Progress marker: the slot read all of its share (it was in a later epoch)."""


def epoch_pieces(pieces: Sequence[Piece], *, seed: int, epoch: int, shuffle: bool) -> list[Piece]:
    """The window's pieces in epoch ``epoch``'s order (as
    :func:`~torchtitan_ext.text.stream_window.slot_items` permutes them)."""
    order = list(range(len(pieces)))
    if shuffle:
        order = [int(i) for i in np.random.default_rng([seed, epoch]).permutation(order)]
    return [pieces[i] for i in order]


def piece_ids(pieces: Sequence[Piece], sizes: Sequence[int], doc_id: Callable[[int, int], int]):
    """Per piece, the ids of its documents (``doc_id(shard, lo) + arange(size)``)."""
    return [
        doc_id(p.shard, p.lo) + np.arange(n, dtype=np.int64)
        for p, n in zip(pieces, sizes, strict=True)
    ]


def slot_stream_ids(
    ordered: Sequence[np.ndarray],
    slot: int,
    nslots: int,
    *,
    shard_level: bool,
    block: int,
    seed: int,
    epoch: int,
) -> np.ndarray:
    """Slot ``slot``'s block-shuffled epoch stream as document ids (the same order as
    :func:`~torchtitan_ext.text.stream_window.block_shuffled` over ``slot_items``), from the
    ids of the pieces in epoch order."""
    if shard_level:
        parts = list(ordered[slot::nslots])
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    else:
        ids = (np.concatenate(list(ordered)) if ordered else np.zeros(0, np.int64))[slot::nslots]
    if block <= 1:
        return ids
    out = ids.copy()
    for b, lo in enumerate(range(0, len(ids), block)):
        chunk = ids[lo : lo + block]
        perm = np.random.default_rng([seed, epoch, slot, b]).permutation(len(chunk))
        out[lo : lo + block] = chunk[perm]
    return out


def remainder_ids(
    ordered: Sequence[np.ndarray],
    history: dict[str, Any],
    *,
    block: int,
    seed: int,
    epoch: int,
) -> np.ndarray:
    """The documents of the epoch nobody has read after ``history`` (``{"base", "phases"}``, see
    the module docstring), in epoch order."""
    nslots, shard_level, consumed = history["base"]
    doc_order = np.concatenate(list(ordered)) if ordered else np.zeros(0, np.int64)
    read = []
    for s, c in enumerate(consumed):
        mine = slot_stream_ids(
            ordered, s, int(nslots), shard_level=bool(shard_level), block=block, seed=seed,
            epoch=epoch,
        )  # fmt: skip
        read.append(mine if int(c) == ALL else mine[: int(c)])
    done = np.concatenate(read) if read else np.zeros(0, np.int64)
    units = [Unit(int(g), 0, 1) for g in doc_order[~np.isin(doc_order, done)]]
    for ph in history["phases"]:
        n = len(ph)
        prog = [[len(units[s::n]) if int(k) == ALL else int(k), 0] for s, (k, _) in enumerate(ph)]
        units = remainder(units, Phase.from_state(prog))
    return np.array([u.id for u in units], dtype=np.int64)


def share(rest: np.ndarray, slot: int, nslots: int) -> np.ndarray:
    """Slot ``slot``'s documents of the remainder, in reading order."""
    return np.asarray(deal(list(rest), slot, nslots), dtype=np.int64)


def _progress(st: dict[str, Any], epoch: int) -> int:
    e = int(st["epoch"])
    return int(st["consumed"]) if e == epoch else (0 if e < epoch else ALL)


def merge(old: Sequence[dict[str, Any]], nslots: int) -> list[dict[str, Any]]:
    """The states of ``nslots`` new slots from the states of every old slot (in slot order).

    Every new slot starts at the oldest epoch an old slot was in, with the history (one ``base``
    or one more phase per epoch up to the newest) that :func:`remainder_ids` turns into what is
    left; pending packer segments are dealt one per document; skip logs, document counts and
    packer counters go to new slot ``old % nslots`` (the totals are kept)."""
    lo, hi = min(int(s["epoch"]) for s in old), max(int(s["epoch"]) for s in old)
    history: dict[str, Any] = {}
    for st in old:
        history.update(st["history"])
    new_hist: dict[str, Any] = {}
    for e in range(lo, hi + 1):
        prog = [_progress(st, e) for st in old]
        h = history.get(str(e))
        if h is None:
            at_e = [int(st["shard_level"]) for st in old if int(st["epoch"]) == e]
            level = at_e[0] if at_e else int(old[0]["shard_level"])
            new_hist[str(e)] = {"base": [len(old), level, prog], "phases": []}
        else:
            new_hist[str(e)] = {"base": h["base"], "phases": [*h["phases"], [[k, 0] for k in prog]]}
    held = [_held(st) for st in old]  # one item per pending document segment
    dealt = redeal(held, nslots)
    out = []
    for t in range(nslots):
        mine = [st for s, st in enumerate(old) if s % nslots == t]
        segs = [seg for seg, _ in dealt[t]]
        out.append(
            {
                "version": old[0]["version"],
                "epoch": lo,
                "consumed": 0,
                "shard_level": 0,
                "history": new_hist,
                "ended": 0,
                "docs_used": sum(int(st["docs_used"]) for st in mine),
                "skips": _merged_skips([st["skips"] for st in mine]),
                "packer": _packer_of(
                    old[0]["packer"],
                    segs,
                    [st["packer"] for st in mine],
                    carried=sum(_label_started(st) for st in mine),
                ),
                "track": [list(tr) for _, tr in dealt[t]],
                "row_tail": -1,
                "tokens_read": sum(int(st.get("tokens_read", 0)) for st in mine),
            }
        )
    return out


def _label_started(st: dict[str, Any]) -> bool:
    """The slot's last row ended on the first token of its pending head document: that
    token was emitted only as the row's label-only last token, so the document's start was
    never an input (``track`` head ``[doc, epoch, length - 1, length]``)."""
    tr = st["track"]
    return bool(tr) and int(tr[0][2]) == int(tr[0][3]) - 1 and int(st.get("row_tail", -1)) >= 0


def _held(st: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """The slot's pending ``(segment tokens, track entry)`` pairs, in packer order.

    At an unchanged degree a document whose first token closed the last row (label only)
    continues at offset 1 as the *first input of the slot's next row*, which is where its
    start is counted (``doc_offsets`` 1 at a row's first token). Re-dealt, that continuation
    would land inside another slot's row and its start would never show: the document would
    be lost to every start count (and to ``doc_offsets``-based diversity checks). So its first
    token (the ``row_tail`` the slot saved) is put back in front and the document is re-dealt
    whole, from offset 0 (that one token is a label once more; the packer counts it as
    ``tokens_carried``)."""
    pairs = [
        (seg, [int(v) for v in tr])
        for seg, tr in zip(_segments(st["packer"]), st["track"], strict=True)
    ]
    if _label_started(st):
        seg, tr = pairs[0]
        pairs[0] = ([int(st["row_tail"]), *seg], [tr[0], tr[1], tr[3], tr[3]])
    return pairs


def _segments(pk: dict[str, Any]) -> list[list[int]]:
    out, off = [], 0
    for n in pk["lengths"]:
        out.append(list(pk["tokens"][off : off + int(n)]))
        off += int(n)
    return out


def _packer_of(
    like: dict[str, Any], segs: list[list[int]], olds: list[dict], carried: int = 0
) -> dict[str, Any]:
    counters = {k: 0 for k in like["counters"]}
    for pk in olds:
        for k, v in pk["counters"].items():
            counters[k] += int(v)
    if carried and "tokens_carried" in counters:
        counters["tokens_carried"] += carried  # first tokens put back by _held (totals kept)
    return {
        "kind": like["kind"],
        "row_len": like["row_len"],
        "lengths": [len(s) for s in segs],
        "tokens": [int(t) for s in segs for t in s],
        "counters": counters,
    }


def _merged_skips(logs: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    for lg in logs:
        for k, v in lg.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + int(v)
        for k, v in lg.get("examples", {}).items():
            examples.setdefault(k, []).extend(str(x) for x in v)
    return {"counts": counts, "examples": {k: v[:5] for k, v in examples.items()}}
