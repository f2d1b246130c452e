"""The command-line layer of a train config, before tyro sees it.

tyro (torchtitan's parser) applies ``--section.key value`` overrides last, so the command line
beats the TOML file, which beats the defaults. Three things are settled here first:

* ``--model.X`` is pre-scanned: ``[model]`` picks the defaults layer, which must exist before the
  TOML and the other options are applied (:func:`model_overrides`).
* ``--dataloader.name`` is taken out: it picks the loader Config class the other
  ``--dataloader.*`` options belong to (:func:`take_option`).
* booleans accept a value: tyro spells them as flags (``--checkpoint.enable`` /
  ``--checkpoint.no-enable``) and reads ``--checkpoint.enable false`` as an unknown subcommand
  "false". :func:`normalize_bools` rewrites ``--x.flag true|false|1|0|yes|no`` and
  ``--x.flag=false`` to the flag spelling, so both forms work.

Options of the older section names (``--prefetch.queue_size``) are refused with the one name to
use instead, since each setting has exactly one name (see :mod:`torchtitan_ext.toml_config`).
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

from torchtitan_ext.toml_config import LEGACY_ALIASES, ConfigError

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _norm(option: str) -> str:
    """``--Training.Disable-Cuda_graphs`` -> ``training.disable_cuda_graphs``."""
    return option.lstrip("-").replace("-", "_").lower()


def model_overrides(args: list[str]) -> dict[str, str]:
    """``--model.X value`` / ``--model.X=value`` pairs (left in ``args``: tyro applies them too)."""
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


def take_option(args: list[str], flag: str) -> tuple[str | None, list[str]]:
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


def bool_options(cfg: Any, prefix: str = "") -> set[str]:
    """Dotted names (``checkpoint.enable``) of every bool field reachable from dataclass ``cfg``,
    following the runtime type of each nested value (a loader Config subclass included)."""
    out: set[str] = set()
    for f in fields(cfg):
        if f.name.startswith("_"):
            continue
        name = f"{prefix}{f.name}"
        v = getattr(cfg, f.name, None)
        if isinstance(v, bool) or f.type in (bool, "bool"):
            out.add(name)
        elif is_dataclass(v) and not isinstance(v, type):
            out |= bool_options(v, name + ".")
    return out


def reject_legacy(args: list[str]) -> None:
    """``--prefetch.queue_size 8`` -> ConfigError naming the option's one name."""
    for a in args:
        if not a.startswith("--"):
            continue
        head, _, rest = _norm(a.split("=", 1)[0]).partition(".")
        if head in LEGACY_ALIASES and rest:
            target, keys = LEGACY_ALIASES[head]
            new = keys.get(rest)
            use = f"--{target}.{new}" if new else f"a --{target}.* option"
            raise ConfigError(f"{a.split('=', 1)[0]}: this option is now {use}")


def normalize_bools(args: list[str], bools: set[str]) -> list[str]:
    """Rewrite ``--x.flag VALUE`` / ``--x.flag=VALUE`` of bool fields to tyro's flag spelling."""
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, val = a.partition("=")
        key = _norm(name) if a.startswith("--") else ""
        if key in bools:
            if not eq and i + 1 < len(args) and args[i + 1].lower() in _TRUE | _FALSE:
                val, eq = args[i + 1], "="
                i += 1
            if eq:
                if val.lower() not in _TRUE | _FALSE:
                    raise ConfigError(f"{name}: expected true or false, got {val!r}")
                section, _, leaf = key.rpartition(".")
                on = val.lower() in _TRUE
                a = f"--{section + '.' if section else ''}{'' if on else 'no-'}{leaf}"
        out.append(a)
        i += 1
    return out


def tyro_reason(box: Any) -> str:
    """The first section of the error box tyro printed (into ``box``, a StringIO) as one line,
    e.g. "Error parsing checkpoint: last_save_in_hf requires last_save_model_only=True." or
    "Unrecognized options: --loss.num_chunks, 4" ("see --help" when there is no box). The rest
    of the box (the list of subcommands, the pointer to --help) is left out."""
    lines = []
    for raw in box.getvalue().splitlines():
        text = raw.strip().strip("│╭╮╰╯").strip()
        if text.startswith("─"):
            if lines:
                break
            continue
        if text and not raw.lstrip().startswith(("╭", "╰")):
            lines.append(text)
    return " ".join(lines) or "invalid option (see --help)"
