"""torchtitan glue for the offline Qwen3-VL cache: ``[dataloader] name = "cached_vl"``.

``CachedVLDataLoader.Config(...).build(dp_rank=, dp_world_size=, tokenizer=, seq_len=,
local_batch_size=)`` (what torchtitan's trainer calls) maps its Config onto
``vl.pack_source.open_packs``, which chooses the data source once (an existing cache, a cache
built now, or the slow online fallback, warned) and opens it for this rank.

Batches come from a ``torch.utils.data.DataLoader`` over ``CachedVLDataset`` (``num_workers``
processes, each reading a disjoint block-interleaved slice of this rank's packs, in the same order
as with no workers) and ``vl.collate.PackCollator`` (``batch_format`` "torchtitan" -> ``(input_dict,
labels)`` for torchtitan's trainer, "hf" -> Qwen3-VL forward kwargs).

State. The loader counts the packs it has *handed to the consumer* and reports the global
``(epoch, cursor)`` reached (see ``vl/dataset.py``), so prefetched-but-unconsumed batches in worker
queues never leak into a checkpoint: resume is bitwise exact with any ``num_workers``, and elastic
(a DP=2 checkpoint loads at DP=1 and vice versa). The state is a dict of plain ints, stored under
the rank-independent key ``"global"`` (every rank writes the same values; DCP de-duplicates) —
torchtitan's ``"dp_rank_{r}"`` keying would make a DP=1 -> DP=2 restart fail, because DCP's default
load planner refuses keys missing from the checkpoint (rank 1 would ask for ``dp_rank_1``).
``load_state_dict`` also accepts ``{"dp_rank_{r}": state}`` dicts.

Cost (``python -m benchmarks vl_dataset``, 2-core box): building the loader over an existing
cache is the cache open (24-34 ms at 10k packs of 8k tokens); per step the training thread pays fetch + collate
(1.7 ms HF / 2.8 ms torchtitan format for an 8k pack with 23 images) with ``num_workers=0``. With
one worker it only receives the batch through shared memory, measured 2.4-7 ms for ~21 MB: no
clear gain, so the GPU config keeps ``num_workers=0`` and lets ``AsyncDeviceLoader``'s background
thread call this loader (``[staging] enable``; pass ``device_transform=loader.finish_on_device``
when ``normalize_on="device"``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from torch.utils.data import DataLoader
from torchtitan.components.dataloader import BaseDataLoader

from torchtitan_ext.vl.build import BuildConfig
from torchtitan_ext.vl.collate import (
    BATCH_FORMATS,
    PackCollator,
    PixelNorm,
    check_special_tokens,
    finish_on_device,
)
from torchtitan_ext.vl.dataset import CachedVLDataset, advance
from torchtitan_ext.vl.layouts import Format
from torchtitan_ext.vl.pack_source import OnlinePreprocessingWarning, open_packs

logger = logging.getLogger(__name__)


def processor_path(model_path: str | None, hf_assets_path: str | None) -> str | None:
    """The processor that tokenizes the cache: ``model_path``; unset, the model's own directory
    (the trainer's ``hf_assets_path``) when it holds a Qwen3-VL processor; else None (the
    embedded offline processor). The path itself is not part of the cache key, its contents are."""
    if model_path:
        return model_path
    if hf_assets_path and (Path(hf_assets_path) / "preprocessor_config.json").is_file():
        return str(hf_assets_path)
    return None


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
        # `tokenizer` is the trainer's: the cache carries its own special token ids (from the
        # processor it was built with); a torchtitan MultiModalTokenizer's must equal them
        # (checked below, before any cache is built). `snapshot_every_n_steps` is moot: the
        # state is computed, not snapshotted. torchtitan main passes extra kwargs: ignored.
        del snapshot_every_n_steps
        if kwargs:
            logger.debug("CachedVLDataLoader ignores build kwargs %s", sorted(kwargs))
        cfg = config
        if cfg.batch_format not in BATCH_FORMATS:
            raise ValueError(
                f"dataloader.batch_format must be one of {BATCH_FORMATS}, got {cfg.batch_format!r}"
            )
        if cfg.normalize_on not in ("collate", "device"):
            raise ValueError(
                f"dataloader.normalize_on must be 'collate' or 'device', got {cfg.normalize_on!r}"
            )
        if cfg.remainder not in ("drop", "wrap"):
            raise ValueError(
                f"dataloader.remainder must be 'drop' or 'wrap', got {cfg.remainder!r}"
            )
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        pack_len = cfg.pack_seq_len or seq_len
        if not pack_len:
            raise ValueError("need dataloader.pack_seq_len or the trainer's seq_len")
        self.config = cfg
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batch_size = local_batch_size
        self.pack_seq_len = int(pack_len)

        t0 = time.perf_counter()
        self.model_path = processor_path(cfg.model_path, getattr(tokenizer, "tokenizer_path", None))
        self._check_model_tokenizer(tokenizer)
        packs = open_packs(
            cfg if self.model_path == cfg.model_path else replace(cfg, model_path=self.model_path),
            seq_len=self.pack_seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            block_size=local_batch_size,
        )
        self.source, self.cache_path, self.dataset = packs.source, packs.path, packs.dataset
        special, metadata = packs.special_tokens, packs.metadata
        self.num_workers = cfg.num_workers if packs.source == "cache" else 0
        self.open_s = time.perf_counter() - t0
        self.pixel_norm = PixelNorm.from_metadata(metadata)
        self.special_tokens = special
        self.collate = PackCollator(
            cfg.batch_format,  # type: ignore[arg-type]
            special,
            norm=self.pixel_norm,
            normalize_on=cfg.normalize_on,  # type: ignore[arg-type]
        )
        self._stats = {
            "batches": 0,
            "packs": 0,
            "tokens": 0,
            "pad_tokens": 0,
            "images": 0,
            "patches": 0,
        }
        self._wait_s = 0.0
        self._last_wait_s = 0.0
        self._reset_position()

    # -- the model's tokenizer ------------------------------------------------------------------
    def _check_model_tokenizer(self, tokenizer: Any) -> None:
        """With torchtitan's ``MultiModalTokenizer`` (its VLMs' tokenizer: ``TOKEN_FIELDS`` and
        ``<name>_id`` attributes), refuse a cache whose special-token ids differ from it. Uses
        ``cache_path``'s (checked) manifest, else the processor the cache is keyed on
        (``model_path``), so nothing is built first."""
        fields = getattr(tokenizer, "TOKEN_FIELDS", None)
        if not fields:
            return
        model = {f"{n}_id": int(getattr(tokenizer, f"{n}_id")) for n in fields}
        cfg = self.config
        if cfg.cache_path:
            from torchtitan_ext.vl.cache import read_manifest

            meta = Path(cfg.cache_path) / "metadata.json"
            special = (
                read_manifest(Path(cfg.cache_path))["special_tokens"] if meta.is_file() else None
            )
            cache_from = f"the VL cache {cfg.cache_path}"
        else:
            from torchtitan_ext.vl.processor import load_processor, special_token_ids

            special = special_token_ids(load_processor(self.model_path))
            cache_from = (
                f"the VL cache's processor ({self.model_path})"
                if self.model_path
                else "the VL cache's processor (dataloader.model_path unset: the embedded "
                "offline processor)"
            )
        if special is not None:  # a missing cache_path is reported by open_packs
            check_special_tokens(
                model,
                special,
                model_from=f"hf_assets_path={getattr(tokenizer, 'tokenizer_path', '?')}",
                cache_from=cache_from,
            )

    # -- iteration ------------------------------------------------------------------------------
    def _reset_position(self) -> None:
        """(Re)start reading at the dataset's current anchor."""
        self._packs_since_anchor = 0
        self._iterator: Iterator[Any] | None = None
        ds = self.dataset
        # Global position where the current DataLoader pass starts. Kept here (not read live from
        # the dataset) because with workers the main-process dataset never iterates.
        self._anchor = (ds._epoch, ds._cursor) if self.source == "cache" else (0, 0)

    def _make_loader(self) -> DataLoader:
        kw: dict[str, Any] = {}
        if self.num_workers > 0:
            kw["num_workers"] = self.num_workers
            if self.config.prefetch_factor is not None:
                kw["prefetch_factor"] = self.config.prefetch_factor
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            collate_fn=self.collate,
            pin_memory=self.config.pin_memory,
            **kw,
        )

    def __iter__(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self._make_loader())
        it = self._iterator
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                # Finite pass over: move the anchor past it (the workers' copies did the same).
                if self.source == "cache":
                    ds = self.dataset
                    ds._epoch, ds._cursor = self._cache_position()
                    ds._yielded = 0
                self._reset_position()
                return
            dt = time.perf_counter() - t0
            self._wait_s += dt
            self._last_wait_s = dt
            self._account(batch)
            yield batch

    def _account(self, batch: Any) -> None:
        if isinstance(batch, tuple):
            inp, labels = batch
            tokens = inp["input"]
            grid = inp.get("grid_thw", inp.get("image_grid_thw"))
        else:
            tokens, labels, grid = batch["input_ids"], batch["labels"], batch.get("image_grid_thw")
        n = int(tokens.shape[0])
        self._packs_since_anchor += n
        s = self._stats
        s["batches"] += 1
        s["packs"] += n
        pad = int((tokens == self.collate.pad_id).sum())
        s["tokens"] += int(tokens.numel()) - pad
        s["pad_tokens"] += pad
        if grid is not None:
            s["images"] += int(grid.shape[0])
            s["patches"] += int(grid.prod(dim=-1).sum())
        del labels

    def finish_on_device(self, batch: Any) -> Any:
        """Normalise uint8 pixel_values where the batch now lives (``normalize_on="device"``)."""
        return finish_on_device(batch, self.pixel_norm)

    # -- state ----------------------------------------------------------------------------------
    def _global_state(self) -> dict[str, Any]:
        if self.source == "online":
            # In process (no workers, no read-ahead): the dataset's own state is the consumer's.
            return {"source": 1, **self.dataset.state_dict()}
        ds: CachedVLDataset = self.dataset
        epoch, cursor = self._cache_position()
        st = ds.state_dict()  # compatibility fields (num_packs, seed, ...) from the main process
        st.update({"epoch": epoch, "cursor": cursor, "yielded": 0, "source": 0})
        return st

    def _cache_position(self) -> tuple[int, int]:
        ds: CachedVLDataset = self.dataset
        return advance(
            ds.num_packs,
            ds.dp_world_size,
            *self._anchor,
            self._packs_since_anchor,
            ds.remainder,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"global": self._global_state(), "world_size": self.dp_world_size}

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
        st = dict(st)
        source = int(st.pop("source", 0))
        if (source == 1) != (self.source == "online"):
            raise ValueError(
                f"VL loader state was saved from the {'online' if source else 'cache'} source but "
                f"this loader reads from the {self.source}; the orders differ"
            )
        self.dataset.load_state_dict(st)
        self._reset_position()

    # -- stats ----------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """Numbers for the step log line (cumulative unless the name says ``last``)."""
        s = self._stats
        total = s["tokens"] + s["pad_tokens"]
        g = self._global_state()
        skipped = float(sum(self.dataset.skips.values())) if self.source == "online" else 0.0
        return {
            "batches": float(s["batches"]),
            "packs": float(s["packs"]),
            "tokens": float(s["tokens"]),
            "pad_pct": 100.0 * s["pad_tokens"] / total if total else 0.0,
            "images": float(s["images"]),
            "patches": float(s["patches"]),
            "consumer_wait_ms": 1e3 * self._wait_s,
            "wait_ms_last": 1e3 * self._last_wait_s,
            "epoch": float(g["epoch"]),
            "online": 1.0 if self.source == "online" else 0.0,
            "skipped": skipped,
            "open_s": self.open_s,
        }


__all__ = ["CachedVLDataLoader", "OnlinePreprocessingWarning"]
