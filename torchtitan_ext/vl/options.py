"""The options of the VL loader's stages, one dataclass per stage, free of torchtitan.

The ``cached_vl`` loader's Config (``loaders/vl.py``) *inherits* these dataclasses, so the TOML keys
stay flat (``[dataloader] num_workers``) and each knob is spelled, defaulted and documented once,
here; the loader hands each stage its own options with
:func:`torchtitan_ext.pipeline.stage.options`.

===================  =========================================================================
:class:`SourceOptions`  where packs come from: a cache, a cache built now, or the online fallback
                        (``vl/pack_source.py``); most fields are part of the cache key
:class:`OrderOptions`   which pack each rank reads next (``vl/dataset.py``'s position functions)
:class:`BatchOptions`   the collate: batch format, where pixels are normalised, pinning
:class:`WorkerOptions`  DataLoader worker processes (the one stage that runs outside the process)
===================  =========================================================================

The background hand-off's options (``queue_size``, ``thread_priority``) are
:class:`~torchtitan_ext.pipeline.prefetch.PrefetchOptions`, shared with every other loader.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from torchtitan_ext.vl.build_config import OPTION_NAMES, BuildConfig
from torchtitan_ext.vl.layouts import Format

BatchFormat = Literal["torchtitan", "hf", "qwen3_vl"]
NormalizeOn = Literal["collate", "device"]
Remainder = Literal["drop", "wrap"]


@dataclass(kw_only=True)
class SourceOptions:
    """Where the packs come from (``vl/pack_source.py``: cache, cache built now, online)."""

    dataset: str = ""
    """Source dataset: a local Parquet directory / file, a Hugging Face dataset name,
    ``"sample"`` (the small VQA set generated from torchtitan_ext/data/vl_src) or
    ``"sample_chat"`` (the small chat set made from the same images) or ``"sample_video"``
    (generated clips of a moving square, ``vl/sample_video.py``). Part of the cache key.
    Required unless ``dataset_path`` or ``cache_path`` is set."""

    dataset_path: str | None = None
    """Where to read ``dataset`` from when it differs from the name (a local copy); when set
    it replaces ``dataset`` for loading and for the cache key."""

    split: str = "train"
    """Dataset split (part of the cache key)."""

    cache_dir: str = "./preprocessed_cache"
    """Root directory of caches; each key gets a sub-directory: a sample store
    ``<dataset>_<split>_store_<hash>`` (a packed cache:
    ``<dataset>_<split>_seq<L>_buf<B>_<hash>``)."""

    cache_path: str | None = None
    """An explicit cache key directory; skips the key lookup (and building)."""

    pack_seq_len: int | None = None
    """Pack length (tokens). None: the trainer's ``training.seq_len``. A sample store is
    planned for it when the loader starts (any value; nothing is rebuilt); a packed cache
    must have been built with it (part of its key)."""

    buffer_size: int = 64
    """Samples the best-fit packer chooses from (the plan's; part of a packed cache's
    key)."""

    buckets: list[int] | None = None
    """Allowed padded pack lengths (each <= pack_seq_len); None: every pack is padded to
    pack_seq_len. Fewer distinct shapes -> fewer torch.compile recompilations. The plan's
    (part of a packed cache's key)."""

    model_path: str | None = None
    """Qwen3-VL model/processor directory (tokenizer + preprocessor config); None: the
    model's own, i.e. the trainer's ``hf_assets_path`` when it holds a processor
    (``preprocessor_config.json``), else the embedded offline processor (tests/CPU demo).
    Its fingerprint is part of the key."""

    max_samples: int | None = None
    """Use only the first N rows of the split (part of the key, and of the identity a sample
    store records, by which it is found when the source has been moved away)."""

    use_preprocessed_cache: bool = True
    """Use a complete cache for the key when one exists."""

    force_preprocess: bool = False
    """Rebuild the cache even if one exists (every rank rebuilds its share of shards)."""

    build_if_missing: bool = False
    """Build the cache when none exists for the key; False falls back to online
    preprocessing (slow, warned)."""

    preprocess_workers: int = 0
    """Processes used when this loader builds a cache (0: in process)."""

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

    video_column: str | None = BuildConfig.video_column
    """The video column (None: detected); ``--video-column``."""

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

    video_fps: float | None = BuildConfig.video_fps
    """Video frames sampled per second (part of the key); ``--video-fps``. None (each
    ``video_*`` knob): the processor directory's ``video_preprocessor_config.json`` value, else
    transformers' default (2.0 fps, 4-768 frames, 131072-786432 pixels, cap off, 768 tokens)."""

    video_min_frames: int | None = BuildConfig.video_min_frames
    """At least this many frames sampled per video (part of the key); ``--video-min-frames``."""

    video_max_frames: int | None = BuildConfig.video_max_frames
    """At most this many frames sampled per video (part of the key); ``--video-max-frames``."""

    video_min_pixels: int | None = BuildConfig.video_min_pixels
    """Pixel budget floor of a video's sampled frames together (part of the key);
    ``--video-min-pixels``."""

    video_max_pixels: int | None = BuildConfig.video_max_pixels
    """Pixel budget of a video's sampled frames together (part of the key);
    ``--video-max-pixels``."""

    video_cap_pixels_per_frame: bool | None = BuildConfig.video_cap_pixels_per_frame
    """qwen-vl-utils' per-frame pixel cap (part of the key); ``--video-cap-pixels-per-frame``."""

    video_max_tokens: int | None = BuildConfig.video_max_tokens
    """Token ceiling per frame of that cap (part of the key); ``--video-max-tokens``."""

    def build_options(self) -> dict[str, Any]:
        """The fields that are :class:`~torchtitan_ext.vl.build_config.BuildConfig` options
        (cache-key knobs besides dataset, split, seq_len and buffer_size), by name."""
        skip = ("seq_len", "buffer_size")
        return {k: v for k, v in asdict(self).items() if k in OPTION_NAMES and k not in skip}


@dataclass(kw_only=True)
class OrderOptions:
    """Which pack each DP rank reads next (``vl/dataset.py``)."""

    seed: int = 0
    """Shuffle seed; epoch ``e`` visits the packs in ``randperm(N, seed + e)``."""

    shuffle: bool = True
    """Reshuffle the packs every epoch; False: cache order."""

    infinite: bool = True
    """Loop over epochs forever; False: stop after one epoch (validation)."""

    remainder: Remainder = "drop"
    """Equal steps per rank when the pack count is not a multiple of the DP degree:
    "drop" skips the last (N mod W) packs of each epoch's permutation (different ones each
    epoch), "wrap" completes the last round from the start of the permutation."""


@dataclass(kw_only=True)
class BatchOptions:
    """How packs become a batch (``vl/collate.py``)."""

    batch_format: BatchFormat = "torchtitan"
    """"torchtitan": ``(input_dict, labels)`` with MultiModalCollator keys (labels shifted);
    "hf": a dict of Qwen3-VL forward kwargs (input_ids, labels, position_ids [4,B,L], ...);
    "qwen3_vl": ``(input_dict, labels)`` for the ``qwen3_vl`` model module (the "hf" tensors
    under torchtitan's names, labels shifted)."""

    normalize_on: NormalizeOn = "collate"
    """"collate": float pixel_values built on the CPU; "device": pixel_values stay uint8 and are
    normalised after the host-to-device copy (AsyncDeviceLoader, or ``finish_on_device``)."""

    pin_memory: bool = False
    """Copy batches to pinned memory (with CUDA only; leave False when torchtitan_ext's
    device staging copies batches: it has its own pinned buffers)."""


@dataclass(kw_only=True)
class WorkerOptions:
    """DataLoader worker processes reading packs (cache source only)."""

    num_workers: int = 0
    """DataLoader worker processes reading packs (0: in the training process, in the one
    background thread). The data order does not depend on it. The online fallback always runs
    in process."""

    prefetch_factor: int | None = None
    """Batches each worker prepares ahead (None: torch's default of 2 when workers > 0)."""
