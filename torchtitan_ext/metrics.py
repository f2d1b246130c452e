"""torchtitan's per-step metrics with the data loader's stats in them.

:class:`DataMetricsProcessor` is the ``MetricsProcessor`` an ``ExtTrainer`` builds (the
``[metrics]`` section is its Config: torchtitan's fields, nothing added). Each logged step it

* appends the data summary to torchtitan's step line (one log record), e.g.
  ``step:  2  loss: ...  mfu: N/A  data_wait: 0.41ms  queue: 3/8  skipped: 0  epoch: 0``;
* sends the same numbers to the metric backends (TensorBoard / W&B) as ``data/...`` scalars.

==========================  ===================================  ===============================
line                        backends                             source
==========================  ===================================  ===============================
``data_wait: N.NNms``       ``data/wait_ms``                     torchtitan's per-batch
                                                                 ``data_loading_times`` since
                                                                 the previous line, mean, in ms
``images/step: N``          ``data/images_per_step``             cumulative ``images`` /
``patches/step: N``         ``data/patches_per_step``            ``patches`` stats: increase
``frames/step: N``          ``data/video_frames_per_step``       since the previous line / steps
``video_patches/step: N``   ``data/video_patches_per_step``      (the two video ones on the line
                                                                 once a video was seen; a frame
                                                                 is a merged frame)
``queue: D/C``              ``data/queue_depth``,                ``queue_depth`` (over
                            ``data/queue_capacity``              ``queue_capacity`` if known)
``crop%: N``                ``data/crop_pct``                    ``crop_pct``
``skipped: N``              ``data/docs_skipped`` or             ``docs_skipped`` / ``skipped``
                            ``data/skipped``
``epoch: N``                ``data/epoch``                       ``epoch``
``mix: web 70.2%/70% ...``  ``data/source/<name>/share``,        a mixture's ``sources`` (the
                            ``.../target``                       ``Mix.stats`` shape): realised
                                                                 share of the items (rows) / the
                                                                 normalised weight, per source
(not on the line)           ``data/source/<name>/tokens``,       the source's own ``tokens`` (VL)
                            ``.../items``, ``.../ended``, and    or ``tokens_read`` (text)
                            ``.../images``, ``.../patches``      counter, its items, whether it
                            where the source counts them         ended, its VL counters
(not on the line)           ``data/<key>``                       every other numeric stat
==========================  ===================================  ===============================

Stats are the loader's ``get_stats()`` (nested dicts flattened with ``.``, booleans as 0/1), read
on each rank from its own loader. Invariant: the line and the backends show the same values
(the line's percentages are the backends' fractions x 100, to one decimal). ``mix:`` is on the
line only for two sources or more; a source that ended is marked ``(ended)`` there.

Why :meth:`DataMetricsProcessor.log` is a whole method and not a call to torchtitan's: torchtitan
0.3.0 computes the step's metrics, sends them and prints the line in one method
(``torchtitan/components/metrics.py:451`` ``MetricsProcessor.log``) with no hook to add to the
line; this one computes the same metrics, sends them with ours and prints the same line with the
summary after it. MFU shows ``N/A`` where there is no peak FLOPS to divide by (a CPU: the peak is
NaN there, see :mod:`torchtitan_ext.cpu_compat`) as torchtitan does with quantization.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from torchtitan_ext.loaders.integration import LoaderStats, read_stats

PREFIX = "data/"

# Which stats make it into the line, in order (name in get_stats() -> label).
LINE_KEYS = (
    ("queue_depth", "queue"),
    ("crop_pct", "crop%"),
    ("docs_skipped", "skipped"),
    ("skipped", "skipped"),
    ("epoch", "epoch"),
)
# Cumulative counters shown as a mean per step since the previous line (VL: images and vision
# patches the loader handed to the trainer).
PER_STEP_KEYS = (
    ("images", "images"),
    ("patches", "patches"),
    ("video_frames", "frames"),
    ("video_patches", "video_patches"),
)
# Of those, the ones on the line only once the run has seen one (an image-only job shows none).
SHOWN_ONCE_SEEN = ("video_frames", "video_patches")
# Per source of a mixture: backend name -> the source's counters that give it, first found.
SOURCE_KEYS = (
    ("tokens", ("tokens", "tokens_read")),
    ("items", ("items",)),
    ("share", ("share",)),
    ("target", ("target",)),
    ("ended", ("ended",)),
    ("images", ("images",)),
    ("patches", ("patches",)),
)


def _pct(fraction: float) -> str:
    """``0.7`` -> ``"70%"``, ``0.7023`` -> ``"70.2%"`` (one decimal, a trailing .0 dropped)."""
    return f"{100.0 * fraction:.1f}".removesuffix(".0") + "%"


def source_step(
    sources: Mapping[str, Mapping[str, float]],
) -> tuple[dict[str, float], str | None]:
    """A mixture's per-source metrics (:data:`SOURCE_KEYS`, ``data/source/<name>/<key>``) and
    its line part (``mix: web 70.2%/70% code 29.8%/30%``; None for fewer than two sources)."""
    metrics: dict[str, float] = {}
    parts = []
    for name, st in sources.items():
        for out_key, keys in SOURCE_KEYS:
            found = next((st[k] for k in keys if k in st), None)
            if found is not None:
                metrics[f"{PREFIX}source/{name}/{out_key}"] = found
        if "share" in st and "target" in st:
            ended = " (ended)" if st.get("ended") else ""
            parts.append(f"{name} {_pct(st['share'])}/{_pct(st['target'])}{ended}")
    return metrics, ("mix: " + " ".join(parts)) if len(sources) >= 2 and parts else None


def data_step(
    stats: Mapping[str, float],
    waits_s: list[float],
    last: Mapping[str, float],
    batches_per_step: int,
    sources: Mapping[str, Mapping[str, float]] | None = None,
) -> tuple[dict[str, float], str]:
    """One logged step's data metrics and line summary (pure; see the module's table).

    ``stats``: the loader's flattened stats now; ``waits_s``: the per-batch waits since the
    previous line; ``last``: the cumulative :data:`PER_STEP_KEYS` counters at the previous line
    (the caller keeps the new ones, which are in ``stats``); ``sources``: a mixture's per-source
    counters (``LoaderStats.sources``), None or empty for one dataset."""
    wait_ms = 1000.0 * sum(waits_s) / max(1, len(waits_s))
    metrics = {f"{PREFIX}{k}": v for k, v in stats.items()}
    metrics[f"{PREFIX}wait_ms"] = wait_ms
    parts = [f"data_wait: {wait_ms:.2f}ms"]
    # one wait per batch fetched since the previous line
    steps = max(1.0, len(waits_s) / max(1, batches_per_step))
    for key, label in PER_STEP_KEYS:
        if key in stats:
            per_step = (stats[key] - last.get(key, 0.0)) / steps
            metrics[f"{PREFIX}{key}_per_step"] = per_step
            if key not in SHOWN_ONCE_SEEN or stats[key] > 0:
                parts.append(f"{label}/step: {per_step:g}")
    cap = stats.get("queue_capacity")
    for key, label in LINE_KEYS:
        if key in stats:
            val = stats[key]
            if key == "queue_depth" and cap:
                parts.append(f"{label}: {int(val)}/{int(cap)}")
            else:
                parts.append(f"{label}: {val:g}")
    if sources:
        per_source, mix = source_step(sources)
        metrics.update(per_source)
        if mix is not None:
            parts.append(mix)
    return metrics, "  ".join(parts)


@dataclass
class CollectedValidation:
    """The loss of one validation pass, kept by :meth:`DataMetricsProcessor.collect_validation`."""

    loss: float = math.nan


class DataMetricsProcessor(MetricsProcessor):
    """torchtitan's MetricsProcessor whose step line and metrics also carry the data loader's
    stats (see the module docstring). The trainer names the loader with :meth:`follow_loader`
    once it is built (after this processor, in ``Trainer.__init__``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        """torchtitan's ``[metrics]`` fields, unchanged; builds :class:`DataMetricsProcessor`."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.loader: Any = None
        self.batches_per_step = 1
        self._last_counters: dict[str, float] = {}
        self._collecting: CollectedValidation | None = None

    def follow_loader(self, loader: Any, batches_per_step: int) -> None:
        """Report ``loader``'s ``get_stats()`` with each step; ``batches_per_step`` = gradient
        accumulation steps x pipeline microbatches (for the per-step counters)."""
        self.loader = loader
        self.batches_per_step = max(1, int(batches_per_step))

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        """torchtitan's ``log`` (same metrics, same line), plus the data stats."""
        assert self.num_flops_per_token > 0, "num_flops_per_token must be set"
        read = read_stats(self.loader) if self.loader is not None else LoaderStats()
        stats = read.flat
        data, summary = data_step(
            stats,
            list(self.data_loading_times),
            self._last_counters,
            self.batches_per_step,
            read.sources,
        )
        self._last_counters.update({k: stats[k] for k, _ in PER_STEP_KEYS if k in stats})
        metrics, line = self._torchtitan_step(step, global_avg_loss, global_max_loss, grad_norm)
        metrics.update(extra_metrics or {})
        metrics.update(data)
        self.logger.log(metrics, step)
        logger.info(f"{line}  {summary}")

        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

    @contextmanager
    def collect_validation(self) -> Iterator[CollectedValidation]:
        """Within: :meth:`log_validation` keeps the loss in the yielded object instead of
        logging it (and leaves the tps counters running), so a validator can run torchtitan's
        pass per source and log them together (:mod:`torchtitan_ext.validation`)."""
        got = CollectedValidation()
        self._collecting = got
        try:
            yield got
        finally:
            self._collecting = None

    def log_validation(
        self, loss: float, step: int, extra_metrics: dict[str, Any] | None = None
    ) -> None:
        """torchtitan's ``log_validation``; inside :meth:`collect_validation`, the loss is kept."""
        if self._collecting is not None:
            self._collecting.loss = float(loss)
            return
        super().log_validation(loss, step, extra_metrics)

    def _torchtitan_step(
        self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float
    ) -> tuple[dict[str, Any], str]:
        """The metrics and the step line of torchtitan 0.3.0's ``MetricsProcessor.log``
        (components/metrics.py:451-533), without sending or printing them."""
        time_delta = time.perf_counter() - self.time_last_log
        # tokens per second per device
        tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        tflops = self.num_flops_per_token * tps / 1e12
        mfu = None
        if not self.has_quantization and math.isfinite(self.gpu_peak_flops):
            mfu = 100 * self.num_flops_per_token * tps / self.gpu_peak_flops
        times = self.data_loading_times
        mem = self.device_memory_monitor.get_peak_stats()
        metrics: dict[str, Any] = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": tflops,
            "time_metrics/end_to_end(s)": time_delta / self.config.log_freq,
            "time_metrics/data_loading(s)": sum(times) / len(times),
            "time_metrics/data_loading(%)": 100 * sum(times) / time_delta,
            "memory/max_active(GiB)": mem.max_active_gib,
            "memory/max_active(%)": mem.max_active_pct,
            "memory/max_reserved(GiB)": mem.max_reserved_gib,
            "memory/max_reserved(%)": mem.max_reserved_pct,
            "memory/num_alloc_retries": mem.num_alloc_retries,
            "memory/num_ooms": mem.num_ooms,
        }
        if mfu is not None:
            metrics["mfu(%)"] = mfu
        c = self.color
        mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"
        line = (
            f"{c.red}step: {step:2}  "
            f"{c.green}loss: {global_avg_loss:8.5f}  "
            f"{c.orange}grad_norm: {grad_norm:7.4f}  "
            f"{c.turquoise}memory: {mem.max_reserved_gib:5.2f}GiB"
            f"({mem.max_reserved_pct:.2f}%)  "
            f"{c.blue}tps: {round(tps):,}  "
            f"{c.cyan}tflops: {tflops:,.2f}  "
            f"{c.magenta}mfu: {mfu_str}{c.reset}"
        )
        return metrics, line
