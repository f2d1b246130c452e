"""Resuming the Parquet loader at the same or another DP degree: pure functions over rank states.

A checkpoint holds every old DP rank's state (:mod:`torchtitan_ext.pipeline.checkpoint`: one
envelope, gathered at checkpoint time). :func:`resume_state` gives a new rank its state:

* **Same degree** — the rank's own state: the stream continues bitwise.
* **Another degree** — :func:`merge_rank_states`, made of three parts:

  ==============  ===============================================================================
  source          :func:`merge_positions`: the old ranks'
                  progress becomes a phase of the epoch (also of later epochs for ranks that
                  were ahead): the new ranks deal what nobody read, in epoch order
  packer          what the old ranks had read but not yet emitted (buffered documents;
                  concat-split: each old rank's pending run as one item) dealt to the new ranks
                  with ``elastic.redeal``, in old-rank order
  counters        ``rows_read`` ... and skips, packer counters: new rank 0 carries the old sums,
                  the others start at 0, so the totals over ranks reconcile (per rank they do not)
  ==============  ===============================================================================

Guarantee (``tests/test_parquet_pipeline.py`` through ``tests/support/resume.py``): over any chain
of degrees, every document of an epoch is emitted exactly once — none lost, none twice — even when
the old ranks were in different epochs. What changes is which rank emits it and when; batches at
another degree are not the ones the old degree would have made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torchtitan_ext.pipeline.checkpoint import LoaderStateError
from torchtitan_ext.pipeline.elastic import Phase, Progress, Unit, redeal, replay
from torchtitan_ext.pipeline.stage import State
from torchtitan_ext.text import packer_state
from torchtitan_ext.text.parquet_position import Position

LOADER = "parquet_prefetch"


def merge_positions(
    positions: Sequence[Position], units_of: Callable[[int], list[Unit]]
) -> Position:
    """The position, at any new degree, that continues the old slots' ``positions`` (slot ``s``
    of ``len(positions)``): the lowest epoch among them, whose phases gain one phase made of the
    old slots' progress. Slots already in a later epoch count as having finished the earlier
    one, and what they read of the later epochs becomes a phase of those epochs (``ahead``), so
    no row of any epoch is read twice or lost, whatever epochs the old slots were in. The new
    slot starts its deal at ``Progress(0, 0)``. ``units_of(epoch)``: the epoch's global order
    (:func:`~torchtitan_ext.text.parquet_position.epoch_units`)."""
    n = len(positions)
    lo, hi = min(p.epoch for p in positions), max(p.epoch for p in positions)

    def known_phases(e: int) -> tuple[Phase, ...]:
        for p in positions:  # any slot at e or before knows e's earlier phases
            if p.epoch == e:
                return p.phases
            if p.epoch < e and e - p.epoch - 1 < len(p.ahead):
                return p.ahead[e - p.epoch - 1]
        return ()

    per_epoch: list[tuple[Phase, ...]] = []
    for e in range(lo, hi + 1):
        phases = known_phases(e)
        left = len(replay(units_of(e), phases))
        prog = tuple(
            Progress(len(range(s, left, n)), 0)
            if p.epoch > e
            else (p.progress if p.epoch == e else Progress())
            for s, p in enumerate(positions)
        )
        touched = any(pr != Progress() for pr in prog)
        per_epoch.append(phases + (Phase(prog),) if touched else phases)
    later = next(p.ahead for p in positions if p.epoch == hi)
    return Position(lo, per_epoch[0], Progress(), tuple(per_epoch[1:]) + later)


def _summed(dicts: Sequence[dict[str, Any]], keep: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + (int(v) if keep else 0)
    return out


def merge_rank_states(
    old: Sequence[State], new_rank: int, new_world: int, units_of: Callable[[int], list[Unit]]
) -> State:
    """New rank ``new_rank`` of ``new_world``'s state, continuing the old ranks' ``old`` states
    (rank order; compact or live packers). ``units_of(epoch)``: the epoch's global order."""
    n = len(old)
    for s, st in enumerate(old):
        slot = [int(x) for x in st["source"]["slot"]]
        if slot != [s, n]:
            raise LoaderStateError(
                f"{LOADER}: the dataloader state of DP rank {s} of {n} names slot {slot}"
            )
    for key in ("seq_len", "batch_size"):
        if len({int(st[key]) for st in old}) != 1:
            raise LoaderStateError(f"{LOADER}: the old DP ranks' states disagree on {key}")
    packers = [packer_state.compact(st["packer"]) for st in old]
    kind, row_len = int(packers[0]["kind"]), int(packers[0]["row_len"])
    if any((int(p["kind"]), int(p["row_len"])) != (kind, row_len) for p in packers):
        raise LoaderStateError(f"{LOADER}: the old DP ranks' states disagree on the packer")
    try:
        pos = merge_positions([Position.from_state(st["source"]) for st in old], units_of)
    except ValueError as e:  # a progress beyond its deal: not a state of this data
        raise LoaderStateError(
            f"{LOADER}: the dataloader state does not fit this data ({e})"
        ) from e
    mine = redeal([packer_state.items(p) for p in packers], new_world)[new_rank]
    first = new_rank == 0
    return {
        "seq_len": int(old[0]["seq_len"]),
        "batch_size": int(old[0]["batch_size"]),
        "source": pos.to_state(new_rank, new_world),
        "packer": packer_state.from_items(
            mine, kind, row_len, _summed([p["counters"] for p in packers], first)
        ),
        "counters": _summed([st["counters"] for st in old], first),
        "skips": {k: v for k, v in _summed([st["skips"] for st in old], first).items() if v},
    }


def resume_state(
    ranks: Sequence[State],
    dp_rank: int,
    dp_world_size: int,
    units_of: Callable[[int], list[Unit]],
) -> State:
    """This rank's state from every old rank's (``checkpoint.open_envelope``'s output)."""
    if len(ranks) == dp_world_size:
        return ranks[dp_rank]
    return merge_rank_states(ranks, dp_rank, dp_world_size, units_of)


# ---------------------------------------------------------------------------- mixtures
def check_stream_kind(ranks: Sequence[State], names: Sequence[str] | None) -> None:
    """Refuse, in one line, a checkpoint whose data stream is not the configured one: a
    single-source state for a mixture (``names``: its sources) or a mixture's for a single
    source (``names`` None), or a mixture with other sources (added / removed, named)."""
    from torchtitan_ext.pipeline.mix import mismatch_message

    saved = ranks[0].get("mix") if ranks and isinstance(ranks[0], dict) else None
    afresh = "start the data stream afresh with --checkpoint.exclude_from_loading dataloader"
    if names is None and saved is not None:
        raise LoaderStateError(
            f"{LOADER}: the checkpoint's data stream is a mixture of "
            f"{', '.join(map(repr, saved.get('names', [])))} and this config reads one dataset "
            f"(dataset_path); to continue with one dataset, {afresh}"
        )
    if names is not None and saved is None:
        raise LoaderStateError(
            f"{LOADER}: the checkpoint's data stream is a single dataset and this config is a "
            f"mixture of {', '.join(map(repr, names))} ([[dataloader.sources]]); to continue "
            f"with the mixture, {afresh}"
        )
    if names is not None and list(saved.get("names", [])) != list(names):
        raise LoaderStateError(f"{LOADER}: {mismatch_message(list(saved['names']), names)}")


def resume_mixture_state(
    ranks: Sequence[State],
    dp_rank: int,
    dp_world_size: int,
    units_of: Sequence[Callable[[int], list[Unit]]],
) -> State:
    """This rank's mixture state (``parquet_mix.ParquetRowBatches.state()``) from every old rank's:
    the same degree resumes its own; another degree merges each source over the old ranks with
    :func:`merge_rank_states` (``units_of[k]``: source ``k``'s epoch order) through
    :func:`~torchtitan_ext.pipeline.mix.resume_mix`; the batch counter carries on new rank 0."""
    from torchtitan_ext.pipeline.mix import resume_mix

    if len(ranks) == dp_world_size:
        return ranks[dp_rank]
    for key in ("seq_len", "batch_size"):
        if len({int(st[key]) for st in ranks}) != 1:
            raise LoaderStateError(f"{LOADER}: the old DP ranks' states disagree on {key}")

    def chain(k: int, olds: list[State], rank: int, world: int) -> State:
        return merge_rank_states(olds, rank, world, units_of[k])

    mix = resume_mix([st["mix"] for st in ranks], dp_rank, dp_world_size, chain)
    return {
        "seq_len": int(ranks[0]["seq_len"]),
        "batch_size": int(ranks[0]["batch_size"]),
        "batches": sum(int(st["batches"]) for st in ranks) if dp_rank == 0 else 0,
        "mix": mix,
    }
