"""Glue shared by every registered loader inside torchtitan's Trainer.

- :func:`stage_loader` — wraps a built loader in ``AsyncDeviceLoader`` for ``[staging] enable =
  true`` (``ExtTrainer`` stages the loader it builds, so the checkpointer sees the wrapper, whose
  ``state_dict`` accounts for batches in flight).
- :func:`build_tokenizer` / :func:`build_loader` — build a config's tokenizer and loader with
  exactly the arguments ``torchtitan.trainer.Trainer.__init__`` passes (batch size, snapshot
  interval, staging), for tools that need the training loader without a trainer (peek).
- :func:`read_stats` / :func:`loader_stats` — a loader's ``get_stats()`` flattened to numbers
  (a mixture's per-source counters apart), which :mod:`torchtitan_ext.metrics` appends to
  torchtitan's step line and sends to the metric backends (TensorBoard / W&B).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtitan_ext.config import StagingSection

logger = logging.getLogger(__name__)


def stage_loader(loader: Any, staging: StagingSection) -> Any:
    """``loader`` wrapped for the device (``device.staging.wrap_for_device``) with ``staging``'s
    buffers, as torchtitan 0.3.0's ``train_step`` needs it (labels stay on the host)."""
    from torchtitan.tools.utils import get_local_device

    from torchtitan_ext.device.staging import wrap_for_device

    opts: dict[str, Any] = {
        "num_buffers": staging.num_buffers,
        # torchtitan 0.3.0's train_step sums (labels != IGNORE_INDEX) into a CPU tensor
        # before it moves labels itself: they must stay on the host.
        "keep_on_host": {(1,)},
    }
    # A VL loader that leaves pixels as uint8 for the device provides its finisher
    # (normalise right after the copy); any loader may.
    finisher = getattr(loader, "finish_on_device", None)
    if callable(finisher):
        opts["device_transform"] = finisher
    return wrap_for_device(loader, get_local_device(), enabled=True, **opts)


@dataclass
class LoaderStats:
    """A loader's ``get_stats()`` as numbers: ``flat`` (nested dicts flattened with ``.``,
    booleans as 0/1) and, for a mixture (the ``Mix.stats`` shape, whose top-level ``sources``
    maps each source's name to its own counters), ``sources``: name -> its counters, flat too.
    ``flat`` leaves ``sources`` out (a source's name may hold a ``.``)."""

    flat: dict[str, float] = field(default_factory=dict)
    sources: dict[str, dict[str, float]] = field(default_factory=dict)


def _flatten(d: Any, prefix: str = "", out: dict[str, float] | None = None) -> dict[str, float]:
    out = {} if out is None else out
    for k, v in d.items():
        if isinstance(v, dict):
            _flatten(v, f"{prefix}{k}.", out)
        elif isinstance(v, (int, float)):  # a bool is an int: 0/1
            out[f"{prefix}{k}"] = float(v)
    return out


def read_stats(loader: Any) -> LoaderStats:
    """``loader.get_stats()`` read once, as :class:`LoaderStats`; empty when it has none."""
    get = getattr(loader, "get_stats", None)
    if get is None:
        return LoaderStats()
    raw = dict(get())
    per = raw.pop("sources", None)
    sources = (
        {str(n): _flatten(s) for n, s in per.items() if isinstance(s, dict)}
        if isinstance(per, dict)
        else {}
    )
    return LoaderStats(_flatten(raw), sources)


def loader_stats(loader: Any) -> dict[str, float]:
    """Numeric stats of a loader (``get_stats()``), flattened; {} when it has none. A mixture's
    per-source counters are left out (:func:`read_stats` has them)."""
    return read_stats(loader).flat


def build_tokenizer(cfg: Any) -> Any | None:
    """``config.tokenizer.build(tokenizer_path=config.hf_assets_path)`` as the trainer does.

    Where the trainer would fail (no tokenizer under ``hf_assets_path``, e.g. a loader-only VL
    config) this warns and passes ``tokenizer=None``: loaders that carry their own tokenizer or
    processor still build; a loader that needs the trainer's tokenizer fails with its own error.
    """
    tok_cfg = getattr(cfg, "tokenizer", None)
    if tok_cfg is None:
        return None
    try:
        return tok_cfg.build(tokenizer_path=cfg.hf_assets_path)
    except (OSError, ValueError) as e:
        # Not swallowed silently: logged, and the loader decides whether it needs one.
        logger.warning(
            "hf_assets_path=%r: no tokenizer (%s: %s); training would stop here. "
            "Building the loader with tokenizer=None.",
            cfg.hf_assets_path,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None


_BUILD: Any = object()  # sentinel: "build the trainer's tokenizer" (None is a valid tokenizer)


def build_loader(
    cfg: Any,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    *,
    tokenizer: Any = _BUILD,
    staging: bool | None = None,
    validator: bool = False,
) -> Any:
    """Build ``cfg.dataloader`` exactly as ``torchtitan.trainer.Trainer.__init__`` does.

    Batch size: ``parallelism.pipeline_parallel_microbatch_size`` with pipeline parallelism,
    else ``training.local_batch_size``. ``snapshot_every_n_steps``: ``checkpoint.interval`` x
    gradient-accumulation steps x pipeline microbatches when checkpointing, else None (the
    gradient-accumulation steps follow ``training.global_batch_size`` over ``dp_world_size``).
    ``staging`` (None: ``[staging] enable``) wraps the loader like ``ExtTrainer``.
    ``tokenizer`` left out builds the trainer's (:func:`build_tokenizer`).
    ``validator=True`` builds ``[validator.dataloader]`` as torchtitan's Validator does:
    ``replace(config, infinite=validator.steps != -1)``, no snapshot interval, no staging.
    """
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size {dp_world_size})")
    if tokenizer is _BUILD:
        tokenizer = build_tokenizer(cfg)
    par, tr = cfg.parallelism, cfg.training
    pp_enabled = int(getattr(par, "pipeline_parallel_degree", 1)) > 1
    batch_size = par.pipeline_parallel_microbatch_size if pp_enabled else tr.local_batch_size
    snapshot = None
    if cfg.checkpoint.enable:
        global_bs = tr.global_batch_size
        if global_bs < 0:
            global_bs = tr.local_batch_size * dp_world_size
        grad_accum = max(1, global_bs // (tr.local_batch_size * dp_world_size))
        pp_micro = tr.local_batch_size // par.pipeline_parallel_microbatch_size if pp_enabled else 1
        snapshot = cfg.checkpoint.interval * grad_accum * pp_micro
    loader_cfg = cfg.dataloader
    kwargs: dict[str, Any] = {"snapshot_every_n_steps": snapshot}
    if validator:
        from dataclasses import replace

        vcfg = cfg.validator
        loader_cfg = replace(vcfg.dataloader, infinite=vcfg.steps != -1)
        kwargs = {}  # the Validator passes no snapshot interval
        staging = False  # ExtTrainer stages only the training loader
    if staging is None:
        staging = bool(cfg.staging.enable)
    loader = loader_cfg.build(
        dp_world_size=dp_world_size,
        dp_rank=dp_rank,
        tokenizer=tokenizer,
        seq_len=tr.seq_len,
        local_batch_size=batch_size,
        **kwargs,
    )
    if not staging:
        return loader
    # torchtitan's get_local_device() reads LOCAL_RANK (torchrun sets it); a lone process (peek,
    # tools) is local rank 0, as the train launcher assumes. Set only for the wrap, then removed,
    # so an in-process caller's environment is left as it was.
    set_local_rank = "LOCAL_RANK" not in os.environ
    if set_local_rank:
        os.environ["LOCAL_RANK"] = "0"
    try:
        return stage_loader(loader, cfg.staging)
    finally:
        if set_local_rank:
            os.environ.pop("LOCAL_RANK", None)
