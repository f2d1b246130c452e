"""torchtitan glue for the offline Qwen3-VL cache: ``[dataloader] name = "cached_vl"``.

``CachedVLDataLoader.Config(...).build(dp_rank=, dp_world_size=, tokenizer=, seq_len=,
local_batch_size=)`` (what torchtitan's trainer calls) hands each stage its options
(``vl/options.py``, which the Config inherits: flat TOML keys, each documented once) and opens
:class:`torchtitan_ext.vl.reader.VLReader`, which owns everything about reading: the data source
(cache, cache built now, or the online fallback), the chain of stages (``.pipeline``: a
``Prefetch`` in process, or the DataLoader workers), the exact global position and the step-log
stats. This module only speaks torchtitan.

Checkpoint format: the one envelope of ``pipeline/checkpoint.py``, ``loader = "cached_vl"``,
``resumable_at = "any"``. VL's position is global (packs all ranks together consumed, computed,
never snapshotted per rank), so every rank's state is the same value: ``state_dict()`` writes it
once per rank of the saving job (``dp_world_size`` = that job's DP degree) without a collective —
a gather would move identical values — and DCP keeps one copy of the identical envelope. A job at
any DP degree loads it (the ranks' positions must agree). A checkpoint of the previous release
(its bare ``{"global": <position>}``) still loads: it holds exactly that position.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torchtitan.components.dataloader import BaseDataLoader

from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.mix import MixOptions
from torchtitan_ext.pipeline.prefetch import PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage, State, options
from torchtitan_ext.vl.collate import PackCollator, PixelNorm
from torchtitan_ext.vl.mix_reader import MixVLReader
from torchtitan_ext.vl.options import BatchOptions, OrderOptions, SourceOptions, WorkerOptions
from torchtitan_ext.vl.pack_source import OnlinePreprocessingWarning
from torchtitan_ext.vl.reader import VLReader, processor_path

logger = logging.getLogger(__name__)

LOADER = "cached_vl"
"""The loader name in the checkpoint envelope."""


class CachedVLDataLoader(BaseDataLoader):
    """Feeds torchtitan (or an HF training loop) from the offline Qwen3-VL cache."""

    @dataclass(kw_only=True, slots=True)
    class Config(
        BaseDataLoader.Config,
        PrefetchOptions,
        WorkerOptions,
        BatchOptions,
        OrderOptions,
        SourceOptions,
        MixOptions,
    ):
        """Every field is a stage's option, documented there: ``vl/options.py`` (source, order,
        batch, workers), ``PrefetchOptions`` (the background hand-off) and ``MixOptions``
        (``[[dataloader.sources]]``, a mixture: ``vl/mix_reader.py``). Bases are listed last
        to first so the fields keep the order mixture, source, order, batch, workers, prefetch."""

        batch_shapes_vary: ClassVar[bool] = True
        """A pack's ``pixel_values`` rows (its patch count) change from step to step, so the
        trainer turns torchtitan's whole-step CUDA graph off (``config.py``)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        tokenizer: Any = None,
        seq_len: int | None = None,
        local_batch_size: int = 1,
        snapshot_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        # `snapshot_every_n_steps` is moot: the state is computed, not snapshotted. torchtitan
        # main passes extra kwargs: ignored.
        del snapshot_every_n_steps
        if kwargs:
            logger.debug("CachedVLDataLoader ignores build kwargs %s", sorted(kwargs))
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        stages = (
            options(SourceOptions, config),
            options(OrderOptions, config),
            options(BatchOptions, config),
            options(WorkerOptions, config),
            options(PrefetchOptions, config),
        )
        kw: dict[str, Any] = dict(
            seq_len=config.pack_seq_len or seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            tokenizer=tokenizer,
        )
        mix = options(MixOptions, config)
        self.reader = MixVLReader(*stages, mix, **kw) if mix.sources else VLReader(*stages, **kw)

    # -- facts (the reader's, under the loader's name: probes, tests, benchmarks) ---------------
    @property
    def pipeline(self) -> Stage[Any]:
        """The top stage: a ``Prefetch`` (device staging fuses its copy into it) or, with
        DataLoader workers, the worker stage."""
        return self.reader.pipeline

    @property
    def source(self) -> str:
        return self.reader.source

    @property
    def cache_path(self) -> Path | None:
        return self.reader.cache_path

    @property
    def dataset(self) -> Any:
        return self.reader.dataset

    @property
    def model_path(self) -> str | None:
        return self.reader.model_path

    @property
    def pack_seq_len(self) -> int:
        return self.reader.pack_seq_len

    @property
    def num_workers(self) -> int:
        return self.reader.num_workers

    @property
    def special_tokens(self) -> dict[str, int]:
        return self.reader.special_tokens

    @property
    def pixel_norm(self) -> PixelNorm:
        return self.reader.pixel_norm

    @property
    def collate(self) -> PackCollator:
        return self.reader.collate

    # -- torchtitan's calls ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        while True:
            try:
                yield self.reader.next()
            except StopIteration:
                return

    def finish_on_device(self, batch: Any) -> Any:
        """Normalise uint8 pixel_values where the batch now lives (``normalize_on="device"``)."""
        return self.reader.finish_on_device(batch)

    def close(self) -> None:
        """Stop the background thread / worker processes (idempotent)."""
        self.reader.close()

    def rank_state(self) -> State:
        """This rank's state: the global position (the same on every rank)."""
        return self.reader.rank_state()

    def state_dict(self, rank_state: Any = None) -> dict[str, Any]:
        """The one checkpoint envelope (of ``rank_state``, a wrapper's snapshot, when given)."""
        mine = self.rank_state() if rank_state is None else rank_state
        return checkpoint.envelope(LOADER, [mine] * self.dp_world_size, "any")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        legacy = state_dict.get(checkpoint.KEY)
        if isinstance(legacy, dict) and "format" not in legacy and "epoch" in legacy:
            self.reader.load_rank_state(legacy)  # the previous release's bare position
            return
        ranks = checkpoint.open_envelope(state_dict, LOADER, self.dp_world_size)
        if any(r != ranks[0] for r in ranks[1:]):
            raise checkpoint.LoaderStateError(
                f"{LOADER}: the checkpoint's DP ranks hold different positions; a cached_vl "
                "state is the same on every rank (was it written by another loader version?)"
            )
        self.reader.check_source(ranks[0])  # first: its message says more than missing keys
        checkpoint.check_like(ranks, self.rank_state(), LOADER)
        self.reader.load_rank_state(ranks[0])

    def get_stats(self) -> dict[str, Any]:
        """Numbers for the step log line (``VLReader.get_stats``); a mixture adds ``sources``
        (``MixVLReader.get_stats``)."""
        return self.reader.get_stats()


__all__ = ["CachedVLDataLoader", "OnlinePreprocessingWarning", "processor_path"]
