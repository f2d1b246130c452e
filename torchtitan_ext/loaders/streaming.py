"""torchtitan glue for :class:`~torchtitan_ext.text.streaming.StreamingTextDataset`
(registry name ``"streaming_text"``).

A ``torchdata`` ``StatefulDataLoader`` over the streaming dataset, built by torchtitan as
``config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=, local_batch_size=,
snapshot_every_n_steps=)``. Differences from torchtitan's ``ParallelAwareDataloader``: the
checkpoint state is *not* pickled (``{"dp_rank_{r}": <dict of ints/lists>, "world_size": R}``),
and ``get_stats()`` reports epoch / documents / skips for the per-step log line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from torchdata.stateful_dataloader import StatefulDataLoader
from torchtitan.components.dataloader import BaseDataLoader

from torchtitan_ext.text.streaming import StreamingTextDataset

logger = logging.getLogger(__name__)


def _dataset_states(state: Any) -> list[dict[str, Any]]:
    """Every per-worker ``dataset_state`` inside a StatefulDataLoader state dict."""
    found: list[dict[str, Any]] = []
    if isinstance(state, dict):
        ds = state.get("dataset_state")
        if isinstance(ds, dict) and "epoch" in ds:
            found.append(ds)
        for k, v in state.items():
            if k != "dataset_state":
                found += _dataset_states(v)
    return found


class StreamingTextDataLoader(StatefulDataLoader, BaseDataLoader):
    """Streaming text loader: infinite, disjoint over DP ranks x workers, exactly resumable."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = ""
        """Hugging Face hub dataset id, used when ``dataset_path`` is empty."""

        dataset_path: str | None = None
        """Local Parquet / JSONL / text file, directory or glob (e.g. ``data/train-*.parquet``)."""

        dataset_name: str | None = None
        """Hub dataset config name (``load_dataset(path, name)``); ignored for local files."""

        split: str = "train"
        """Hub split; local files are always read as one split."""

        text_column: str = "text"
        """Column holding the document text."""

        tokenizer_path: str | None = None
        """Tokenizer directory / tokenizer.json; overrides the trainer's tokenizer when set."""

        seed: int = 0
        """Shuffle seed; epoch e reshuffles with (seed, e). Give eval its own seed."""

        shuffle: bool = True
        """Permute shards per epoch and documents within blocks of ``shuffle_buffer``."""

        shuffle_buffer: int = 1000
        """Documents per within-worker shuffle block."""

        skip_first: int = 0
        """Global index (raw source order) of the first document: the eval offset."""

        max_documents: int | None = None
        """Window length in documents. Read once, never replayed: with ``infinite`` the stream
        raises DocumentLimitReached at its end; without, it ends."""

        infinite: bool = True
        """Loop over epochs forever (training) or read the data once. torchtitan's validator sets
        this to ``steps != -1``."""

        repeat_window: bool = False
        """With ``max_documents``: loop over the window in counted, reshuffled epochs (a train
        split [0, N) beside an eval window at skip_first=N) instead of raising at its end."""

        batches_per_iter: int | None = None
        """If set, each iteration over the loader yields exactly this many batches (a fixed-size
        evaluation); the next iteration continues the stream."""

        on_bad_input: Literal["error", "skip"] = "error"
        """``"error"``: raise naming file and row; ``"skip"``: count the record with its reason."""

        add_bos: bool = False
        """Prefix each document with BOS (documents are always followed by the EOS boundary)."""

        encode_batch: int = 32
        """Documents per batched tokenizer call."""

        text_sample_by: Literal["line", "paragraph", "document"] = "paragraph"
        """For .txt sources: one document per "line", "paragraph" or "document" (file)."""

        emit_doc_ids: bool = False
        """Debug: add per-token ``doc_ids``/``doc_epochs``/``doc_offsets`` to each batch (for
        scripts/verify_data_diversity.py). Never for training: torchtitan passes extra keys to
        the model."""

        num_workers: int = 0
        """DataLoader worker processes (each reads its own disjoint slice)."""

        persistent_workers: bool = True
        """Keep workers between iterations; the stream continues either way."""

        prefetch_factor: int | None = None
        """Batches prefetched per worker (num_workers > 0 only)."""

        pin_memory: bool = False
        """Pin batches in page-locked memory."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        tokenizer: Any = None,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            logger.debug("StreamingTextDataLoader ignores build kwargs %s", sorted(kwargs))
        tok = config.tokenizer_path or tokenizer
        if tok is None:
            raise ValueError("streaming_text: no tokenizer (set dataloader.tokenizer_path)")
        source = config.dataset_path or config.dataset
        if not source:
            raise ValueError("streaming_text: set dataloader.dataset_path (or a hub id in dataset)")
        self.config = config
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._rank_id = f"dp_rank_{dp_rank}"
        self.streaming_dataset = StreamingTextDataset(
            source,
            tok,
            seq_len,
            seed=config.seed,
            shuffle=config.shuffle,
            shuffle_buffer=config.shuffle_buffer,
            skip_first=config.skip_first,
            max_documents=config.max_documents,
            infinite=config.infinite,
            repeat_window=config.repeat_window,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            text_column=config.text_column,
            name=config.dataset_name,
            split=config.split,
            on_bad_input=config.on_bad_input,
            add_bos=config.add_bos,
            encode_batch=config.encode_batch,
            batches_per_iter=config.batches_per_iter,
            batch_size=local_batch_size,
            emit_doc_ids=config.emit_doc_ids,
            text_sample_by=config.text_sample_by,
        )
        dl_kwargs: dict[str, Any] = {
            "batch_size": local_batch_size,
            "num_workers": config.num_workers,
            "pin_memory": config.pin_memory,
            "snapshot_every_n_steps": snapshot_every_n_steps or 1,
        }
        if config.num_workers > 0:
            dl_kwargs["persistent_workers"] = config.persistent_workers
            if config.prefetch_factor is not None:
                dl_kwargs["prefetch_factor"] = config.prefetch_factor
        super().__init__(self.streaming_dataset, **dl_kwargs)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """``{"dp_rank_{r}": <StatefulDataLoader state: dicts of ints/lists>, "world_size": R}``
        — no pickle (torchtitan's ParallelAwareDataloader pickles this)."""
        return {self._rank_id: super().state_dict(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # an empty state is valid (fresh start), as in torchtitan
        if self._rank_id not in state_dict:
            logger.warning("streaming_text: no dataloader state for %s", self._rank_id)
            return
        if int(state_dict["world_size"]) != self.dp_world_size:
            raise ValueError(
                f"dataloader state was saved with dp_world_size={state_dict['world_size']}, "
                f"this run has {self.dp_world_size}: resharding a stream is not supported"
            )
        super().load_state_dict(state_dict[self._rank_id])

    # ------------------------------------------------------------------ stats
    def get_stats(self) -> dict[str, Any]:
        """Epoch (slowest worker), documents read/used and skips, summed over this rank's
        workers (from the latest worker snapshots when num_workers > 0)."""
        if self.config.num_workers == 0:
            states = [self.streaming_dataset.state_dict()]
        else:
            states = _dataset_states(super().state_dict())
        if not states:
            return {}
        skips: dict[str, int] = {}
        for s in states:
            for k, v in s["skips"]["counts"].items():
                skips[k] = skips.get(k, 0) + int(v)
        return {
            "epoch": min(int(s["epoch"]) for s in states),
            "docs_used": sum(int(s["docs_used"]) for s in states),
            "skipped": sum(skips.values()),
            "skips": skips,
        }
