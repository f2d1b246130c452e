"""TOML train configs for torchtitan 0.3.0, and the job config extended with our sections.

torchtitan 0.3.0 configures jobs with Python: ``--module llama3 --config llama3_debugmodel`` picks
a function returning a ``Trainer.Config`` dataclass, then tyro applies ``--section.key value``
overrides. It has no TOML layer any more. This module adds one, in three layers:

1. **defaults** — the config function named by ``[model] module`` / ``config`` (e.g. ``llama3`` /
   ``llama3_debugmodel``), optionally re-flavoured by ``[model] flavor``; then the defaults that
   depend on the machine (:func:`machine_defaults`: float32 on a CPU without native bf16 matmul,
   no ANSI colours when stdout is not a terminal), so that both layers below still override them.
2. **the TOML file** — any section of the config (``[training]``, ``[optimizer]``,
   ``[lr_scheduler]``, ``[checkpoint]``, ``[parallelism]``, ``[dataloader]``, ``[metrics]``,
   ``[validator]``, …), top-level keys (``dump_folder``, ``hf_assets_path``) and ours
   (``[model]``, ``[staging]``). ``[dataloader] name = "parquet_prefetch"`` picks a loader from the
   registry; the table's other keys are that loader Config's fields (checked by
   :mod:`torchtitan_ext.toml_config`).
3. **the command line** — ``--section.key value`` (tyro, exactly like torchtitan) beats the TOML;
   nothing is copied over the config after it (see :mod:`torchtitan_ext.cli_args`).

Each setting has one name: a loader setting is a field of its loader Config (``[dataloader]
queue_size``, ``[validator.dataloader] skip_first``), spelled the same in the TOML file, on the
command line and in ``--help``, which shows the value the job would use.

``[model] module`` names a torchtitan model (``llama3``, ``qwen3``, …), a model package of ours
under ``torchtitan_ext/models/<name>/`` (its ``config_registry`` holds the config functions, its
``model_registry`` the flavors), or any importable module path.

Checks that need the files a config points to (paths, tokenizer, checkpoint) run in
:mod:`torchtitan_ext.preflight`, after the config is loaded and before the model is built.

Special path values: ``"embedded"`` for ``hf_assets_path`` / ``dataloader.dataset_path`` means the
embedded corpus and its locally built tokenizer (see :mod:`torchtitan_ext.data.embedded`).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import shlex
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torchtitan_ext import cpu_compat, logs

# Must precede the first import of torchtitan.trainer (see cpu_compat's docstring); inert with CUDA.
cpu_compat.apply()
logs.install()  # before torchtitan builds its first Config (see logs' docstring)

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from torchtitan_ext import cli_args as cli  # noqa: E402
from torchtitan_ext.checkpointing import RecordingCheckpointManager  # noqa: E402
from torchtitan_ext.config_finish import config_to_dict, finalize  # noqa: E402
from torchtitan_ext.metrics import DataMetricsProcessor  # noqa: E402
from torchtitan_ext.toml_config import (  # noqa: E402
    Coercer,
    ConfigError,
    read_toml,
    translate_legacy_sections,
)
from torchtitan_ext.validation import MixValidator  # noqa: E402

# Where ``[model] module = "<name>"`` is looked for, in order ("{}" is the name).
MODEL_PACKAGES = ("torchtitan.models.{}", "torchtitan_ext.models.{}")


# ---------------------------------------------------------------------------------- our sections
@dataclass(kw_only=True, slots=True)
class ModelSection:
    """Which torchtitan model config the job starts from (the 'defaults' layer)."""

    module: str = "llama3"
    """Model package whose ``config_registry`` holds the config function: a torchtitan model
    (``llama3``), one of ours (``torchtitan_ext/models/<name>``) or a dotted module path."""

    config: str | None = None
    """Name of the config function in that registry, e.g. ``llama3_debugmodel``; None:
    ``<module>_debugmodel``."""

    flavor: str | None = None
    """Model flavor to build instead of the config function's (e.g. ``debugmodel``, ``8B``);
    None keeps the function's choice."""

    attn_backend: str | None = None
    """Attention backend for the flavor (``flex``, ``sdpa``, ``varlen``); None keeps the
    function's. On a machine without CUDA, Flex/varlen are swapped for SDPA (no CPU backward)."""

    freeze: list[str] | None = None
    """Components whose weights stay fixed (no gradient, no optimizer state, left out of the
    gradient norm). qwen3_vl: any of ``vision``, ``merger``, ``language_model``,
    ``embeddings``, ``lm_head``. None keeps the model's default (nothing frozen)."""

    patch_embed: str | None = None
    """qwen3_vl: how the vision tower embeds patches, ``conv`` (transformers' Conv3d) or
    ``matmul`` (the same weights as one matrix multiply; kernel = stride makes them equal).
    None keeps the model's default."""


# The fields that pick the defaults layer itself (read before the TOML's other sections).
BASE_KEYS = ("module", "config", "flavor", "attn_backend")


@dataclass(kw_only=True, slots=True)
class StagingSection:
    """Async host→device staging around whichever loader is configured."""

    enable: bool = False
    """Wrap the loader in AsyncDeviceLoader: pinned buffers + a copy stream with CUDA; a plain
    background prefetcher without."""

    num_buffers: int = 2
    """Batches staged ahead (2 = double buffering) by the wrapper's own background thread. A
    loader that prefetches in a pipeline stage of its own is staged in that stage's thread
    instead, and its ``[dataloader] queue_size`` is the depth."""


class ExtTrainer(Trainer):
    """torchtitan's Trainer with our config sections and loader integration.

    Differences from ``Trainer``, each an override of what 0.3.0 builds, no object patched:

    ============================  ==========================================================
    ``[staging] enable``          the loader is staged (:func:`~torchtitan_ext.loaders.
                                  integration.stage_loader`) as it is stored, before the
                                  checkpointer is built with it (the :attr:`dataloader`
                                  property)
    ``[metrics]``                 builds :class:`~torchtitan_ext.metrics.DataMetricsProcessor`:
                                  the loader's ``get_stats()`` on the per-step line and in the
                                  metric backends; ``mfu: N/A`` where there is no peak FLOPS
    ``[checkpoint]``              builds :class:`~torchtitan_ext.checkpointing.
                                  RecordingCheckpointManager`: each save gets a record of what
                                  its data state depends on (loader, data-parallel degree,
                                  seq_len, batch size; :mod:`torchtitan_ext.preflight` compares
                                  it with the next job's) and of its model (what
                                  ``torchtitan-ext-export`` needs); the last save in HF format
                                  also gets ``config.json`` and the job's processor
    ``[validator]``               builds :class:`~torchtitan_ext.validation.MixValidator`
                                  (from torchtitan's plain ``Validator.Config``; a model's
                                  own validator is kept): with a mixture as
                                  ``[validator.dataloader]``, the loss of each source
    ============================  ==========================================================
    """

    metrics_processor: DataMetricsProcessor
    checkpointer: RecordingCheckpointManager

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelSection = field(default_factory=ModelSection)
        """The torchtitan model config the job starts from (module / config / flavor)."""

        staging: StagingSection = field(default_factory=StagingSection)
        """Async host-to-device staging around whichever loader is configured."""

        metrics: DataMetricsProcessor.Config = field(default_factory=DataMetricsProcessor.Config)
        """torchtitan's metrics settings; the step line and the metric backends also carry the
        data loader's stats."""

        checkpoint: RecordingCheckpointManager.Config = field(
            default_factory=RecordingCheckpointManager.Config
        )
        """torchtitan's checkpoint settings; each save also gets the job's record."""

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)  # slots=True: no zero-argument super()
            # A torchtitan config function sets torchtitan's own Configs: same fields, ours build
            self.metrics = _as_ours(DataMetricsProcessor.Config, self.metrics, "metrics")
            self.checkpoint = _as_ours(
                RecordingCheckpointManager.Config, self.checkpoint, "checkpoint"
            )
            # torchtitan's plain Validator becomes ours; a model's own (e.g. Flux's) is kept
            if type(self.validator) is Validator.Config:
                self.validator = _as_ours(MixValidator.Config, self.validator, "validator")
            if getattr(self.dataloader, "batch_shapes_vary", False):
                # torchtitan 0.3.0 replays forward+backward as one CUDA graph unless told not
                # to (trainer.py:613 ``if not config.training.disable_cuda_graphs``), and the
                # graph refuses a batch whose shapes differ from the first (cudagraph.py:278):
                # a VL loader's second step would stop the job.
                self.training.disable_cuda_graphs = True

    def __init__(self, config: Config):
        super().__init__(config)
        self.metrics_processor.follow_loader(
            self.dataloader,
            self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches,
        )
        if self.checkpointer.enable:
            from torchtitan_ext.preflight.checkpoint import job_record, model_record

            dims = self.parallel_dims
            record = job_record(self.config, dims.dp_replicate * dims.dp_shard)
            record["model"] = model_record(self.config)
            self.checkpointer.set_job_record(record)

    @property
    def dataloader(self) -> BaseDataLoader:
        """The training loader, staged for the device when ``[staging] enable``.

        A property because ``Trainer.__init__`` builds the loader inline and hands it to the
        checkpointer at its next statement (trainer.py:575 ``self.dataloader =
        config.dataloader.build(...)``, then :591 ``config.checkpoint.build(dataloader=
        self.dataloader, ...)``): storing it is the only step in between that a subclass can
        override, and the checkpointer must hold the staged loader (its ``state_dict`` accounts
        for the batches in flight)."""
        return self._dataloader

    @dataloader.setter
    def dataloader(self, loader: BaseDataLoader) -> None:
        from torchtitan_ext.loaders.integration import stage_loader

        staging = self.config.staging
        self._dataloader = stage_loader(loader, staging) if staging.enable else loader

    def close(self) -> None:
        super().close()
        # Our loaders own background threads; stop them with the trainer, not at interpreter exit.
        close = getattr(getattr(self, "dataloader", None), "close", None)
        if callable(close):
            close()


def _as_ours(cls: type, value: Any, section: str) -> Any:
    """``value`` (torchtitan's Config of ``cls``'s base) as a ``cls`` with the same fields."""
    if isinstance(value, cls):
        return value
    base = cls.__mro__[1]
    if type(value) is not base:
        raise ConfigError(
            f"[{section}]: ExtTrainer needs torchtitan's {base.__qualname__} here (it builds its "
            f"own {cls.__qualname__} from it), got {type(value).__qualname__}"
        )
    return cls(**{f.name: getattr(value, f.name) for f in fields(value) if f.init})


ExtTrainerConfig = ExtTrainer.Config


def base_config(model: ModelSection) -> Trainer.Config:
    """Layer 1: the torchtitan config function, re-flavoured if asked."""
    mod_name = model.module
    module = None
    for cand in model_module_candidates(mod_name):
        try:
            module = importlib.import_module(cand)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not cand.startswith(e.name):
                # the package exists but one of *its* imports is missing: say which
                raise ConfigError(f"[model] module {mod_name!r}: importing {cand}: {e}") from e
    if module is None:
        raise ConfigError(
            f"[model] module {mod_name!r}: no such model package (looked for "
            f"{', '.join(model_module_candidates(mod_name))})"
        )
    config_name = model.config or f"{mod_name.rsplit('.', 1)[-1]}_debugmodel"
    fn = getattr(module, config_name, None)
    if not callable(fn):
        avail = [
            n
            for n in dir(module)
            if not n.startswith("_") and callable(getattr(module, n)) and n[0].islower()
        ]
        raise ConfigError(
            f"[model] config {config_name!r} not found in {module.__name__}; available: {avail}"
        )
    cfg = fn()
    if model.flavor is not None or model.attn_backend is not None:
        pkg = importlib.import_module(module.__name__.rsplit(".", 1)[0])
        registry = getattr(pkg, "model_registry", None)
        if registry is None:
            raise ConfigError(f"[model] flavor: {pkg.__name__} has no model_registry()")
        flavor = model.flavor or cfg.model_spec.flavor
        kwargs = {"attn_backend": model.attn_backend} if model.attn_backend else {}
        try:
            cfg.model_spec = registry(flavor, **kwargs)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"[model] flavor {flavor!r}: {e}") from None
        _sync_vocab(cfg)
    return cfg


def model_module_candidates(name: str) -> list[str]:
    """Modules tried, in order, for ``[model] module = name``: ``<package>.config_registry`` for
    each of :data:`MODEL_PACKAGES`, then ``name.config_registry`` and ``name`` itself."""
    short = [p.format(name) + ".config_registry" for p in MODEL_PACKAGES] if "." not in name else []
    return [*short, f"{name}.config_registry", name]


def _sync_vocab(cfg: Any) -> None:
    """Keep the loss's global vocab size in step with a re-flavoured model."""
    try:
        from torchtitan.models.common.config_utils import decoder_vocab_size
        from torchtitan.models.common.decoder import Decoder

        if not isinstance(cfg.model_spec.model, Decoder.Config):
            return  # e.g. qwen3_vl: its loss needs no vocab size (no tensor parallelism)
        loss_fn = getattr(cfg.loss, "loss_fn", None)
        if loss_fn is not None and hasattr(loss_fn, "global_vocab_size"):
            loss_fn.global_vocab_size = decoder_vocab_size(cfg.model_spec)
    except ImportError:  # older/newer layouts: nothing to keep in sync
        return


def _to_ext(base: Trainer.Config) -> ExtTrainer.Config:
    kwargs = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
    return ExtTrainer.Config(**kwargs)


def machine_defaults(cfg: ExtTrainer.Config) -> None:
    """The defaults that depend on this machine (part of layer 1: the TOML and the command line
    still override them): on a CPU, the parameter dtype :func:`cpu_compat.cpu_param_dtype` picks;
    no ANSI colours in torchtitan's log lines when stdout (its log stream) is not a terminal."""
    if cpu_compat.needed():
        cfg.training.mixed_precision_param = cpu_compat.cpu_param_dtype()  # type: ignore[assignment]
    if not sys.stdout.isatty():
        cfg.metrics.disable_color_printing = True


def load_config(
    config_file: str | Path | None, cli_args: list[str] | None = None
) -> ExtTrainer.Config:
    """Build the job config: defaults < TOML file < command line. Raises ConfigError."""
    import tyro
    from torchtitan.config.manager import custom_registry

    args = list(cli_args or [])
    table = read_toml(config_file) if config_file else {}
    file = str(config_file) if config_file else "<no config file>"
    coercer = Coercer(file, translate_legacy_sections(table, file))
    cli.reject_legacy(args)

    model = ModelSection()
    if "model" in table:
        if not isinstance(table["model"], dict):
            raise coercer.fail("model", "expected a table [model]")
        coercer.apply(model, table["model"], "model")
    model_keys = [f.name for f in fields(ModelSection)]
    for k, v in cli.model_overrides(args).items():
        if k not in model_keys:
            raise ConfigError(f"unknown option --model.{k}; valid: {model_keys}")
        if k in BASE_KEYS:  # the others (lists among them) are tyro's to parse
            setattr(model, k, v)

    loader_name, args = cli.take_option(args, "--dataloader.name")
    if loader_name is not None:
        dl = table.setdefault("dataloader", {})
        if not isinstance(dl, dict):
            raise coercer.fail("dataloader", "expected a table [dataloader]")
        if dl.get("name") not in (None, loader_name):
            # A different loader: the TOML's other [dataloader] keys belonged to the old one.
            table["dataloader"] = {"name": loader_name}
        else:
            dl["name"] = loader_name

    cfg = _to_ext(base_config(model))
    cfg.model = model
    machine_defaults(cfg)
    coercer.apply(cfg, {k: v for k, v in table.items() if k != "model"}, "")

    if args:
        args = cli.normalize_bools(args, cli.bool_options(cfg))
        box = io.StringIO()  # tyro's error box, turned into one line below
        try:
            with contextlib.redirect_stderr(box):
                cfg = tyro.cli(
                    ExtTrainer.Config,
                    args=args,
                    default=cfg,
                    registry=custom_registry,
                    prog="python -m torchtitan_ext.train --config-file FILE",
                )
        except SystemExit as e:
            if e.code not in (0, None):
                raise ConfigError(
                    f"{file} with the command line {shlex.join(args)}: {cli.tyro_reason(box)}"
                ) from None
            sys.stderr.write(box.getvalue())
            raise
        sys.stderr.write(box.getvalue())
    finalize(cfg, file)
    return cfg


__all__ = [
    "ConfigError",
    "ExtTrainer",
    "ExtTrainerConfig",
    "ModelSection",
    "StagingSection",
    "load_config",
    "base_config",
    "read_toml",
    "config_to_dict",
]
