"""Elastic resume as pure arithmetic: what is left of an epoch, and who reads it at a new DP degree.

The model (Mosaic Streaming resumes at a new world size the same way: the position is global, the
split among ranks is recomputed):

* An epoch is a global, rank-independent list of :class:`Unit` s — rows ``[lo, hi)`` of one
  reading unit (a Parquet row group, a shard piece, or a single document). A reader with
  ``nslots`` slots (DP ranks x workers) gives slot ``s`` the units ``units[s::nslots]``
  (:func:`deal`) and reads them in that order.
* A slot's position inside that deal is a :class:`Progress`: whole units finished, and rows read
  of the next one.
* When a run with ``nslots`` slots stops, :func:`remainder` turns every slot's progress into the
  units nobody has read yet — in the epoch's order, partly read units starting at their first
  unread row — and the next run deals *that* list to its own slots. A run that changes its
  degree several times in one epoch applies this once per change (:func:`replay`): the state
  needed is the list of past *phases* (``nslots`` and each slot's progress), a few ints per slot,
  never a list of documents.
* What a slot had read but not yet emitted (documents buffered by a packer) is dealt again by
  :func:`redeal`, in old-slot order, so no document is lost or emitted twice.

Invariant (tested over random degrees and progress in ``tests/test_pipeline_elastic.py``): for
any chain of phases, the rows read in the phases plus the rows of the remainder are the epoch's
rows, each exactly once. At an unchanged degree nothing here runs: a slot continues its own deal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Unit:
    """Rows ``[lo, hi)`` of reading unit ``id`` (``hi - lo`` rows; a document is ``(doc, 0, 1)``)."""

    id: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    def as_list(self) -> list[int]:
        return [self.id, self.lo, self.hi]

    @classmethod
    def of(cls, v: Sequence[int]) -> Unit:
        return cls(int(v[0]), int(v[1]), int(v[2]))


@dataclass(frozen=True)
class Progress:
    """How far one slot got through its deal: ``units_done`` whole units, then ``rows_done`` rows
    of the next one."""

    units_done: int = 0
    rows_done: int = 0

    def as_list(self) -> list[int]:
        return [self.units_done, self.rows_done]

    @classmethod
    def of(cls, v: Sequence[int]) -> Progress:
        return cls(int(v[0]), int(v[1]))


@dataclass(frozen=True)
class Phase:
    """A stretch of one epoch read at one degree: ``progress[s]`` is slot ``s``'s at its end."""

    progress: tuple[Progress, ...]

    @property
    def nslots(self) -> int:
        return len(self.progress)

    def to_state(self) -> list[list[int]]:
        return [p.as_list() for p in self.progress]

    @classmethod
    def from_state(cls, v: Sequence[Sequence[int]]) -> Phase:
        return cls(tuple(Progress.of(p) for p in v))


def deal(units: Sequence[T], slot: int, nslots: int) -> list[T]:
    """Slot ``slot``'s share of ``units`` out of ``nslots``, in reading order."""
    if not 0 <= slot < nslots:
        raise ValueError(f"slot {slot} is not in [0, {nslots})")
    return list(units[slot::nslots])


def remainder(units: Sequence[Unit], phase: Phase) -> list[Unit]:
    """The units of ``units`` that no slot of ``phase`` has read, in their order; a partly read
    unit stays, starting at its first unread row."""
    left: dict[int, Unit | None] = {}  # index in units -> what is left of it (None: all read)
    n = phase.nslots
    for s, prog in enumerate(phase.progress):
        mine = range(s, len(units), n)
        if prog.units_done > len(mine) or (prog.units_done == len(mine) and prog.rows_done):
            raise ValueError(
                f"slot {s} of {n} claims {prog.units_done} units + {prog.rows_done} rows, "
                f"its deal has {len(mine)} units"
            )
        for k in mine[: prog.units_done]:
            left[k] = None
        if prog.units_done < len(mine):
            k = mine[prog.units_done]
            u = units[k]
            if not 0 <= prog.rows_done <= u.rows:
                raise ValueError(f"slot {s}: {prog.rows_done} rows read of a {u.rows}-row unit")
            left[k] = Unit(u.id, u.lo + prog.rows_done, u.hi) if prog.rows_done < u.rows else None
    return [left.get(k, u) for k, u in enumerate(units) if left.get(k, u) is not None]


def replay(units: Sequence[Unit], phases: Sequence[Phase]) -> list[Unit]:
    """The units left after ``phases`` (in order), starting from an epoch's ``units``."""
    out = list(units)
    for ph in phases:
        out = remainder(out, ph)
    return out


def redeal(held: Sequence[Sequence[Any]], nslots: int) -> list[list[Any]]:
    """Items held by the old slots (``held[s]``, in each slot's order) dealt to ``nslots`` new
    slots: the concatenation in old-slot order, item ``i`` to slot ``i % nslots``."""
    flat = [x for per_slot in held for x in per_slot]
    return [flat[s::nslots] for s in range(nslots)]
