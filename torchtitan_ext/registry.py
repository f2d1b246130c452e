"""Loader registry: a name in a TOML train config -> a torchtitan ``BaseDataLoader.Config`` class.

A TOML file picks its loader with ``[dataloader] name = "parquet_prefetch"``; every other key of
that table is a field of the registered Config class. Built-in loaders are registered *lazily*
as ``"module:attribute"`` strings so that importing the registry never imports torchtitan,
transformers or any loader module (and a broken optional loader cannot break the others).

Third parties register their own::

    from torchtitan_ext import register_loader
    register_loader("my_loader", MyDataLoader.Config)          # a class
    register_loader("my_other", "my_pkg.loaders:Other.Config")  # or a lazy import path
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:qualname" of the loader's Config class (resolved on first use).
_BUILTIN: dict[str, str] = {
    "parquet_prefetch": "torchtitan_ext.loaders.parquet:PrefetchingParquetDataLoader.Config",
    "streaming_text": "torchtitan_ext.loaders.streaming:StreamingTextDataLoader.Config",
    "cached_vl": "torchtitan_ext.loaders.vl:CachedVLDataLoader.Config",
}

_REGISTRY: dict[str, Any] = dict(_BUILTIN)


class UnknownLoaderError(KeyError):
    """Raised for a loader name that nobody registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text
        return str(self.args[0])


def register_loader(name: str, config_cls: type | str, *, overwrite: bool = False) -> None:
    """Register ``config_cls`` (a ``BaseDataLoader.Config`` subclass, or a lazy
    ``"module:qualname"`` path to one) under ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"loader name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite and _REGISTRY[name] is not config_cls:
        raise ValueError(
            f"loader {name!r} is already registered; pass overwrite=True to replace it"
        )
    _REGISTRY[name] = config_cls


def _resolve(path: str) -> type:
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def get_loader_config(name: str) -> type:
    """The Config class registered under ``name``; raises UnknownLoaderError naming the choices."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise UnknownLoaderError(
            f"unknown loader {name!r} (key dataloader.name); registered loaders: "
            f"{', '.join(sorted(_REGISTRY))}"
        ) from None
    if isinstance(entry, str):
        try:
            entry = _resolve(entry)
        except (ImportError, AttributeError) as e:
            raise UnknownLoaderError(
                f"loader {name!r} (key dataloader.name) is registered as {entry!r}, which cannot "
                f"be imported: {type(e).__name__}: {e}"
            ) from e
        _REGISTRY[name] = entry
    return entry


def loader_name_of(config: Any) -> str | None:
    """Reverse lookup: the registered name of a Config instance's class, if any."""
    for name in available_loaders():
        if type(config) is get_loader_config(name):
            return name
    return None


def available_loaders() -> list[str]:
    return sorted(_REGISTRY)
