"""The elastic-resume arithmetic: any chain of degrees reads every row of an epoch exactly once."""

from __future__ import annotations

import random

import pytest

from torchtitan_ext.pipeline.elastic import Phase, Progress, Unit, deal, redeal, remainder, replay


def _rows(units):
    return [(u.id, r) for u in units for r in range(u.lo, u.hi)]


def _read_some(units, nslots, rng):
    """Each slot reads a random prefix of its deal; returns (phase, rows read)."""
    progress, read = [], []
    for s in range(nslots):
        mine = deal(units, s, nslots)
        k = rng.randint(0, len(mine))
        j = rng.randint(0, mine[k].rows - 1) if k < len(mine) and mine[k].rows > 1 else 0
        read += _rows(mine[:k])
        if k < len(mine):
            read += [(mine[k].id, r) for r in range(mine[k].lo, mine[k].lo + j)]
        progress.append(Progress(k, j))
    return Phase(tuple(progress)), read


@pytest.mark.parametrize("seed", range(40))
def test_chain_of_degrees_reads_each_row_once(seed: int) -> None:
    rng = random.Random(seed)
    units = [Unit(i, 0, rng.randint(1, 6)) for i in rng.sample(range(50), rng.randint(1, 30))]
    everything = sorted(_rows(units))
    left, read, phases = list(units), [], []
    for _ in range(rng.randint(1, 4)):
        phase, got = _read_some(left, rng.randint(1, 5), rng)
        phases.append(phase)
        read += got
        left = remainder(left, phase)
    assert replay(units, phases) == left
    assert sorted(read + _rows(left)) == everything  # nothing lost, nothing twice


def test_dp_2_3_1_example() -> None:
    units = [Unit(i, 0, 4) for i in range(6)]
    # 2 slots: slot 0 read unit 0 and 2 rows of unit 2; slot 1 read nothing of unit 1
    left = remainder(units, Phase((Progress(1, 2), Progress(0, 0))))
    assert left == [Unit(1, 0, 4), Unit(2, 2, 4), Unit(3, 0, 4), Unit(4, 0, 4), Unit(5, 0, 4)]
    assert deal(left, 2, 3) == [Unit(3, 0, 4)]


def test_progress_beyond_the_deal_is_refused() -> None:
    with pytest.raises(ValueError, match="slot 1 of 2 claims 3 units"):
        remainder([Unit(i, 0, 1) for i in range(4)], Phase((Progress(0, 0), Progress(3, 0))))


def test_redeal_keeps_every_item_once() -> None:
    held = [["a", "b", "c"], [], ["d"]]
    assert redeal(held, 2) == [["a", "c"], ["b", "d"]]
    assert sorted(sum(redeal(held, 5), [])) == ["a", "b", "c", "d"]
