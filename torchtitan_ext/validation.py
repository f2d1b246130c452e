"""torchtitan's validator, reporting the loss of each source when the validation data is a mixture.

:class:`MixValidator` is the validator an ``ExtTrainer`` builds (``[validator]`` is its Config:
torchtitan's fields, nothing added). With a single ``[validator.dataloader]`` dataset it is
torchtitan 0.3.0's ``Validator``, unchanged. When ``[validator.dataloader]`` is a mixture
(``[[validator.dataloader.sources]]``, :class:`~torchtitan_ext.pipeline.mix.MixOptions`), each
validation runs torchtitan's pass once per source, on a single-source copy of the loader Config
(:func:`source_config`), and logs

==================================  ==========================================================
log line                            metric backends
==================================  ==========================================================
``validate step: N  loss/<name>:    ``validation_metrics/source/<name>/loss`` (one per source)
X.XXXX``, one line per source
``validate step: N  loss: X.XXXX``  ``validation_metrics/loss`` and the rest of torchtitan's
(torchtitan's line)                 ``validation_metrics/...``, as today
==================================  ==========================================================

The overall ``loss`` of a mixture is the per-source losses weighted by the sources' normalised
weights: the mean loss per token of the mixture the weights describe (a weight is a share of
rows of ``seq_len + 1`` tokens, so of tokens). It is computed from the per-source passes, not
from a further pass over the mixed stream; with ``[validator] steps = N`` each source gets ``N``
steps. A weight-0 source is validated and logged but does not count in the overall loss.

Each source's pass is torchtitan's own ``Validator.validate`` (the model in eval mode, the
per-token loss summed over every DP rank); only the loader Config it builds differs. Its result
reaches us through ``metrics_processor.log_validation`` (``components/validate.py:351`` in
torchtitan 0.3.0 is the one call that carries it), which
:meth:`~torchtitan_ext.metrics.DataMetricsProcessor.collect_validation` turns into a return
value for the duration of the pass: nothing is logged twice, tps is measured over all passes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch.nn as nn
from torchtitan.components.validate import Validator
from torchtitan.tools.logging import logger

from torchtitan_ext.metrics import DataMetricsProcessor
from torchtitan_ext.pipeline.mix import MixOptions, SourceSpec, normalized

LOSS_KEY = "validation_metrics/source/{}/loss"


def mixture_of(loader_cfg: Any) -> list[SourceSpec] | None:
    """The sources of a loader Config that is a mixture, else None (a single dataset)."""
    if isinstance(loader_cfg, MixOptions) and loader_cfg.sources:
        return list(loader_cfg.sources)
    return None


def source_config(loader_cfg: Any, spec: SourceSpec) -> Any:
    """A copy of ``loader_cfg`` reading ``spec``'s data alone: ``sources`` empty, ``dataset_path``
    = ``spec.path`` (or ``dataset`` = ``spec.dataset``, ``dataset_path`` None), and the spec's
    ``text_column`` / ``format`` / ``split`` where it sets them and the Config has the field
    (None keeps the loader's own, e.g. ``split = "val"`` of ``[validator.dataloader]``)."""
    names = {f.name for f in fields(loader_cfg)}
    changes: dict[str, Any] = {"sources": []}
    if spec.path is not None:
        changes["dataset_path"] = spec.path
    else:
        changes["dataset"], changes["dataset_path"] = spec.dataset, None
    for key in ("text_column", "format", "split"):
        if getattr(spec, key) is not None:
            changes[key] = getattr(spec, key)
    missing = sorted(k for k, v in changes.items() if k not in names and v is not None)
    if missing:
        raise ValueError(
            f"[[validator.dataloader.sources]] source {spec.name!r}: "
            f"{type(loader_cfg).__qualname__} has no setting {', '.join(missing)}"
        )
    return replace(loader_cfg, **{k: v for k, v in changes.items() if k in names})


def mixture_loss(losses: dict[str, float], specs: list[SourceSpec]) -> float:
    """The per-source ``losses`` weighted by the normalised weights of ``specs``."""
    p = normalized(specs)
    return float(sum(w * losses[s.name] for s, w in zip(specs, p, strict=True)))


class MixValidator(Validator):
    """torchtitan's ``Validator``; with a mixture, one pass per source (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        """torchtitan's ``[validator]`` fields, unchanged; builds :class:`MixValidator`: the loss
        of each source when ``[validator.dataloader]`` is a mixture."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.specs = mixture_of(self.dl_config)
        if self.specs and not isinstance(self.metrics_processor, DataMetricsProcessor):
            raise TypeError(
                "[validator.dataloader] is a mixture: the loss per source needs the trainer's "
                f"metrics processor to be a DataMetricsProcessor, got "
                f"{type(self.metrics_processor).__qualname__}"
            )
        # one single-source Config per source, built (and checked) once
        self.source_configs = [source_config(self.dl_config, s) for s in self.specs or []]

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        if not self.specs:
            return super().validate(model_parts, step)
        mp = self.metrics_processor
        assert isinstance(mp, DataMetricsProcessor)  # checked in __init__
        mixed, losses = self.dl_config, {}
        try:
            for spec, cfg in zip(self.specs, self.source_configs, strict=True):
                self.dl_config = cfg
                with mp.collect_validation() as got:
                    super().validate(model_parts, step)
                losses[spec.name] = got.loss
                # the start of torchtitan 0.3.0's line (components/metrics.py:567), per source
                logger.info(f"validate step: {step:2}  loss/{spec.name}: {got.loss:7.4f}")
        finally:
            self.dl_config = mixed
        per_source = {LOSS_KEY.format(n): v for n, v in losses.items()}
        mp.log_validation(
            loss=mixture_loss(losses, self.specs), step=step, extra_metrics=per_source
        )


__all__ = ["LOSS_KEY", "MixValidator", "mixture_loss", "mixture_of", "source_config"]
