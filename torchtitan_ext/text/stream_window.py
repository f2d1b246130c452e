"""Position arithmetic of :class:`~torchtitan_ext.text.streaming.StreamingTextDataset`: pure
functions from (source layout, seed, epoch, slot) to the documents a slot reads, in order.

Nothing here opens a file: rows are read through a ``read_rows(piece)`` callable, and shard row
counts come through a ``count(shard)`` callable. Why separate: these functions decide *which*
document each DataLoader worker of each rank sees in each epoch, which is the whole
never-repeat / never-lose / exact-resume contract; kept pure, they are read and tested without
a dataset, a tokenizer or a worker process. The streaming module's docstring gives the
algorithm in prose; the steps are:

* :func:`make_pieces` — clip the shards to the window ``[skip_first, skip_first + max_documents)``.
* :func:`is_shard_level` — whole pieces per slot, or every ``nslots``-th row of all pieces.
* :func:`slot_items` — a slot's epoch stream before the shuffle (epoch-seeded piece order).
* :func:`block_shuffled` — the stream with each block of ``B`` items permuted, from item
  ``start`` on: position ``k`` is addressable (block ``k // B``), so resume needs no buffer.
* :func:`doc_id` / :func:`shard_offsets` — the id of a document in a row of a shard.
* :func:`global_slot` / :func:`worker_quota` — a worker's slot and its samples per ``__iter__``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SHARD_BITS = 40  # doc id without row counts: shard << 40 | row (row < 1.1e12)


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of source shard ``shard`` (``hi=None``: to the end of the shard)."""

    shard: int
    lo: int
    hi: int | None


def piece_size(p: Piece, known: dict[int, int]) -> int | None:
    """Documents in a piece, or None if its shard's row count is not in ``known``."""
    if p.hi is not None:
        return p.hi - p.lo
    n = known.get(p.shard)
    return None if n is None else n - p.lo


def make_pieces(
    n_shards: int,
    count: Callable[[int], int],
    known: dict[int, int],
    skip_first: int,
    max_documents: int | None,
    *,
    count_all: bool = False,
    source: Any = "",
) -> list[Piece]:
    """Clip the shards to the window ``[skip_first, skip_first + max_documents)``.

    ``count(shard)`` gives a shard's rows (it may read the shard; ``known`` holds the counts
    already at hand). Without an end (``max_documents=None``) the shards past the window start
    are whole pieces and are not counted, unless ``count_all``. An empty window is a
    ``ValueError`` naming ``source``."""
    a = skip_first
    b = a + max_documents if max_documents is not None else None
    pieces: list[Piece] = []
    off = 0
    for i in range(n_shards):
        if b is not None and off >= b:
            break
        if b is None and off >= a and not count_all and i not in known:
            # Past the window start with no end: the remaining shards are whole pieces and
            # need no counting.
            pieces += [Piece(j, 0, None) for j in range(i, n_shards)]
            break
        n = count(i)
        lo, hi = max(a, off), (min(b, off + n) if b is not None else off + n)
        if lo < hi:
            pieces.append(Piece(i, lo - off, hi - off))
        off += n
    else:
        if b is not None and b > off and pieces:
            logger.warning(
                "%s: max_documents=%d reaches past the end of the source (%d documents); "
                "the window holds %d",
                source,
                max_documents,
                off,
                off - a,
            )
    if not pieces:
        raise ValueError(
            f"{source}: the window skip_first={a} max_documents={max_documents} "
            f"is empty (the source has {off} documents)"
        )
    return pieces


def is_shard_level(pieces: list[Piece], nslots: int, known: dict[int, int]) -> bool:
    """Whole pieces per slot when their number divides evenly by the slot count *and* they
    are of (nearly) equal size (known sizes differing by <= 5 %): with unequal pieces the
    slots' epochs would drift apart (a slot holding a small piece races through epochs).
    Otherwise example-level."""
    if len(pieces) % nslots != 0:
        return False
    sizes = [piece_size(p, known) for p in pieces]
    if None in sizes:
        return True  # sizes unknown (no metadata, not counted): trust the shard layout
    return max(sizes) - min(sizes) <= max(1, 0.05 * max(sizes))


def slot_items(
    pieces: list[Piece],
    read_rows: Callable[[Piece], Iterable[tuple[int, Any]]],
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    slot: int,
    nslots: int,
    shard_level: bool,
) -> Iterator[tuple[int, int, Any]]:
    """The slot's epoch stream before the block shuffle: ``(shard, row, value)``.

    The pieces are permuted with ``default_rng([seed, epoch])`` (when ``shuffle``); shard-level,
    the slot reads pieces ``slot::nslots``; example-level, it reads all of them and keeps the
    items whose index ``j`` in the epoch stream has ``j % nslots == slot``. Either way every
    row of the window goes to exactly one slot per epoch."""
    order = list(range(len(pieces)))
    if shuffle:
        order = [int(i) for i in np.random.default_rng([seed, epoch]).permutation(order)]
    ordered = [pieces[i] for i in order]
    if shard_level:  # whole pieces per slot
        for p in ordered[slot::nslots]:
            for row, ex in read_rows(p):
                yield p.shard, row, ex
    else:  # example-level: every slot reads everything, keeps every nslots-th row
        j = 0
        for p in ordered:
            for row, ex in read_rows(p):
                if j % nslots == slot:
                    yield p.shard, row, ex
                j += 1


def block_shuffled(
    items: Iterator[Any], start: int, block_size: int, *, seed: int, epoch: int, slot: int
) -> Iterator[Any]:
    """``items`` from position ``start`` on, each consecutive block of ``block_size`` permuted
    with ``default_rng([seed, epoch, slot, block])``. The blocks before ``start``'s block are
    consumed unread by the caller's pipeline (re-read, never tokenized): that is the whole cost
    of an exact resume."""
    B = block_size
    block = start // B
    for _ in islice(items, block * B):
        pass
    offset = start - block * B
    while True:
        chunk = list(islice(items, B))
        if not chunk:
            return
        if B > 1:
            rng = np.random.default_rng([seed, epoch, slot, block])
            chunk = [chunk[i] for i in rng.permutation(len(chunk))]
        yield from chunk[offset:]
        offset = 0
        block += 1


def shard_offsets(counts: list[int]) -> list[int]:
    """Global index of each shard's first row (and the total last), from rows per shard."""
    return [int(x) for x in np.cumsum([0, *counts])]


def doc_id(shard: int, row: int, offsets: list[int] | None) -> int:
    """The global raw index ``offsets[shard] + row`` when every shard's rows are known up
    front, else ``shard << SHARD_BITS | row`` (stable without counting anything)."""
    if offsets is not None:
        return offsets[shard] + row
    return (shard << SHARD_BITS) | row


def global_slot(dp_rank: int, dp_world_size: int, worker: int, num_workers: int) -> tuple[int, int]:
    """``(slot, nslots)``: slot ``dp_rank * num_workers + worker`` of ``dp_world_size *
    num_workers``."""
    return dp_rank * num_workers + worker, dp_world_size * num_workers


def worker_quota(batches: int, batch_size: int, worker: int, num_workers: int) -> int:
    """Samples worker ``worker`` yields for ``batches`` DataLoader batches: a DataLoader takes
    batch ``i`` from worker ``i % num_workers``."""
    return batch_size * len(range(worker, batches, num_workers))
