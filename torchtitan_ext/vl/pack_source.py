"""Where a VL training job's packs come from: a sample store planned now, a packed cache that
exists, a store built now, or the online fallback. ``vl/reader.py`` (under the torchtitan loader)
opens its packs with :func:`open_packs`.

:func:`choose_cache` resolves the data source once:

1. ``cache_path`` -> that directory, as it is (a sample store or a packed cache);
2. ``force_preprocess`` -> rebuild the sample store for the configured key
   (``vl.build.build_cache(store=True)``);
3. else, with ``use_preprocessed_cache``: the sample store of the key (its key has no
   ``seq_len`` / ``buffer_size`` / ``buckets``: those only make the plan, ``vl/plan.py``); when
   the source is a local path that no longer exists, the store whose manifest records this
   source and processor (one line says its fingerprint could not be re-checked); else a packed
   cache (packs fixed at build time) of the full key;
4. else ``build_if_missing`` -> build the store now (``build_cache`` splits the shards over the
   job's ranks via RANK/WORLD_SIZE; every rank returns once it is complete);
5. else None: the caller falls back to ``vl.online.OnlineVLDataset``, which runs the *same*
   preprocessing and packing inside the loader, with a loud warning that it is slow.

A store is read through its plan (``PlannedStore``: packs gathered from the store's samples),
a packed cache as it is; both give the same packs for the same options.

The request is a :class:`~torchtitan_ext.vl.options.SourceOptions` (the ``cached_vl`` loader Config
inherits it). Its fields named like a :class:`~torchtitan_ext.vl.build_config.BuildConfig` field
(``buckets``, ``model_path``, ``max_samples``, ``exif_transpose``, ``fingerprint``, ...) flow into
the cache key by name (:meth:`SourceOptions.build_options`), so a knob added to both is never
re-listed here. A damaged cache is an error (``vl.cache.CacheError``), never a silent rebuild or
fallback.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_ext.vl.options import OrderOptions, SourceOptions

logger = logging.getLogger(__name__)

SAMPLE_DATASET = "sample"
SAMPLE_CHAT_DATASET = "sample_chat"
SAMPLE_VIDEO_DATASET = "sample_video"


def resolve_dataset(name: str | Path) -> str | Path:
    """A dataset argument: the generated VQA sample for ``"sample"``, the generated chat sample
    for ``"sample_chat"``, the generated video sample for ``"sample_video"``, anything else as
    it is."""
    if name == SAMPLE_DATASET:
        from torchtitan_ext.vl.sample_data import sample_dataset_path

        return sample_dataset_path()
    if name == SAMPLE_CHAT_DATASET:
        from torchtitan_ext.vl.sample_chat import chat_sample_path

        return chat_sample_path()
    if name == SAMPLE_VIDEO_DATASET:
        from torchtitan_ext.vl.sample_video import video_sample_path

        return video_sample_path()
    return name


class OnlinePreprocessingWarning(UserWarning):
    """The VL loader runs preprocessing inside the training job (no cache): slow."""


def dataset_arg(req: SourceOptions) -> str | Path:
    """The dataset to read: ``dataset_path`` when set, else ``dataset`` (:func:`resolve_dataset`)."""
    if req.dataset_path:
        return req.dataset_path
    if not req.dataset:
        raise ValueError(
            "dataloader.dataset is required for the cached_vl loader: a local Parquet "
            "directory, a Hugging Face dataset name, 'sample', 'sample_chat' or 'sample_video' (or set "
            "dataloader.cache_path)"
        )
    return resolve_dataset(req.dataset)


def key_args(req: SourceOptions, seq_len: int) -> dict[str, Any]:
    """``find_cache`` / ``build_cache`` arguments of a request: its BuildConfig-named
    attributes, by name."""
    return {
        "dataset": dataset_arg(req),
        "split": req.split,
        "cache_dir": req.cache_dir,
        "seq_len": seq_len,
        "buffer_size": req.buffer_size,
        **req.build_options(),
    }


def _build(req: SourceOptions, seq_len: int, force: bool) -> Path:
    from torchtitan_ext.vl import build  # looked up at call time (tests spy on build_cache)

    kw = key_args(req, seq_len)
    logger.warning(
        "building the VL sample store for %s under %s (the full preprocessing runs now)",
        kw["dataset"],
        req.cache_dir,
    )
    # (an in-process build leaves the training job's torch thread count as it was)
    return Path(
        build.build_cache(
            **kw,
            store=True,
            num_workers=req.preprocess_workers,
            strict=req.strict,
            force=force,
            show_progress=False,
        )
    )


def choose_cache(req: SourceOptions, seq_len: int) -> Path | None:
    """The cache directory to read, or None for the online fallback (warned)."""
    if req.cache_path:
        p = Path(req.cache_path)
        if not (p / "metadata.json").is_file():
            raise FileNotFoundError(
                f"dataloader.cache_path={p} is not a cache directory (no metadata.json)"
            )
        return p
    if req.force_preprocess:
        return _build(req, seq_len, force=True)
    if req.use_preprocessed_cache:
        from torchtitan_ext.vl.build import find_cache, source_absent

        kw = key_args(req, seq_len)
        found = find_cache(**kw, store=True)
        if found is None and not source_absent(str(kw["dataset"])):
            found = find_cache(**kw)  # a packed cache built before sample stores
        if found is not None:
            logger.info("using VL cache %s", found)
            return Path(found)
        if source_absent(str(kw["dataset"])):
            raise FileNotFoundError(
                f"VL dataset {kw['dataset']} does not exist and no sample store under "
                f"{req.cache_dir} records it (same split, max_samples, options and processor)"
            )
        if req.build_if_missing:
            return _build(req, seq_len, force=False)
    msg = (
        "no preprocessed VL cache for this config"
        if req.use_preprocessed_cache
        else "use_preprocessed_cache=false"
    )
    warnings.warn(
        f"{msg}: falling back to ONLINE preprocessing inside the training loader (decode, "
        "resize, tokenise and pack every step: slow, typically CPU-bound). Build the cache "
        "once with `preprocess-cached` (or set dataloader.build_if_missing=true).",
        OnlinePreprocessingWarning,
        stacklevel=4,
    )
    logger.warning("VL loader: %s; using slow online preprocessing", msg)
    return None


@dataclass
class Packs:
    """What a loader iterates: ``dataset`` yields pack dicts for one DP rank."""

    source: str
    """``"cache"`` or ``"online"``."""
    path: Path | None
    dataset: Any
    """``CachedVLDataset`` or ``OnlineVLDataset``."""
    special_tokens: dict[str, int]
    metadata: dict[str, Any]


def open_packs(
    req: SourceOptions,
    order: OrderOptions,
    *,
    seq_len: int,
    dp_rank: int,
    dp_world_size: int,
    block_size: int,
) -> Packs:
    """Choose the source (:func:`choose_cache`) and open it for one DP rank, in ``order``."""
    path = choose_cache(req, seq_len)
    if path is not None:
        from torchtitan_ext.vl.dataset import CachedVLDataset

        ds = CachedVLDataset(
            open_cache_or_plan(path, req, seq_len),
            dp_rank,
            dp_world_size,
            infinite=order.infinite,
            seed=order.seed,
            shuffle=order.shuffle,
            remainder=order.remainder,
            block_size=block_size,
        )
        cache: Any = ds.cache
        return Packs("cache", path, ds, dict(cache.special_tokens), dict(cache.metadata))

    from torchtitan_ext.vl.online import OnlineVLDataset

    kw = key_args(req, seq_len)
    kw.pop("cache_dir")
    online = OnlineVLDataset(
        **kw,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=order.infinite,
        seed=order.seed,
        shuffle=order.shuffle,
        strict=req.strict,
    )
    return Packs("online", None, online, online.special_tokens, online.metadata)


def open_cache_or_plan(path: Path, req: SourceOptions, seq_len: int) -> Any:
    """A packed cache's path (``CachedVLDataset`` opens it, and re-opens it in each worker), or
    a sample store planned with this request's options."""
    from torchtitan_ext.vl.cache import VLCache, resolve_cache_dir
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions, plan_packs

    cache = VLCache.open(resolve_cache_dir(path))
    log_build_skips(cache)
    if not cache.is_store:
        return path
    lengths = [cache.shard_sample_lengths(s) for s in range(cache.num_shards)]
    plan = plan_packs(lengths, PlanOptions.make(seq_len, req.buffer_size, req.buckets))
    logger.info("VL plan over %s: %s", cache.path, plan.stats())
    return PlannedStore(cache, plan)


def log_build_skips(cache: Any) -> None:
    """Say once which rows the cache's build skipped, by reason: the step log's ``skipped``
    counts this run's skips (the online fallback's), so a cache's own would go unseen."""
    from torchtitan_ext.vl.inspect import packing_stats

    st = packing_stats(cache)
    skipped = {k: v for k, v in st.get("skipped", {}).items() if v}
    if skipped:
        logger.info(
            "VL cache %s was built from %d rows; %d were skipped then %s (not in the step "
            "log's skipped: count; inspect-cache shows them)",
            cache.path,
            st["rows_read"],
            sum(skipped.values()),
            skipped,
        )
