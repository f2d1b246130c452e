"""What determines a VL cache's bytes: :class:`BuildConfig`, and :func:`config_from`, the one place
``find_cache`` / ``build_cache`` arguments become one (so the two always compute the same key). The
key itself (a hash of the config with the dataset, layout, label rule and processor fingerprints)
is ``vl/build.py``'s ``cache_key``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from torchtitan_ext.vl.layouts import COLUMN_ROLES, Format
from torchtitan_ext.vl.sources import DEFAULT_FINGERPRINT, Fingerprint
from torchtitan_ext.vl.video import VideoOptions

DEFAULT_ROWS_PER_SHARD = 1024


@dataclass
class BuildConfig:
    """Everything that determines the cache bytes (and so the key)."""

    dataset: str
    """Local Parquet file/dir/glob or hub dataset name."""
    split: str = "train"
    """Split (hub) or file-name filter (local: ``{split}-*.parquet`` / ``{split}/``; else all)."""
    seq_len: int = 8192
    """Maximum tokens per pack; longer samples are skipped (reason ``too_long``)."""
    buffer_size: int = 64
    """Best-fit buffer: candidates considered for each pack."""
    buckets: list[int] | None = None
    """Padded pack lengths (each <= seq_len); None = always pad to seq_len."""
    max_samples: int | None = None
    """Read at most this many input rows (reads = packed + skipped)."""
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    """Input rows per shard: the unit of resume, scale-out and atomic write."""
    model_path: str | None = None
    """Qwen3-VL processor directory; None = the offline processor."""
    max_image_pixels: int = 89_478_485
    """Decoded images above this many pixels are skipped (PIL's decompression-bomb limit)."""
    exif_transpose: bool = True
    """Apply an image's EXIF orientation before anything else (what ``datasets``' ``Image``
    feature and transformers' ``load_image`` do, so the model sees the photo upright); False
    keeps the stored pixel order (what the HF image processor does with a PIL image as given)."""
    fingerprint: Fingerprint = DEFAULT_FINGERPRINT
    """How source files enter the key: ``"full"`` hashes every byte (cached per file by size and
    mtime), ``"quick"`` only the size and the first and last MiB (``vl/sources.py``)."""
    format: Format = "auto"
    """Row layout (``vl/layouts.py``): ``"vqa"``, ``"messages"``, ``"llava"``, ``"cauldron"``, or
    ``"auto"`` (detected from the column names). The resolved layout and its columns enter the
    key, not this field, so ``auto`` and the layout it finds share a cache."""
    image_column: str | None = None
    """Column of the row's image(s) (every layout); None: detected."""
    video_column: str | None = None
    """Column of the row's video(s) (``vqa``, ``messages``, ``llava``); None: detected."""
    question_column: str | None = None
    """``vqa``: the question column; None: detected."""
    answer_column: str | None = None
    """``vqa``: the answer column (a string or a list of answers); None: detected."""
    messages_column: str | None = None
    """``messages``: the chat column (``[{role, content}, ...]``); None: ``messages``."""
    conversations_column: str | None = None
    """``llava``: the conversation column (``[{from, value}, ...]``); None: ``conversations``."""
    texts_column: str | None = None
    """``cauldron``: the turns column (``[{user, assistant}, ...]``); None: ``texts``."""
    truncate: bool = False
    """A sample longer than ``seq_len`` drops whole trailing turns (and their images) until it
    fits, cut after an assistant turn (the loss mask stays whole); False: it is ``too_long``."""
    video_fps: float | None = None
    """Video frames sampled per second. None (each ``video_*`` knob): the processor directory's
    ``video_preprocessor_config.json`` value, else transformers 5.23's class default
    (:func:`video_knobs`); the resolved value is what enters the key."""
    video_min_frames: int | None = None
    """Sample at least this many frames of a video (a shorter video gives all it has)."""
    video_max_frames: int | None = None
    """Sample at most this many frames of a video."""
    video_min_pixels: int | None = None
    """Pixel budget floor of a video's sampled frames together (HF ``size.shortest_edge``)."""
    video_max_pixels: int | None = None
    """Pixel budget of a video's sampled frames together (HF ``size.longest_edge``)."""
    video_cap_pixels_per_frame: bool | None = None
    """qwen-vl-utils' per-frame pixel cap (HF's ``cap_pixels_per_frame``; off in 5.23)."""
    video_max_tokens: int | None = None
    """The per-frame cap's token ceiling (HF's ``max_video_tokens``)."""
    store: bool = False
    """True: build a *sample store* (``vl/plan.py``): every entry one unpadded sample, no
    packing; ``buffer_size`` and ``buckets`` are not part of its key, nor is ``seq_len`` unless
    ``truncate`` (the cut depends on it). False: a packed cache (packs fixed at build time)."""


VIDEO_OPTIONS: dict[str, str] = {
    "video_fps": "fps",
    "video_min_frames": "min_frames",
    "video_max_frames": "max_frames",
    "video_min_pixels": "min_pixels",
    "video_max_pixels": "max_pixels",
    "video_cap_pixels_per_frame": "cap_pixels_per_frame",
    "video_max_tokens": "max_video_tokens",
}
"""BuildConfig field -> the :class:`~torchtitan_ext.vl.video.VideoOptions` field it sets (the
model's patch, temporal patch and merge sizes come from the processor instead)."""


VIDEO_CONFIG_FILE = "video_preprocessor_config.json"
"""A checkpoint's video processor settings (beside ``preprocessor_config.json``)."""


def processor_video_defaults(model_path: str | Path | None) -> VideoOptions:
    """The video settings HF's processor loads from ``model_path``: its
    ``video_preprocessor_config.json`` over transformers 5.23's class defaults (no file, or no
    directory, i.e. the embedded offline processor: the class defaults). Qwen3-VL checkpoints
    ship one whose pixel budget (``size.longest_edge`` 25165824) is 32x the class default's, so
    a build that ignored it would not give the checkpoint's own processor's videos.
    Raises ``ValueError`` naming the file when it is not JSON or asks for sampling we lack."""
    if model_path is None:
        return VideoOptions()
    path = Path(model_path) / VIDEO_CONFIG_FILE
    if not path.is_file():
        return VideoOptions()
    import json

    try:
        return VideoOptions.from_config(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {e}") from None


def video_knobs(config: BuildConfig) -> dict[str, Any]:
    """Each ``video_*`` knob's value for a build: the config's own where set, else
    :func:`processor_video_defaults` of its processor directory (``model_path``)."""
    unset = [k for k in VIDEO_OPTIONS if getattr(config, k) is None]
    base = processor_video_defaults(config.model_path) if unset else None
    return {
        k: getattr(base, f) if k in unset else getattr(config, k) for k, f in VIDEO_OPTIONS.items()
    }


def video_options(config: BuildConfig, params: Any) -> VideoOptions:
    """The :class:`VideoOptions` of a build: its ``video_*`` knobs (:func:`video_knobs`) with
    the processor's patch, temporal patch and merge sizes (``params``: its ``ImageParams``)."""
    return VideoOptions(
        **{VIDEO_OPTIONS[k]: v for k, v in video_knobs(config).items()},
        patch_size=params.patch_size,
        temporal_patch_size=params.temporal_patch_size,
        merge_size=params.merge_size,
    )


PLAN_OPTIONS = ("seq_len", "buffer_size", "buckets")
"""BuildConfig fields a sample store's packs are planned with (not part of a store's key)."""


def sample_max_len(config: BuildConfig) -> int | None:
    """The longest sample a build keeps (longer ones are ``too_long``, or cut with
    ``truncate``): ``seq_len`` for a packed cache; None (no limit) for a store, whose plans
    skip the samples longer than their own ``seq_len``; ``seq_len`` for a truncating store."""
    return config.seq_len if (config.truncate or not config.store) else None


def store_fields(config: BuildConfig) -> dict[str, Any]:
    """The fields that make a sample store's bytes: all but the plan options (``seq_len``
    stays when ``truncate``: the cut depends on it)."""
    from dataclasses import asdict

    drop = ("buffer_size", "buckets") if config.truncate else PLAN_OPTIONS
    return {k: v for k, v in asdict(config).items() if k not in drop}


LAYOUT_OPTIONS = ("format", *(f"{r}_column" for r in COLUMN_ROLES))
"""BuildConfig fields that choose the layout; they enter the key as the resolved layout."""


OPTION_NAMES = tuple(
    f.name for f in fields(BuildConfig) if f.name not in ("dataset", "split", "store")
)
"""The options callers pass by name (``store`` is chosen by the function called)."""


def config_from(
    dataset: str | Path, split: str, seq_len: int, buffer_size: int, *, store: bool = False,
    **options: Any,
) -> BuildConfig:  # fmt: skip
    """The :class:`BuildConfig` of ``find_cache`` / ``build_cache`` arguments (one place, so the
    two always compute the same key); ``options`` are further BuildConfig fields."""
    from torchtitan_ext.vl.packing import normalize_buckets

    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown cache option(s) {unknown}; known: {list(OPTION_NAMES)}")
    cfg = BuildConfig(dataset=str(dataset), split=split, seq_len=int(seq_len),
                      buffer_size=int(buffer_size), store=store, **options)  # fmt: skip
    cfg.buckets = normalize_buckets(cfg.seq_len, cfg.buckets)
    cfg.rows_per_shard = int(cfg.rows_per_shard)
    cfg.model_path = None if cfg.model_path is None else str(cfg.model_path)
    if cfg.buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {cfg.buffer_size}")
    if cfg.rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {cfg.rows_per_shard}")
    for k, v in video_knobs(cfg).items():  # resolved here: the key holds the values used
        setattr(cfg, k, v)
    check_video_options(cfg)
    return cfg


def check_video_options(cfg: BuildConfig) -> None:
    """One line naming the ``video_*`` knob that cannot work (before anything is built); knobs
    left None are checked at the values they resolve to (:func:`video_knobs`)."""
    cfg = replace(cfg, **video_knobs(cfg))
    bad = None
    least = VideoOptions.temporal_patch_size  # Qwen3-VL's; HF refuses fewer sampled frames
    if not (cfg.video_fps > 0 and math.isfinite(cfg.video_fps)):
        bad = f"video_fps must be a finite number > 0, got {cfg.video_fps}"
    elif not 1 <= cfg.video_min_frames <= cfg.video_max_frames:
        bad = (f"video_min_frames ({cfg.video_min_frames}) and video_max_frames "
               f"({cfg.video_max_frames}) need 1 <= min <= max")  # fmt: skip
    elif cfg.video_max_frames < least:
        bad = (f"video_max_frames ({cfg.video_max_frames}) must be >= {least}: the model takes "
               f"frames in pairs and every video would be skipped as too_few_frames")  # fmt: skip
    elif not 0 < cfg.video_min_pixels <= cfg.video_max_pixels:
        bad = (f"video_min_pixels ({cfg.video_min_pixels}) and video_max_pixels "
               f"({cfg.video_max_pixels}) need 0 < min <= max")  # fmt: skip
    elif cfg.video_max_tokens < 1:
        bad = f"video_max_tokens must be >= 1, got {cfg.video_max_tokens}"
    if bad:
        raise ValueError(bad)
