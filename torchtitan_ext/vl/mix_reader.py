"""MixVLReader: one DP rank's batches of a VL mixture (``[[dataloader.sources]]`` of ``cached_vl``).

Each source has its OWN cache, found or built exactly as a single-source ``cached_vl`` finds or
builds it (``vl/pack_source.py``), from the source's ``dataset`` / ``path``, ``split`` and
``format`` and the loader's other cache-key options. Re-weighting, adding or removing a source
therefore never processes an image of an existing source again: it changes only the mixed order
(``vl/mix_position.py``), a pure function of the seed, the weights and the caches' pack counts.

Checked before anything is read, each in one line naming the source: the mixture itself
(``pipeline.mix.check_sources``), a source with no cache and no way to build one (a mixture never
falls back to online preprocessing), a source whose cache holds no packs, and two sources whose
caches were made by different processors, tokenizers or chat templates (their recorded
fingerprints differ), naming both. A checkpoint of another mixture is refused with
``pipeline.mix.mismatch_message``.

Everything else is :class:`~torchtitan_ext.vl.reader.VLReader`'s: the batch options, the
tokenizer check, the collate, ``next`` / ``close``; ``get_stats`` adds ``sources`` in the
``pipeline.mix.Mix.stats`` shape.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchtitan_ext.pipeline.mix import (
    MixOptions,
    MixtureError,
    SourceSpec,
    check_sources,
    mismatch_message,
    normalized,
)
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.vl.collate import PackCollator, PixelNorm
from torchtitan_ext.vl.mix_position import MixPlan, Walker
from torchtitan_ext.vl.mix_stages import (
    POSITION_KEYS,
    MixedVLDataset,
    MixPacks,
    MixWorkerBatches,
    strip_counters,
)
from torchtitan_ext.vl.options import BatchOptions, OrderOptions, SourceOptions, WorkerOptions
from torchtitan_ext.vl.plan import PlannedStore
from torchtitan_ext.vl.reader import VLReader, _check, check_model_tokenizer, processor_path
from torchtitan_ext.vl.stages import CollatePacks, CountBatches

WHERE = "[[dataloader.sources]]"

SAME_BUILD = (
    ("processor", "processor, tokenizer or chat template"),
    ("special_tokens", "special-token ids"),
    ("image_params", "image preprocessing (patch / merge size, pixel norm)"),
)
"""Manifest entries every source's cache must share (one model reads them all)."""


def source_request(base: SourceOptions, spec: SourceSpec) -> SourceOptions:
    """The single-source request of one source: the loader's options with the source's
    ``dataset`` / ``path``, ``split`` and ``format``."""
    return replace(
        base,
        dataset=spec.dataset or "",
        dataset_path=spec.path,
        split=spec.split or base.split,
        format=spec.format or base.format,  # type: ignore[arg-type]
    )


def check_mixture(source: SourceOptions, specs: list[SourceSpec], where: str = WHERE) -> None:
    """One-line errors for a mixture this loader cannot read, before any cache is opened."""
    check_sources(specs, where)
    if source.cache_path:
        raise MixtureError(
            f"{where}: dataloader.cache_path names one cache; a mixture finds each source's "
            "cache by its key under dataloader.cache_dir (unset cache_path)"
        )
    for s in specs:
        if s.text_column is not None:
            raise MixtureError(
                f"{where} source {s.name!r}: 'text_column' is not a cached_vl option (the row "
                "layout is 'format' and the *_column options)"
            )


def open_source_cache(req: SourceOptions, seq_len: int, name: str) -> Any:
    """Source ``name``'s cache (found, or built when the options say so), opened; MixtureError
    naming the source when it has none or it holds no packs."""
    from torchtitan_ext.vl import build
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.pack_source import choose_cache, key_args, open_cache_or_plan
    from torchtitan_ext.vl.store_lookup import source_absent

    label = f"{WHERE} source {name!r}"
    if not (req.use_preprocessed_cache or req.force_preprocess):
        raise MixtureError(
            f"{label}: a mixture reads caches only; use_preprocessed_cache = false (the "
            "single-source online fallback) cannot serve it"
        )
    try:
        kw = key_args(req, seq_len)
        if (
            not (req.force_preprocess or req.build_if_missing)
            and not source_absent(str(kw["dataset"]))  # absent: a store recorded for it
            and build.find_cache(**kw, store=True) is None
            and build.find_cache(**kw) is None
        ):
            raise MixtureError(
                f"{label}: no VL cache for {kw['dataset']} (split {req.split!r}) under "
                f"{req.cache_dir}; a mixture reads caches only: build it with "
                "`preprocess-cached` or set dataloader.build_if_missing = true"
            )
        path = choose_cache(req, seq_len)
        if path is None:
            raise MixtureError(f"{label}: no VL cache for {kw['dataset']} under {req.cache_dir}")
        opened = open_cache_or_plan(path, req, seq_len)  # a sample store: planned here
        cache = VLCache.open(opened) if isinstance(opened, Path) else opened
    except MixtureError:
        raise
    except (OSError, ValueError) as e:
        raise MixtureError(f"{label}: {e}") from e
    if len(cache) == 0:
        raise MixtureError(f"{label}: its cache {path} holds no packs (no usable rows)")
    return cache


def check_same_build(names: list[str], caches: list[Any]) -> None:
    """Every source's cache made by the same processor (MixtureError naming two sources)."""
    ref = caches[0].metadata
    for name, cache in zip(names[1:], caches[1:], strict=True):
        for key, what in SAME_BUILD:
            if cache.metadata.get(key) != ref.get(key):
                raise MixtureError(
                    f"{WHERE}: sources {names[0]!r} and {name!r} were preprocessed with a "
                    f"different {what} (caches {caches[0].path} and {cache.path}); one model "
                    "reads every source: build both caches with the same dataloader.model_path"
                )


def mix_plan(specs: list[SourceSpec], lens: list[int], mix: MixOptions, order: OrderOptions):
    """The :class:`MixPlan` of a mixture over caches of ``lens`` packs."""
    per_pass = [s.max_epochs or (None if order.infinite else 1) for s in specs]
    return MixPlan(
        lens=tuple(lens),
        p=tuple(float(x) for x in normalized(specs)),
        limits=tuple(None if e is None else e * n for e, n in zip(per_pass, lens, strict=True)),
        seed=int(order.seed),
        stop=mix.mix_stop,
        shuffle=order.shuffle,
        passes=not order.infinite,
    )


class MixVLReader(VLReader):
    """:class:`VLReader` over a mixture: one cache per source, the global mixed order
    (``vl/mix_position.py``), per-source stats. Facts as ``VLReader``'s, plus ``names`` and
    ``cache_paths`` (``cache_path`` is the first source's)."""

    def __init__(
        self,
        source: SourceOptions,
        order: OrderOptions,
        batch: BatchOptions,
        workers: WorkerOptions,
        prefetch: PrefetchOptions,
        mix: MixOptions,
        *,
        seq_len: int | None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        batch_size: int = 1,
        tokenizer: Any = None,
    ) -> None:
        specs = list(mix.sources or [])
        check_mixture(source, specs)
        self.pack_seq_len = _check(batch, order, batch_size, seq_len)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batch_size = batch_size
        t0 = time.perf_counter()
        self.model_path = processor_path(
            source.model_path, getattr(tokenizer, "tokenizer_path", None)
        )
        check_model_tokenizer(tokenizer, None, self.model_path)
        source = replace(source, model_path=self.model_path)
        self.names = [s.name for s in specs]
        caches = [
            open_source_cache(source_request(source, s), self.pack_seq_len, s.name) for s in specs
        ]
        check_same_build(self.names, caches)
        self.caches = caches  # each source's packs: a packed cache, or a store read by its plan
        self.cache_paths: list[Path] = [Path(c.path) for c in caches]
        # what a worker process opens: a packed cache by its path, a planned store as itself
        # (it pickles as its path and plan)
        reopen = [c if isinstance(c, PlannedStore) else Path(c.path) for c in caches]
        self.source, self.cache_path = "cache", self.cache_paths[0]
        self.special_tokens = dict(caches[0].special_tokens)
        self.num_workers = workers.num_workers
        self.walker = Walker(mix_plan(specs, [len(c) for c in caches], mix, order))
        self.dataset = MixedVLDataset(
            reopen,
            self.walker,
            rank=dp_rank,
            world=dp_world_size,
            remainder=order.remainder,
            block_size=batch_size,
        )
        self.open_s = time.perf_counter() - t0
        self.pixel_norm = PixelNorm.from_metadata(caches[0].metadata)
        self.collate = PackCollator(
            batch.batch_format, self.special_tokens, self.pixel_norm, batch.normalize_on
        )
        packs = MixPacks(
            caches,
            self.walker,
            self.names,
            rank=dp_rank,
            world=dp_world_size,
            remainder=order.remainder,
            copy_pixels=not self.collate.copies_pixels,
        )
        self.pipeline = self._mix_chain(packs, batch, workers, prefetch)
        self._wait_s = self._wait_last_s = 0.0

    def _mix_chain(
        self,
        packs: MixPacks,
        batch: BatchOptions,
        workers: WorkerOptions,
        prefetch: PrefetchOptions,
    ) -> Stage[Any]:
        pad_id = self.collate.pad_id
        if self.num_workers > 0:
            inner = MixWorkerBatches(
                self.dataset, packs, self.batch_size, self.collate, workers, batch.pin_memory
            )
            return CountBatches(inner, pad_id)
        collated = CollatePacks(packs, self.batch_size, self.collate, batch.pin_memory)
        return Prefetch(CountBatches(collated, pad_id), prefetch, name="vl-loader")

    # -- state ----------------------------------------------------------------------------------
    def rank_state(self) -> State:
        """The global position (the same on every rank), without this process's counters."""
        return strip_counters(self.pipeline.state()["at"])

    def check_source(self, position: State) -> None:
        """A position of another mixture, or of a single source, is refused in one line."""
        saved = position.get("names")
        if saved is None:
            raise MixtureError(
                f"the checkpoint holds a single-source cached_vl position but {WHERE} is set "
                f"({', '.join(map(repr, self.names))}); to continue with the mixture, start the "
                "data stream afresh with --checkpoint.exclude_from_loading dataloader"
            )
        if list(saved) != self.names:
            raise MixtureError(mismatch_message(list(saved), self.names))
        lens = [int(s["packs"]) for s in position["sources"]]
        now = list(self.walker.plan.lens)
        if lens != now or int(position["seed"]) != self.walker.plan.seed:
            changed = [n for n, a, b in zip(self.names, lens, now, strict=True) if a != b]
            raise MixtureError(
                f"the checkpoint's data mixture was read from other caches or another seed "
                f"(packs per source {lens} -> {now}{f', changed: {changed}' if changed else ''}; "
                f"seed {position['seed']} -> {self.walker.plan.seed}); to continue, start the "
                "data stream afresh with --checkpoint.exclude_from_loading dataloader"
            )

    def load_rank_state(self, position: State) -> None:
        """Restore a :meth:`rank_state` (saved at any DP degree); counters stay this process's."""
        self.check_source(position)
        now = self.pipeline.state()
        at = {**{k: position[k] for k in POSITION_KEYS}, "per": now["at"]["per"]}
        self.pipeline.reset({"at": at, "counts": list(now["counts"])})

    # -- stats ----------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        """``VLReader.get_stats``' numbers plus ``sources``: per source its ``packs``,
        ``tokens``, ``images``, ``patches``, ``items`` (= packs), realised ``share`` of the
        packs, ``target`` weight, ``epoch`` and ``ended``."""
        top = self.pipeline
        if isinstance(top, Prefetch):
            out = top.get_stats()
        else:
            out = {**top.stats(top.state()), "consumer_wait_ms": 1e3 * self._wait_s}
        sources = out.pop("sources")
        out["wait_ms_last"] = 1e3 * self._wait_last_s
        out["open_s"] = self.open_s
        return {**{k: float(v) for k, v in out.items()}, "sources": sources}
