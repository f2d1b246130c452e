"""Rows to batches: the stage after a mixture's :class:`~torchtitan_ext.pipeline.mix.Mix`.

A text mixture draws one packed **row** per ``Mix.next()`` (each source packs its own rows, so a
row never holds two sources: ``pipeline/mix.py``). :class:`RowBatches` stacks ``batch_size`` of
those rows into the batch torchtitan trains on, the same shape a single-source loader gives:

=====================  =========================================================================
row (one ``next()``    ``({"input": [L], "positions": [L], ...}, labels [L])``, ``L = seq_len``
of the upstream)       (any further per-token keys, e.g. the debug ``doc_ids``, are stacked too)
batch                  ``({"input": [B, L], "positions": [B, L], ...}, labels [B, L])``
=====================  =========================================================================

Invariant: every batch has exactly ``batch_size`` rows. At the end of a finite stream (every
source of the mixture ended) the last batch is completed with **padding rows**: ``input`` is
``pad_id``, ``labels`` are ``IGNORE_INDEX`` (no loss, not counted as a valid token),
``positions`` 0 (as the packer pads a short row) and every other per-token key -1 (the value
the debug document fields give padding). Then ``StopIteration``. (A short last batch would give
data-parallel ranks different shapes at the same step.)

State: the upstream's, unchanged. A batch is assembled inside one ``next()``, so nothing is
buffered here between calls, and a state taken after a batch resumes right after it.
"""

from __future__ import annotations

import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.pipeline.stage import Stage, State

Row = tuple[dict[str, torch.Tensor], torch.Tensor]


def padding_row(like: Row, pad_id: int) -> Row:
    """A row that trains on nothing, shaped like ``like`` (see the module docstring)."""
    x, labels = like
    out = {}
    for k, v in x.items():
        fill = pad_id if k == "input" else 0 if k == "positions" else -1
        out[k] = torch.full_like(v, fill)
    return out, torch.full_like(labels, IGNORE_INDEX)


class RowBatches(Stage[Row]):
    """``batch_size`` rows of ``upstream`` per batch; the last batch of a finite stream padded
    with :func:`padding_row` (see the module docstring)."""

    def __init__(self, upstream: Stage[Row], batch_size: int, pad_id: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.upstream, self.batch_size, self.pad_id = upstream, int(batch_size), int(pad_id)

    def next(self) -> Row:
        rows: list[Row] = []
        while len(rows) < self.batch_size:
            try:
                rows.append(self.upstream.next())
            except StopIteration:
                if not rows:
                    raise
                rows += [padding_row(rows[0], self.pad_id)] * (self.batch_size - len(rows))
        x = {k: torch.stack([r[0][k] for r in rows]) for k in rows[0][0]}
        return x, torch.stack([r[1] for r in rows])

    def state(self) -> State:
        return self.upstream.state()

    def reset(self, state: State | None = None) -> None:
        self.upstream.reset(state)
