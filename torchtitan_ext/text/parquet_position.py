"""Where a Parquet source slot is in its stream: :class:`Position` and the epoch order.

An epoch is the list of every row group of the split as :class:`~torchtitan_ext.pipeline.elastic.Unit`
``(row_group_index, 0, num_rows)`` (:func:`epoch_units`: permuted by ``(seed, epoch)`` when
shuffled, global, the same on every rank); DP rank ``r`` of ``n`` reads ``deal(units, r, n)``
(:class:`~torchtitan_ext.text.parquet_source.ParquetSource`).

Position (:class:`Position`, the stage's ``state()``), right after the last chunk:

==============  ====================================================================
``slot``        ``[dp_rank, dp_world_size]`` it belongs to (another slot is refused)
``epoch``       the epoch being read
``phases``      the past phases of this epoch at other DP degrees (``elastic.Phase``
                lists; empty unless the degree changed mid-epoch): this slot reads
                ``deal(replay(units, phases), r, n)``
``progress``    ``elastic.Progress`` in that deal: units finished, rows of the next
``ahead``       phases already known for the following epochs (only after a resume at
                another degree from ranks that were in different epochs)
==============  ====================================================================

A position at the end of a deal is normalised to the start of the next epoch, which starts at
the current degree with the phases of ``ahead[0]`` (none, normally). Resuming at another degree
is :func:`~torchtitan_ext.text.parquet_resume.merge_positions`: pure arithmetic over the old
ranks' positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_ext.pipeline.elastic import Phase, Progress, Unit


@dataclass(frozen=True)
class Position:
    """Where a slot is in the stream (see the module docstring's table)."""

    epoch: int = 0
    phases: tuple[Phase, ...] = ()
    progress: Progress = Progress()
    ahead: tuple[tuple[Phase, ...], ...] = ()

    @property
    def whole(self) -> bool:
        """At the very start of an epoch read at one degree only."""
        return self.progress == Progress() and not self.phases

    def next_epoch(self) -> Position:
        return Position(
            self.epoch + 1, self.ahead[0] if self.ahead else (), Progress(), self.ahead[1:]
        )

    def to_state(self, slot: int, nslots: int) -> dict[str, Any]:
        return {
            "slot": [slot, nslots],
            "epoch": self.epoch,
            "phases": [ph.to_state() for ph in self.phases],
            "progress": self.progress.as_list(),
            "ahead": [[ph.to_state() for ph in phs] for phs in self.ahead],
        }

    @classmethod
    def from_state(cls, v: dict[str, Any]) -> Position:
        return cls(
            int(v["epoch"]),
            tuple(Phase.from_state(p) for p in v["phases"]),
            Progress.of(v["progress"]),
            tuple(tuple(Phase.from_state(p) for p in phs) for phs in v["ahead"]),
        )


def epoch_units(rows: Sequence[int], epoch: int, seed: int, shuffle: bool) -> list[Unit]:
    """Epoch ``epoch``'s reading order of row groups with ``rows[i]`` rows each (global)."""
    n = len(rows)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else range(n)
    return [Unit(int(i), 0, int(rows[i])) for i in order]
