"""Glue shared by every registered loader inside torchtitan's Trainer.

- :class:`StagedLoaderConfig` — stands in for the user's loader Config while ``Trainer.__init__``
  builds the dataloader, so the built loader comes back wrapped in ``AsyncDeviceLoader``
  (``[staging] enable = true``) and the checkpointer sees the wrapper (whose ``state_dict``
  accounts for batches in flight).
- :func:`build_tokenizer` / :func:`build_loader` — build a config's tokenizer and loader with
  exactly the arguments ``torchtitan.trainer.Trainer.__init__`` passes (batch size, snapshot
  interval, staging), for tools that need the training loader without a trainer (peek).
- :func:`attach_stats_logging` — appends the loader's ``get_stats()`` (data-wait ms, queue depth …)
  to torchtitan's per-step log line and to its metrics backends (TensorBoard / W&B).
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

STATS_PREFIX = "data/"


class StagedLoaderConfig:
    """Proxy for a loader Config: ``build(**kw)`` builds the real loader, then wraps it."""

    def __init__(self, inner: Any, staging: Any) -> None:
        self.inner = inner
        self.staging = staging

    def build(self, **kwargs: Any) -> Any:
        from torchtitan.tools.utils import get_local_device

        from torchtitan_ext.device.staging import wrap_for_device

        loader = self.inner.build(**kwargs)
        opts: dict[str, Any] = {
            "num_buffers": self.staging.num_buffers,
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

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)


def loader_stats(loader: Any) -> dict[str, float]:
    """Numeric stats of a loader (``get_stats()``), flattened; {} when it has none."""
    get = getattr(loader, "get_stats", None)
    if get is None:
        return {}
    out: dict[str, float] = {}

    def walk(prefix: str, d: Any) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{prefix}{k}"] = float(v)
            elif isinstance(v, bool):
                out[f"{prefix}{k}"] = float(v)

    walk("", get())
    return out


# Which stats make it into the one-line summary, in order (name in get_stats() -> label).
_LINE_KEYS = (
    ("queue_depth", "queue"),
    ("crop_pct", "crop%"),
    ("docs_skipped", "skipped"),
    ("skipped", "skipped"),
    ("epoch", "epoch"),
)
# Cumulative counters shown as a mean per step since the previous log line (VL: images and
# vision patches the loader handed to the trainer).
_PER_STEP_KEYS = (("images", "images"), ("patches", "patches"))


class _StepLineFilter(logging.Filter):
    """Appends the data summary to torchtitan's per-step log record (the one with "loss:")."""

    def __init__(self, trainer: Any) -> None:
        super().__init__()
        self.trainer = trainer
        self.pending: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            self.pending
            and isinstance(record.msg, str)
            and "loss:" in record.msg
            and "step:" in record.msg
        ):
            record.msg = f"{record.msg}  {self.pending}"
            self.pending = None
        return True


def attach_stats_logging(trainer: Any) -> None:
    """Wrap ``trainer.metrics_processor.log`` so each step's log line carries data-wait ms and the
    loader's stats, and the metric backends receive them as ``data/...`` scalars."""
    from torchtitan.tools.logging import logger as tt_logger

    mp = trainer.metrics_processor
    original = mp.log
    flt = _StepLineFilter(trainer)
    tt_logger.addFilter(flt)
    last: dict[str, float] = {}
    batches_per_step = getattr(trainer, "gradient_accumulation_steps", 1) * getattr(
        trainer, "num_pipeline_parallel_microbatches", 1
    )

    def log(
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        times = list(mp.data_loading_times)
        wait_ms = 1000.0 * sum(times) / max(1, len(times))
        stats = loader_stats(trainer.dataloader)
        extra = dict(extra_metrics or {})
        extra.update({f"{STATS_PREFIX}{k}": v for k, v in stats.items()})
        extra[f"{STATS_PREFIX}wait_ms"] = wait_ms
        parts = [f"data_wait: {wait_ms:.2f}ms"]
        # one data_loading_times entry per batch fetched since the previous log line
        steps = max(1.0, len(times) / max(1, batches_per_step))
        for key, label in _PER_STEP_KEYS:
            if key in stats:
                per_step = (stats[key] - last.get(key, 0.0)) / steps
                extra[f"{STATS_PREFIX}{key}_per_step"] = per_step
                parts.append(f"{label}/step: {per_step:g}")
                last[key] = stats[key]
        cap = stats.get("queue_capacity")
        for key, label in _LINE_KEYS:
            if key in stats:
                val = stats[key]
                if key == "queue_depth" and cap:
                    parts.append(f"{label}: {int(val)}/{int(cap)}")
                else:
                    parts.append(f"{label}: {val:g}")
        flt.pending = "  ".join(parts)
        original(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    mp.log = log
    trainer._ext_stats_filter = flt


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
    set_local_rank = False
    if staging:
        loader_cfg = StagedLoaderConfig(loader_cfg, cfg.staging)
        # torchtitan's get_local_device() reads LOCAL_RANK (torchrun sets it); a lone process (peek, tools)
        # is local rank 0, as the train launcher assumes. Set only for the build, then removed, so
        # an in-process caller's environment is left as it was.
        set_local_rank = "LOCAL_RANK" not in os.environ
        if set_local_rank:
            os.environ["LOCAL_RANK"] = "0"
    try:
        return loader_cfg.build(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            seq_len=tr.seq_len,
            local_batch_size=batch_size,
            **kwargs,
        )
    finally:
        if set_local_rank:
            os.environ.pop("LOCAL_RANK", None)
