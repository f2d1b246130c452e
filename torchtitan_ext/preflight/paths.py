"""Preflight checks of paths and parallel degrees: nothing is read yet, only looked up."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from torchtitan_ext.preflight import Job, loader_name
from torchtitan_ext.toml_config import ConfigError

# Loader Config fields that name local files or directories.
LOADER_PATH_KEYS = ("dataset_path", "tokenizer_path", "cache_path", "model_path")

NO_CONFIG_HINT = (
    "; no --config-file was given, so this is torchtitan's own default: pass one, e.g. "
    "--config-file train_configs/llama3_debug_cpu.toml"
)


def exists(value: str) -> bool:
    """A path exists, or a glob matches at least one path."""
    return bool(glob.glob(value)) if any(c in value for c in "*?[") else Path(value).exists()


def check_loader_paths(
    loader_cfg: Any, file: str = "<config>", section: str = "dataloader"
) -> None:
    """ConfigError naming the key for a local path of a loader Config that does not exist
    (``dataset_path``, ``tokenizer_path``, ``cache_path``, ``model_path``; globs must match)."""
    for key in LOADER_PATH_KEYS:
        val = getattr(loader_cfg, key, None)
        if val and not exists(str(val)):
            raise ConfigError(
                f"{file}: [{section}] {key} = {str(val)!r} does not exist (loader "
                f"{loader_name(loader_cfg)!r}); fix [{section}] {key} or pass --{section}.{key} PATH"
            )


def check_paths(job: Job) -> None:
    """hf_assets_path (the trainer builds its tokenizer there), the loaders' paths, and the
    checkpoint to start from."""
    cfg, file = job.config, job.file
    hint = NO_CONFIG_HINT if file == "<no config file>" else ""
    if getattr(cfg, "tokenizer", None) is not None and not Path(cfg.hf_assets_path).is_dir():
        raise ConfigError(
            f"{file}: hf_assets_path = {cfg.hf_assets_path!r} is not a directory (the trainer "
            "loads its tokenizer from it); point it at a directory with tokenizer.json, or use "
            f'"embedded" for the demo tokenizer{hint}'
        )
    for section, loader_cfg in job.loaders():
        check_loader_paths(loader_cfg, file, section)
    init = cfg.checkpoint.initial_load_path
    if cfg.checkpoint.enable and init and not Path(init).is_dir():
        raise ConfigError(
            f"{file}: [checkpoint] initial_load_path = {init!r} is not a directory; fix it or "
            "leave it unset"
        )


def check_parallelism(job: Job) -> None:
    """The parallel degrees multiply to the number of processes (torchtitan asserts it later)."""
    _ = job.dp_degree  # computing it raises ConfigError on a mismatch
