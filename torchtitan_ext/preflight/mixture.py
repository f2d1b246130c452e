"""Preflight checks of a data mixture (``[[dataloader.sources]]``), before the model is built.

* :func:`check_mixture` (in :data:`~torchtitan_ext.preflight.CHECKS`): each mixture of the job
  (``[dataloader]`` and, when the validator is on, ``[validator.dataloader]``) can be drawn from
  (:func:`~torchtitan_ext.pipeline.mix.check_sources`: weights, names, ``max_epochs``, exactly
  one of ``path`` / ``dataset``), and every source's local ``path`` (a file, a directory or a
  glob) holds at least one data file; for ``parquet_prefetch``, rows of the split (Parquet
  footers only: an empty source is named before the model is built).
* :func:`check_saved_mixture` (run by :func:`~torchtitan_ext.preflight.checkpoint.
  check_checkpoint` when the data state would be resumed): the checkpoint's mixture is the
  configured one. Its source names come from the saved loader envelope itself (every DP rank's
  state, read from the DCP checkpoint without building anything); a mixture whose sources were
  added, removed or reordered is named in one line
  (:func:`~torchtitan_ext.pipeline.mix.mismatch_message`), with the way to continue: the model
  and optimizer from the checkpoint, the data stream afresh
  (``--checkpoint.exclude_from_loading dataloader``).
"""

from __future__ import annotations

import glob
import json
import warnings
from pathlib import Path
from typing import Any

from torchtitan_ext.pipeline.mix import (
    MixOptions,
    MixtureError,
    check_sources,
    mismatch_message,
    saved_names,
)
from torchtitan_ext.preflight import Job
from torchtitan_ext.toml_config import ConfigError


def data_files(path: str) -> bool:
    """``path`` names at least one file: the file itself, a file under the directory (at any
    depth, hidden ones not counted), or a file the glob matches."""
    if any(c in path for c in "*?["):
        return any(Path(p).is_file() for p in glob.iglob(path, recursive=True))
    p = Path(path)
    if p.is_dir():
        return any(
            f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            for f in p.rglob("*")
        )
    return p.is_file()


def recorded_store(loader_cfg: Any, path: str) -> bool:
    """A ``cached_vl`` source whose local data is gone still trains from the sample store built
    from it (``vl/store_lookup.py``: a new pack length or new weights are only a new plan): some
    store under the loader's ``cache_dir`` records ``path`` as its dataset. Which store, and
    whether its processor is the job's, the loader decides (it loads the processor)."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.format import MANIFEST

    if not isinstance(loader_cfg, CachedVLDataLoader.Config):
        return False
    for mf in Path(loader_cfg.cache_dir).glob(f"*/{MANIFEST}"):
        try:
            if json.loads(mf.read_text()).get("config", {}).get("dataset") == str(path):
                return True
        except (OSError, ValueError, AttributeError):
            continue  # a damaged manifest is the loader's to name, with the store it chose
    return False


def configured_names(loader_cfg: Any) -> list[str]:
    """The source names of a loader Config's mixture ([] for a single dataset)."""
    if isinstance(loader_cfg, MixOptions) and loader_cfg.sources:
        return [s.name for s in loader_cfg.sources]
    return []


def check_mixture(job: Job) -> None:
    """Every mixture of the job can be drawn from and its local paths hold data files."""
    for section, loader_cfg in job.loaders():
        if not isinstance(loader_cfg, MixOptions) or not loader_cfg.sources:
            continue
        where = f"[[{section}.sources]]"
        try:
            check_sources(loader_cfg.sources, where)
        except MixtureError as e:
            raise ConfigError(f"{job.file}: {e}") from None
        for spec in loader_cfg.sources:
            if spec.path is None or data_files(spec.path):
                continue
            if recorded_store(loader_cfg, spec.path):
                continue  # the sample store built from it trains without it (a new plan only)
            raise ConfigError(
                f"{job.file}: {where} source {spec.name!r}: path = {spec.path!r} matches no "
                "data file; point it at a file, a directory holding the files, or a glob "
                "that matches them"
            )
        _check_parquet_rows(job, loader_cfg, where)
        _check_not_empty(job, loader_cfg, where)


def holds_a_row(path: str) -> bool:
    """Some data file under ``path`` holds a row: a Parquet file whose footer counts one, or
    another file with a non-blank byte. Stops at the first such file (footers and first bytes
    only: a large source costs what its first file costs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if any(c in path for c in "*?["):
        files = (Path(f) for f in glob.iglob(path, recursive=True))
    elif Path(path).is_dir():
        base = Path(path)
        files = (f for f in sorted(base.rglob("*"))
                 if not any(p.startswith(".") for p in f.relative_to(base).parts))  # fmt: skip
    else:
        files = iter([Path(path)])
    for f in files:
        if not f.is_file():
            continue
        if f.suffix == ".parquet":
            try:
                if pq.ParquetFile(f).metadata.num_rows > 0:
                    return True
            except (OSError, pa.ArrowException):
                return True  # unreadable is not empty: the loader names the file
            continue
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 16):
                if chunk.strip():
                    return True
    return False


def _check_not_empty(job: Job, loader_cfg: Any, where: str) -> None:
    """A ``streaming_text`` or ``cached_vl`` source whose local data files hold no row is named
    now (the Parquet loader's sources are counted per split by ``_check_parquet_rows``)."""
    from torchtitan_ext.loaders.streaming import StreamingTextDataLoader
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    if not isinstance(loader_cfg, (StreamingTextDataLoader.Config, CachedVLDataLoader.Config)):
        return
    for spec in loader_cfg.sources:
        if spec.path is not None and data_files(spec.path) and not holds_a_row(spec.path):
            raise ConfigError(
                f"{job.file}: {where} source {spec.name!r}: path = {spec.path!r} is an empty "
                "source: its data files hold no row"
            )


def _check_parquet_rows(job: Job, loader_cfg: Any, where: str) -> None:
    """A Parquet mixture's sources hold rows of their split (footers only, no row read): an
    empty source is named now, not after the model is built."""
    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader

    if not isinstance(loader_cfg, PrefetchingParquetDataLoader.Config):
        return
    from torchtitan_ext.text.parquet_mix import check_parquet_sources

    try:
        check_parquet_sources(
            loader_cfg.sources or [],
            split=loader_cfg.split,
            val_files=loader_cfg.val_files,
            on_bad_input=loader_cfg.on_bad_input,
        )
    except MixtureError as e:
        raise ConfigError(
            f"{job.file}: {str(e).replace('[[dataloader.sources]]', where)}"
        ) from None


def _saved_rank_states(job: Job, step_dir: Path) -> list[Any] | None:
    """The DP ranks' loader states of the checkpoint's envelope (encoded), or None when its
    loader state is not one envelope (another loader's, or none). Read with torch's
    ``_load_state_dict_from_keys`` (private in torch 2.13: the one DCP reader that loads a key
    without a template of its structure; no process group needed); only the ``dataloader`` key
    is read, a few MB at most (the text loaders' packer buffers)."""
    from torchtitan_ext.pipeline import checkpoint
    from torchtitan_ext.preflight.checkpoint import _damaged, _metadata_keys

    prefix = f"dataloader.{checkpoint.KEY}."
    if not any(k.startswith(prefix) for k in _metadata_keys(job, step_dir)):
        return None
    meta = step_dir / ".metadata"
    try:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        with warnings.catch_warnings():  # "no process group: loading in a single process"
            warnings.simplefilter("ignore")
            value = _load_state_dict_from_keys(keys={"dataloader"}, checkpoint_id=str(step_dir))
        env = value["dataloader"][checkpoint.KEY]
        ranks = list(env["ranks"])
    except Exception as e:  # unreadable: named, with the ways out
        raise _damaged(job, meta, e) from e
    return ranks


def check_saved_mixture(job: Job, step_dir: Path) -> None:
    """The mixture saved in ``step_dir``'s loader state is the one ``[dataloader]`` configures
    (the same source names in the same order); ConfigError naming what changed if not."""
    now = configured_names(job.config.dataloader)
    ranks = _saved_rank_states(job, step_dir)
    if ranks is None:
        return
    saved = next((n for r in ranks if (n := saved_names(r)) is not None), [])
    if saved != now:
        raise ConfigError(
            f"{job.file}: the checkpoint this job would resume from, {step_dir}: "
            f"{mismatch_message(saved, now)}"
        )
