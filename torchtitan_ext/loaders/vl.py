"""torchtitan glue for the offline Qwen3-VL cache: ``[dataloader] name = "cached_vl"``.

``CachedVLDataLoader.Config(...).build(dp_rank=, dp_world_size=, tokenizer=, seq_len=,
local_batch_size=)`` (what torchtitan's trainer calls) maps its Config onto
:class:`torchtitan_ext.vl.reader.VLReader`, which owns everything about reading: the data source
(cache, cache built now, or the online fallback), the DataLoader and its workers, the consumer's
exact global ``(epoch, cursor)`` and the step-log stats. This module only speaks torchtitan.

Checkpoint format. The reader's state (plain ints, the same on every rank) is stored under the
rank-independent key ``"global"`` (DCP de-duplicates it) — torchtitan's ``"dp_rank_{r}"`` keying
would make a DP=1 -> DP=2 restart fail, because DCP's default load planner refuses keys missing
from the checkpoint (rank 1 would ask for ``dp_rank_1``). ``load_state_dict`` also accepts
``{"dp_rank_{r}": state}`` dicts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan.components.dataloader import BaseDataLoader

from torchtitan_ext.vl.build_config import BuildConfig
from torchtitan_ext.vl.layouts import Format
from torchtitan_ext.vl.pack_source import OnlinePreprocessingWarning
from torchtitan_ext.vl.reader import VLReader, processor_path

logger = logging.getLogger(__name__)

READER_FACTS = frozenset(
    ("source", "cache_path", "dataset", "model_path", "pack_seq_len", "num_workers",
     "special_tokens", "pixel_norm", "collate")
)  # fmt: skip
"""``VLReader`` attributes a loader answers for (the probes, tests and benchmarks read them)."""


class CachedVLDataLoader(BaseDataLoader):
    """Feeds torchtitan (or an HF training loop) from the offline Qwen3-VL cache."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = ""
        """Source dataset: a local Parquet directory / file, a Hugging Face dataset name,
        ``"sample"`` (the small VQA set generated from torchtitan_ext/data/vl_src) or
        ``"sample_chat"`` (the small chat set made from the same images). Part of the cache key.
        Required unless ``dataset_path`` or ``cache_path`` is set."""

        dataset_path: str | None = None
        """Where to read ``dataset`` from when it differs from the name (a local copy); when set
        it replaces ``dataset`` for loading and for the cache key."""

        split: str = "train"
        """Dataset split (part of the cache key)."""

        cache_dir: str = "./preprocessed_cache"
        """Root directory of caches; each key gets a sub-directory
        ``<dataset>_<split>_seq<L>_buf<B>_<hash>``."""

        cache_path: str | None = None
        """An explicit cache key directory; skips the key lookup (and building)."""

        pack_seq_len: int | None = None
        """Pack length (tokens). None: the trainer's ``training.seq_len``. Must equal the
        ``seq_len`` the cache was built with — it is part of the key."""

        buffer_size: int = 64
        """Samples the best-fit packer chooses from (part of the key)."""

        buckets: list[int] | None = None
        """Allowed padded pack lengths (each <= pack_seq_len); None: every pack is padded to
        pack_seq_len. Fewer distinct shapes -> fewer torch.compile recompilations."""

        model_path: str | None = None
        """Qwen3-VL model/processor directory (tokenizer + preprocessor config); None: the
        model's own, i.e. the trainer's ``hf_assets_path`` when it holds a processor
        (``preprocessor_config.json``), else the embedded offline processor (tests/CPU demo).
        Its fingerprint is part of the key."""

        max_samples: int | None = None
        """Use only the first N rows of the split (part of the key)."""

        use_preprocessed_cache: bool = True
        """Use a complete cache for the key when one exists."""

        force_preprocess: bool = False
        """Rebuild the cache even if one exists (every rank rebuilds its share of shards)."""

        build_if_missing: bool = False
        """Build the cache when none exists for the key; False falls back to online
        preprocessing (slow, warned)."""

        preprocess_workers: int = 0
        """Processes used when this loader builds a cache (0: in process)."""

        num_workers: int = 0
        """DataLoader worker processes reading packs (0: in the training process). The data
        order does not depend on it. The online fallback always runs in process."""

        prefetch_factor: int | None = None
        """Batches each worker prepares ahead (None: torch's default of 2 when workers > 0)."""

        pin_memory: bool = False
        """Let the DataLoader copy batches to pinned memory (leave False when torchtitan_ext's
        AsyncDeviceLoader stages batches: it has its own pinned buffers)."""

        seed: int = 0
        """Shuffle seed; epoch ``e`` visits the packs in ``randperm(N, seed + e)``."""

        shuffle: bool = True
        """Reshuffle the packs every epoch; False: cache order."""

        infinite: bool = True
        """Loop over epochs forever; False: stop after one epoch (validation)."""

        remainder: Literal["drop", "wrap"] = "drop"
        """Equal steps per rank when the pack count is not a multiple of the DP degree:
        "drop" skips the last (N mod W) packs of each epoch's permutation (different ones each
        epoch), "wrap" completes the last round from the start of the permutation."""

        batch_format: Literal["torchtitan", "hf", "qwen3_vl"] = "torchtitan"
        """"torchtitan": ``(input_dict, labels)`` with MultiModalCollator keys (labels shifted);
        "hf": a dict of Qwen3-VL forward kwargs (input_ids, labels, position_ids [4,B,L], ...);
        "qwen3_vl": ``(input_dict, labels)`` for the ``qwen3_vl`` model module (the "hf" tensors
        under torchtitan's names, labels shifted)."""

        normalize_on: Literal["collate", "device"] = "collate"
        """"collate": float pixel_values built on the CPU; "device": pixel_values stay uint8 and are
        normalised after the host-to-device copy (AsyncDeviceLoader, or ``finish_on_device``)."""

        strict: bool = False
        """When building a cache: fail on the first bad row instead of counting a skip."""

        exif_transpose: bool = BuildConfig.exif_transpose
        """Turn photos upright by their EXIF orientation before preprocessing, as HF
        ``datasets`` does (part of the cache key; ``preprocess-cached --no-exif-transpose``)."""

        fingerprint: str = BuildConfig.fingerprint
        """How the source files enter the cache key: "full" (every byte, hashed once per file
        and remembered by size + mtime) or "quick" (size + first/last MiB); must match the
        ``preprocess-cached --fingerprint`` the cache was built with."""

        format: Format = BuildConfig.format
        """Row layout: "vqa", "messages" (HF chat), "llava", "cauldron", or "auto" (detected
        from the columns); ``preprocess-cached --format`` (docs/vl-data-formats.md)."""

        image_column: str | None = BuildConfig.image_column
        """The image column (None: detected); ``--image-column``."""

        question_column: str | None = BuildConfig.question_column
        """vqa: the question column (None: detected); ``--question-column``."""

        answer_column: str | None = BuildConfig.answer_column
        """vqa: the answer column (None: detected); ``--answer-column``."""

        messages_column: str | None = BuildConfig.messages_column
        """messages: the chat column (None: "messages"); ``--messages-column``."""

        conversations_column: str | None = BuildConfig.conversations_column
        """llava: the conversations column (None: "conversations"); ``--conversations-column``."""

        texts_column: str | None = BuildConfig.texts_column
        """cauldron: the turns column (None: "texts"); ``--texts-column``."""

        truncate: bool = BuildConfig.truncate
        """A sample longer than the pack length drops whole trailing turns instead of being
        skipped as too_long (part of the key); ``--truncate``."""

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
        self.reader = VLReader(
            config,
            seq_len=config.pack_seq_len or seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            tokenizer=tokenizer,
        )

    def __getattr__(self, name: str) -> Any:
        # The reader's facts (`source`, `dataset`, `collate`, ...) under the loader's name.
        if name in READER_FACTS:
            return getattr(self.reader, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __iter__(self) -> Iterator[Any]:
        return iter(self.reader)

    def finish_on_device(self, batch: Any) -> Any:
        """Normalise uint8 pixel_values where the batch now lives (``normalize_on="device"``)."""
        return self.reader.finish_on_device(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"global": self.reader.state_dict(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        st = state_dict.get("global")
        if st is None:  # torchtitan-style {"dp_rank_r": ...}: all entries hold the same state
            ranked = sorted(k for k in state_dict if k.startswith("dp_rank_"))
            if not ranked:
                raise ValueError(
                    f"VL loader state has no 'global' entry: keys {sorted(state_dict)}"
                )
            st = state_dict.get(f"dp_rank_{self.dp_rank}", state_dict[ranked[0]])
        self.reader.load_state_dict(st)

    def get_stats(self) -> dict[str, float]:
        """Numbers for the step log line (``VLReader.get_stats``)."""
        return self.reader.get_stats()


__all__ = ["CachedVLDataLoader", "OnlinePreprocessingWarning", "processor_path"]
