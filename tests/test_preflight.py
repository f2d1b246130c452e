"""Every data, tokenizer and checkpoint mismatch fails before the model is built: one line
``config error: ...`` naming the key and the fix, exit code 2, no traceback.

Most cases run the launcher in process (``train.main``) with ``run`` (which builds the model)
replaced by a recorder, so "before the model is built" is checked directly: the recorder must
stay empty. Two cases run the real command line in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO
from torchtitan_ext import preflight, train
from torchtitan_ext.config import ConfigError, load_config
from torchtitan_ext.data.embedded import corpus_documents
from torchtitan_ext.preflight.checkpoint import RECORD

MAIN = REPO / "train_configs" / "llama3_debug_cpu.toml"
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def launch(monkeypatch, capsys, tmp_path):
    """``launch(args, world_size=1) -> (exit code, stderr, configs that reached run())``; the
    job writes to a fresh dump folder unless ``args`` name one."""
    for k in _ENV:  # restored after the test: main() fills them in for a lone process
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setattr("torchtitan.tools.logging.init_logger", lambda: None)

    def go(args: list[str], world_size: int = 1) -> tuple[int, str, list]:
        if world_size > 1:  # act as rank 0 of a torchrun job
            for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(world_size))):
                monkeypatch.setenv(k, v)
        built: list = []
        monkeypatch.setattr(train, "run", lambda cfg: built.append(cfg) or 0)
        capsys.readouterr()
        if "--dump_folder" not in args:
            args = [*args, "--dump_folder", str(tmp_path / "dump")]
        rc = train.main(args)
        return rc, capsys.readouterr().err, built

    return go


def assert_config_error(result: tuple[int, str, list], *needles: str) -> str:
    rc, err, built = result
    lines = err.strip().splitlines()
    assert rc == 2 and not built, (rc, err)
    assert len(lines) == 1 and lines[0].startswith("config error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def job(*args: str) -> list[str]:
    return ["--config-file", str(MAIN), *args]


# ------------------------------------------------------------------------------ data fixtures
@pytest.fixture(scope="module")
def docs() -> list[str]:
    return corpus_documents()[:200]


def write_parquet(d: Path, docs: list[str], column: str = "text", files: int = 2) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        part = docs[i::files]
        pq.write_table(
            pa.table({column: part, "id": list(range(len(part)))}), d / f"part-{i}.parquet"
        )
    return d


def tokenizer_dir(d: Path, docs: list[str], vocab: int, bos: bool) -> Path:
    from torchtitan_ext.tokenizer.bpe import train_bpe_from_texts
    from torchtitan_ext.tokenizer.export import save_tokenizer_dir

    specials = ["<|endoftext|>", "<|bos|>"]
    v, m = train_bpe_from_texts(docs, vocab, specials, num_workers=0)
    save_tokenizer_dir(
        v, m, specials, d, eos_token="<|endoftext|>", bos_token="<|bos|>" if bos else None
    )
    return d


# ------------------------------------------------------------------------------ paths and values
def test_nonexistent_dataset_path(launch, tmp_path):
    assert_config_error(
        launch(job("--dataloader.dataset_path", str(tmp_path / "nope"))),
        "[dataloader] dataset_path",
        "does not exist",
        "--dataloader.dataset_path PATH",
    )


def test_enum_value_is_checked_before_anything(launch, tmp_path):
    p = tmp_path / "x.toml"
    p.write_text(MAIN.read_text().replace('packing = "zero_discard"', 'packing = "zero-discard"'))
    line = assert_config_error(launch(["--config-file", str(p)]), "[dataloader] packing")
    assert "'zero_discard'" in line and "'zero-discard'" in line  # the choices and the value


def test_val_files_glob_matching_nothing(launch, tmp_path, docs):
    data = write_parquet(tmp_path / "d", docs)
    assert_config_error(
        launch(job("--dataloader.dataset_path", str(data), "--dataloader.val_files", "zz*.x")),
        "[dataloader] val_files",
    )


def test_no_config_file_names_hf_assets_path_and_suggests_one(launch, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # torchtitan's default ./tests/assets/tokenizer is not here
    assert_config_error(launch([]), "hf_assets_path", "--config-file train_configs/")


def test_parallel_degrees_that_do_not_fit_the_processes(launch):
    assert_config_error(
        launch(job("--parallelism.data_parallel_shard_degree", "2")),
        "[parallelism]",
        "world size 1",
    )


# ------------------------------------------------------------------------------ tokenizer
def test_tokenizer_larger_than_the_model(launch, tmp_path, docs):
    tok = tokenizer_dir(tmp_path / "tok", docs, 2300, bos=True)
    assert_config_error(
        launch(job("--hf_assets_path", str(tok))),
        "2,300 tokens",
        "embeds only 2,048",
        "--vocab-size 2048",
    )


def test_tokenizer_without_bos_names_the_path_and_the_toml_key(launch, tmp_path, docs):
    tok = tokenizer_dir(tmp_path / "tok", docs, 600, bos=False)
    assert_config_error(
        launch(job("--hf_assets_path", str(tok))), f"hf_assets_path = '{tok}'", "bos_token"
    )
    # the key it names fixes it (and the loader then starts rows with that token)
    rc, err, built = launch(job("--hf_assets_path", str(tok), "--dataloader.bos_token", "<|bos|>"))
    assert rc == 0 and len(built) == 1, err
    from torchtitan_ext.loaders.integration import build_loader

    cfg = built[0]
    cfg.training.local_batch_size = 2
    loader = build_loader(cfg)
    try:
        inputs, _ = next(iter(loader))
        bos = json.loads((tok / "tokenizer.json").read_text())["added_tokens"]
        bos_id = next(t["id"] for t in bos if t["content"] == "<|bos|>")
        assert (inputs["input"][:, 0] == bos_id).all()
    finally:
        loader.close()


def test_bos_token_not_in_the_vocabulary(launch):
    assert_config_error(
        launch(job("--dataloader.bos_token", "<|nope|>")), "[dataloader] bos_token", "<|nope|>"
    )


def test_missing_text_column_suggests_text_column(launch, tmp_path, docs):
    data = write_parquet(tmp_path / "d", docs, column="content")
    assert_config_error(
        launch(job("--dataloader.dataset_path", str(data))),
        "[dataloader] text_column = 'text'",
        "text_column = 'content'",
    )


@pytest.mark.parametrize(
    "column,other,needle",
    [
        ("int64", "title", "text_column = 'title'"),
        ("list<element: string>", None, "this file has none"),
    ],
    ids=["int-with-a-string-column", "list-without-one"],
)
def test_text_column_that_is_not_text(launch, tmp_path, column, other, needle):
    """A `text` column of another type (numbers, lists) is one line naming its type and a string
    column to use, before the model is built (was: a traceback from the loader's thread)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 50
    cols = {"text": pa.array(list(range(n))) if column == "int64" else pa.array([["a", "b"]] * n)}
    if other:
        cols[other] = pa.array([f"document {i}" for i in range(n)])
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table(cols), tmp_path / "d" / "part-0.parquet")
    assert_config_error(
        launch(job("--dataloader.dataset_path", str(tmp_path / "d"))),
        "text_column = 'text' is not a text column in",
        f"its type is {column}",
        needle,
    )


def test_held_out_files_are_named_with_their_rule(tmp_path, docs):
    data = write_parquet(tmp_path / "d", docs, files=3)
    cfg = load_config(
        MAIN, ["--dataloader.dataset_path", str(data), "--dump_folder", str(tmp_path / "o")]
    )
    (note,) = preflight.run(cfg, str(MAIN)).notes
    assert "part-2.parquet" in note and "the last shard in sorted order" in note
    assert "training on the other 2" in note and 'val_files = "none"' in note


# ------------------------------------------------------------------------------ checkpoints
def fake_checkpoint(
    dump: Path, step: int, ranks: int = 1, record: dict | None = None, legacy: bool = False
) -> Path:
    """A DCP checkpoint with a data-loader state: the one envelope our loaders save (resumable
    at any DP degree), or with ``legacy`` one keyed per rank (torchtitan's own loaders, and ours
    before the envelope)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from torchtitan_ext.pipeline import checkpoint

    d = dump / "checkpoint" / f"step-{step}"
    if legacy:
        loader = {**{f"dp_rank_{r}": {"seq_len": 256} for r in range(ranks)}, "world_size": ranks}
    else:
        loader = checkpoint.envelope("parquet_prefetch", [{"seq_len": 256}] * ranks)
    state = {"dataloader": loader, "train_state": {"step": torch.tensor(step)}}
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    if record is not None:
        (d / RECORD).write_text(json.dumps(record))
    return d


RECORD_NOW = {"loader": "parquet_prefetch", "dp_degree": 1, "seq_len": 256, "local_batch_size": 4}


def test_our_loaders_resume_at_another_dp_degree(launch, tmp_path):
    """Their one envelope resumes at any degree: preflight lets DP 1 -> 2 through."""
    fake_checkpoint(tmp_path, 10, ranks=1, record=RECORD_NOW)
    rc, err, built = launch(job("--dump_folder", str(tmp_path)), world_size=2)
    assert rc == 0 and len(built) == 1, err


def test_per_rank_state_of_an_earlier_release_is_named(launch, tmp_path):
    fake_checkpoint(tmp_path, 10, ranks=1, legacy=True)
    assert_config_error(
        launch(job("--dump_folder", str(tmp_path))),
        "parquet_prefetch's data-loader state in an earlier release's per-rank format",
        "--dump_folder",
        "--checkpoint.exclude_from_loading dataloader",
    )
    # the documented way out: keep the model, restart the data
    rc, err, built = launch(
        job("--dump_folder", str(tmp_path), "--checkpoint.exclude_from_loading", "dataloader")
    )
    assert rc == 0 and len(built) == 1, err


def test_a_per_rank_loader_is_held_to_its_dp_degree(launch, tmp_path, monkeypatch):
    """A loader keyed per rank (torchtitan's own, a third party's) cannot change degree: DCP
    would fail after the build on the missing rank's key. (Ours stand in for one here.)"""
    monkeypatch.setattr("torchtitan_ext.preflight.checkpoint.ENVELOPE_LOADERS", frozenset())
    fake_checkpoint(tmp_path, 10, ranks=1, legacy=True)
    assert_config_error(
        launch(job("--dump_folder", str(tmp_path)), world_size=2),
        "data-parallel degree 1 (this job: 2)",
        "make clean-demo",
        "--checkpoint.exclude_from_loading dataloader",
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--training.seq_len", "128"], "seq_len 256 (this job: 128)"),
        (["--training.local_batch_size", "2"], "local_batch_size 4 (this job: 2)"),
        (["--dataloader.name", "streaming_text"], "loader 'parquet_prefetch'"),
    ],
    ids=["seq_len", "batch_size", "loader"],
)
def test_checkpoint_saved_with_other_data_settings(launch, tmp_path, args, needle):
    fake_checkpoint(tmp_path, 10, record=RECORD_NOW)
    assert_config_error(launch(job("--dump_folder", str(tmp_path), *args)), needle)
    rc, err, built = launch(job("--dump_folder", str(tmp_path)))  # the same job resumes
    assert rc == 0 and len(built) == 1, err


@pytest.mark.parametrize("damage", ["record-garbled", "record-null", "metadata-truncated"])
def test_damaged_checkpoint_is_named_before_the_model_is_built(launch, tmp_path, damage):
    """A checkpoint whose job record or DCP metadata cannot be read is one line naming the file
    (before: a JSONDecodeError traceback, or no check at all and torchtitan failing later)."""
    d = fake_checkpoint(tmp_path, 10, record=RECORD_NOW)
    if damage == "record-garbled":
        (d / RECORD).write_text('{"loader": "parq')
    elif damage == "record-null":
        (d / RECORD).write_text("null")
    else:
        meta = d / ".metadata"
        meta.write_bytes(meta.read_bytes()[:20])
    name = ".metadata" if damage.startswith("metadata") else RECORD
    assert_config_error(
        launch(job("--dump_folder", str(tmp_path))),
        f"unreadable {name}",
        str(d / name),
        "--checkpoint.exclude_from_loading dataloader",
    )


def test_a_complete_job_says_so_and_builds_nothing(launch, tmp_path):
    fake_checkpoint(tmp_path, 20, record=RECORD_NOW)
    rc, err, built = launch(job("--dump_folder", str(tmp_path)))
    assert rc == 0 and not built
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nothing to do: "), err
    assert "training.steps = 20" in lines[0] and "--training.steps" in lines[0]


def test_load_step_that_was_not_saved(launch, tmp_path):
    fake_checkpoint(tmp_path, 10, record=RECORD_NOW)
    assert_config_error(
        launch(job("--dump_folder", str(tmp_path), "--checkpoint.load_step", "7")),
        "[checkpoint] load_step = 7",
        "saved steps: [10]",
    )


def test_checkpoint_enable_false_is_accepted(launch, tmp_path):
    fake_checkpoint(tmp_path, 10, ranks=1)
    rc, err, built = launch(job("--dump_folder", str(tmp_path), "--checkpoint.enable", "false"))
    assert rc == 0 and len(built) == 1 and built[0].checkpoint.enable is False, err


# ------------------------------------------------------------------------------ the mechanism
def test_a_model_package_plugs_in_its_checks_with_one_entry(monkeypatch, tmp_path):
    seen = []

    def check(job: preflight.Job) -> None:
        seen.append(job.config.model.module)
        raise ConfigError("from the model's check")

    monkeypatch.setitem(preflight.MODEL_CHECKS, "llama3", [check])
    with pytest.raises(ConfigError, match="from the model's check"):
        preflight.run(load_config(MAIN, ["--dump_folder", str(tmp_path)]), str(MAIN))
    assert seen == ["llama3"]


def test_model_module_lookup_includes_our_model_packages():
    from torchtitan_ext.config import model_module_candidates

    assert "torchtitan_ext.models.qwen3_vl.config_registry" in model_module_candidates("qwen3_vl")
    with pytest.raises(ConfigError, match="no such model package"):
        load_config(None, ["--model.module", "no_such_model_xyz"])


# ------------------------------------------------------------------------------ real command line
def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize(
    "case", ["dataset_path", "no_config_file"], ids=["dataset_path", "no_config_file"]
)
def test_command_line_exit_code_2_one_line_no_traceback(tmp_path, case):
    if case == "dataset_path":
        out = cli(*job("--dataloader.dataset_path", str(tmp_path / "nope")))
    else:
        out = cli(cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), out.stderr[-2000:]
    assert "Traceback" not in out.stdout + out.stderr
