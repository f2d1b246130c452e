"""torchtitan glue for :class:`~torchtitan_ext.text.prefetch.PrefetchingParquetLoader`.

Registered as ``parquet_prefetch`` (``[dataloader] name = "parquet_prefetch"`` in a TOML config);
the default loader of the main job. The Trainer builds it with
``config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=, local_batch_size=,
snapshot_every_n_steps=)``; everything about *how* batches are made lives in
``torchtitan_ext.text``. The Config is *made of* the stages' options (it inherits
:class:`~torchtitan_ext.text.parquet_source.ParquetOptions`,
:class:`~torchtitan_ext.text.pack_stage.PackOptions` and
:class:`~torchtitan_ext.pipeline.prefetch.PrefetchOptions`: flat TOML keys, each documented once
there) and hands each stage its own with :func:`torchtitan_ext.pipeline.stage.options`.

Checkpoint: the one envelope of :mod:`torchtitan_ext.pipeline.checkpoint`, gathered from every DP
rank when it is taken, resumable at any DP degree (:mod:`torchtitan_ext.text.parquet_resume`):
bitwise at the same degree; at another, every document of the epoch exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.mix import MixOptions, MixtureError
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import State, options
from torchtitan_ext.text.pack_stage import PackOptions
from torchtitan_ext.text.parquet_mix import MixedParquetLoader
from torchtitan_ext.text.parquet_resume import (
    LOADER,
    check_stream_kind,
    resume_mixture_state,
    resume_state,
)
from torchtitan_ext.text.parquet_source import ParquetOptions
from torchtitan_ext.text.prefetch import PrefetchingParquetLoader
from torchtitan_ext.text.tokenize import TextTokenizer

logger = logging.getLogger(__name__)


class PrefetchingParquetDataLoader(BaseDataLoader):
    """Parquet shards -> background read + tokenize -> BOS best-fit packed batches."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config, ParquetOptions, PackOptions, PrefetchOptions, MixOptions):
        dataset: str = "parquet"
        """Informational name of the dataset (logged); the data comes from ``dataset_path``."""

        dataset_path: str | None = None
        """Directory, glob (``data/*.parquet``) or file of Parquet shards. ``None`` uses the
        embedded public-domain corpus (built once into the cache dir; no download);
        ``"embedded:war_and_peace"`` / ``"embedded:shakespeare"`` one of its two corpora alone.
        Leave it unset with ``[[dataloader.sources]]`` (each source names its own ``path``)."""

        tokenizer_path: str | None = None
        """A tokenizer dir or ``tokenizer.json`` overriding the Trainer's tokenizer (the one built
        from ``hf_assets_path``). ``None``: use the Trainer's, or the embedded corpus's tokenizer
        when the Trainer passes none and ``dataset_path`` is ``None``."""

        bos_token: str | None = None
        """The token string that starts every document and row (BOS), e.g. ``"<|endoftext|>"``
        for a tokenizer that declares none (``train-tokenizer`` output without
        ``--bos-token``). None: the tokenizer's own (``bos_token`` in tokenizer_config.json)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        tokenizer: Any = None,
        seq_len: int | None = None,
        local_batch_size: int = 1,
        snapshot_every_n_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        # snapshot_every_n_steps is not needed: our state is exact after every batch and cheap to
        # take (~0.3 ms at T=2048 with 1000 buffered documents).
        if seq_len is None:
            # torchtitan's main branch passes max_context_length instead of seq_len.
            seq_len = kwargs.get("max_context_length")
        if seq_len is None:
            raise ValueError("PrefetchingParquetDataLoader needs seq_len")
        tok: Any = config.tokenizer_path or tokenizer
        self.config = config
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.loader: PrefetchingParquetLoader | MixedParquetLoader
        if config.sources:
            if config.dataset_path is not None:
                raise MixtureError(
                    f"[dataloader] dataset_path = {config.dataset_path!r} and "
                    "[[dataloader.sources]] are both set: a mixture names each source's path; "
                    "remove dataset_path"
                )
            self.loader = self._mixture(config, tok, int(seq_len), int(local_batch_size))
            logger.info(f"parquet_prefetch: {self.loader.describe()}")
            return
        from torchtitan_ext.data.embedded import ensure_embedded_data, resolve_embedded

        path: Any = config.dataset_path
        if path is not None:
            path = resolve_embedded(path)  # "embedded:<corpus>"
        if path is None or tok is None:
            root = ensure_embedded_data()
            if path is None:
                path = root
            if tok is None:
                tok = root / "tokenizer"
        if config.bos_token is not None:
            tok = TextTokenizer.coerce(tok, bos_token=config.bos_token)
        self.loader = PrefetchingParquetLoader(
            path,
            tok,
            seq_len=int(seq_len),
            batch_size=int(local_batch_size),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            source=options(ParquetOptions, config),
            pack=options(PackOptions, config),
            prefetch=options(PrefetchOptions, config),
        )
        logger.info(f"parquet_prefetch: {self.loader.source.describe()}")

    def _mixture(self, config: Config, tok: Any, seq_len: int, batch_size: int) -> Any:
        """The mixture's loader; its sources are checked (footers only) before the tokenizer
        loads or a reader starts."""
        from torchtitan_ext.text.parquet_mix import check_parquet_sources

        paths = check_parquet_sources(
            config.sources or [], config.split, config.val_files, config.on_bad_input
        )
        if tok is None:
            from torchtitan_ext.data.embedded import embedded_tokenizer_dir

            tok = embedded_tokenizer_dir()
        if config.bos_token is not None:
            tok = TextTokenizer.coerce(tok, bos_token=config.bos_token)
        return MixedParquetLoader(
            config.sources or [],
            tok,
            seq_len=seq_len,
            batch_size=batch_size,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            stop=config.mix_stop,
            paths=paths,
            source=options(ParquetOptions, config),
            pack=options(PackOptions, config),
            prefetch=options(PrefetchOptions, config),
        )

    @property
    def pipeline(self) -> Prefetch:
        """The loader's :class:`~torchtitan_ext.pipeline.prefetch.Prefetch`: device staging
        (``[staging]``) installs its copy there and takes batches from it (fused mode: no thread,
        queue or state snapshot of its own). This adapter keeps that convention: its batches are
        ``pipeline.next()``, its state is made from ``pipeline.state()``, and ``iter()`` only
        resets the pipeline after a finished pass."""
        return self.loader.pipeline

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        if self.loader.done:
            # A finished single pass: a new iter() starts a new pass (validation reuse).
            self.loader.reset(None)
        return iter(self.loader)

    def __next__(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return next(self.loader)

    def get_stats(self) -> dict[str, float]:
        return self.loader.get_stats()

    def close(self) -> None:
        self.loader.close()

    # ------------------------------------------------------------------ checkpoint
    def rank_state(self) -> State:
        """This DP rank's state (no collective)."""
        return self.loader.rank_state()

    def state_dict(self, rank_state: Any = None) -> dict[str, Any]:
        """The one checkpoint envelope, holding every DP rank's state (one ``all_gather_object``
        when torch.distributed is initialised): identical on every rank, so DCP keeps one copy
        and a resume at another DP degree sees every old rank's position. ``rank_state``: the
        envelope of that state of this rank (a wrapper's snapshot) instead of the current one."""
        mine = self.rank_state() if rank_state is None else rank_state
        ranks = checkpoint.gather(mine, self.dp_rank, self.dp_world_size)
        return checkpoint.envelope(LOADER, ranks, "any")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`'s value, at this or another DP degree; an empty value
        is a fresh start; another format is refused in one line (``LoaderStateError``)."""
        if not state_dict:
            return  # an empty state is valid (fresh start), as in torchtitan
        ranks = checkpoint.open_envelope(state_dict, LOADER, self.dp_world_size)
        mixed = isinstance(self.loader, MixedParquetLoader)
        check_stream_kind(ranks, self.loader.names if mixed else None)
        checkpoint.check_like(ranks, self.rank_state(), LOADER)
        if isinstance(self.loader, MixedParquetLoader):
            units = [s.epoch_units for s in self.loader.sources]
            state = resume_mixture_state(ranks, self.dp_rank, self.dp_world_size, units)
        else:
            state = resume_state(
                ranks, self.dp_rank, self.dp_world_size, self.loader.source.epoch_units
            )
        try:
            self.loader.reset(state)
        except (KeyError, ValueError) as e:
            raise checkpoint.LoaderStateError(f"{LOADER}: cannot resume this state: {e}") from e
