"""The torchtitan glue overrides what torchtitan 0.3.0 builds and patches no live object.

One in-process trainer (toy loader, staging on, checkpoint every step, 2 steps) is built and
trained once for the module; the tests check that nothing was swapped or wrapped on it (loader
Config, ``metrics_processor.log``, ``checkpointer.save``, filters on torchtitan's logger) and that
what those patches used to provide is still there: the data stats on the step line and in the
metric backends, the staged loader in the checkpoint, the job record next to each save.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.support.trainer_probes import LogRecords, MetricBackend

TOY = REPO / "tests" / "data" / "configs" / "toy_debug.toml"
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    """Build the trainer as the launcher does, train STEPS steps, close; what was observed."""
    import torch

    from torchtitan_ext.config import ExtTrainer
    from torchtitan_ext.registry import register_loader
    from torchtitan_ext.train import build_trainer

    register_loader("toy", "tests.support.toy_loader:ToyLoader.Config", overwrite=True)
    dump = tmp_path_factory.mktemp("glue")
    root = logging.getLogger()  # torchtitan's logger
    filters_before = list(root.filters)
    seen: dict[str, Any] = {}

    def keep_config(config: Any) -> None:
        seen["user_loader_cfg"] = config.dataloader

    original_init_distributed = ExtTrainer.init_distributed

    def init_distributed(self: Any) -> Any:
        # the first thing Trainer.__init__ calls, after self.config is set
        seen["loader_cfg_during_build"] = self.config.dataloader
        return original_init_distributed(self)

    saved_env, level = dict(os.environ), root.level
    for var in DIST_ENV:  # a fresh single-process rendezvous
        os.environ.pop(var, None)
    records = LogRecords()
    trainer = None
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(ExtTrainer, "init_distributed", init_distributed)
        argv = ["--staging.enable", "--training.steps", str(STEPS), "--dump_folder", str(dump)]
        argv += ["--checkpoint.interval", "1", "--debug.seed", "0"]
        trainer = build_trainer(str(TOY), argv, edit=keep_config)
        mp.undo()
        seen["filters_after_build"] = list(root.filters)
        seen["instance_attrs"] = {
            "metrics_processor": set(vars(trainer.metrics_processor)),
            "checkpointer": set(vars(trainer.checkpointer)),
        }
        seen["loader_cfg_after_build"] = trainer.config.dataloader
        seen["types"] = {
            "metrics_processor": type(trainer.metrics_processor),
            "checkpointer": type(trainer.checkpointer),
            "dataloader": type(trainer.dataloader),
        }
        seen["checkpointed_loader_is_the_trainers"] = (
            trainer.checkpointer.states["dataloader"] is trainer.dataloader
        )
        backend = MetricBackend()
        trainer.metrics_processor.logger = backend  # the backends it built: none are enabled
        root.setLevel(logging.INFO)
        root.addHandler(records)
        trainer.train()
        seen["filters_after_train"] = list(root.filters)
        seen["messages"], seen["sent"] = list(records.messages), list(backend.sent)
        seen["mfu_known"] = math.isfinite(trainer.metrics_processor.gpu_peak_flops)
        seen["upstream_vs_ours"] = _log_both_ways(trainer.metrics_processor, records)
    finally:
        mp.undo()
        root.removeHandler(records)
        root.setLevel(level)
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved_env)
    seen["filters_before"] = filters_before
    seen["checkpoint_dir"] = dump / "checkpoint"
    return seen


def _log_both_ways(mp: Any, records: LogRecords) -> dict[str, tuple[set[str], str]]:
    """One step logged by torchtitan's ``MetricsProcessor.log`` and by the trainer's: the metric
    names sent and the line printed, each."""
    from torchtitan.components.metrics import MetricsProcessor

    out = {}
    for name, log in (("upstream", MetricsProcessor.log), ("ours", type(mp).log)):
        mp.logger, mp.data_loading_times, mp.ntokens_since_last_log = MetricBackend(), [0.001], 64
        log(mp, 9, 1.5, 1.75, 0.5, extra_metrics={"n_tokens_seen": 128})
        out[name] = (set(mp.logger.sent[0][1]), records.messages[-1])
    return out


def _step_lines(run: dict[str, Any]) -> list[str]:
    return [m for m in run["messages"] if m.startswith("step:") and "loss:" in m]


# ------------------------------------------------------------------------ nothing patched
def test_loader_config_is_the_users_throughout_the_build(run):
    """The Trainer builds the loader from the user's Config object itself: no stand-in is put
    in its place while ``Trainer.__init__`` runs (staging is on)."""
    assert run["loader_cfg_during_build"] is run["user_loader_cfg"]
    assert run["loader_cfg_after_build"] is run["user_loader_cfg"]


def test_no_method_is_replaced_on_the_built_objects(run):
    assert "log" not in run["instance_attrs"]["metrics_processor"]
    assert "save" not in run["instance_attrs"]["checkpointer"]
    assert "_save" not in run["instance_attrs"]["checkpointer"]

    from torchtitan_ext.checkpointing import RecordingCheckpointManager
    from torchtitan_ext.metrics import DataMetricsProcessor

    assert run["types"]["metrics_processor"] is DataMetricsProcessor
    assert run["types"]["checkpointer"] is RecordingCheckpointManager


def test_no_filter_is_added_to_torchtitans_logger(run):
    assert run["filters_after_build"] == run["filters_before"]
    assert run["filters_after_train"] == run["filters_before"]


# ------------------------------------------------------------- what the patches provided
def test_step_line_carries_the_data_summary(run):
    lines = _step_lines(run)
    assert len(lines) == STEPS  # log_freq = 1: one line per step, the summary on the same line
    for line in lines:
        torchtitan, _, ours = line.partition("  data_wait: ")
        assert ours.endswith("ms"), line  # the toy's stats have no line keys: the wait only
        assert ("mfu: N/A" in torchtitan) != run["mfu_known"], line  # a CPU has no peak


def test_step_line_and_metrics_are_torchtitans_plus_the_data(run):
    """The trainer's log is torchtitan 0.3.0's (same metric names, same line) plus the data
    part: a torchtitan upgrade that changes its step logging fails here."""
    (up_keys, up_line), (our_keys, our_line) = run["upstream_vs_ours"].values()
    if not run["mfu_known"]:
        up_keys.discard("mfu(%)")  # torchtitan divides by a CPU's NaN peak; ours says N/A
    assert {k for k in our_keys if not k.startswith("data/")} == up_keys
    torchtitan, _, data = our_line.partition("  data_wait: ")

    def timeless(line: str) -> str:  # the two calls differ in elapsed time only
        return re.sub(r"(tps|tflops|mfu): [\d,.]+", r"\1: #", line)

    assert timeless(torchtitan) == timeless(up_line.replace("mfu: nan%", "mfu: N/A"))
    assert data.endswith("ms")


def test_backends_receive_the_data_stats(run):
    assert [step for step, _ in run["sent"]] == [1, 2]
    for _, metrics in run["sent"]:
        assert metrics["data/wait_ms"] >= 0.0
        assert metrics["data/batches"] >= 1  # the toy loader's own stat, through staging
        assert metrics["data/staging/batches"] >= 1  # the staging wrapper's
        assert "loss_metrics/global_avg_loss" in metrics and "n_tokens_seen" in metrics
        assert ("mfu(%)" in metrics) == run["mfu_known"]


def test_staged_loader_is_the_one_the_checkpointer_saves(run):
    from torchtitan_ext.device.staging import AsyncDeviceLoader

    assert run["types"]["dataloader"] is AsyncDeviceLoader
    assert run["checkpointed_loader_is_the_trainers"]


def test_job_record_is_written_next_to_each_save(run):
    from torchtitan_ext.preflight.checkpoint import RECORD

    for step in range(1, STEPS + 1):
        record = json.loads((Path(run["checkpoint_dir"]) / f"step-{step}" / RECORD).read_text())
        assert record["loader"] == "toy" and record["dp_degree"] == 1
        assert record["model"]["name"] == "llama3"


# ---------------------------------------------------------------------------- pure parts
def test_data_step_line_and_metrics():
    from torchtitan_ext.metrics import data_step

    stats = {"queue_depth": 3.0, "queue_capacity": 8.0, "images": 12.0, "epoch": 0.0}
    metrics, line = data_step(stats, [0.001, 0.003, 0.002, 0.002], {"images": 4.0}, 2)
    assert line == "data_wait: 2.00ms  images/step: 4  queue: 3/8  epoch: 0"
    assert metrics["data/wait_ms"] == pytest.approx(2.0)
    assert metrics["data/images_per_step"] == 4.0  # (12 - 4) images over 4 batches / 2 per step
    assert metrics["data/queue_depth"] == 3.0 and metrics["data/queue_capacity"] == 8.0


def test_data_step_without_stats_or_waits():
    from torchtitan_ext.metrics import data_step

    metrics, line = data_step({}, [], {}, 1)
    assert (metrics, line) == ({"data/wait_ms": 0.0}, "data_wait: 0.00ms")


def test_torchtitan_section_configs_become_ours_and_others_are_refused():
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.metrics import MetricsProcessor

    from torchtitan_ext.checkpointing import RecordingCheckpointManager
    from torchtitan_ext.config import ConfigError, ExtTrainer
    from torchtitan_ext.metrics import DataMetricsProcessor

    cfg = ExtTrainer.Config(
        metrics=MetricsProcessor.Config(log_freq=7),
        checkpoint=CheckpointManager.Config(interval=3, folder="ck"),
    )
    assert type(cfg.metrics) is DataMetricsProcessor.Config and cfg.metrics.log_freq == 7
    assert type(cfg.checkpoint) is RecordingCheckpointManager.Config
    assert (cfg.checkpoint.interval, cfg.checkpoint.folder) == (3, "ck")

    class OtherMetrics(MetricsProcessor):
        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            pass

    with pytest.raises(ConfigError, match=r"\[metrics\].*OtherMetrics"):
        ExtTrainer.Config(metrics=OtherMetrics.Config())
