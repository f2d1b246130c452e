"""torchtitan glue for the streaming text loader (registry name ``"streaming_text"``).

Built by torchtitan as ``config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=,
local_batch_size=, ...)``. The loader is a chain of stages on :mod:`torchtitan_ext.pipeline`
(:mod:`~torchtitan_ext.text.stream_stages`): documents of a slot -> tokenize + pack + batch,
run by :class:`~torchtitan_ext.pipeline.prefetch.Prefetch` (``num_workers = 0``: one thread)
or by :class:`~torchtitan_ext.text.stream_workers.WorkerChains` (``num_workers > 0``: one chain
per worker process). A slot is ``dp_rank * workers + worker`` of ``dp_world_size * workers``.

Checkpoint: the one format (:mod:`torchtitan_ext.pipeline.checkpoint`), ``resumable_at="any"``.
This rank's state (:meth:`StreamingTextDataLoader.rank_state`) is ``{"workers": [slot state per
worker], "next": k}``. :meth:`~StreamingTextDataLoader.load_state_dict`: the same DP degree and
worker count -> this rank's own state (bitwise resume); the same number of slots otherwise ->
each slot's own state; another number of slots -> :func:`~torchtitan_ext.text.stream_elastic.
merge` (what is left of the epoch, dealt document by document).

Mixtures (``[[dataloader.sources]]``, :class:`~torchtitan_ext.pipeline.mix.MixOptions`): each
slot runs :class:`~torchtitan_ext.text.stream_mix.MixChainSpec`'s chain (per source documents ->
rows, then ``Mix`` -> ``RowBatches``) under the same ``Prefetch`` / ``WorkerChains``; a slot's
state is then the ``Mix`` state, re-dealt at another number of slots by
:func:`~torchtitan_ext.text.stream_mix.resume_slots`. A checkpoint of another mixture, or of one
dataset when the config has a mixture (and the reverse), is refused in one line naming the
sources (:func:`~torchtitan_ext.text.stream_mix.check_resumable`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.mix import MixOptions, MixtureError
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage, State, options
from torchtitan_ext.text.stream_elastic import merge
from torchtitan_ext.text.stream_mix import (
    WHERE,
    MixChainSpec,
    check_resumable,
    mixture_stats,
    open_sources,
    resume_slots,
)
from torchtitan_ext.text.stream_pack import PackOptions
from torchtitan_ext.text.stream_stages import StreamOptions, open_source, slot_stats
from torchtitan_ext.text.stream_workers import ChainSpec, WorkerChains, merged_stats
from torchtitan_ext.text.streaming import check_args
from torchtitan_ext.text.tokenize import TextTokenizer

logger = logging.getLogger(__name__)

NAME = "streaming_text"


def _pinned(batch: Any) -> Any:
    x, y = batch
    return {k: v.pin_memory() for k, v in x.items()}, y.pin_memory()


class StreamingTextDataLoader(BaseDataLoader):
    """Streaming text loader: infinite, disjoint over DP ranks x workers, exactly resumable,
    resumable at another DP degree or worker count."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config, StreamOptions, PackOptions, PrefetchOptions, MixOptions):
        dataset: str = ""
        """Hugging Face hub dataset id, used when ``dataset_path`` is empty (and there are no
        ``[[dataloader.sources]]``)."""

        dataset_path: str | None = None
        """Local Parquet / JSONL / text file, directory or glob (e.g. ``data/train-*.parquet``)."""

        tokenizer_path: str | None = None
        """Tokenizer directory / tokenizer.json; overrides the trainer's tokenizer when set."""

        batches_per_iter: int | None = None
        """If set, each iteration over the loader yields exactly this many batches (a fixed-size
        evaluation); the next iteration continues the stream."""

        num_workers: int = 0
        """Worker processes, each reading its own disjoint slot (0: one thread in-process)."""

        persistent_workers: bool = True
        """Kept for old configs: the stream is one long-lived iterator, so workers always
        persist and a new iteration always continues the stream."""

        prefetch_factor: int | None = None
        """Batches prefetched per worker (num_workers > 0; torch's default 2)."""

        pin_memory: bool = False
        """Pin batches in page-locked memory (when CUDA is available)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            logger.debug("StreamingTextDataLoader ignores build kwargs %s", sorted(kwargs))
        tok = config.tokenizer_path or tokenizer
        if tok is None:
            raise ValueError("streaming_text: no tokenizer (set dataloader.tokenizer_path)")
        source = config.dataset_path or config.dataset
        specs = list(config.sources) if config.sources else None
        if specs is not None and source:
            raise MixtureError(
                f"streaming_text: both [dataloader] dataset_path/dataset ({source!r}) and "
                f"{WHERE} are set; a mixture names every dataset in its sources"
            )
        if not source and specs is None:
            raise ValueError("streaming_text: set dataloader.dataset_path (or a hub id in dataset)")
        stream = options(StreamOptions, config)
        check_args(
            seq_len=seq_len,
            seed=stream.seed,
            skip_first=stream.skip_first,
            max_documents=stream.max_documents,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.specs = specs
        spec: ChainSpec | MixChainSpec
        if specs is None:
            self.tokenizer = TextTokenizer.coerce(tok)
            self.sources = [open_source(source, stream)]
            spec = ChainSpec(
                self.sources[0], stream, options(PackOptions, config), self.tokenizer, seq_len,
                local_batch_size,
            )  # fmt: skip
        else:
            self.sources = open_sources(specs, stream)  # the one-line checks before the tokenizer
            self.tokenizer = TextTokenizer.coerce(tok)
            spec = MixChainSpec(
                specs, self.sources, stream, options(PackOptions, config), self.tokenizer,
                seq_len, local_batch_size, config.mix_stop,
            )  # fmt: skip
        self.workers = max(1, config.num_workers)  # slots of this rank
        self.nslots = dp_world_size * self.workers
        self.slots = [dp_rank * self.workers + w for w in range(self.workers)]
        self.stage: Stage[Any]
        if config.num_workers == 0:
            pin = config.pin_memory and torch.cuda.is_available()
            self.stage = Prefetch(
                spec.build(self.slots[0], self.nslots),
                options(PrefetchOptions, config),
                name=f"streaming_text[dp{dp_rank}]",
                then=_pinned if pin else None,
            )
        else:
            self.stage = WorkerChains(
                spec,
                self.slots,
                self.nslots,
                prefetch_factor=config.prefetch_factor,
                pin_memory=config.pin_memory,
            )

    @property
    def pipeline(self) -> Stage[Any] | None:
        """The top stage when it is the one Prefetch and every batch is its ``next()``
        (``num_workers = 0``, no ``batches_per_iter``): device staging then fuses its copy into
        that thread. Otherwise None, and staging runs its own hand-off over this loader."""
        if isinstance(self.stage, Prefetch) and self.config.batches_per_iter is None:
            return self.stage
        return None

    def __iter__(self):
        quota = self.config.batches_per_iter
        n = 0
        while quota is None or n < quota:
            try:
                batch = self.stage.next()
            except StopIteration:
                return
            n += 1
            yield batch

    @property
    def source(self):
        """The (first) source: the one dataset of a single-source loader."""
        return self.sources[0]

    def num_documents(self) -> int:
        """Documents in the window (of every source of a mixture; counts every shard of it that
        has no metadata)."""
        return sum(s.num_documents() for s in self.sources)

    def close(self) -> None:
        self.stage.close()

    # ------------------------------------------------------------------ checkpointing
    def rank_state(self) -> State:
        """This DP rank's state, ``{"workers": [slot state per worker], "next": k}`` (no
        collective; ints, strs, lists and the packers' arrays)."""
        st = self.stage.state()
        return st if self.config.num_workers > 0 else {"workers": [st], "next": 0}

    def state_dict(self, rank_state: Any = None) -> dict[str, Any]:
        """The one envelope, identical on every rank (one gather at checkpoint time); of
        ``rank_state`` (a wrapper's snapshot) when given, else of the current state."""
        mine = self.rank_state() if rank_state is None else rank_state
        ranks = checkpoint.gather(mine, self.dp_rank, self.dp_world_size)
        return checkpoint.envelope(NAME, ranks, "any")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # an empty state is valid (fresh start), as in torchtitan
        ranks = checkpoint.open_envelope(state_dict, NAME, self.dp_world_size, self.rank_state())
        names = [s.name for s in self.specs] if self.specs is not None else None
        for r in ranks:
            for slot in r["workers"]:
                check_resumable(slot, names, NAME)
        try:
            mine = self._mine(ranks)
            self.stage.reset(mine if self.config.num_workers > 0 else mine["workers"][0])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise checkpoint.LoaderStateError(f"{NAME}: cannot resume this state: {e!r}") from e

    def _mine(self, ranks: list[Any]) -> dict[str, Any]:
        """This rank's state out of the old ranks' (the same slots, or the rest re-dealt)."""
        old = [slot for r in ranks for slot in r["workers"]]
        if len(ranks) == self.dp_world_size and len(ranks[0]["workers"]) == self.workers:
            mine = ranks[self.dp_rank]
        elif len(old) == self.nslots:
            mine = {"workers": [old[s] for s in self.slots], "next": 0}
        else:
            logger.info(
                "%s: resuming %d slots (%d DP ranks) as %d slots: re-dealing the rest of the epoch",
                NAME,
                len(old),
                len(ranks),
                self.nslots,
            )
            if self.specs is None:
                merged = merge(old, self.nslots)
                mine = {"workers": [merged[s] for s in self.slots], "next": 0}
            else:
                mine = {"workers": resume_slots(old, self.slots, self.nslots), "next": 0}
        return mine

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict[str, Any]:
        """Epoch (slowest slot), documents used and skips, summed over this rank's slots, as of
        the last batch returned; a mixture adds them over its sources and gives each source's
        own under ``sources`` (:func:`~torchtitan_ext.text.stream_mix.mixture_stats`)."""
        slots = self.rank_state()["workers"]
        if self.specs is not None:
            return mixture_stats(self.specs, slots)
        return merged_stats([slot_stats(s) for s in slots])
