"""Mixtures for the Parquet loader: one reader and packer per source, a weighted draw per row.

``[[dataloader.sources]]`` (:class:`~torchtitan_ext.pipeline.mix.SourceSpec`) turns the chain of
:mod:`torchtitan_ext.text.prefetch` into::

    ParquetSource(source A) -> PackedRows ─┐
    ParquetSource(source B) -> PackedRows ─┼─> Mix ──> ParquetRowBatches ──> Prefetch
    ...                                    ─┘ (stream = dp_rank)

Each source has its own reader (its row groups dealt to the DP ranks as for a single source,
its own epochs and ``max_epochs``) and its own packer, so **a row never holds two sources** and
a weight is a share of rows of ``seq_len + 1`` tokens, i.e. of tokens. A source's chain yields
numpy rows (:class:`~torchtitan_ext.text.pack_stage.PackedRows`); :class:`ParquetRowBatches`
copies ``batch_size`` drawn rows into one array and makes the usual ``({"input", "positions"},
labels)`` tensors once per batch, with the single-source loader's own ``to_batch``; at the end of
a finite mixture the last batch is padded with ignored-label rows exactly as
:class:`~torchtitan_ext.text.pack_stage.PackedBatches` pads a single source's, so shapes never
change.

State (``ParquetRowBatches.state()``): ``seq_len``, ``batch_size``, ``batches`` and ``mix`` (the
:class:`~torchtitan_ext.pipeline.mix.Mix` state: draws, per-source ``taken`` and each source's
own ``PackedRows`` state). Resume: the same degree continues bitwise; another degree goes
through :func:`~torchtitan_ext.pipeline.mix.resume_mix` with the single-source merge
(:func:`~torchtitan_ext.text.parquet_resume.merge_rank_states`) per source, so within each
source's epoch no document is lost or read twice (:func:`resume_mixture_state`).

Bad input is found before anything is read: :func:`check_parquet_sources` (the mixture's own
rules, then each source's files and row count from the footers) raises one
:class:`~torchtitan_ext.pipeline.mix.MixtureError` line naming the source and its path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from torchtitan_ext.pipeline.loader import PrefetchedLoader
from torchtitan_ext.pipeline.mix import Mix, MixStop, MixtureError, SourceSpec, check_sources
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.text.pack_stage import (
    Batch,
    PackedRow,
    PackedRows,
    PackOptions,
    pad_rows,
    to_batch,
)
from torchtitan_ext.text.parquet_source import ParquetOptions, ParquetSource
from torchtitan_ext.text.tokenize import TextTokenizer

WHERE = "[[dataloader.sources]]"


def source_path(spec: SourceSpec) -> str:
    """The Parquet path a source reads (``"embedded:<corpus>"`` resolved, built on first use)."""
    from torchtitan_ext.data.embedded import resolve_embedded

    return resolve_embedded(str(spec.path))


def check_parquet_sources(
    specs: Sequence[SourceSpec],
    split: str = "train",
    val_files: str = "auto",
    on_bad_input: str = "error",
) -> list[str]:
    """The sources' resolved paths, after checking (footers only, no rows read) that each one
    can be served: :func:`~torchtitan_ext.pipeline.mix.check_sources`, then a local ``path``
    (not a hub ``dataset``) in Parquet, matching files of ``split``, holding at least one row.
    Anything else is one :class:`MixtureError` line naming the source and its path (an
    unreadable file too, unless ``on_bad_input = "skip"``: the reader then counts it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchtitan_ext.text.parquet import list_split

    check_sources(specs, WHERE)
    paths = []
    for s in specs:
        label = f"{WHERE} source {s.name!r}"
        if s.dataset is not None:
            raise MixtureError(
                f"{label}: parquet_prefetch reads local Parquet files; give 'path' (a directory, "
                f"glob or file), not dataset = {s.dataset!r}"
            )
        if s.format not in (None, "parquet"):
            raise MixtureError(f"{label}: parquet_prefetch reads Parquet, not format {s.format!r}")
        try:
            path = source_path(s)
            files = list_split(path, s.split or split, val_files)
        except (OSError, ValueError) as e:
            said = str(s.path) in str(e)  # the reader's message names the path already
            raise MixtureError(
                f"{label}: {e}" if said else f"{label}: path {s.path!r}: {e}"
            ) from None
        rows = 0
        for f in files:
            try:
                rows += pq.ParquetFile(f).metadata.num_rows
            except (OSError, pa.ArrowException) as e:
                if on_bad_input == "skip":
                    continue
                raise MixtureError(
                    f"{label}: path {s.path!r}: {f} is not readable Parquet ({e})"
                ) from None
        if rows == 0:
            raise MixtureError(
                f"{label}: path {s.path!r} is an empty source: its {len(files)} "
                f"{s.split or split} file(s) hold 0 rows"
            )
        paths.append(path)
    return paths


class ParquetRowBatches(Stage[Batch]):
    """``batch_size`` rows drawn by the :class:`~torchtitan_ext.pipeline.mix.Mix` (each a
    :class:`~torchtitan_ext.text.pack_stage.PackedRow` of one source) per batch, with the
    Parquet loader's state around the mixture's: ``seq_len`` and ``batch_size`` (a resumed
    stream cannot change them), ``batches``, and the figures of :meth:`stats` a plain sum over
    sources gets wrong.

    The rows are copied into one ``[B, seq_len + 1]`` array and shifted into tensors once, by
    the single-source loader's own :func:`~torchtitan_ext.text.pack_stage.to_batch`; at the end
    of a finite mixture the missing rows are padding (ignored labels) as there, so every batch
    has ``batch_size`` rows (the invariant of :mod:`~torchtitan_ext.text.row_batches`)."""

    def __init__(self, upstream: Mix[PackedRow], *, seq_len: int, batch_size: int, pad_id: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.upstream = self.mix = upstream  # close / interrupt / join_threads pass on to it
        self.seq_len, self.batch_size = seq_len, int(batch_size)
        self.pad_id = int(pad_id)
        self.batches = 0

    def next(self) -> Batch:
        B, R = self.batch_size, self.seq_len + 1
        tokens = np.empty((B, R), dtype=np.int64)
        positions = np.empty((B, R), dtype=np.int64)
        valid = [R] * B
        for i in range(B):
            try:
                row = self.mix.next()
            except StopIteration:
                if i == 0:
                    raise
                pad_rows(tokens, positions, valid, i, self.pad_id)
                break
            tokens[i], positions[i], valid[i] = row.tokens, row.positions, row.valid
        self.batches += 1
        return to_batch(tokens, positions, valid)

    def state(self) -> State:
        return {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "batches": self.batches,
            "mix": self.mix.state(),
        }

    def reset(self, state: State | None = None) -> None:
        if state is None:
            self.mix.reset(None)
            self.batches = 0
            return
        for key, mine in (("seq_len", self.seq_len), ("batch_size", self.batch_size)):
            if int(state[key]) != mine:
                raise ValueError(
                    f"loader state has {key}={int(state[key])}, this loader has {key}={mine}: "
                    "a resumed data stream cannot change it"
                )
        self.mix.reset(state["mix"])
        self.batches = int(state["batches"])

    def stats(self, state: State) -> dict[str, Any]:
        """:meth:`Mix.stats <torchtitan_ext.pipeline.mix.Mix.stats>` (the sources' counters
        summed, and ``sources``: each one's own, whose ``items`` / ``batches`` are rows), with
        the figures a sum gets wrong made again: ``batches`` (this stage's), ``crop_pct`` and
        ``fill_pct`` (over every source's packer) and ``epoch`` (the highest source epoch: has
        any source started repeating)."""
        out = self.mix.stats(state["mix"])
        srcs = state["mix"]["sources"]
        pcs = [s["packer"]["counters"] for s in srcs]
        tin, tout = sum(p["tokens_in"] for p in pcs), sum(p["tokens_out"] for p in pcs)
        rows = sum(p["rows"] for p in pcs)
        out["batches"] = int(state["batches"])
        out["crop_pct"] = 100.0 * sum(p["tokens_cropped"] for p in pcs) / max(tin, 1)
        out["fill_pct"] = 100.0 * tout / max(rows * (self.seq_len + 1), 1)
        out["epoch"] = max(int(s["source"]["epoch"]) for s in srcs)
        return out


class MixedParquetLoader(PrefetchedLoader):
    """The Parquet loader over a mixture of sources (see the module docstring); the same calls
    as :class:`~torchtitan_ext.text.prefetch.PrefetchingParquetLoader`.

    Each source reads with the shared ``source`` options but its own ``path``, and its
    ``text_column`` / ``split`` / ``max_epochs`` where the :class:`SourceSpec` sets them.
    ``paths``: the sources' paths as :func:`check_parquet_sources` returned them (None: it is
    called here, before the tokenizer or any reader is built).
    """

    def __init__(
        self,
        specs: Sequence[SourceSpec],
        tokenizer: Any,
        *,
        seq_len: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        stop: MixStop = "all_exhausted",
        paths: Sequence[str] | None = None,
        read_delay_s: float = 0.0,
        source: ParquetOptions | None = None,
        pack: PackOptions | None = None,
        prefetch: PrefetchOptions | None = None,
    ) -> None:
        src_o, pack_o = source or ParquetOptions(), pack or PackOptions()
        self.specs = list(specs)
        if paths is None:  # else: check_parquet_sources' result, the caller checked already
            paths = check_parquet_sources(
                self.specs, src_o.split, src_o.val_files, src_o.on_bad_input
            )
        tok = TextTokenizer.coerce(tokenizer)
        self.sources: list[ParquetSource] = []
        self.packs: list[PackedRows] = []
        for spec, path in zip(self.specs, paths, strict=True):
            o = dataclasses.replace(
                src_o,
                text_column=spec.text_column or src_o.text_column,
                split=spec.split or src_o.split,  # type: ignore[arg-type]
                max_epochs=spec.max_epochs if spec.max_epochs is not None else src_o.max_epochs,
            )
            src = ParquetSource(
                path, o, dp_rank=dp_rank, dp_world_size=dp_world_size,
                read_delay_s=read_delay_s, name=spec.name,
            )  # fmt: skip
            self.sources.append(src)
            self.packs.append(PackedRows(src, tok, pack_o, seq_len=seq_len))
        self.mix = Mix(self.packs, self.specs, seed=src_o.seed, stream=dp_rank, stop=stop)
        pad = self.packs[0].packer.pad_id
        self.rows = ParquetRowBatches(self.mix, seq_len=seq_len, batch_size=batch_size, pad_id=pad)
        self.pipeline = Prefetch(
            self.rows, prefetch or PrefetchOptions(), name=f"parquet-mix-{src_o.split}-dp{dp_rank}"
        )
        self.tokenizer = tok
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def describe(self) -> str:
        w = self.mix.p
        return f"a mixture of {len(self.specs)} sources: " + "; ".join(
            f"{s.name!r} (weight {p:.3g}) {src.describe()}"
            for s, p, src in zip(self.specs, w, self.sources, strict=True)
        )

    @property
    def skip_counts(self) -> dict[str, int]:
        """Skipped records per reason over every source, as of the last batch returned."""
        out: dict[str, int] = {}
        for s in self.pipeline.state()["mix"]["sources"]:
            for k, v in s["skips"].items():
                out[k] = out.get(k, 0) + int(v)
        return out

    # ------------------------------------------------------------------ state
    def rank_state(self) -> State:
        """This rank's state as of the last batch returned, every source's packer compact."""
        st = self.pipeline.state()
        srcs = [
            p.checkpoint_state(s) for p, s in zip(self.packs, st["mix"]["sources"], strict=True)
        ]
        return {**st, "mix": {**st["mix"], "sources": srcs}}
