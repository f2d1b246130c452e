"""Glue shared by every registered loader inside torchtitan's Trainer.

- :class:`StagedLoaderConfig` — stands in for the user's loader Config while ``Trainer.__init__``
  builds the dataloader, so the built loader comes back wrapped in ``AsyncDeviceLoader``
  (``[staging] enable = true``) and the checkpointer sees the wrapper (whose ``state_dict``
  accounts for batches in flight).
- :func:`attach_stats_logging` — appends the loader's ``get_stats()`` (data-wait ms, queue depth …)
  to torchtitan's per-step log line and to its metrics backends (TensorBoard / W&B).
"""

from __future__ import annotations

import logging
from typing import Any

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
