"""Building the packed VL cache: the key, the shards and the build loop.

Rows are split into fixed shards of ``rows_per_shard`` input rows; each shard is processed
(decode -> resize -> uint8 patchify -> tokenise, in a process pool or in process:
``vl/row_work.py``), packed on its own and written (``vl/write.py``) into ``shards/.tmp-*``, then
renamed into place. So the content does not depend on the number of ranks or on interruptions: a
restart skips the complete shards (SIGKILL-safe), and with ``RANK``/``WORLD_SIZE`` rank r builds
shards r, r+W, .... When all shards exist, whichever rank takes the manifest lock first writes
``packing_stats.json`` then ``metadata.json`` (the commit marker). The writers' locks are
``vl/locks.py``; the options that make up the key ``vl/build_config.py``. The cost per pack:
``python -m benchmarks vl_preprocess`` (rows in ``benchmarks/RESULTS.md``).

Per-row failures never stop a build: each is a counted :class:`~torchtitan_ext.vl.write.Skip`
with a reason (``corrupt_image``, ``too_long``, ...; ``decode_error`` / ``processor_error`` with
the exception's class for anything unforeseen), or, with ``strict``, an error naming the row.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.vl.build_config import (
    DEFAULT_ROWS_PER_SHARD,
    LAYOUT_OPTIONS,
    OPTION_NAMES,
    BuildConfig,
    config_from,
    store_fields,
    video_knobs,
)
from torchtitan_ext.vl.chat import LABEL_RULE
from torchtitan_ext.vl.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PACKING_STATS,
    SHARD_STATS,
    SHARDS,
    canonical,
)
from torchtitan_ext.vl.layouts import column_overrides
from torchtitan_ext.vl.locks import CacheLockedError, flock, key_lock, lock_path
from torchtitan_ext.vl.manifest import write_manifest
from torchtitan_ext.vl.row_work import process_parsed, process_row, worker_init
from torchtitan_ext.vl.sources import Rows, open_source
from torchtitan_ext.vl.store_lookup import find_store_by_identity, source_absent
from torchtitan_ext.vl.write import (
    JSON_TMP_PREFIX,
    ProcessedRow,
    Skip,
    publish_shard,
    write_shard,
)

# ----------------------------------------------------------------------------------------------
# the key


def _versions() -> dict[str, str]:
    import PIL
    import tensordict
    import tokenizers
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tensordict": tensordict.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
    }


def cache_key(
    config: BuildConfig,
    source_fingerprint: dict[str, Any],
    processor_fp: dict[str, Any],
    layout: dict[str, Any] | None = None,
) -> str:
    """sha256 over the format version, dataset fingerprint, row layout and its column mapping,
    the label rule, split, processor/tokenizer/chat-template fingerprint and every packing
    parameter (the model path itself is not in it: two copies of the same processor give the same
    key; nor are the layout options, which enter as the layout they resolve to). A sample
    store's key (``config.store``) leaves out the plan options (``store_fields``) and says
    ``"kind": "store"``; a packed cache's key is what it was before stores existed."""
    if config.store:
        cfg = store_fields(config)
    else:
        cfg = asdict(config)
        cfg.pop("store")
    cfg.update(video_knobs(config))  # the values used (a knob left None: the processor's)
    for k in ("dataset", "model_path", *LAYOUT_OPTIONS):
        cfg.pop(k)
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dataset": source_fingerprint,
        "layout": layout or {},
        "labels": LABEL_RULE,
        "processor": processor_fp,
        "config": cfg,
    }
    if config.store:
        doc["kind"] = "store"
    return hashlib.sha256(canonical(doc).encode()).hexdigest()


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", s).strip("-")[:40] or "dataset"


def key_dir_name(config: BuildConfig, source_name: str, key: str) -> str:
    if config.store:
        cut = f"_seq{config.seq_len}" if config.truncate else ""
        return f"{_slug(source_name)}_{_slug(config.split)}_store{cut}_{key[:12]}"
    return (
        f"{_slug(source_name)}_{_slug(config.split)}_seq{config.seq_len}_buf{config.buffer_size}_"
        f"{key[:12]}"
    )


@dataclass
class Resolved:
    """A config resolved against its source and processor."""

    config: BuildConfig
    rows: Rows
    processor: Any
    key: str
    kdir: Path


def _resolve(config: BuildConfig) -> tuple[Rows, Any, str]:
    """(rows, processor, key) of a config."""
    from torchtitan_ext.vl.processor import load_processor, processor_fingerprint

    rows = open_source(config.dataset, config.split, config.fingerprint, config.format,
                       column_overrides(config))  # fmt: skip
    proc = load_processor(config.model_path)
    key = cache_key(config, rows.fingerprint(), processor_fingerprint(proc), rows.layout.describe())
    return rows, proc, key


def resolve(config: BuildConfig, cache_dir: str | Path) -> Resolved:
    rows, proc, key = _resolve(config)
    return Resolved(config, rows, proc, key, Path(cache_dir) / key_dir_name(config, rows.name, key))


# ----------------------------------------------------------------------------------------------
# the build


def default_num_workers() -> int:
    """Build worker processes when none are asked for: ``cpu_count - 1`` from 3 cores up, else 0
    (in process).

    The main process is busy too: it reads the next shard's rows, then packs, writes, hashes and
    fsyncs each shard while the pool decodes the next one, so one core is left to it and every
    other core decodes. With 2 cores that leaves a single decoding worker, which adds the cost
    of sending each row's pixels between processes and no parallelism: in process was the
    fastest there on a quiet machine (``python -m benchmarks vl_build_workers``, rows in
    ``benchmarks/RESULTS.md``). Use ``--num-workers 0`` to leave the machine's cores to other
    jobs; more than ``cpu_count - 1`` only contends.
    """
    cores = os.cpu_count() or 1
    return cores - 1 if cores >= 3 else 0


def shard_ranges(total: int, rows_per_shard: int) -> list[tuple[int, int]]:
    return [(a, min(a + rows_per_shard, total)) for a in range(0, total, rows_per_shard)]


def _dist_env(rank: int | None, world_size: int | None) -> tuple[int, int]:
    r = int(os.environ.get("RANK", 0)) if rank is None else rank
    w = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not (w >= 1 and 0 <= r < w):
        raise ValueError(f"bad RANK/WORLD_SIZE: {r}/{w}")
    return r, w


def find_cache(
    dataset: str | Path, split: str, cache_dir: str | Path, seq_len: int, buffer_size: int,
    *, store: bool = False, **options: Any,
) -> Path | None:  # fmt: skip
    """The complete cache directory for these arguments, or None. ``options``: further
    :class:`BuildConfig` fields. ``store``: the sample store these options plan from (its key
    leaves the plan options out); when the source is absent (a local path that no longer
    exists) the store is found by the identity it records (:func:`find_store_by_identity`)."""
    cfg = config_from(dataset, split, seq_len, buffer_size, store=store, **options)
    if store and source_absent(cfg.dataset):
        return find_store_by_identity(cfg, cache_dir)
    r = resolve(cfg, cache_dir)
    return r.kdir if (r.kdir / MANIFEST).exists() else None


def build_cache(
    dataset: str | Path,
    split: str,
    cache_dir: str | Path,
    seq_len: int,
    buffer_size: int,
    *,
    num_workers: int = 0,
    strict: bool = False,
    force: bool = False,
    show_progress: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    wait_timeout: float | None = None,
    store: bool = False,
    **options: Any,
) -> Path:
    """Build (or finish, or reuse) the cache for these arguments; returns the key directory.

    ``options``: further :class:`BuildConfig` fields (``model_path``, ``buckets``, ...).
    ``rank``/``world_size`` default to the ``RANK``/``WORLD_SIZE`` environment; every rank returns
    once ``metadata.json`` exists (``wait_timeout`` seconds at most, None = forever).
    ``strict``: the first bad row raises ``ValueError`` naming it instead of being skipped.
    ``store``: build the sample store (one unpadded sample per entry; ``vl/plan.py`` packs it)
    instead of a packed cache; ``seq_len`` / ``buffer_size`` / ``buckets`` do not change it.
    """
    rank, world = _dist_env(rank, world_size)
    cfg0 = config_from(dataset, split, seq_len, buffer_size, store=store, **options)
    if store and not force and source_absent(cfg0.dataset):
        found = find_store_by_identity(cfg0, cache_dir)
        if found is not None:
            return found
    res = resolve(cfg0, cache_dir)
    kdir, cfg = res.kdir, res.config
    if not force and (kdir / MANIFEST).exists():
        return kdir  # complete: no lock needed to read it (metadata.json is written last)
    total = res.rows.num_rows if cfg.max_samples is None else min(res.rows.num_rows,
                                                                    int(cfg.max_samples))  # fmt: skip
    ranges = shard_ranges(total, cfg.rows_per_shard)
    shards = kdir / SHARDS
    tag = f"r{rank}of{world}"
    with key_lock(kdir, world), flock(lock_path(kdir, f"rank{rank}of{world}"), False, str(kdir)):
        if force:
            with flock(lock_path(kdir, "manifest"), True, str(kdir)):
                for f in (MANIFEST, PACKING_STATS):
                    with contextlib.suppress(FileNotFoundError):
                        (kdir / f).unlink()
            for k in range(rank, len(ranges), world):
                shutil.rmtree(shards / f"{k:05d}", ignore_errors=True)
        if (kdir / MANIFEST).exists():
            return kdir
        shards.mkdir(parents=True, exist_ok=True)
        for t in shards.glob(f".tmp-*-{tag}-*"):  # this rank's partial shards of a killed run
            shutil.rmtree(t, ignore_errors=True)
        mine = [
            k
            for k in range(rank, len(ranges), world)
            if not (shards / f"{k:05d}" / SHARD_STATS).exists()
        ]
        _ShardBuilder(res, ranges, num_workers, strict, show_progress, tag).run(mine)
        _finalize(res, ranges, wait_timeout)
    return kdir


class _ShardBuilder:
    """Processes and writes a list of shards, one shard of look-ahead in the pool."""

    def __init__(self, res: Resolved, ranges, num_workers: int, strict: bool, progress: bool,
                 tag: str):  # fmt: skip
        self.res, self.ranges, self.tag = res, ranges, tag
        self.num_workers, self.strict, self.progress = num_workers, strict, progress

    def run(self, mine: Sequence[int]) -> None:
        from tqdm import tqdm

        from torchtitan_ext.vl.packing import normalize_buckets
        from torchtitan_ext.vl.processor import ImageParams

        if not mine:
            return
        cfg = self.res.config
        buckets = normalize_buckets(cfg.seq_len, cfg.buckets)
        params = ImageParams.from_processor(self.res.processor)
        patch_dim = 3 * params.patch_size**2
        video_dim = patch_dim * params.temporal_patch_size
        n_rows = sum(self.ranges[k][1] - self.ranges[k][0] for k in mine)
        bar = tqdm(total=n_rows, unit="sample", desc=f"preprocess {self.tag}",
                   disable=not self.progress, dynamic_ncols=True, smoothing=0.1)  # fmt: skip
        threads = torch.get_num_threads()  # an in-process pool sets 1: the caller keeps its own
        pool = self._pool()
        shards = self.res.kdir / SHARDS
        packs = skips = 0
        try:
            pending = self._submit(pool, mine[0])
            for n, k in enumerate(mine):
                results: list[ProcessedRow | Skip] = []
                for r in pending:
                    if isinstance(r, Skip):
                        skips += 1
                        if self.strict:
                            raise ValueError(f"{cfg.dataset} row {r.row}: {r.message} (--strict)")
                    results.append(r)
                    bar.update(1)
                # One shard of look-ahead: the pool works on shard k+1 while this process packs,
                # writes, hashes and fsyncs shard k (~0.1 s per 20 MB pack); memory stays bounded
                # to two shards.
                if n + 1 < len(mine):
                    pending = self._submit(pool, mine[n + 1])
                tmp = shards / f".tmp-{k:05d}-{self.tag}-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                st = write_shard(tmp, results, cfg.seq_len, cfg.buffer_size, buckets, patch_dim,
                                 store=cfg.store, video_dim=video_dim)  # fmt: skip
                packs += st["packs"]
                publish_shard(tmp, shards / f"{k:05d}")
                bar.set_postfix(packs=packs, skipped=skips, refresh=False)
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            torch.set_num_threads(threads)
            bar.close()

    def _pool(self):
        args = (self.res.config, self.res.rows.layout, self.res.rows.root)  # picklable (spawn)
        if self.num_workers <= 0:
            worker_init(*args)
            return None
        import multiprocessing as mp

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        return ctx.Pool(self.num_workers, initializer=worker_init, initargs=args)

    def _submit(self, pool, k: int):
        a, b = self.ranges[k]
        items = list(zip(range(a, b), self.res.rows.read(a, b), strict=True))
        return pool.imap(process_row, items, chunksize=4) if pool else map(process_row, items)


def _finalize(res: Resolved, ranges: Sequence[tuple[int, int]], wait_timeout: float | None):
    kdir = res.kdir
    shards = kdir / SHARDS
    t0 = time.monotonic()
    while True:
        with flock(lock_path(kdir, "manifest"), True, str(kdir)):
            if (kdir / MANIFEST).exists():
                return
            if all((shards / f"{k:05d}" / SHARD_STATS).exists() for k in range(len(ranges))):
                for t in kdir.glob(f"{JSON_TMP_PREFIX}*"):  # only finalisers write these
                    t.unlink(missing_ok=True)
                write_manifest(kdir, ranges, _identity(res))
                return
        if wait_timeout is not None and time.monotonic() - t0 > wait_timeout:
            missing = [k for k in range(len(ranges)) if not (shards / f"{k:05d}").exists()]
            raise TimeoutError(f"{kdir}: shards {missing[:10]} still missing after {wait_timeout}s")
        time.sleep(0.5)


def _identity(res: Resolved) -> dict[str, Any]:
    from torchtitan_ext.vl.processor import ImageParams, processor_fingerprint, special_token_ids

    return {
        "key": res.key,
        "config": store_fields(res.config) if res.config.store else asdict(res.config),
        "dataset_fingerprint": res.rows.fingerprint(),
        "layout": res.rows.layout.describe(),
        "processor": processor_fingerprint(res.processor),
        "image_params": asdict(ImageParams.from_processor(res.processor)),
        "special_tokens": special_token_ids(res.processor),
        "versions": _versions(),
    }


# Names callers, tests and benchmarks import from here (their homes: vl/build_config.py,
# vl/locks.py, vl/row_work.py).
_flock, _worker_init = flock, worker_init
__all__ = [
    "DEFAULT_ROWS_PER_SHARD",
    "LAYOUT_OPTIONS",
    "OPTION_NAMES",
    "BuildConfig",
    "CacheLockedError",
    "Skip",
    "build_cache",
    "cache_key",
    "config_from",
    "default_num_workers",
    "find_cache",
    "key_dir_name",
    "process_parsed",
    "process_row",
    "resolve",
    "shard_ranges",
    "source_absent",
]
