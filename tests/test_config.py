"""TOML -> torchtitan Trainer.Config layering: round trip, precedence, and the error texts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from torchtitan_ext.config import (
    ConfigError,
    ExtTrainer,
    config_to_dict,
    load_config,
)
from torchtitan_ext.registry import register_loader

TOY = REPO / "tests" / "data" / "configs" / "toy_debug.toml"


@pytest.fixture(autouse=True)
def _toy_registered():
    register_loader("toy", "tests.support.toy_loader:ToyLoader.Config", overwrite=True)


def write(tmp_path: Path, body: str, name: str = "job.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def test_toml_round_trip_sets_torchtitan_and_our_sections(tmp_path):
    cfg = load_config(TOY)
    assert isinstance(cfg, ExtTrainer.Config)
    assert (
        cfg.training.steps == 4
        and cfg.training.seq_len == 32
        and cfg.training.local_batch_size == 2
    )
    assert cfg.checkpoint.enable is True and cfg.checkpoint.interval == 2
    assert type(cfg.dataloader).__qualname__ == "ToyLoader.Config"
    assert cfg.dataloader.vocab_size == 200
    assert cfg.model_spec.name == "llama3" and cfg.model_spec.flavor == "debugmodel"
    # "embedded" resolved to the locally built tokenizer directory
    assert Path(cfg.hf_assets_path, "tokenizer.json").is_file()
    d = config_to_dict(cfg)
    assert d["training"]["steps"] == 4 and d["staging"]["enable"] is False


def test_precedence_cli_beats_toml_beats_defaults(tmp_path):
    # defaults: llama3_debugmodel() has steps=10, warmup_steps=2; the TOML sets steps=4
    cfg = load_config(TOY)
    assert cfg.training.steps == 4
    assert cfg.lr_scheduler.warmup_steps == 2  # untouched default
    cfg = load_config(TOY, ["--training.steps", "7", "--lr_scheduler.warmup_steps", "1"])
    assert cfg.training.steps == 7 and cfg.lr_scheduler.warmup_steps == 1
    cfg = load_config(TOY, ["--dataloader.vocab_size", "99"])
    assert cfg.dataloader.vocab_size == 99


def test_nested_list_of_dataclasses(tmp_path):
    p = write(
        tmp_path,
        """
        [optimizer]
        param_groups = [{ pattern = ".*", optimizer_name = "AdamW", optimizer_kwargs = { lr = 0.001 } }]
        [dataloader]
        name = "toy"
    """,
    )
    cfg = load_config(p)
    (g,) = cfg.optimizer.param_groups
    assert g.optimizer_name == "AdamW" and g.optimizer_kwargs == {"lr": 0.001}


def test_typo_key_error_names_file_key_and_suggestion(tmp_path):
    p = write(
        tmp_path,
        """
        [training]
        stesp = 3
    """,
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "stesp" in msg and "[training]" in msg
    assert "did you mean 'steps'" in msg


def test_wrong_type_error_names_key_and_expected_type(tmp_path):
    p = write(
        tmp_path,
        """
        [training]
        steps = "ten"
    """,
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "[training] steps" in msg and "expected int" in msg and "'ten'" in msg


def test_bool_is_not_an_int(tmp_path):
    p = write(
        tmp_path,
        """
        [training]
        steps = true
    """,
    )
    with pytest.raises(ConfigError, match="expected int"):
        load_config(p)


def test_literal_choices_are_checked(tmp_path):
    p = write(
        tmp_path,
        """
        [lr_scheduler]
        decay_type = "cosinus"
    """,
    )
    with pytest.raises(ConfigError, match="expected one of"):
        load_config(p)


def test_missing_file_and_unknown_loader(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    p = write(
        tmp_path,
        """
        [dataloader]
        name = "no_such_loader"
    """,
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "dataloader.name" in str(e.value) and "no_such_loader" in str(e.value)


def test_unknown_loader_field_is_an_error(tmp_path):
    p = write(
        tmp_path,
        """
        [dataloader]
        name = "toy"
        vocab_sise = 10
    """,
    )
    with pytest.raises(ConfigError, match="did you mean 'vocab_size'"):
        load_config(p)


def test_section_value_the_loader_cannot_take_is_an_error(tmp_path):
    p = write(
        tmp_path,
        """
        [dataloader]
        name = "toy"
        [prefetch]
        queue_size = 8
    """,
    )
    with pytest.raises(
        ConfigError, match=r"\[prefetch\] queue_size \(= \[dataloader\] queue_size\) is set but"
    ):
        load_config(p)


def test_prefetch_thread_priority_is_applied_and_its_choices_checked(tmp_path):
    body = """
        [dataloader]
        name = "parquet_prefetch"
        [prefetch]
        thread_priority = "{}"
    """
    cfg = load_config(write(tmp_path, body.format("normal")))
    assert cfg.dataloader.thread_priority == "normal"
    with pytest.raises(ConfigError, match=r"thread_priority.*expected one of"):
        load_config(write(tmp_path, body.format("low")))


def test_cli_switches_loader_by_name(tmp_path):
    p = write(
        tmp_path,
        """
        [dataloader]
        name = "toy"
        vocab_size = 50
    """,
    )
    cfg = load_config(p, ["--dataloader.name", "toy", "--dataloader.seed", "3"])
    assert cfg.dataloader.seed == 3 and cfg.dataloader.vocab_size == 50


def test_help_lists_our_sections_with_docs():
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.run_with_toy", "--config-file", str(TOY), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-2000:]
    for section in ("model", "staging"):
        assert f"{section} options" in text, section
    assert "Wrap the loader in AsyncDeviceLoader" in text  # a field docstring of ours


def test_cli_type_error_exits_nonzero():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.run_with_toy",
            "--config-file",
            str(TOY),
            "--training.steps",
            "many",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode != 0
    assert "training.steps" in (out.stdout + out.stderr)
