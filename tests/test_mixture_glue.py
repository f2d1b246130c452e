"""Mixtures on torchtitan's side: ``[[dataloader.sources]]`` in the TOML layer and ``--help``,
per-source accounting on the step line and in the metric backends, peek's mixture summary, and
the validator's loss per source.

The loader is ``tests/support/mix_toy.py`` (a Config inheriting ``MixOptions``, ``Mix`` over toy
JSONL chains), so none of this waits for the real loaders' wiring; the stats are the ``Mix.stats``
shape they will have.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.support import mix_toy
from tests.support.mix_toy import mix_config, sources_toml
from tests.support.trainer_probes import LogRecords, MetricBackend
from torchtitan_ext.config import ConfigError, load_config
from torchtitan_ext.loaders.integration import LoaderStats, loader_stats, read_stats
from torchtitan_ext.metrics import data_step
from torchtitan_ext.pipeline.mix import SourceSpec

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _registered():
    mix_toy.register()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return mix_toy.write_sources(tmp_path_factory.mktemp("mix_data"))


# ------------------------------------------------------------------------------ the TOML layer
def test_sources_tables_become_source_specs(tmp_path, data):
    cfg = load_config(
        mix_config(tmp_path, data, body=""), ["--dataloader.mix_stop", "first_exhausted"]
    )
    specs = cfg.dataloader.sources
    assert [type(s) for s in specs] == [SourceSpec, SourceSpec]
    assert [(s.name, s.weight, s.path) for s in specs] == [
        ("web", 7.0, str(data / "web.jsonl")),
        ("code", 3.0, str(data / "code.jsonl")),
    ]
    assert cfg.dataloader.mix_stop == "first_exhausted"


def test_no_sources_is_the_single_dataset_case(tmp_path, data):
    cfg = load_config(mix_config(tmp_path, data, sources=f'dataset_path = "{data}"\n'), [])
    assert cfg.dataloader.sources == [] and cfg.dataloader.dataset_path == str(data)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (
            ('name = "code"', 'nmae = "code"'),
            "[[dataloader.sources]] #1 nmae for SourceSpec; did you mean 'name'?",
        ),
        (("weight = 7", 'weight = "lots"'), "[[dataloader.sources]] #0 weight: expected float"),
        (('name = "web"\n', ""), "[[dataloader.sources]] #0: SourceSpec needs key(s) ['name']"),
    ],
    ids=["unknown-key", "wrong-type", "missing-name"],
)
def test_a_bad_source_table_is_one_line_naming_its_index_and_key(tmp_path, data, edit, needle):
    f = mix_config(tmp_path, data)
    f.write_text(f.read_text().replace(*edit, 1))
    with pytest.raises(ConfigError) as e:
        load_config(f, [])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_validator_sources_are_named_in_their_section(tmp_path, data):
    body = '\n[validator]\nenable = true\n[validator.dataloader]\nname = "mix_toy"\n'
    body += sources_toml(data, "validator.dataloader").replace("weight = 3", "wieght = 3")
    with pytest.raises(ConfigError, match=r"\[\[validator.dataloader.sources\]\] #1 wieght"):
        load_config(mix_config(tmp_path, data, body=body), [])


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )


def test_help_works_with_the_sources_field(tmp_path, data):
    """The train command's ``--help`` (tyro) with a loader Config that has ``sources``."""
    f = mix_config(tmp_path, data)
    out = _cli("-m", "tests.support.mix_toy", "--config-file", str(f), "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dataloader.sources" in out.stdout and "dataloader.mix-stop" in out.stdout


# --------------------------------------------------------------------- step line and backends
WEB = {"tokens_read": 7020.0, "items": 702.0, "share": 0.702, "target": 0.7, "ended": 0.0}
CODE = {"tokens_read": 2980.0, "items": 298.0, "share": 0.298, "target": 0.3, "ended": 1.0}


def test_step_line_and_backends_carry_each_source():
    metrics, line = data_step({"epoch": 0.0}, [0.002], {}, 1, {"web": WEB, "code": CODE})
    assert line == "data_wait: 2.00ms  epoch: 0  mix: web 70.2%/70% code 29.8%/30% (ended)"
    assert metrics["data/source/web/tokens"] == 7020.0
    assert metrics["data/source/web/share"] == 0.702 and metrics["data/source/web/target"] == 0.7
    assert metrics["data/source/code/ended"] == 1.0 and metrics["data/source/code/items"] == 298
    assert not any(k.startswith("data/sources") for k in metrics)


def test_the_line_shows_the_backends_values():
    """Invariant: each percentage on the line is the backend's fraction x 100, to 0.1."""
    srcs = {"a": {**WEB, "share": 0.123456, "target": 1 / 3}, "b": {**CODE, "share": 0.876544}}
    metrics, line = data_step({}, [], {}, 1, srcs)
    shown = re.findall(r"(\w+) ([\d.]+)%/([\d.]+)%", line.partition("mix: ")[2])
    assert [n for n, _, _ in shown] == ["a", "b"]
    for name, share, target in shown:
        assert float(share) == pytest.approx(100 * metrics[f"data/source/{name}/share"], abs=0.05)
        assert float(target) == pytest.approx(100 * metrics[f"data/source/{name}/target"], abs=0.05)


def test_vl_sources_report_images_and_patches():
    vl = {
        "tokens": 900.0,
        "images": 12.0,
        "patches": 4800.0,
        "items": 3.0,
        "share": 1.0,
        "target": 1.0,
    }
    metrics, line = data_step({}, [], {}, 1, {"photos": vl})
    assert metrics["data/source/photos/tokens"] == 900.0
    assert metrics["data/source/photos/images"] == 12.0
    assert metrics["data/source/photos/patches"] == 4800.0
    assert "mix:" not in line  # one source: the line stays short


def test_one_dataset_keeps_the_line_unchanged():
    stats = {"queue_depth": 3.0, "queue_capacity": 8.0, "epoch": 1.0}
    assert data_step(stats, [0.001], {}, 1) == data_step(stats, [0.001], {}, 1, {})
    assert data_step(stats, [0.001], {}, 1)[1] == "data_wait: 1.00ms  queue: 3/8  epoch: 1"


class _Fake:
    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats = stats

    def get_stats(self) -> dict[str, Any]:
        return self.stats


def test_read_stats_keeps_sources_apart():
    raw = {"epoch": 2, "staging/batches": 5, "sources": {"we.b": {"items": 3, "ended": True}}}
    got = read_stats(_Fake(raw))
    assert got == LoaderStats(
        {"epoch": 2.0, "staging/batches": 5.0}, {"we.b": {"items": 3.0, "ended": 1.0}}
    )
    assert loader_stats(_Fake(raw)) == got.flat
    assert read_stats(object()) == LoaderStats()


def test_mix_stage_stats_reach_the_line_with_their_realised_shares(tmp_path, data):
    """The real Mix (through its loader and Prefetch): the shares on the line are the items each
    source handed over, over all items."""
    cfg = load_config(mix_config(tmp_path, data), [])
    loader = cfg.dataloader.build(seq_len=32, local_batch_size=2)
    try:
        it = iter(loader)
        for _ in range(20):
            next(it)
        read = read_stats(loader)
    finally:
        loader.close()
    web, code = read.sources["web"], read.sources["code"]
    assert web["items"] + code["items"] == 20
    metrics, line = data_step(read.flat, [], {}, 1, read.sources)
    assert metrics["data/source/web/share"] == web["items"] / 20
    assert (
        metrics["data/source/web/tokens"] == web["items"] * 2 * 32
    )  # labels: batches x 2 rows x seq_len
    assert f"web {100 * web['items'] / 20:.1f}".removesuffix(".0") + "%/70%" in line


# -------------------------------------------------------------------------------------- peek
def test_peek_prints_the_mixture_summary(tmp_path, data, capsys):
    from torchtitan_ext.peek import main

    f = mix_config(tmp_path, data)
    assert main(["--config-file", str(f), "--batches", "10"]) == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("peek: mixture:")]
    assert len(line) == 1, out
    m = re.findall(r"(\w+) (\d+) items, (\d+) tokens ([\d.]+)% \(target ([\d.]+)%\)", line[0])
    assert [x[0] for x in m] == ["web", "code"] and sum(int(x[1]) for x in m) == 10
    assert [x[4] for x in m] == ["70.0", "30.0"]
    assert line[0].endswith("(after 10 batches)")

    single = mix_config(tmp_path, data, sources=f'dataset_path = "{data / "web.jsonl"}"\n')
    assert main(["--config-file", str(single), "--batches", "2"]) == 0
    assert "mixture" not in capsys.readouterr().out


# --------------------------------------------------------------------------------- validator
def test_source_config_is_a_single_source_copy():
    from torchtitan_ext.validation import source_config

    cfg = mix_toy.MixToyLoader.Config(
        sources=[SourceSpec(name="a", path="x.jsonl"), SourceSpec(name="b", dataset="hub/b")],
        split="val",
    )
    a = source_config(cfg, cfg.sources[0])
    assert (a.sources, a.dataset_path, a.split) == ([], "x.jsonl", "val")
    b = source_config(cfg, replace(cfg.sources[1], split="test", text_column="body"))
    assert (b.dataset, b.dataset_path, b.split, b.text_column) == ("hub/b", None, "test", "body")
    with pytest.raises(ValueError, match="source 'a': MixToyLoader.Config has no setting format"):
        source_config(cfg, replace(cfg.sources[0], format="json"))


def test_mixture_loss_weighs_sources_by_their_weights():
    from torchtitan_ext.validation import mixture_loss

    specs = [SourceSpec(name="a", weight=7, path="a"), SourceSpec(name="b", weight=3, path="b")]
    assert mixture_loss({"a": 2.0, "b": 4.0}, specs) == pytest.approx(2.6)


@pytest.fixture(scope="module")
def validated(tmp_path_factory, data) -> dict[str, Any]:
    """A trainer (llama3 debug model) whose [validator.dataloader] is the web/code mixture: one
    validation by its validator, then one by a validator over web alone (no mixture)."""
    import torch

    from torchtitan_ext.train import build_trainer
    from torchtitan_ext.validation import MixValidator, source_config

    mix_toy.register()
    tmp = tmp_path_factory.mktemp("val")
    body = "\n[validator]\nenable = true\nfreq = 1\nsteps = 2\n[validator.dataloader]\n"
    body += 'name = "mix_toy"\n' + sources_toml(data, "validator.dataloader")
    f = mix_config(tmp, data, body=body)
    saved_env = dict(os.environ)
    for var in DIST_ENV:
        os.environ.pop(var, None)
    root, records, trainer = logging.getLogger(), LogRecords(), None
    level = root.level
    seen: dict[str, Any] = {}
    try:
        trainer = build_trainer(str(f), ["--dump_folder", str(tmp / "dump"), "--debug.seed", "0"])
        seen["type"] = type(trainer.validator)
        backend = MetricBackend()
        trainer.metrics_processor.logger = backend
        root.setLevel(logging.INFO)
        root.addHandler(records)
        trainer.validator.validate(trainer.model_parts, 1)
        seen["mix"] = (list(records.messages), list(backend.sent))
        v = trainer.validator
        web = source_config(v.config.dataloader, v.config.dataloader.sources[0])
        single = MixValidator(
            replace(v.config, dataloader=web),
            parallelism=v.parallelism,
            dp_world_size=1,
            dp_rank=0,
            tokenizer=v.tokenizer,
            parallel_dims=v.parallel_dims,
            loss_fn=v.loss_fn,
            validation_context=v.validation_context,
            metrics_processor=v.metrics_processor,
            seq_len=v.seq_len,
            local_batch_size=v.local_batch_size,
        )
        records.messages.clear()
        backend.sent.clear()
        single.validate(trainer.model_parts, 2)
        seen["single"] = (list(records.messages), list(backend.sent))
    finally:
        root.removeHandler(records)
        root.setLevel(level)
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
    return seen


def _validate_lines(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith("validate step:")]


@pytest.mark.integration
def test_validator_reports_each_source_and_the_mixture(validated):
    from torchtitan_ext.validation import MixValidator

    assert validated["type"] is MixValidator
    messages, sent = validated["mix"]
    lines = _validate_lines(messages)
    assert len(lines) == 3, messages
    per = dict(re.findall(r"loss/(\w+): +([\d.]+)", " ".join(lines[:2])))
    assert list(per) == ["web", "code"]
    assert "loss/" not in lines[2] and re.search(r"loss: +[\d.]+", lines[2]), lines[2]
    assert len(sent) == 1  # one backend call: the overall loss and each source's
    step, metrics = sent[0]
    web, code = (
        metrics["validation_metrics/source/web/loss"],
        metrics["validation_metrics/source/code/loss"],
    )
    assert step == 1 and web != code
    assert metrics["validation_metrics/loss"] == pytest.approx(0.7 * web + 0.3 * code)
    assert float(per["web"]) == pytest.approx(web, abs=5e-5)


@pytest.mark.integration
def test_a_single_source_validator_is_torchtitans_and_gives_that_sources_loss(validated):
    (_, mixed), (messages, sent) = validated["mix"], validated["single"]
    assert len(_validate_lines(messages)) == 1 and len(sent) == 1
    metrics = sent[0][1]
    assert not any("/source/" in k for k in metrics)
    assert metrics["validation_metrics/loss"] == pytest.approx(
        mixed[0][1]["validation_metrics/source/web/loss"], rel=1e-6
    )
