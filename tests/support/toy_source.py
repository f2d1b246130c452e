"""A whole loader from a new source in under 100 lines: what the pipeline gives a source for free.

``JsonlSource`` (one document per JSONL line) is the only part that knows the data; it reads its
deal of an epoch's line ranges (:mod:`~torchtitan_ext.pipeline.elastic` ``Unit`` s) and its state
is a few ints. ``PackRows`` tokenizes (bytes + 1; 0 pads) and cuts rows of ``seq_len + 1``
tokens, ``batch`` rows per item. :class:`~torchtitan_ext.pipeline.prefetch.Prefetch` runs both
in a thread; ``ToyJsonlLoader`` is the torchtitan-facing adapter. Free: the background hand-off,
stats, the checkpoint envelope, exact resume, elastic resume (old ranks' phases + redealt
buffers). Invariant: every document of a finite pass starts in exactly one batch
and ends in exactly one (``input["doc_starts"]``, ``input["doc_ends"]``), at any chain of DP
degrees.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.elastic import Phase, Progress, Unit, deal, redeal, replay
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage, State


class JsonlSource(Stage[tuple[int, str]]):
    """``(line id, text)`` (lines of ``files`` numbered in order); slot ``slot`` of ``nslots``
    reads its deal of the ``piece``-line ranges nobody read in the state's past ``phases``."""

    def __init__(self, files: list[Path], slot: int, nslots: int, infinite: bool, piece: int = 4):
        self.lines = [ln for f in files for ln in Path(f).read_text().splitlines()]
        n = len(self.lines)
        self.units = [Unit(i, i, min(i + piece, n)) for i in range(0, n, piece)]
        self.slot, self.nslots, self.infinite = slot, nslots, infinite
        self.reset(None)

    def reset(self, state: State | None = None) -> None:
        s = state or {"phases": [], "at": [0, 0], "epoch": 0}
        self.phases, self.at, self.epoch = s["phases"], Progress.of(s["at"]), int(s["epoch"])
        left = replay(self.units, [Phase.from_state(p) for p in self.phases])
        self.mine = deal(left, self.slot, self.nslots)

    def next(self) -> tuple[int, str]:
        u, r = self.at.units_done, self.at.rows_done
        if u == len(self.mine):
            if not self.infinite:
                raise StopIteration
            self.reset({"phases": [], "at": [0, 0], "epoch": self.epoch + 1})
            return self.next()
        line = self.mine[u].lo + r
        self.at = Progress(u + 1, 0) if line + 1 == self.mine[u].hi else Progress(u, r + 1)
        return line, json.loads(self.lines[line])["text"]

    def state(self) -> State:
        return {"phases": self.phases, "at": self.at.as_list(), "epoch": self.epoch}

    def stats(self, state: State) -> dict[str, Any]:
        return {"epoch": state["epoch"], "units_done": state["at"][0]}


class PackRows(Stage[tuple[dict, torch.Tensor]]):
    """Rows cut from the documents' concatenated byte tokens; state = source + held pieces
    ``[doc, start already emitted, tokens]`` (never mutated once made)."""

    def __init__(self, upstream: Stage[tuple[int, str]], seq_len: int, batch: int) -> None:
        self.upstream, self.n, self.b, self.held = upstream, seq_len + 1, batch, []

    def _row(self, starts: list[int], ends: list[int]) -> np.ndarray | None:
        row: list[np.ndarray] = []
        while (need := self.n - sum(map(len, row))) and (self.held or self._pull()):
            doc, started, toks = self.held[0]
            starts += [] if started else [doc]
            ends += [doc] if len(toks) <= need else []
            row.append(toks[:need])
            self.held[0:1] = [[doc, 1, toks[need:]]] if len(toks) > need else []
        return np.pad(np.concatenate(row), (0, need)) if row else None

    def _pull(self) -> bool:
        try:
            doc, text = self.upstream.next()
        except StopIteration:
            return False
        self.held.append([doc, 0, np.frombuffer(text.encode(), np.uint8).astype(np.int64) + 1])
        return True

    def next(self) -> tuple[dict, torch.Tensor]:
        starts, ends = [], []  # documents starting / ending in this batch
        rows = [r for _ in range(self.b) if (r := self._row(starts, ends)) is not None]
        if not rows:
            raise StopIteration
        x = torch.from_numpy(np.stack(rows))
        ids = {"doc_starts": torch.tensor(starts).long(), "doc_ends": torch.tensor(ends).long()}
        return {"input": x[:, :-1], **ids}, x[:, 1:]

    def state(self) -> State:
        return {"source": self.upstream.state(), "held": list(self.held)}

    def reset(self, state: State | None = None) -> None:
        self.upstream.reset(state and state["source"])
        self.held = [list(p) for p in state["held"]] if state else []

    def stats(self, state: State) -> dict[str, Any]:
        return {**self.upstream.stats(state["source"]), "held_docs": len(state["held"])}


class ToyJsonlLoader:
    """The adapter torchtitan (and ``tests/support/resume.py``) talks to."""

    name = "toy_jsonl"

    def __init__(self, files: list[Path], dp_rank: int, dp_world_size: int, *, infinite: bool,
                 seq_len: int = 16, batch: int = 2, options: PrefetchOptions | None = None):  # fmt: skip
        self.rank, self.world = dp_rank, dp_world_size
        src = JsonlSource(files, dp_rank, dp_world_size, infinite)
        self.pipeline = Prefetch(PackRows(src, seq_len, batch), options, name=self.name)

    def __iter__(self) -> Prefetch:
        return self.pipeline

    def rank_state(self) -> State:
        return self.pipeline.state()

    def state_dict(self, rank_state: State = None) -> dict[str, Any]:
        mine = self.rank_state() if rank_state is None else rank_state
        ranks = checkpoint.gather(mine, self.rank, self.world)
        return checkpoint.envelope(self.name, ranks, "any")

    def load_state_dict(self, value: dict[str, Any]) -> None:
        old = checkpoint.open_envelope(value, self.name, self.world)
        if len(old) == self.world:
            return self.pipeline.reset(old[self.rank])
        src = old[0]["source"]  # a new degree: one more phase, the old buffers dealt again
        phases = [*src["phases"], [r["source"]["at"] for r in old]]
        held = redeal([r["held"] for r in old], self.world)[self.rank]
        self.pipeline.reset({"source": {**src, "phases": phases, "at": [0, 0]}, "held": held})

    def get_stats(self) -> dict[str, Any]:
        return self.pipeline.get_stats()

    def close(self) -> None:
        self.pipeline.close()
