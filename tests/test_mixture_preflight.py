"""A bad mixture fails before the model is built: one line ``config error: ...`` naming the
source, exit code 2 (the launcher in process with the model build replaced by a recorder, as
``tests/test_preflight.py`` does, and once through the real command line).

Cases: a ``[[dataloader.sources]]`` that cannot be drawn from (``pipeline.mix.check_sources``),
a source whose path matches no data file, and a checkpoint whose saved mixture (read from the
loader envelope's rank states) is not the configured one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.support import mix_toy
from tests.support.mix_toy import mix_config, sources_toml, write_sources
from tests.test_preflight import assert_config_error, launch  # noqa: F401 (fixture)
from torchtitan_ext.preflight.checkpoint import RECORD


@pytest.fixture(autouse=True)
def _registered():
    mix_toy.register()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_sources(tmp_path_factory.mktemp("mix_data"))


def edited(tmp: Path, src: Path, *edits: tuple[str, str], body: str = "") -> list[str]:
    """``--config-file`` of the mixture toy config over ``src`` with ``edits`` made."""
    f = mix_config(tmp, src, body=body)
    text = f.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    f.write_text(text)
    return ["--config-file", str(f)]


@pytest.mark.parametrize(
    "edit, needles",
    [
        (("weight = 7", "weight = -1"), ("[[dataloader.sources]] source 'web'", "weight")),
        (('name = "code"', 'name = "web"'), ("source 'web'", "used twice")),
        (("weight = 3", "weight = 3\nmax_epochs = 0"), ("source 'code'", "max_epochs")),
        (("weight = 3", 'weight = 3\ndataset = "hub/code"'), ("source 'code'", "one of 'path'")),
        (("weight = 7", "weight = 0"), ()),  # fine: 'code' still has weight
    ],
    ids=["negative-weight", "duplicate-name", "max-epochs-0", "path-and-dataset", "zero-ok"],
)
def test_a_mixture_that_cannot_be_drawn_from(launch, tmp_path, data, edit, needles):  # noqa: F811
    result = launch(edited(tmp_path, data, edit))
    if not needles:
        assert result[0] == 0 and len(result[2]) == 1, result[1]
        return
    assert_config_error(result, *needles)


def test_weights_summing_to_zero(launch, tmp_path, data):  # noqa: F811
    args = edited(tmp_path, data, ("weight = 7", "weight = 0"), ("weight = 3", "weight = 0"))
    assert_config_error(launch(args), "[[dataloader.sources]]", "sum to 0")


@pytest.mark.parametrize("kind", ["file", "glob", "empty-dir"])
def test_a_source_path_with_no_data_file(launch, tmp_path, data, kind):  # noqa: F811
    empty = tmp_path / "empty"
    (empty / ".hidden").mkdir(parents=True)
    (empty / ".hidden" / "x.jsonl").write_text("{}\n")
    bad = {
        "file": str(data / "nope.jsonl"),
        "glob": str(data / "*.parquet"),
        "empty-dir": str(empty),
    }[kind]
    args = edited(tmp_path, data, (str(data / "code.jsonl"), bad))
    line = assert_config_error(launch(args), "[[dataloader.sources]] source 'code'", repr(bad))
    assert "matches no data file" in line


def test_a_directory_or_glob_of_data_files_is_fine(launch, tmp_path, data):  # noqa: F811
    args = edited(
        tmp_path,
        data,
        (str(data / "web.jsonl"), str(data)),
        (str(data / "code.jsonl"), str(data / "c*.jsonl")),
    )
    rc, err, built = launch(args)
    assert rc == 0 and len(built) == 1, err


def test_the_validators_mixture_is_checked_too(launch, tmp_path, data):  # noqa: F811
    body = '\n[validator]\nenable = true\n[validator.dataloader]\nname = "mix_toy"\n'
    body += sources_toml(data, "validator.dataloader").replace("weight = 3", "weight = -3")
    args = edited(tmp_path, data, body=body)
    assert_config_error(launch(args), "[[validator.dataloader.sources]] source 'code'", "weight")


# ------------------------------------------------------------------------------ checkpoints
def checkpoint_of(dump: Path, names: list[str] | None, step: int = 2) -> Path:
    """A DCP checkpoint holding the mixture toy's envelope, one Mix state per rank (nested the
    way a loader's chain nests it) over ``names``; ``names`` None: a single-source state."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_ext.pipeline import checkpoint

    if names is None:
        rank = {"at": {"source": {"epoch": 0}, "held": []}, "tokens": 0}
    else:
        mix = {
            "draws": 5,
            "stream": 0,
            "ended": [False] * len(names),
            "taken": [1] * len(names),
            "names": names,
            "sources": [{"at": {"held": [[1, 0, list(range(40))]]}, "tokens": 9}] * len(names),
        }
        rank = {"batcher": {"buffer": [1, 2, 3], "mix": mix}}
    d = dump / "checkpoint" / f"step-{step}"
    value = checkpoint.envelope(mix_toy.NAME, [rank], "same")
    dcp.save(
        {"dataloader": value, "train_state": {"step": torch.tensor(step)}},
        checkpoint_id=str(d),
        no_dist=True,
    )
    record = {"loader": mix_toy.NAME, "dp_degree": 1, "seq_len": 32, "local_batch_size": 2}
    (d / RECORD).write_text(json.dumps(record))
    return d


@pytest.mark.parametrize(
    "saved, needles",
    [
        (["web", "books"], ("added 'code'", "removed 'books'")),
        (["code", "web"], ("reordered",)),
        (None, ("added 'web', 'code'",)),
    ],
    ids=["added-removed", "reordered", "single-to-mixture"],
)
def test_a_checkpoint_of_another_mixture(launch, tmp_path, data, saved, needles):  # noqa: F811
    dump = tmp_path / "dump"
    checkpoint_of(dump, saved)
    args = [*edited(tmp_path, data), "--dump_folder", str(dump)]
    line = assert_config_error(launch(args), "step-2", *needles)
    assert "--checkpoint.exclude_from_loading dataloader" in line


def test_a_checkpoint_of_the_same_mixture_resumes(launch, tmp_path, data):  # noqa: F811
    dump = tmp_path / "dump"
    checkpoint_of(dump, ["web", "code"])
    rc, err, built = launch([*edited(tmp_path, data), "--dump_folder", str(dump)])
    assert rc == 0 and len(built) == 1, err


def test_the_documented_way_to_continue_with_a_new_mixture(launch, tmp_path, data):  # noqa: F811
    dump = tmp_path / "dump"
    checkpoint_of(dump, ["web", "books"])
    args = [*edited(tmp_path, data), "--dump_folder", str(dump)]
    rc, err, built = launch([*args, "--checkpoint.exclude_from_loading", "dataloader"])
    assert rc == 0 and len(built) == 1, err


def test_a_mixture_checkpoint_for_a_single_dataset_job(launch, tmp_path, data):  # noqa: F811
    dump = tmp_path / "dump"
    checkpoint_of(dump, ["web", "code"])
    f = mix_config(tmp_path, data, sources=f'dataset_path = "{data / "web.jsonl"}"\n')
    line = assert_config_error(
        launch(["--config-file", str(f), "--dump_folder", str(dump)]), "removed 'web', 'code'"
    )
    assert "[[dataloader.sources]]" in line


def test_command_line_exit_code_2_one_line(tmp_path, data):  # noqa: F811
    args = edited(tmp_path, data, (str(data / "code.jsonl"), str(tmp_path / "nothing")))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.mix_toy",
            *args,
            "--dump_folder",
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), out.stderr[-2000:]
    assert "source 'code'" in lines[0] and "matches no data file" in lines[0]
    assert "Traceback" not in out.stdout + out.stderr


def test_an_empty_parquet_source_is_named_before_the_model(launch, tmp_path):  # noqa: F811
    """parquet_prefetch: a source whose files hold no row (footers read, no row) stops the job
    in preflight, naming the source and its path (the loader, built after the model, would
    say the same later)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty / "train-0.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty / "val-0.parquet")
    cfg = (REPO / "train_configs" / "llama3_mixture_cpu.toml").read_text()
    assert 'path = "embedded:shakespeare"' in cfg
    job = tmp_path / "job.toml"
    job.write_text(cfg.replace('path = "embedded:shakespeare"', f'path = "{empty}"'))
    line = assert_config_error(launch(["--config-file", str(job)]), "source 'shakespeare'")
    assert "empty source" in line and str(empty) in line
