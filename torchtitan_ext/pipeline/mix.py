"""Mixtures: one stage that interleaves several source chains by weight, and its elastic resume.

A mixture is ``[[dataloader.sources]]`` in a TOML config (:class:`SourceSpec`, one table per
source). The loader builds one chain per source (its own reader and packer, so a row never
straddles two sources), puts :class:`Mix` over them, then its usual batcher and ``Prefetch``::

    source A chain ─┐
    source B chain ─┼─> Mix ──> rows to batches ──> Prefetch ──> (staging) ──> adapter
    source C chain ─┘

What a draw is. ``Mix.next()`` draws a source and returns that source's next item. Draw ``d``
of stream ``s`` (a DP rank, or a rank x worker slot) is a pure function of ``(seed, s, d)``: the
draws come in blocks of :data:`BLOCK`, each a weighted ``choice`` of a generator seeded with
``(seed, s, d // BLOCK)``, so any draw can be recomputed from three ints (a resume needs no RNG
state) and the counts of source ``k`` over any window of ``N`` draws are binomial(``N``,
``w_k``), i.e. within a few ``sqrt(N w_k (1 - w_k))`` of ``N w_k`` (tested over sliding windows).

The weight's unit is the item a chain yields. For the text loaders that is one **packed row**
of ``seq_len + 1`` tokens, so a weight is a share of rows, hence of tokens: every row is full
except the very last one a finite source flushes, and each row holds one source only. (Weighting
documents instead would tie the token share to each source's document lengths; weighting
tokens by drawing per document would put several sources in one row.) For the VL cache the
item is a pack of one source's samples (``vl/mix_position.py`` says why).

Ends. A chain is finite when its source has ``max_epochs`` (or ``infinite = false``). When one
raises ``StopIteration``:

===================  ==========================================================================
``mix_stop``         what happens
===================  ==========================================================================
``"all_exhausted"``  the source leaves the mixture: its later draws are passed over, so the others
                     keep their relative weights; the mixture ends when every source has ended
``"first_exhausted"`` the mixture ends at once (every source then stays within its epochs)
===================  ==========================================================================

With no ``max_epochs`` a source repeats as its weight demands: its own chain starts its next
epoch (reshuffled by its seed and epoch) and logs it, naming the source.

State (:meth:`Mix.state`): ``draws`` (this stream's draws so far), ``stream``, ``ended`` (one
bool per source), ``taken`` (items returned per source) and ``sources`` (each chain's own
state, in :class:`SourceSpec` order). Invariant: ``sum(taken) + (draws passed over) == draws``,
and ``taken[k]`` equals the items source ``k``'s chain returned since the start, also after a
resume at the same degree. At another degree :func:`resume_mix` merges the old ranks' states
source by source with the loader's own per-source resume, so a mixture resumes elastically
exactly when each of its sources does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from torchtitan_ext.pipeline.stage import Stage, State

T = TypeVar("T")

BLOCK = 4096
"""Draws per generator block: one ``Generator.choice`` call per 4096 items (~40 us)."""

MixStop = Literal["all_exhausted", "first_exhausted"]


class MixtureError(ValueError):
    """A mixture that cannot be served; the message names the source (one line)."""


@dataclass(kw_only=True)
class SourceSpec:
    """One ``[[dataloader.sources]]`` table: a dataset in the mixture and its weight."""

    name: str
    """Names the source in logs, stats, checkpoints and errors (unique within the mixture)."""

    weight: float = 1.0
    """Relative share of the mixture's items (rows of ``seq_len + 1`` tokens for text, packs
    for VL); weights are normalised, so ``7`` and ``3`` mean 70 % and 30 %."""

    path: str | None = None
    """Local data: a file, directory or glob (Parquet for ``parquet_prefetch``; Parquet,
    JSON Lines or text for ``streaming_text``; the VL loaders' ``dataset`` forms)."""

    dataset: str | None = None
    """A dataset name where the loader takes one (a Hugging Face Hub name for
    ``streaming_text`` and ``cached_vl``); give ``path`` or ``dataset``."""

    text_column: str | None = None
    """The column holding the text; None: the loader's ``text_column``."""

    format: str | None = None
    """The file format where the loader reads several (``streaming_text``); None: by suffix."""

    split: str | None = None
    """The split to read; None: the loader's."""

    max_epochs: int | None = None
    """Stop this source after this many passes; None: repeat as its weight demands."""


@dataclass(kw_only=True)
class MixOptions:
    """Options of :class:`Mix` (a loader Config inherits them; TOML ``[dataloader]``)."""

    sources: list[SourceSpec] = field(default_factory=list)
    """The mixture, one ``[[dataloader.sources]]`` table per dataset; empty: the loader's single
    dataset (unchanged). (A list, not ``None``, when empty: tyro, torchtitan's command-line
    parser, cannot build a parser for an optional list of tables.)"""

    mix_stop: MixStop = "all_exhausted"
    """When a source with ``max_epochs`` ends: ``"all_exhausted"`` (it leaves the mixture, the
    others go on) or ``"first_exhausted"`` (the mixture ends)."""


def check_sources(specs: Sequence[SourceSpec], where: str = "[[dataloader.sources]]") -> None:
    """Raise :class:`MixtureError` (one line naming the source) for a mixture that cannot be
    drawn from: no sources, a duplicate or empty name, a weight that is negative, NaN,
    infinite or zero-sum, a ``max_epochs`` below 1, neither/both of ``path`` and ``dataset``,
    or one dataset listed twice (same data, column, format and split: each listing would read
    every document, so they would repeat within an epoch; a weight says how often instead)."""
    if not specs:
        raise MixtureError(f"{where}: a mixture needs at least one source")
    seen: set[str] = set()
    data_of: dict[tuple, str] = {}
    for i, s in enumerate(specs):
        label = f"{where} source {s.name!r}" if s.name else f"{where} source #{i}"
        if not s.name:
            raise MixtureError(f"{label}: 'name' is empty")
        if s.name in seen:
            raise MixtureError(f"{label}: the name is used twice; names must be unique")
        seen.add(s.name)
        w = s.weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
            raise MixtureError(f"{label}: weight must be a finite number >= 0, got {w!r}")
        if s.max_epochs is not None and s.max_epochs < 1:
            raise MixtureError(f"{label}: max_epochs must be >= 1, got {s.max_epochs}")
        if (s.path is None) == (s.dataset is None):
            raise MixtureError(f"{label}: give exactly one of 'path' and 'dataset'")
        data = (
            os.path.abspath(s.path) if s.path is not None else None,
            s.dataset, s.text_column, s.format, s.split,
        )  # fmt: skip
        if data in data_of:
            what = f"path = {s.path!r}" if s.path is not None else f"dataset = {s.dataset!r}"
            raise MixtureError(
                f"{label}: {what} is source {data_of[data]!r}'s data too; a dataset listed "
                "twice repeats its documents within an epoch: list it once and give it the "
                "summed weight"
            )
        data_of[data] = s.name
    if sum(s.weight for s in specs) <= 0:
        names = ", ".join(repr(s.name) for s in specs)
        raise MixtureError(f"{where}: the weights of {names} sum to 0; at least one must be > 0")


def normalized(specs: Sequence[SourceSpec]) -> np.ndarray:
    """The weights as probabilities (float64, summing to 1). Finite weights whose sum overflows
    (``1e308`` twice) are scaled by the largest first: dividing by an infinite sum made every
    probability 0, every source "ended" and the loader end before its first batch."""
    w = np.array([float(s.weight) for s in specs], dtype=np.float64)
    total = w.sum()
    if not math.isfinite(total):
        w = w / w.max()
        total = w.sum()
    return w / total


def draws_block(seed: int, stream: int, block: int, p: np.ndarray) -> np.ndarray:
    """Sources of draws ``block * BLOCK ... + BLOCK - 1`` of ``stream`` (int8/int16 indices)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, block])))
    return rng.choice(len(p), size=BLOCK, p=p).astype(np.int32)


class Mix(Stage[T]):
    """Weighted interleave of ``chains`` (one per :class:`SourceSpec`, same order); see the
    module docstring for draws, ends and the state."""

    def __init__(
        self,
        chains: Sequence[Stage[T]],
        specs: Sequence[SourceSpec],
        *,
        seed: int,
        stream: int = 0,
        stop: MixStop = "all_exhausted",
    ) -> None:
        if len(chains) != len(specs):
            raise ValueError(f"Mix: {len(chains)} chains for {len(specs)} sources")
        check_sources(specs)
        if stop not in ("all_exhausted", "first_exhausted"):
            raise ValueError(f"mix_stop must be 'all_exhausted' or 'first_exhausted', got {stop!r}")
        self.chains = list(chains)
        self.specs = list(specs)
        self.names = [s.name for s in specs]
        self.p = normalized(specs)
        self.seed, self.stop = int(seed), stop
        self._block_id = -1
        self._block: np.ndarray | None = None
        self._set(stream, 0, [False] * len(chains), [0] * len(chains))

    def _set(self, stream: int, draws: int, ended: list[bool], taken: list[int]) -> None:
        self.stream, self.draws = int(stream), int(draws)
        # a weight-0 source is never drawn: it counts as ended (it cannot hold the mixture open)
        self.ended = [bool(e) or self.p[k] == 0 for k, e in enumerate(ended)]
        self.taken = [int(t) for t in taken]
        self._over = self.stop == "first_exhausted" and any(
            e and self.p[k] > 0 for k, e in enumerate(ended)
        )
        self._block_id = -1

    def source_of(self, draw: int) -> int:
        """The source of draw ``draw`` of this stream (a pure function of seed, stream, draw)."""
        b = draw // BLOCK
        if b != self._block_id:
            self._block = draws_block(self.seed, self.stream, b, self.p)
            self._block_id = b
        return int(self._block[draw % BLOCK])  # type: ignore[index]

    def next(self) -> T:
        while not self._over and not all(self.ended):
            k = self.source_of(self.draws)
            self.draws += 1
            if self.ended[k]:
                continue  # passed over: the others keep their relative weights
            try:
                item = self.chains[k].next()
            except StopIteration:
                self.ended[k] = True
                if self.stop == "first_exhausted":
                    self._over = True
                continue
            self.taken[k] += 1
            return item
        raise StopIteration

    def state(self) -> State:
        return {
            "draws": self.draws,
            "stream": self.stream,
            "ended": list(self.ended),
            "taken": list(self.taken),
            "names": list(self.names),
            "sources": [c.state() for c in self.chains],
        }

    def reset(self, state: State | None = None) -> None:
        if state is None:
            for c in self.chains:
                c.reset(None)
            self._set(self.stream, 0, [False] * len(self.chains), [0] * len(self.chains))
            return
        if list(state["names"]) != self.names:
            raise MixtureError(mismatch_message(list(state["names"]), self.names))
        for c, s in zip(self.chains, state["sources"], strict=True):
            c.reset(s)
        self._set(state["stream"], state["draws"], list(state["ended"]), list(state["taken"]))

    def close(self) -> None:
        for c in self.chains:
            c.close()

    def interrupt(self) -> None:
        for c in self.chains:
            c.interrupt()

    def join_threads(self, group: Any) -> None:
        for c in self.chains:
            c.join_threads(group)

    def stats(self, state: State) -> dict[str, Any]:
        """The chains' counters summed (so a mixture reports the same keys as one source), plus
        ``sources``: per source its own counters, ``items``, realised ``share`` and ``target``."""
        per = [c.stats(s) for c, s in zip(self.chains, state["sources"], strict=True)]
        total = sum(state["taken"])
        out: dict[str, Any] = {}
        for st in per:
            for key, v in st.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out[key] = out.get(key, 0) + v
        out["sources"] = {
            name: {
                **st,
                "items": int(n),
                "share": (n / total) if total else 0.0,
                "target": float(p),
                "ended": bool(e),
            }
            for name, st, n, p, e in zip(
                self.names, per, state["taken"], self.p, state["ended"], strict=True
            )
        }
        return out


def mismatch_message(saved: Sequence[str], now: Sequence[str]) -> str:
    """One line saying how a checkpoint's mixture differs from the configured one, and the way
    to continue (the data stream afresh, the model and optimizer from the checkpoint)."""
    added = [n for n in now if n not in saved]
    removed = [n for n in saved if n not in now]
    parts = []
    if added:
        parts.append(f"added {', '.join(map(repr, added))}")
    if removed:
        parts.append(f"removed {', '.join(map(repr, removed))}")
    if not parts:
        parts.append(f"reordered (checkpoint: {list(saved)}, config: {list(now)})")
    return (
        f"the checkpoint's data mixture differs from [[dataloader.sources]]: {'; '.join(parts)}; "
        "to continue with the new mixture, start the data stream afresh with "
        "--checkpoint.exclude_from_loading dataloader"
    )


ResumeChain = Callable[[int, list[State], int, int], State]
"""``(source index, that source's state on every old rank, new rank, new world) -> its state on
the new rank``: the loader's own resume of one source (e.g. the Parquet loader's)."""


def resume_mix(old: Sequence[State], rank: int, world: int, resume_chain: ResumeChain) -> State:
    """This new rank's mixture state from every old rank's (``old[r]``, a :meth:`Mix.state`).

    Same degree: rank ``rank``'s own state (the stream continues bitwise). Another degree: each
    source's chain state is merged by ``resume_chain`` over the old ranks; the new rank draws
    from the start of its own stream (``stream = rank``), which is as good a sequence as any
    (the guarantee at another degree is per document, not per batch); ``taken`` carries the old
    sums on new rank 0 (totals over ranks reconcile, as the loaders' counters do); ``ended`` is
    recomputed by the chains themselves (an ended source ends again at its first draw)."""
    if len(old) == world:
        return old[rank]
    names = list(old[0]["names"])
    for s in old[1:]:
        if list(s["names"]) != names:
            raise MixtureError("the checkpoint's ranks disagree on the mixture's sources")
    k = len(names)
    sources = [resume_chain(i, [s["sources"][i] for s in old], rank, world) for i in range(k)]
    taken = [sum(int(s["taken"][i]) for s in old) if rank == 0 else 0 for i in range(k)]
    return {
        "draws": 0,
        "stream": rank,
        "ended": [False] * k,
        "taken": taken,
        "names": names,
        "sources": sources,
    }


MIX_STATE_KEYS = frozenset(("draws", "stream", "ended", "taken", "names", "sources"))
"""The keys of a :meth:`Mix.state` (how a mixture is recognised inside a loader's state)."""


def saved_names(state: Any) -> list[str] | None:
    """The source names of the first :meth:`Mix.state` found in a loader's rank state (a tree
    of dicts and lists, possibly as the checkpoint envelope encodes it), or None where it holds
    no mixture. Lists of numbers (token buffers) are not walked."""
    todo = [state]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if MIX_STATE_KEYS <= node.keys() and isinstance(node["names"], list | tuple):
                return [str(n) for n in node["names"]]
            if "__ndarray__" not in node:
                todo.extend(reversed(list(node.values())))
        elif isinstance(node, list | tuple) and node and isinstance(node[0], dict | list | tuple):
            todo.extend(reversed(node))
    return None
