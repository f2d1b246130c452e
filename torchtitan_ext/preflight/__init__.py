"""Preflight: every data, tokenizer and checkpoint mismatch caught before the model is built.

A job config can be well-typed (the TOML layer checks that) and still point at things that do
not fit: a dataset path that does not exist, a tokenizer larger than the model's vocabulary, a
text column the files do not have, a checkpoint saved by a job with another data-parallel
degree. torchtitan finds those only after building the model, and reports them as tracebacks.
:func:`run` runs a list of check functions on the loaded config before ``config.build()``; each
raises :class:`~torchtitan_ext.config.ConfigError` with one line naming the key and the fix (the
launcher prints ``config error: ...`` and exits 2), or adds a line to ``job.notes`` (logged).

Checks are ``"module:function"`` strings, imported when they run (like the loader registry), in
two lists:

* :data:`CHECKS` — for every job, in order: paths, mixtures, parallel degrees, tokenizer, text
  data, checkpoint;
* :data:`MODEL_CHECKS` — by ``[model] module``: a model package of ours adds its own with one
  entry, e.g. ``"qwen3_vl": ["torchtitan_ext.models.qwen3_vl.preflight:check"]``.

A check receives the :class:`Job` (config, file name, world size, the data-parallel degree, and
a cache for things several checks need, such as the tokenizer) and may assume the checks before
it passed. A job whose checkpoint already reached ``training.steps`` raises :class:`JobComplete`:
not an error, but nothing to build either.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from torchtitan_ext.toml_config import ConfigError

Check = Callable[["Job"], None]

CHECKS: list[str | Check] = [
    "torchtitan_ext.preflight.paths:check_paths",
    "torchtitan_ext.preflight.mixture:check_mixture",
    "torchtitan_ext.preflight.paths:check_parallelism",
    "torchtitan_ext.preflight.tokens:check_tokenizer",
    "torchtitan_ext.preflight.data:check_text_data",
    "torchtitan_ext.preflight.data:check_vl_cache",
    "torchtitan_ext.preflight.data:check_vl_video_options",
    "torchtitan_ext.preflight.checkpoint:check_checkpoint",
    # a batch format named after one of our model modules feeds that module only
    "torchtitan_ext.models.qwen3_vl.preflight:check_format_owner",
    # a cached_vl mixture: its sources table and this loader's rules for it
    "torchtitan_ext.vl.mix_preflight:check_vl_mixture",
]

DATA_CHECKS: list[str | Check] = [
    "torchtitan_ext.preflight.mixture:check_mixture",
    "torchtitan_ext.preflight.data:check_vl_video_options",
    "torchtitan_ext.vl.mix_preflight:check_vl_mixture",
]
"""The checks of :data:`CHECKS` that read the data settings alone (no tokenizer, model or
checkpoint): what a tool that only reads data (``peek``) runs before building a loader."""

# [model] module -> its model-specific checks (run after CHECKS).
MODEL_CHECKS: dict[str, list[str | Check]] = {
    "qwen3_vl": ["torchtitan_ext.models.qwen3_vl.preflight:check"],
}


class JobComplete(Exception):
    """The checkpoint the job would resume from already reached ``training.steps``."""


@dataclass
class Job:
    """What the checks look at: the loaded config and the process's place in the job."""

    config: Any
    file: str = "<config>"
    world_size: int = field(default_factory=lambda: int(os.environ.get("WORLD_SIZE", "1")))
    notes: list[str] = field(default_factory=list)
    """Lines for the log (files held out for validation, ...)."""
    cache: dict[str, Any] = field(default_factory=dict)
    """Shared between checks (e.g. the built tokenizer)."""

    @cached_property
    def dp_degree(self) -> int:
        """Data-parallel degree (replicate x shard) torchtitan will derive for this job."""
        from torchtitan.distributed import ParallelDims

        try:
            dims = ParallelDims.from_config(self.config.parallelism, self.world_size)
        except AssertionError as e:
            raise ConfigError(
                f"{self.file}: [parallelism]: {e} (world size {self.world_size}: the number of "
                "processes, e.g. torchrun --nproc_per_node)"
            ) from None
        return dims.dp_replicate * dims.dp_shard

    def loaders(self) -> list[tuple[str, Any]]:
        """(section, loader Config) for the training loader and, when the validator is on,
        the validation loader."""
        out = [("dataloader", self.config.dataloader)]
        val = getattr(self.config, "validator", None)
        if val is not None and val.enable and getattr(val, "dataloader", None) is not None:
            out.append(("validator.dataloader", val.dataloader))
        return out


def loader_name(loader_cfg: Any) -> str:
    """The registry name of a loader Config (its class name if unregistered)."""
    from torchtitan_ext.registry import loader_name_of

    return loader_name_of(loader_cfg) or type(loader_cfg).__qualname__


def _resolve(check: str | Check) -> Check:
    if callable(check):
        return check
    module, _, attr = check.partition(":")
    return getattr(importlib.import_module(module), attr)


def run(config: Any, file: str = "<config>", world_size: int | None = None) -> Job:
    """Run :data:`CHECKS` and the model's :data:`MODEL_CHECKS` on ``config``. Raises ConfigError
    (or JobComplete); returns the Job with its notes."""
    job = Job(config, file)
    if world_size is not None:
        job.world_size = world_size
    model = getattr(getattr(config, "model", None), "module", None)
    for check in [*CHECKS, *MODEL_CHECKS.get(model, [])]:
        _resolve(check)(job)
    return job


def run_data_checks(config: Any, file: str = "<config>") -> None:
    """Run :data:`DATA_CHECKS` on ``config``; raises ConfigError (one line)."""
    job = Job(config, file)
    for check in DATA_CHECKS:
        _resolve(check)(job)


__all__ = [
    "CHECKS",
    "DATA_CHECKS",
    "MODEL_CHECKS",
    "run_data_checks",
    "Check",
    "Job",
    "JobComplete",
    "loader_name",
    "run",
]
