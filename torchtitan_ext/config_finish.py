"""The last step of loading a train config, after its three layers (``config.py``): the
cross-section rules no single field can express, the ``[model]`` options handed to the model's
own Config, the special path value ``"embedded"``; and a JSON view of a config for logs, tests and
``peek``.

Every function here takes the finished ``ExtTrainer.Config`` (typed ``Any``: this module is
imported by ``config.py`` and must not import it back)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from torchtitan.components.dataloader import BaseDataLoader

from torchtitan_ext.toml_config import ConfigError

EMBEDDED = "embedded"
"""``hf_assets_path`` / ``dataloader.dataset_path`` value: the embedded corpus and its tokenizer."""

# ModelSection fields set on the model's own Config after every layer (the model's Config owns
# their defaults and validation): a model whose Config has no such field refuses the key.
MODEL_OPTIONS = ("freeze", "patch_embed")


def resolve_paths(cfg: Any) -> None:
    """Resolve the special value ``"embedded"`` (embedded corpus / tokenizer, built on first use)."""
    from torchtitan_ext.data.embedded import ensure_embedded_data, resolve_embedded

    def embedded() -> Path:
        return ensure_embedded_data()

    if cfg.hf_assets_path == EMBEDDED:
        cfg.hf_assets_path = str(embedded() / "tokenizer")
    for ld in (cfg.dataloader, getattr(cfg.validator, "dataloader", None)):
        if ld is not None and getattr(ld, "dataset_path", None) == EMBEDDED:
            ld.dataset_path = str(embedded())
        # "embedded:<corpus>" (one embedded corpus alone), also as a mixture source's path
        if ld is not None and isinstance(getattr(ld, "dataset_path", None), str):
            ld.dataset_path = resolve_embedded(ld.dataset_path)
        for src in getattr(ld, "sources", None) or []:
            if isinstance(src.path, str):
                src.path = resolve_embedded(src.path)


def check_consistency(cfg: Any, file: str = "<config>") -> None:
    """Cross-section rules no single field can express."""
    if getattr(cfg.dataloader, "normalize_on", None) == "device" and not cfg.staging.enable:
        raise ConfigError(
            f"{file}: [dataloader] normalize_on = 'device' needs [staging] enable = true (the "
            "staging wrapper normalises the uint8 pixels after the copy; without it the model "
            "would receive uint8 pixel_values). Use normalize_on = 'collate' without staging."
        )


def apply_model_options(cfg: Any, file: str = "<config>") -> None:
    """Copy the set :data:`MODEL_OPTIONS` of ``[model]`` onto the model's Config (after the
    command line, so ``--model.freeze`` counts); values are the model's to check (preflight)."""
    model_cfg = cfg.model_spec.model
    for name in MODEL_OPTIONS:
        value = getattr(cfg.model, name)
        if value is None:
            continue
        if not hasattr(model_cfg, name):
            raise ConfigError(
                f"{file}: [model] {name} (in the file or --model.{name}): model "
                f"{cfg.model_spec.name!r} has no such option (it is a qwen3_vl setting)"
            )
        if isinstance(value, list):  # --model.freeze vision,merger
            value = [v.strip() for item in value for v in str(item).split(",") if v.strip()]
            setattr(cfg.model, name, value)
        setattr(model_cfg, name, value)
    check = getattr(model_cfg, "option_problem", None)
    problem = check() if callable(check) else None
    if problem:
        raise ConfigError(f"{file}: {problem}")


def finalize(cfg: Any, file: str = "<config>") -> None:
    check_consistency(cfg, file)
    apply_model_options(cfg, file)
    resolve_paths(cfg)


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
