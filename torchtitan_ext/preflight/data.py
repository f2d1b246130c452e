"""Preflight checks of local text data: the files exist, the text column is there, and which
files are held out for validation (and by which rule) is said in the log.

Only Parquet footers are read (the schema), never rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchtitan_ext.preflight import Job, loader_name
from torchtitan_ext.toml_config import ConfigError


def _string_columns(schema: Any) -> list[str]:
    """The columns the loaders read as text (the loaders' own rule, ``text.columns.text_kind``)."""
    from torchtitan_ext.text.columns import text_kind

    return [n for n, t in zip(schema.names, schema.types, strict=True) if text_kind(t)]


def check_text_column(files: list[Path], loader_cfg: Any, section: str, file: str) -> None:
    """``text_column`` is a text column of every file (with ``on_bad_input = "skip"``: of at
    least one), naming the string columns there are otherwise."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchtitan_ext.text.columns import text_kind

    column = loader_cfg.text_column
    skip = getattr(loader_cfg, "on_bad_input", "error") == "skip"
    missing: list[tuple[Path, Any]] = []
    not_text: list[tuple[Path, Any]] = []
    for f in files:
        try:
            schema = pq.read_schema(f)
        except (OSError, pa.ArrowException) as e:
            if skip:
                continue  # counted as an unreadable file by the loader
            raise ConfigError(
                f"{file}: [{section}] dataset_path: {f} is not a readable Parquet file ({e}); "
                f'remove it, or set [{section}] on_bad_input = "skip" to count and skip it'
            ) from None
        if column not in schema.names:
            missing.append((f, schema))
        elif text_kind(schema.field(column).type) is None:
            not_text.append((f, schema))
    for bad, what in ((missing, "is not a column of"), (not_text, "is not a text column in")):
        if bad and (not skip or len(bad) == len(files)):
            f, schema = bad[0]
            cols = [c for c in _string_columns(schema) if c != column]
            if not cols:
                use = "text_column to a string column (this file has none: write the text as one)"
            elif len(cols) == 1:
                use = f"text_column = {cols[0]!r}"
            else:
                use = f"text_column to one of {cols}"
            kind = f" (its type is {schema.field(column).type})" if bad is not_text else ""
            raise ConfigError(
                f"{file}: [{section}] text_column = {column!r} {what} {f}{kind} "
                f"({len(bad)} of {len(files)} file(s)); set [{section}] {use}"
            )


def _parquet_split(job: Job, section: str, loader_cfg: Any) -> list[Path]:
    """The files of a parquet_prefetch split; notes the held-out files for a training split."""
    from torchtitan_ext.text.parquet import split_files

    try:
        files = split_files(loader_cfg.dataset_path, loader_cfg.val_files)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(
            f"{job.file}: [{section}] val_files = {loader_cfg.val_files!r}: {e}"
        ) from None
    used = files.val if loader_cfg.split == "val" else files.train
    if not used:
        raise ConfigError(
            f"{job.file}: [{section}] split = {loader_cfg.split!r} of dataset_path = "
            f"{loader_cfg.dataset_path!r} has no files under {files.rule}; set [{section}] "
            'val_files ("none", "last_shard" or a glob of the validation files)'
        )
    if loader_cfg.split == "train" and files.val:
        names = ", ".join(f.name for f in files.val)
        note = (
            f"[{section}] {len(files.val)} file(s) held out for validation by {files.rule}: "
            f"{names}; training on the other {len(files.train)}"
        )
        if not job.config.validator.enable:
            note += f' (the validator is off: [{section}] val_files = "none" trains on all)'
        job.notes.append(note)
    return used


def _streaming_files(job: Job, section: str, loader_cfg: Any) -> list[Path]:
    from torchtitan_ext.text.streaming import resolve_local_files

    try:
        found = resolve_local_files(loader_cfg.dataset_path, loader_cfg.split)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{job.file}: [{section}] dataset_path: {e}") from None
    if found is None or found[0] != "parquet":
        return []  # a hub dataset, or JSONL / text files: no schema to look at
    return [Path(f) for f in found[1]]


def check_text_data(job: Job) -> None:
    """For the text loaders reading local Parquet files: the split's files, the text column."""
    for section, loader_cfg in job.loaders():
        name = loader_name(loader_cfg)
        if not getattr(loader_cfg, "dataset_path", None):
            continue  # the embedded corpus, or a hub dataset
        if name == "parquet_prefetch":
            files = _parquet_split(job, section, loader_cfg)
        elif name == "streaming_text":
            files = _streaming_files(job, section, loader_cfg)
        else:
            continue
        check_text_column(files, loader_cfg, section, job.file)


def check_vl_cache(job: Job) -> None:
    """For ``cached_vl`` with an explicit ``cache_path``: the manifest reads and checks (digest,
    fields; the same :func:`~torchtitan_ext.vl.format.read_manifest` the reader uses), and the
    cache holds packs for every data-parallel rank. A key lookup (``cache_dir``) is left to the
    loader: finding that cache means fingerprinting the source data, not a preflight's job."""
    for section, loader_cfg in job.loaders():
        path = getattr(loader_cfg, "cache_path", None)
        if loader_name(loader_cfg) != "cached_vl" or not path:
            continue
        from torchtitan_ext.vl.format import CacheError, read_manifest

        where = f"{job.file}: [{section}] cache_path = {path!r}"
        try:
            counts = read_manifest(Path(path))["counts"]
        except CacheError as e:
            raise ConfigError(f"{where}: {e}") from None
        packs, dp = int(counts["packs"]), job.dp_degree
        if packs == 0:
            raise ConfigError(
                f"{where} holds no packs: all {counts.get('rows_read', '?')} rows read were "
                f"skipped (`inspect-cache --cache-dir {path}` lists why)"
            )
        if packs < dp and getattr(loader_cfg, "remainder", "drop") == "drop":
            raise ConfigError(
                f"{where} holds {packs} packs, fewer than the {dp} data-parallel ranks: every "
                f"rank would get none; set [{section}] remainder = 'wrap' or use more data"
            )


def check_vl_video_options(job: Job) -> None:
    """For ``cached_vl``: the ``video_*`` knobs can work (fps > 0, min <= max, ...): one line
    naming the key, before the cache is looked up or built."""
    from torchtitan_ext.vl.build_config import VIDEO_OPTIONS, BuildConfig, check_video_options
    from torchtitan_ext.vl.reader import processor_path

    for section, loader_cfg in job.loaders():
        if loader_name(loader_cfg) != "cached_vl":
            continue
        knobs = {k: getattr(loader_cfg, k) for k in VIDEO_OPTIONS}
        proc = processor_path(loader_cfg.model_path, getattr(job.config, "hf_assets_path", None))
        try:
            check_video_options(BuildConfig(dataset="", model_path=proc, **knobs))
        except ValueError as e:
            raise ConfigError(f"{job.file}: [{section}] {e}") from None
