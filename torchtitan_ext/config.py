"""TOML train configs for torchtitan 0.3.0, and the job config extended with our sections.

torchtitan 0.3.0 configures jobs with Python: ``--module llama3 --config llama3_debugmodel`` picks
a function returning a ``Trainer.Config`` dataclass, then tyro applies ``--section.key value``
overrides. It has no TOML layer any more. This module adds one, in three layers:

1. **defaults** — the torchtitan config function named by ``[model] module`` / ``config``
   (e.g. ``llama3`` / ``llama3_debugmodel``), optionally re-flavoured by ``[model] flavor``;
   plus our sections' defaults.
2. **the TOML file** — any section of the config (``[training]``, ``[optimizer]``,
   ``[lr_scheduler]``, ``[checkpoint]``, ``[parallelism]``, ``[dataloader]``, ``[metrics]``, …),
   top-level keys (``dump_folder``, ``hf_assets_path``) and ours (``[prefetch]``, ``[vl_cache]``,
   ``[eval_stream]``, ``[staging]``). ``[dataloader] name = "parquet_prefetch"`` picks a loader
   from the registry; the table's other keys are that loader Config's fields.
3. **the command line** — ``--section.key value`` (tyro, exactly like torchtitan) beats the TOML.

Every TOML key is checked before anything is built: an unknown key or a value of the wrong type
raises :class:`ConfigError` naming the file, the ``[section] key`` and the expected type (with a
"did you mean" suggestion), never a silent ignore. A missing file is an error naming the path.

Special path values: ``"embedded"`` for ``hf_assets_path`` / ``dataloader.dataset_path`` means the
embedded corpus and its locally built tokenizer (see :mod:`torchtitan_ext.data.embedded`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

# tomli (a declared dependency) is the library stdlib tomllib was taken from; same API.
import tomli as _toml

from torchtitan_ext import cpu_compat

# Must precede the first import of torchtitan.trainer (see cpu_compat's docstring); inert with CUDA.
cpu_compat.apply()

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from torchtitan_ext.registry import UnknownLoaderError, get_loader_config  # noqa: E402

EMBEDDED = "embedded"


class ConfigError(ValueError):
    """A train config is wrong: the message names the file, the key and what was expected."""


# ---------------------------------------------------------------------------------- our sections
@dataclass(kw_only=True, slots=True)
class ModelSection:
    """Which torchtitan model config the job starts from (the 'defaults' layer)."""

    module: str = "llama3"
    """torchtitan model module whose ``config_registry`` holds the config function: a short
    name of torchtitan's (``llama3``, ``qwen3_5``) or of ours (``qwen3_vl``, in
    ``torchtitan_ext.models``), or a dotted module path."""

    config: str | None = None
    """Name of the config function in that registry, e.g. ``llama3_debugmodel``; None:
    ``<module>_debugmodel``."""

    flavor: str | None = None
    """Model flavor to build instead of the config function's (e.g. ``debugmodel``, ``8B``);
    None keeps the function's choice."""

    attn_backend: str | None = None
    """Attention backend for the flavor (``flex``, ``sdpa``, ``varlen``); None keeps the
    function's. On a machine without CUDA, Flex/varlen are swapped for SDPA (no CPU backward)."""


@dataclass(kw_only=True, slots=True)
class PrefetchSection:
    """Background prefetching of the Parquet text loader (seed 000). Unset (None) fields keep the
    loader's own defaults; a set field is applied to the loader, and is an error if the configured
    loader has no such setting."""

    queue_size: int | None = None
    """Bounded queue capacity, in tokenized batches of documents (seed: ``prefetch_queue_maxsize``,
    4). Larger absorbs slower storage at the cost of memory."""

    tokenizer_batch_size: int | None = None
    """Documents per ``encode_batch`` call in the background thread (seed: 128)."""

    buffer_size: int | None = None
    """Documents held by the best-fit packer to choose from (seed: ``bos_dataloader_buffer_size``,
    1000). Larger lowers the crop rate."""

    thread_priority: Literal["adaptive", "idle", "normal"] | None = None
    """OS scheduling policy of the background threads: ``"adaptive"`` (loader default:
    ``SCHED_IDLE`` while the queue is full, normal when it runs low, where the process may switch
    back), ``"idle"`` or ``"normal"``."""

    # section field -> field of the loader Config (PrefetchingParquetDataLoader.Config)
    _targets: ClassVar[dict[str, str]] = {
        "queue_size": "queue_size",
        "tokenizer_batch_size": "chunk_rows",
        "buffer_size": "buffer_docs",
        "thread_priority": "thread_priority",
    }


@dataclass(kw_only=True, slots=True)
class VLCacheSection:
    """Offline Qwen3-VL preprocessing cache (seed 004); applied to the ``cached_vl`` loader."""

    use_preprocessed_cache: bool | None = None
    """Use a complete cache for the configured key when one exists."""

    cache_dir: str | None = None
    """Root directory of preprocessed caches (one sub-directory per cache key)."""

    force_preprocess: bool | None = None
    """Rebuild the cache even if one exists for the key."""

    _targets: ClassVar[dict[str, str]] = {
        "use_preprocessed_cache": "use_preprocessed_cache",
        "cache_dir": "cache_dir",
        "force_preprocess": "force_preprocess",
    }


@dataclass(kw_only=True, slots=True)
class EvalStreamSection:
    """Train/eval offsets of the streaming text dataset (seed 002); applied to the validation
    loader when it supports them."""

    skip_first: int | None = None
    """Document offset at which the evaluation stream starts (seed: 100000); train starts at 0."""

    seed: int | None = None
    """Shuffle seed of the evaluation stream (seed: train seed + 999)."""

    _targets: ClassVar[dict[str, str]] = {"skip_first": "skip_first", "seed": "seed"}


@dataclass(kw_only=True, slots=True)
class StagingSection:
    """Async host→device staging (seed 003) around whichever loader is configured."""

    enable: bool = False
    """Wrap the loader in AsyncDeviceLoader: pinned buffers + a copy stream with CUDA; a plain
    background prefetcher without."""

    num_buffers: int = 2
    """Device buffers in flight (2 = double buffering)."""


class ExtTrainer(Trainer):
    """torchtitan's Trainer with our config sections and loader integration.

    Differences from ``Trainer``: the dataloader is wrapped in ``AsyncDeviceLoader`` when
    ``[staging] enable``; the loader's ``get_stats()`` is appended to the per-step log line.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelSection = field(default_factory=ModelSection)
        """The torchtitan model config the job starts from (module / config / flavor)."""

        prefetch: PrefetchSection = field(default_factory=PrefetchSection)
        """Prefetching Parquet loader knobs (seed 000)."""

        vl_cache: VLCacheSection = field(default_factory=VLCacheSection)
        """Offline Qwen3-VL cache knobs (seed 004)."""

        eval_stream: EvalStreamSection = field(default_factory=EvalStreamSection)
        """Evaluation stream offset / seed (seed 002)."""

        staging: StagingSection = field(default_factory=StagingSection)
        """Async host-to-device staging (seed 003)."""

    def __init__(self, config: Config):
        from torchtitan_ext.loaders.integration import StagedLoaderConfig, attach_stats_logging

        # Trainer.__init__ builds the dataloader inline (trainer.py ~575) and hands it to the
        # checkpointer, so wrapping must happen *inside* that build call: swap in a Config proxy
        # whose build() wraps, then restore the user's Config object.
        user_loader_cfg = config.dataloader
        if config.staging.enable:
            config.dataloader = StagedLoaderConfig(user_loader_cfg, config.staging)  # type: ignore[assignment]
        try:
            super().__init__(config)
        finally:
            config.dataloader = user_loader_cfg
        attach_stats_logging(self)

    def close(self) -> None:
        super().close()
        # Our loaders own background threads; stop them with the trainer, not at interpreter exit.
        close = getattr(getattr(self, "dataloader", None), "close", None)
        if callable(close):
            close()


ExtTrainerConfig = ExtTrainer.Config

_OUR_SECTIONS = ("prefetch", "vl_cache", "eval_stream")


# ---------------------------------------------------------------------------------- TOML → config
def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable forward refs in a third-party Config: fall back to raw
        return {f.name: f.type for f in fields(cls)}


class _Coercer:
    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, where: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.file}: {where}: {msg}")

    def value(self, v: Any, tp: Any, where: str, current: Any = None) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any or tp is object:
            return v
        if origin is typing.Annotated:
            return self.value(v, args[0], where, current)
        if origin in (typing.Union, types.UnionType):
            non_none = [a for a in args if a is not type(None)]
            if len(non_none) == 1:  # Optional[X] (TOML has no null): X's own, more precise error
                return self.value(v, non_none[0], where, current)
            errors = []
            # Prefer the type of the current value (e.g. a nested Config subclass instance).
            for a in non_none:
                try:
                    return self.value(v, a, where, current)
                except ConfigError as e:
                    errors.append(e)
            raise self.fail(where, f"expected {_type_name(tp)}, got {type(v).__name__} {v!r}")
        if origin is Literal:
            if v not in args:
                raise self.fail(where, f"expected one of {list(args)}, got {v!r}")
            return v
        if origin in (list, tuple, set) or tp in (list, tuple):
            if not isinstance(v, list):
                raise self.fail(
                    where, f"expected a list ({_type_name(tp)}), got {type(v).__name__} {v!r}"
                )
            if origin is tuple and args and args[-1] is not Ellipsis:
                if len(args) != len(v):
                    raise self.fail(where, f"expected {len(args)} items, got {len(v)}")
                return tuple(
                    self.value(x, a, f"{where}[{i}]")
                    for i, (x, a) in enumerate(zip(v, args, strict=False))
                )
            elem = args[0] if args else Any
            out = [self.value(x, elem, f"{where}[{i}]") for i, x in enumerate(v)]
            return tuple(out) if origin is tuple else out
        if origin is dict or tp is dict:
            if not isinstance(v, dict):
                raise self.fail(
                    where, f"expected a table ({_type_name(tp)}), got {type(v).__name__} {v!r}"
                )
            vt = args[1] if len(args) == 2 else Any
            return {k: self.value(x, vt, f"{where}.{k}") for k, x in v.items()}
        if isinstance(tp, type) and is_dataclass(tp):
            if not isinstance(v, dict):
                raise self.fail(
                    where, f"expected a table ({tp.__name__}), got {type(v).__name__} {v!r}"
                )
            if isinstance(current, tp):
                return self.apply(current, v, where)
            return self.construct(tp, v, where)
        if tp is bool:
            if not isinstance(v, bool):
                raise self.fail(where, f"expected bool (true/false), got {type(v).__name__} {v!r}")
            return v
        if tp is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise self.fail(where, f"expected int, got {type(v).__name__} {v!r}")
            return v
        if tp is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise self.fail(where, f"expected float, got {type(v).__name__} {v!r}")
            return float(v)
        if tp is str:
            if not isinstance(v, str):
                raise self.fail(where, f"expected str, got {type(v).__name__} {v!r}")
            return v
        if tp is type(None):
            raise self.fail(where, "expected None (omit the key instead)")
        if isinstance(tp, type) and isinstance(v, tp):
            return v
        raise self.fail(where, f"expected {_type_name(tp)}, got {type(v).__name__} {v!r}")

    def apply(self, obj: Any, table: dict[str, Any], where: str) -> Any:
        """Set ``table``'s keys on dataclass instance ``obj`` (in place), checking each."""
        cls = type(obj)
        flds = {f.name: f for f in fields(cls) if f.init and not f.name.startswith("_")}
        hints = _hints(cls)
        for key, v in table.items():
            loc = f"[{where}] {key}" if where else key
            if key == "name" and isinstance(obj, BaseDataLoader.Config):
                continue  # handled by the caller (loader selection)
            if key not in flds:
                close = difflib.get_close_matches(key, list(flds), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{self.file}: unknown key {loc!r} for {cls.__qualname__}{hint} "
                    f"Valid keys: {', '.join(sorted(flds))}"
                )
            tp = hints.get(key, flds[key].type)
            current = getattr(obj, key)
            if isinstance(v, dict) and _is_loader_config_type(tp, current):
                new = self.loader(current, v, f"{where}.{key}" if where else key)
            else:
                new = self.value(v, tp, loc, current)
            setattr(obj, key, new)
        return obj

    def construct(self, cls: type, table: dict[str, Any], where: str) -> Any:
        """Build a fresh dataclass from a table (for list items and required-field classes)."""
        flds = {f.name: f for f in fields(cls) if f.init and not f.name.startswith("_")}
        hints = _hints(cls)
        kwargs = {}
        for key, v in table.items():
            if key not in flds:
                close = difflib.get_close_matches(key, list(flds), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"{self.file}: unknown key {where}.{key} for {cls.__qualname__}{hint} "
                    f"Valid keys: {', '.join(sorted(flds))}"
                )
            kwargs[key] = self.value(v, hints.get(key, flds[key].type), f"{where}.{key}")
        missing = [
            n
            for n, f in flds.items()
            if n not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise self.fail(where, f"{cls.__qualname__} needs key(s) {missing}")
        return cls(**kwargs)

    def loader(self, current: Any, table: dict[str, Any], where: str) -> Any:
        name = table.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise self.fail(
                    f"[{where}] name", f"expected str, got {type(name).__name__} {name!r}"
                )
            try:
                cls = get_loader_config(name)
            except UnknownLoaderError as e:
                raise ConfigError(f"{self.file}: [{where}] name: {e}") from None
            current = cls()
        return self.apply(current, table, where)


def _is_loader_config_type(tp: Any, current: Any) -> bool:
    return isinstance(current, BaseDataLoader.Config) or (
        isinstance(tp, type) and issubclass(tp, BaseDataLoader.Config)
    )


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (from --config-file)")
    try:
        with open(p, "rb") as f:
            return _toml.load(f)
    except _toml.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None


def _model_overrides_from_cli(args: list[str]) -> dict[str, str]:
    """Pre-scan ``--model.X value`` / ``--model.X=value``: the model section picks the defaults
    layer, so it must be known before the TOML and the rest of the CLI are applied."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--model.") or a.startswith("--model-"):
            key = a[len("--model.") :].replace("-", "_")
            if "=" in key:
                key, val = key.split("=", 1)
            elif i + 1 < len(args):
                val = args[i + 1]
                i += 1
            else:
                raise ConfigError(f"{a} requires a value")
            out[key] = val
        i += 1
    return out


def _take_option(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Remove ``flag value`` / ``flag=value`` from ``args``; return (value, remaining args)."""
    out, val, i = [], None, 0
    alt = flag.replace("_", "-")
    while i < len(args):
        a = args[i]
        if a in (flag, alt):
            if i + 1 >= len(args):
                raise ConfigError(f"{flag} requires a value")
            val, i = args[i + 1], i + 2
            continue
        if a.startswith(flag + "=") or a.startswith(alt + "="):
            val = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return val, out


def base_config(model: ModelSection) -> Trainer.Config:
    """Layer 1: the torchtitan config function, re-flavoured if asked."""
    from torchtitan.models import _supported_models

    mod_name = model.module
    candidates = (
        [f"torchtitan.models.{mod_name}.config_registry"]
        if mod_name in _supported_models
        else [f"{_OUR_MODELS}.{mod_name}.config_registry"]
        if _is_our_model(mod_name)
        else [f"{mod_name}.config_registry", mod_name]
    )
    module = None
    errors = []
    for cand in candidates:
        try:
            module = importlib.import_module(cand)
            break
        except ImportError as e:  # try the next candidate; all failures are reported below
            errors.append(f"{cand}: {e}")
    if module is None:
        raise ConfigError(f"[model] module {mod_name!r}: cannot import ({'; '.join(errors)})")
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


_OUR_MODELS = "torchtitan_ext.models"


def _is_our_model(name: str) -> bool:
    """A short name of a model package in ``torchtitan_ext.models`` (e.g. ``qwen3_vl``)."""
    import importlib.util

    return "." not in name and importlib.util.find_spec(f"{_OUR_MODELS}.{name}") is not None


def model_checks(cfg: ExtTrainer.Config, file: str = "<config>") -> None:
    """The model module's own checks of the whole job, before anything is built: a package of
    ``torchtitan_ext.models`` may define ``validate_job(cfg, file)`` raising ConfigError. A VL
    ``batch_format`` named after one of those modules feeds that module only."""
    name = cfg.model.module
    fmt = getattr(cfg.dataloader, "batch_format", None)
    if isinstance(fmt, str) and fmt != name and _is_our_model(fmt):
        raise ConfigError(
            f"{file}: [dataloader] batch_format = {fmt!r} is the input of [model] module "
            f"{fmt!r}, not of {name!r}"
        )
    if _is_our_model(name):
        importlib.import_module(f"{_OUR_MODELS}.{name}.validate").validate_job(cfg, file)


def _sync_vocab(cfg: Any) -> None:
    """Keep the loss's global vocab size in step with a re-flavoured model."""
    try:
        from torchtitan.models.common.config_utils import decoder_vocab_size
        from torchtitan.models.common.decoder import Decoder

        loss_fn = getattr(cfg.loss, "loss_fn", None)
        if not isinstance(cfg.model_spec.model, Decoder.Config):
            return  # e.g. qwen3_vl: its loss needs no vocab size (no tensor parallelism)
        if loss_fn is not None and hasattr(loss_fn, "global_vocab_size"):
            loss_fn.global_vocab_size = decoder_vocab_size(cfg.model_spec)
    except ImportError:  # older/newer layouts: nothing to keep in sync
        return


def _to_ext(base: Trainer.Config) -> ExtTrainer.Config:
    kwargs = {f.name: getattr(base, f.name) for f in fields(base) if f.init}
    return ExtTrainer.Config(**kwargs)


def load_config(
    config_file: str | Path | None, cli_args: list[str] | None = None
) -> ExtTrainer.Config:
    """Build the job config: defaults < TOML file < command line. Raises ConfigError."""
    import tyro
    from torchtitan.config.manager import custom_registry

    cli_args = list(cli_args or [])
    table = read_toml(config_file) if config_file else {}
    file = str(config_file) if config_file else "<no config file>"
    coercer = _Coercer(file)

    model = ModelSection()
    if "model" in table:
        if not isinstance(table["model"], dict):
            raise coercer.fail("model", "expected a table [model]")
        coercer.apply(model, table["model"], "model")
    for k, v in _model_overrides_from_cli(cli_args).items():
        if k not in {f.name for f in fields(ModelSection)}:
            raise ConfigError(
                f"unknown option --model.{k}; valid: {[f.name for f in fields(ModelSection)]}"
            )
        setattr(model, k, v)

    loader_name, cli_args = _take_option(cli_args, "--dataloader.name")
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
    rest = {k: v for k, v in table.items() if k != "model"}
    coercer.apply(cfg, rest, "")

    if cli_args:
        try:
            cfg = tyro.cli(
                ExtTrainer.Config,
                args=cli_args,
                default=cfg,
                registry=custom_registry,
                prog="python -m torchtitan_ext.train --config-file FILE",
            )
        except SystemExit as e:
            if e.code not in (0, None):
                raise ConfigError(f"invalid command-line override in {cli_args}") from None
            raise
    finalize(cfg, file)
    return cfg


def apply_sections(cfg: ExtTrainer.Config, file: str = "<config>") -> None:
    """Copy set (non-None) fields of our job-level sections onto the loader Config(s) that have
    the matching setting; a set field the loader cannot take is an error, not a silent ignore."""
    targets = {
        "prefetch": [cfg.dataloader],
        "vl_cache": [cfg.dataloader],
        "eval_stream": [getattr(cfg.validator, "dataloader", None)],
    }
    for section in _OUR_SECTIONS:
        sec = getattr(cfg, section)
        for fname, target_name in type(sec)._targets.items():
            val = getattr(sec, fname)
            if val is None:
                continue
            loaders = [ld for ld in targets[section] if ld is not None]
            applied = False
            for ld in loaders:
                if target_name in {f.name for f in fields(ld)}:
                    setattr(ld, target_name, val)
                    applied = True
            if not applied:
                names = ", ".join(type(ld).__qualname__ for ld in loaders) or "no loader"
                raise ConfigError(
                    f"{file}: [{section}] {fname} is set but {names} has no setting "
                    f"{target_name!r}; remove it or choose a loader that supports it"
                )


def resolve_paths(cfg: ExtTrainer.Config) -> None:
    """Resolve the special value ``"embedded"`` (embedded corpus / tokenizer, built on first use)."""
    from torchtitan_ext.data.embedded import ensure_embedded_data

    def embedded() -> Path:
        return ensure_embedded_data()

    if cfg.hf_assets_path == EMBEDDED:
        cfg.hf_assets_path = str(embedded() / "tokenizer")
    for ld in (cfg.dataloader, getattr(cfg.validator, "dataloader", None)):
        if ld is not None and getattr(ld, "dataset_path", None) == EMBEDDED:
            ld.dataset_path = str(embedded())


def check_consistency(cfg: ExtTrainer.Config, file: str = "<config>") -> None:
    """Cross-section rules no single field can express."""
    if getattr(cfg.dataloader, "normalize_on", None) == "device" and not cfg.staging.enable:
        raise ConfigError(
            f"{file}: [dataloader] normalize_on = 'device' needs [staging] enable = true (the "
            "staging wrapper normalises the uint8 pixels after the copy; without it the model "
            "would receive uint8 pixel_values). Use normalize_on = 'collate' without staging."
        )


def finalize(cfg: ExtTrainer.Config, file: str = "<config>") -> None:
    apply_sections(cfg, file)
    check_consistency(cfg, file)
    resolve_paths(cfg)
    model_checks(cfg, file)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-able view of the config (for logs, tests and peek metadata)."""
    out = {}
    for f in fields(cfg):
        if f.name.startswith("_") or f.name == "model_spec":
            continue
        v = getattr(cfg, f.name)
        out[f.name] = _plain(v)
    if getattr(cfg, "model_spec", None) is not None:
        out["model_spec"] = {"name": cfg.model_spec.name, "flavor": cfg.model_spec.flavor}
    return out


def _plain(v: Any) -> Any:
    if is_dataclass(v) and not isinstance(v, type):
        d = {f.name: _plain(getattr(v, f.name)) for f in fields(v) if not f.name.startswith("_")}
        if isinstance(v, BaseDataLoader.Config):
            d["__class__"] = type(v).__qualname__
        return d
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return repr(v)


__all__ = [
    "ConfigError",
    "ExtTrainer",
    "ExtTrainerConfig",
    "ModelSection",
    "PrefetchSection",
    "VLCacheSection",
    "EvalStreamSection",
    "StagingSection",
    "load_config",
    "base_config",
    "read_toml",
    "config_to_dict",
]
