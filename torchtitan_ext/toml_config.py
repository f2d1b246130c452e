"""The TOML layer of a train config: a parsed TOML table applied onto typed config dataclasses.

Every key is checked against the dataclass it lands in: an unknown key or a value of the wrong
type raises :class:`ConfigError` naming the file, the ``[section] key`` and the expected type (with
a "did you mean" suggestion), never a silent ignore. ``Literal`` fields list their choices.

Older section names. Some loader settings used to have a second spelling in their own sections
(``[prefetch]``, ``[vl_cache]``, ``[eval_stream]``). Each setting now has one name, a field of the
loader Config, so ``--help`` shows it once with its real default and the command line overrides
it like any other key. The old sections are still read from TOML files as aliases
(:data:`LEGACY_ALIASES`): each key is moved to its one name before anything is applied, and a
setting given both ways with different values is an error naming both.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

# tomli (a declared dependency) is the library stdlib tomllib was taken from; same API.
import tomli as _toml

from torchtitan_ext import cpu_compat

# Must precede the first torchtitan import (see cpu_compat's docstring); inert with CUDA.
cpu_compat.apply()

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402

from torchtitan_ext.registry import UnknownLoaderError, get_loader_config  # noqa: E402


class ConfigError(ValueError):
    """A train config is wrong: the message names the file, the key and what was expected."""


def did_you_mean(key: str, choices: Any) -> str:
    """``"; did you mean 'steps'?"`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(key, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


# old [section] -> (the table its keys belong to, {old key: key there})
LEGACY_ALIASES: dict[str, tuple[str, dict[str, str]]] = {
    "prefetch": (
        "dataloader",
        {
            "queue_size": "queue_size",
            "tokenizer_batch_size": "chunk_rows",
            "buffer_size": "buffer_docs",
            "thread_priority": "thread_priority",
        },
    ),
    "vl_cache": (
        "dataloader",
        {
            "use_preprocessed_cache": "use_preprocessed_cache",
            "cache_dir": "cache_dir",
            "force_preprocess": "force_preprocess",
        },
    ),
    "eval_stream": ("validator.dataloader", {"skip_first": "skip_first", "seed": "seed"}),
}


def translate_legacy_sections(table: dict[str, Any], file: str) -> dict[str, str]:
    """Move the keys of old-named sections to their one name, in place. Returns
    ``{"dataloader.queue_size": "[prefetch] queue_size", ...}`` for error messages."""
    origins: dict[str, str] = {}
    for old, (target, keys) in LEGACY_ALIASES.items():
        if old not in table:
            continue
        sec = table.pop(old)
        if not isinstance(sec, dict):
            raise ConfigError(f"{file}: [{old}]: expected a table")
        dest = table
        for part in target.split("."):
            dest = dest.setdefault(part, {})
            if not isinstance(dest, dict):
                raise ConfigError(f"{file}: [{target}]: expected a table")
        for key, v in sec.items():
            if key not in keys:
                raise ConfigError(
                    f"{file}: unknown key '[{old}] {key}'{did_you_mean(key, keys)} ([{old}] is an "
                    "older spelling of "
                    f"[{target}] keys: {', '.join(f'{k} -> {v}' for k, v in keys.items())})"
                )
            new = keys[key]
            if new in dest and dest[new] != v:
                raise ConfigError(
                    f"{file}: [{old}] {key} = {v!r} and [{target}] {new} = {dest[new]!r} set the "
                    f"same setting to different values; keep one ([{target}] {new})"
                )
            dest[new] = v
            origins[f"{target}.{new}"] = f"[{old}] {key}"
    return origins


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable forward refs in a third-party Config: fall back to raw
        return {f.name: f.type for f in fields(cls)}


class Coercer:
    """Applies TOML tables to config dataclasses, checking every key and value."""

    def __init__(self, file: str, origins: dict[str, str] | None = None) -> None:
        self.file = file
        # "dataloader.queue_size" -> "[prefetch] queue_size": what the user wrote, for errors
        self.origins = origins or {}

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
            # an array of tables ([[dataloader.sources]]) names its items "#i", as written
            item = "{} #{}" if where.startswith("[[") else "{}[{}]"
            out = [self.value(x, elem, item.format(where, i)) for i, x in enumerate(v)]
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
                origin = self.origins.get(f"{where}.{key}")
                if origin is not None:
                    raise ConfigError(
                        f"{self.file}: {origin} (= [{where}] {key}) is set but {cls.__qualname__} "
                        f"has no setting {key!r}; remove it or choose a loader that has it"
                    )
                raise ConfigError(
                    f"{self.file}: unknown key {loc!r} for {cls.__qualname__}"
                    f"{did_you_mean(key, flds)} "
                    f"Valid keys: {', '.join(sorted(flds))}"
                )
            tp = hints.get(key, flds[key].type)
            current = getattr(obj, key)
            if isinstance(v, dict) and _is_loader_config_type(tp, current):
                new = self.loader(current, v, f"{where}.{key}" if where else key)
            elif _is_table_array(v, tp):  # [[where.key]] tables: errors say "[[where.key]] #i"
                new = self.value(v, tp, f"[[{where}.{key}]]" if where else f"[[{key}]]", current)
            else:
                new = self.value(v, tp, loc, current)
            setattr(obj, key, new)
        return obj

    def construct(self, cls: type, table: dict[str, Any], where: str) -> Any:
        """Build a fresh dataclass from a table (for list items and required-field classes)."""
        flds = {f.name: f for f in fields(cls) if f.init and not f.name.startswith("_")}
        hints = _hints(cls)
        kwargs = {}
        # an item of a [[table array]] is "[[dataloader.sources]] #0 key"; others "where.key"
        sep = " " if where.startswith("[[") else "."
        for key, v in table.items():
            if key not in flds:
                raise ConfigError(
                    f"{self.file}: unknown key {where}{sep}{key} for {cls.__qualname__}"
                    f"{did_you_mean(key, flds)} "
                    f"Valid keys: {', '.join(sorted(flds))}"
                )
            kwargs[key] = self.value(v, hints.get(key, flds[key].type), f"{where}{sep}{key}")
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


def _is_table_array(v: Any, tp: Any) -> bool:
    """``v`` is a TOML array of tables for a ``list[SomeDataclass]`` (or ``| None``) field."""
    if not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
        return False
    for t in (tp, *typing.get_args(tp)):
        args = typing.get_args(t)
        if typing.get_origin(t) is list and args and is_dataclass(args[0]):
            return True
    return False


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
