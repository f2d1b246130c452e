"""One name per knob, and the command line always wins: for every key of our sections and of every
registered loader Config, defaults < TOML < command line, checked field by field.

Each loader's fields are all set at once (one TOML, one command line) and checked one by one, so
a field that a later step overwrites (the bug where a section was copied over the loader Config
after the command line was applied) fails under its own name.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.conftest import REPO
from torchtitan_ext.config import ConfigError, StagingSection, load_config
from torchtitan_ext.registry import get_loader_config
from torchtitan_ext.toml_config import LEGACY_ALIASES

LOADERS = ["parquet_prefetch", "streaming_text", "cached_vl"]


# ------------------------------------------------------------------------------ value generation
def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return non_none[0]
    return tp


def two_values(tp: Any, default: Any) -> tuple[Any, Any]:
    """(a TOML value, a command-line value): both differ from ``default`` where the type allows,
    and always from each other."""
    tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        others = [c for c in typing.get_args(tp) if c != default]
        return others[0], (others[1] if len(others) > 1 else default)
    if tp is bool:
        return (not default), default
    if tp is int:
        base = default if isinstance(default, int) else 0
        return base + 3, base + 5
    if tp is float:
        base = default if isinstance(default, float) else 0.0
        return base + 0.5, base + 1.5
    if tp is str:
        return "toml_value", "cli_value"
    if origin is list:
        return [7, 9], [11, 13]
    raise NotImplementedError(f"no test values for {tp}")


def toml_literal(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    return repr(v)


def cli_args(option: str, v: Any) -> list[str]:
    if isinstance(v, bool):
        return [option, "true" if v else "false"]  # the value form (tyro alone wants flags)
    if isinstance(v, list):
        return [option, *map(str, v)]
    return [option, str(v)]


def field_cases(cls: type) -> list[tuple[str, Any, Any, Any]]:
    """(field, default, TOML value, CLI value) for every public field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or not f.init:
            continue
        tp = _strip_optional(hints[f.name])
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            continue  # [[section.key]] tables (a mixture's sources): the mixture tests set them
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        t, c = two_values(hints[f.name], default)
        out.append((f.name, default, t, c))
    return out


# ------------------------------------------------------------------------------ the three layers
def _layers(tmp: Path, section: str, name: str | None, cases: list) -> dict[str, Any]:
    """Configs with the section at defaults, set by a TOML file, and then by the command line."""
    head = f"[{section}]\n{'name = ' + toml_literal(name) if name else ''}\n"
    if section == "validator.dataloader":
        head = "[validator]\nenable = true\n" + head
    if name == "cached_vl":  # normalize_on = "device" needs the staging wrapper
        head = "[staging]\nenable = true\n" + head
    plain = tmp / f"{section}-{name}-plain.toml"
    plain.write_text(head)
    full = tmp / f"{section}-{name}-full.toml"
    full.write_text(head + "".join(f"{k} = {toml_literal(t)}\n" for k, _, t, _ in cases))
    args: list[str] = []
    for k, _, _, c in cases:
        args += cli_args(f"--{section}.{k}", c)
    return {
        "defaults": load_config(plain),
        "toml": load_config(full),
        "cli": load_config(full, args),
    }


def _get(cfg: Any, section: str) -> Any:
    for part in section.split("."):
        cfg = getattr(cfg, part)
    return cfg


SECTIONS: list[tuple[str, str | None, type]] = [
    *[("dataloader", n, get_loader_config(n)) for n in LOADERS],
    ("validator.dataloader", "streaming_text", get_loader_config("streaming_text")),
    ("validator.dataloader", "parquet_prefetch", get_loader_config("parquet_prefetch")),
    ("staging", None, StagingSection),
]
CASES = [
    pytest.param(section, name, case, id=f"{section}:{name or ''}:{case[0]}")
    for section, name, cls in SECTIONS
    for case in field_cases(cls)
]


@pytest.fixture(scope="module")
def layered(tmp_path_factory) -> dict[tuple[str, str | None], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("layers")
    return {
        (section, name): _layers(tmp, section, name, field_cases(cls))
        for section, name, cls in SECTIONS
    }


@pytest.mark.parametrize("section,name,case", CASES)
def test_cli_beats_toml_beats_defaults(layered, section, name, case):
    key, default, toml_v, cli_v = case
    cfgs = layered[(section, name)]
    got = {layer: getattr(_get(cfg, section), key) for layer, cfg in cfgs.items()}
    assert got["defaults"] == default, f"[{section}] {key}: default"
    assert got["toml"] == toml_v, f"[{section}] {key}: the TOML value is not applied"
    assert got["cli"] == cli_v, f"[{section}] {key}: the command line does not win over the TOML"


MODEL_CASES = [
    ("module", "llama3", "torchtitan.models.llama3"),
    ("config", "llama3_debugmodel_varlen_attn", "llama3_debugmodel_ce_loss"),
    ("flavor", "1B", "debugmodel"),
    ("attn_backend", "flex", "varlen"),
]


@pytest.mark.parametrize("key,toml_v,cli_v", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_section_cli_beats_toml(tmp_path, key, toml_v, cli_v):
    p = tmp_path / "m.toml"
    p.write_text(f'[model]\n{key} = "{toml_v}"\n')
    assert getattr(load_config(p).model, key) == toml_v
    assert getattr(load_config(p, [f"--model.{key}", cli_v]).model, key) == cli_v


def test_loader_config_defaults_are_the_loaders_own():
    """A default lives once: the torchtitan-facing Config and the framework-free class it builds
    agree on every setting they share (the Config is what --help shows). The loaders' Configs
    *are made of* their stages' options dataclasses, so their defaults are theirs by construction."""
    from torchtitan_ext.pipeline.prefetch import PrefetchOptions
    from torchtitan_ext.text import pack_stage, stream_pack, stream_stages
    from torchtitan_ext.text.parquet_source import ParquetOptions

    checked = 0
    made_of = {
        "streaming_text": (stream_stages.StreamOptions, stream_pack.PackOptions, PrefetchOptions),
        "parquet_prefetch": (ParquetOptions, pack_stage.PackOptions, PrefetchOptions),
    }
    for name, parts in made_of.items():
        cfg = get_loader_config(name)
        fields = {f.name: f for f in dataclasses.fields(cfg)}
        for opts in parts:
            assert issubclass(cfg, opts), f"{name} is not made of {opts.__name__}"
            for f in dataclasses.fields(opts):
                assert fields[f.name].default == f.default, f"{name}.{f.name}"
                checked += 1
    assert checked >= 20
    # a keyword constructor that repeats defaults must agree with them
    from torchtitan_ext.text.streaming import StreamingTextDataset

    for cfg_cls, impl in [(get_loader_config("streaming_text"), StreamingTextDataset)]:
        params = inspect.signature(impl.__init__).parameters
        for f in dataclasses.fields(cfg_cls):
            p = params.get(f.name)
            if p is None or p.default is inspect.Parameter.empty:
                continue
            assert f.default == p.default, (
                f"{cfg_cls.__qualname__}.{f.name}: {f.default!r} != {p.default!r}"
            )
            checked += 1


# ------------------------------------------------------------------------------ older section names
ALIAS_CASES = [
    pytest.param(old, key, new, target, id=f"{old}.{key}")
    for old, (target, keys) in LEGACY_ALIASES.items()
    for key, new in keys.items()
]
ALIAS_LOADER = {
    "prefetch": "parquet_prefetch",
    "vl_cache": "cached_vl",
    "eval_stream": "streaming_text",
}


def _alias_value(old: str, key: str) -> Any:
    cls = get_loader_config(ALIAS_LOADER[old])
    new = LEGACY_ALIASES[old][1][key]
    f = next(f for f in dataclasses.fields(cls) if f.name == new)
    return two_values(typing.get_type_hints(cls)[new], f.default)


def _alias_toml(tmp: Path, old: str, key: str, v: Any, extra: str = "") -> Path:
    target = LEGACY_ALIASES[old][0]
    body = (
        f'[{target}]\nname = "{ALIAS_LOADER[old]}"\n{extra}\n[{old}]\n{key} = {toml_literal(v)}\n'
    )
    if target == "validator.dataloader":
        body = "[validator]\nenable = true\n" + body
    p = tmp / "alias.toml"
    p.write_text(body)
    return p


@pytest.mark.parametrize("old,key,new,target", ALIAS_CASES)
def test_older_section_name_is_read_as_the_one_name_and_the_cli_still_wins(
    tmp_path, old, key, new, target
):
    toml_v, cli_v = _alias_value(old, key)
    p = _alias_toml(tmp_path, old, key, toml_v)
    assert getattr(_get(load_config(p), target), new) == toml_v
    cfg = load_config(p, cli_args(f"--{target}.{new}", cli_v))
    assert getattr(_get(cfg, target), new) == cli_v


@pytest.mark.parametrize("old,key,new,target", ALIAS_CASES)
def test_a_setting_given_both_ways_with_different_values_is_an_error(
    tmp_path, old, key, new, target
):
    toml_v, other = _alias_value(old, key)
    same = _alias_toml(tmp_path, old, key, toml_v, f"{new} = {toml_literal(toml_v)}")
    assert getattr(_get(load_config(same), target), new) == toml_v  # equal values: fine
    p = _alias_toml(tmp_path, old, key, toml_v, f"{new} = {toml_literal(other)}")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert f"[{old}] {key}" in msg and f"[{target}] {new}" in msg and "\n" not in msg


def test_older_section_option_on_the_command_line_names_the_one_name(tmp_path):
    with pytest.raises(
        ConfigError, match=r"--prefetch.queue_size: this option is now --dataloader.queue_size"
    ):
        load_config(None, ["--prefetch.queue_size", "16"])


# ------------------------------------------------------------------------------ booleans, --help
@pytest.mark.parametrize(
    "args,expected",
    [
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable=False"], False),
        (["--checkpoint.no-enable"], False),
        (["--checkpoint.enable", "true"], True),
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable", "1", "--training.steps", "3"], True),
    ],
)
def test_bool_options_take_a_value_or_a_flag(tmp_path, args, expected):
    p = tmp_path / "c.toml"
    p.write_text(f"[checkpoint]\nenable = {toml_literal(not expected)}\n")
    assert load_config(p, args).checkpoint.enable is expected


def test_bool_option_with_a_non_bool_value_is_a_config_error():
    with pytest.raises(ConfigError, match="--checkpoint.enable: expected true or false"):
        load_config(None, ["--checkpoint.enable=maybe"])


def test_help_shows_the_value_the_config_would_use():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_ext.train",
            "--config-file",
            str(REPO / "train_configs" / "llama3_debug_cpu.toml"),
            "--dataloader.chunk_rows",
            "48",
            "--help",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-2000:]
    flat = " ".join(text.replace("│", " ").split())
    assert "--dataloader.queue-size INT" in flat
    assert "(default: 4)" in flat.split("--dataloader.queue-size INT", 1)[1][:400]  # the TOML's
    assert "--prefetch." not in flat and "--eval-stream." not in flat  # one name per knob
    assert "initial_load_model_only" not in text.split("usage:", 1)[0]  # a quiet --help


def test_user_facing_texts_name_no_seed_or_issue_numbers():
    """README, docs, TOML comments, the Makefile, and the Python sources whose docstrings and
    strings become --help, error messages and help() text."""
    import re

    bad = re.compile(r"\bseed \d{3}\b|seed's|\bissues? ?#?\d", re.IGNORECASE)
    texts = [
        *sorted((REPO / "train_configs").glob("*.toml")),
        *sorted((REPO / "docs").glob("*.md")),
        REPO / "README.md",
        REPO / "DATA_LICENSES.md",
        REPO / "Makefile",
        REPO / "benchmarks" / "RESULTS.md",
        REPO / "benchmarks" / "results_history.md",
        *sorted((REPO / "torchtitan_ext").rglob("*.py")),
        *sorted((REPO / "scripts").glob("*.py")),
        *sorted((REPO / "benchmarks").glob("*.py")),
    ]
    for f in texts:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            assert not bad.search(line), f"{f.name}:{i}: {line}"


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--checkpoint.last_save_in_hf", "true"], "last_save_in_hf requires last_save_model_only"),
        (["--loss.num_chunks", "4"], "Unrecognized options: --loss.num_chunks"),
    ],
)
def test_a_value_torchtitan_refuses_is_one_line_with_its_reason(args, reason):
    """tyro's error box (torchtitan's own validation, an unknown option) becomes one line with
    the box's reason and where the values came from, not a bare "invalid override"."""
    path = REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml"
    with pytest.raises(ConfigError) as e:
        load_config(path, args)
    msg = str(e.value)
    assert reason in msg and str(path) in msg and "\n" not in msg, msg
