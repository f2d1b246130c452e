"""Mixtures for the streaming text loader: one chain per slot over several sources.

With ``[[dataloader.sources]]`` (:class:`~torchtitan_ext.pipeline.mix.SourceSpec`) the chain of
one slot (``dp_rank * workers + worker``, as for a single source) is::

    source k: StreamDocs(its files, slot, nslots) -> PackBatches(rows) ─┐  (one per source)
                                                                        ├─> Mix -> RowBatches
    (stream = the slot's global index, so every slot draws its own sequence)

* **A row never straddles sources**: each source has its own reader and packer, and ``Mix``
  draws whole packed rows (``seq_len + 1`` tokens), so a weight is a share of rows = tokens.
* **Each source is a single-source stream** in everything else: the same window options
  (``skip_first``, ``max_documents``, ``repeat_window``, ``shuffle_buffer``, ``seed``) apply
  to each source's own documents, with its own ``split`` / ``text_column`` / ``format`` where
  the source table gives one; ``max_epochs`` ends it after that many passes (``mix_stop`` says
  what the mixture does then). A new epoch of a source is logged with the source's name.
* **Resume**: at the same slots each slot resumes its own state (bitwise). At another number of
  slots :func:`resume_slots` applies :func:`~torchtitan_ext.pipeline.mix.resume_mix` with the
  single-source elastic merge (:func:`~torchtitan_ext.text.stream_elastic.merge`) as each
  source's resume: within each source's interrupted epoch no document is lost or read twice.
* **State** of a slot: ``Mix.state()`` (``draws``, ``stream``, ``ended``, ``taken``, ``names``,
  ``sources``: each source's slot state, the single-source form). :func:`mixture_stats` gives
  the per-rank stats in ``Mix.stats``'s shape.

Debug: with ``emit_doc_ids`` every row also carries ``doc_sources`` (the source's index in the
mixture per token, -1 on padding), since document ids are numbered within each source.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_ext.pipeline.checkpoint import LoaderStateError
from torchtitan_ext.pipeline.mix import (
    Mix,
    MixStop,
    MixtureError,
    SourceSpec,
    check_sources,
    mismatch_message,
    normalized,
    resume_mix,
)
from torchtitan_ext.pipeline.stage import Map, State
from torchtitan_ext.text.row_batches import RowBatches
from torchtitan_ext.text.stream_elastic import merge
from torchtitan_ext.text.stream_pack import PackBatches, PackOptions
from torchtitan_ext.text.stream_source import FORMATS, StreamSource
from torchtitan_ext.text.stream_stages import (
    StreamDocs,
    StreamOptions,
    open_source,
    slot_stats,
)
from torchtitan_ext.text.stream_workers import merged_stats
from torchtitan_ext.text.tokenize import TextTokenizer

WHERE = "[[dataloader.sources]]"


def source_options(spec: SourceSpec, stream: StreamOptions) -> StreamOptions:
    """The loader's stream options with this source's own ``split`` / ``text_column`` /
    ``format`` where the source table gives one."""
    return dataclasses.replace(
        stream,
        split=spec.split if spec.split is not None else stream.split,
        text_column=spec.text_column if spec.text_column is not None else stream.text_column,
        format=spec.format if spec.format is not None else stream.format,
    )


def open_sources(specs: Sequence[SourceSpec], stream: StreamOptions) -> list[StreamSource]:
    """Every source opened (files located, Parquet footers read), or :class:`MixtureError`, one
    line naming the source: :func:`~torchtitan_ext.pipeline.mix.check_sources`' rules first (no
    file is touched for them), then an unknown ``format``, then per source what opening it
    finds (no files, an unreadable Parquet footer, an empty window: the source's own checks,
    each prefixed with the source's name)."""
    check_sources(specs, WHERE)
    for s in specs:
        if s.format is not None and s.format not in FORMATS:
            raise MixtureError(
                f"{WHERE} source {s.name!r}: unknown format {s.format!r}; use one of "
                f"{sorted(FORMATS)} (or leave it out: by file suffix)"
            )
    out = []
    for s in specs:
        label = f"{WHERE} source {s.name!r}"
        try:
            src = open_source(s.path or s.dataset, source_options(s, stream))
        except (OSError, ValueError) as e:  # FileNotFoundError, BadInputError, format errors
            raise MixtureError(f"{label}: {e}") from e
        out.append(src)
    return out


def tag_source(k: int, row: Any) -> Any:
    """Add ``doc_sources`` (``k`` where a token has a document id, else -1) to a debug row."""
    x, labels = row
    ids = x["doc_ids"]
    x["doc_sources"] = torch.where(ids >= 0, torch.full_like(ids, k), torch.full_like(ids, -1))
    return x, labels


@dataclass
class MixChainSpec:
    """What a slot (a thread or a worker process) needs to build its mixture chain; pickled
    into each worker, as :class:`~torchtitan_ext.text.stream_workers.ChainSpec` is (the same
    ``build(slot, nslots)``, so :class:`~torchtitan_ext.text.stream_workers.WorkerChains` runs
    either)."""

    specs: list[SourceSpec]
    sources: list[StreamSource]
    stream: StreamOptions
    pack: PackOptions
    tokenizer: TextTokenizer
    seq_len: int
    batch_size: int
    stop: MixStop

    def build(self, slot: int, nslots: int) -> RowBatches:
        chains: list[Any] = []
        for k, (spec, src) in enumerate(zip(self.specs, self.sources, strict=True)):
            docs = StreamDocs(
                src, source_options(spec, self.stream), slot, nslots,
                max_epochs=spec.max_epochs, label=spec.name,
            )  # fmt: skip
            rows: Any = PackBatches(docs, self.tokenizer, self.seq_len, self.pack, None)
            if self.pack.emit_doc_ids:
                rows = Map(rows, functools.partial(tag_source, k))
            chains.append(rows)
        mix = Mix(chains, self.specs, seed=self.stream.seed, stream=slot, stop=self.stop)
        return RowBatches(mix, self.batch_size, self.tokenizer.pad_id or 0)


def resume_slots(old: list[State], slots: Sequence[int], nslots: int) -> list[State]:
    """The states of new slots ``slots`` (of ``nslots``) from every old slot's mixture state:
    :func:`~torchtitan_ext.pipeline.mix.resume_mix` with each source merged over the old slots
    by the single-source :func:`~torchtitan_ext.text.stream_elastic.merge` (computed once per
    source for all new slots)."""
    merged: dict[int, list[State]] = {}

    def resume_chain(k: int, states: list[State], slot: int, world: int) -> State:
        if k not in merged:
            merged[k] = merge(states, world)
        return merged[k][slot]

    return [resume_mix(old, s, nslots, resume_chain) for s in slots]


def check_resumable(saved: State, names: list[str] | None, loader: str) -> None:
    """:class:`LoaderStateError` (one line naming the sources) unless the saved slot state
    ``saved`` is of the same kind as this loader's: both one dataset, or both a mixture of the
    same sources in the same order (``names``; None: this loader reads one dataset)."""
    saved_names = list(saved["names"]) if isinstance(saved, dict) and "names" in saved else None
    fresh = "start the data stream afresh with --checkpoint.exclude_from_loading dataloader"
    if saved_names is None and names is not None:
        raise LoaderStateError(
            f"{loader}: the checkpoint's data stream reads one dataset, but {WHERE} is a mixture "
            f"of {', '.join(map(repr, names))}; to continue with the mixture, {fresh}"
        )
    if saved_names is not None and names is None:
        raise LoaderStateError(
            f"{loader}: the checkpoint's data stream is a mixture of "
            f"{', '.join(map(repr, saved_names))}, but [dataloader] reads one dataset (no "
            f"{WHERE}); to continue with it, {fresh}"
        )
    if saved_names is not None and saved_names != names:
        raise LoaderStateError(f"{loader}: {mismatch_message(saved_names, names or [])}")


def mixture_stats(specs: Sequence[SourceSpec], slots: Sequence[State]) -> dict[str, Any]:
    """One rank's stats over its slots' mixture states, in ``Mix.stats``'s shape: the sources'
    counters (each merged over the slots as a single source's are) summed, except ``epoch``
    (the highest source's, as the Parquet mixture reports it), the skip reasons merged, and
    ``sources: {name: {its counters, items, share, target, ended}}``."""
    per = [merged_stats([slot_stats(s["sources"][k]) for s in slots]) for k in range(len(specs))]
    taken = [sum(int(s["taken"][k]) for s in slots) for k in range(len(specs))]
    total = sum(taken)
    out: dict[str, Any] = {}
    skips: dict[str, int] = {}
    for st in per:
        for key, v in st.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                out[key] = out.get(key, 0) + v
        for key, v in st.get("skips", {}).items():
            skips[key] = skips.get(key, 0) + int(v)
    out["skips"] = skips
    if per:  # a sum of epochs means nothing: the furthest source (has any started repeating)
        out["epoch"] = max(int(st.get("epoch", 0)) for st in per)
    out["sources"] = {
        spec.name: {
            **st,
            "items": n,
            "share": n / total if total else 0.0,
            "target": float(p),
            "ended": all(bool(s["ended"][k]) for s in slots),
        }
        for k, (spec, st, n, p) in enumerate(zip(specs, per, taken, normalized(specs), strict=True))
    }
    return out
