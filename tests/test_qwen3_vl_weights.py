"""HF weights checked before the build: a qwen3_vl job whose safetensors cannot give the flavor's
model (a wrong shape, a missing tensor, a deleted shard, a damaged file, an integer tensor, a
tensor the model would drop) stops in preflight with one line naming the tensor and the file,
while save_pretrained checkpoints (dense, MoE, MoE in the published expert layout, tied with or
without lm_head) pass. One launcher run proves exit 2 with nothing built.

(Loading good weights into the trainer: test_qwen3_vl_train.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.test_qwen3_vl_train import TINY, make_hf_dir
from torchtitan_ext import preflight
from torchtitan_ext.config import ConfigError, load_config
from torchtitan_ext.models.qwen3_vl.weights import WeightsError, check_checkpoint, read_header

EMBED = "model.language_model.embed_tokens.weight"
Q_PROJ = "model.language_model.layers.1.self_attn.q_proj.weight"
GATE_UP = "model.language_model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Pristine tiny checkpoints (save_pretrained), built once; tests damage copies of them."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("qwen3_vl_weights")
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    out = {}
    for name, flavor, published in [
        ("dense", "debugmodel", False),
        ("moe", "debugmodel_moe", False),
        ("moe_published", "debugmodel_moe", True),
        ("tied", "debugmodel_tied", False),
    ]:
        (root / name).mkdir()
        out[name] = make_hf_dir(root / name / "hf", flavor, published)
    sharded = root / "sharded" / "hf"
    shutil.copytree(out["dense"], sharded)
    for f in sharded.glob("model*.safetensors"):
        f.unlink()
    _hf_model(out["dense"]).save_pretrained(sharded, max_shard_size="100KB")
    out["sharded"] = sharded
    yield out
    mp.undo()


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True)


def copy(dirs: dict[str, Path], name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dirs[name], tmp_path / name))


def rewrite(hf: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Apply ``change`` to the tensors of ``hf``'s single model.safetensors; the file it is in."""
    from safetensors.torch import load_file, save_file

    st = hf / "model.safetensors"
    tensors = load_file(str(st))
    change(tensors)
    save_file(tensors, str(st), metadata={"format": "pt"})
    return st


def run_preflight(hf: Path, flavor: str = "debugmodel", *args: str) -> preflight.Job:
    argv = ["--model.flavor", flavor, "--hf_assets_path", str(hf), "--dump_folder"]
    argv += [str(hf.parent / "out"), "--checkpoint.initial_load_in_hf", "--checkpoint.load_only"]
    return preflight.run(load_config(TINY, argv + list(args)), "job.toml")


def refused(hf: Path, flavor: str = "debugmodel", *args: str) -> str:
    with pytest.raises(ConfigError) as e:
        run_preflight(hf, flavor, *args)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("job.toml: the HF weights to load"), msg
    return msg


def assert_match(msg: str, pattern: str) -> None:
    assert re.search(pattern, msg), msg


# --------------------------------------------------------------------------------------- pass
@pytest.mark.parametrize("name", ["dense", "moe", "moe_published", "sharded"])
def test_save_pretrained_checkpoints_pass(dirs, name):
    flavor = "debugmodel_moe" if name.startswith("moe") else "debugmodel"
    assert run_preflight(dirs[name], flavor).notes == []


def test_tied_checkpoint_passes_with_or_without_lm_head(dirs, tmp_path):
    """save_pretrained leaves the tied lm_head out; a copy of it in the file is not read (the
    embedding is the output layer), which the log says; in another shape it is refused."""
    from tests.support.qwen3_vl_flavors import TEST_FLAVORS
    from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel

    cfg = Qwen3VLModel.Config(flavor="tied", hf_config=TEST_FLAVORS["debugmodel_tied"])
    assert check_checkpoint(dirs["tied"], cfg, str(dirs["tied"]), "tied") == []
    hf = copy(dirs, "tied", tmp_path)
    rewrite(hf, lambda t: t.__setitem__("lm_head.weight", t[EMBED].clone()))
    (note,) = check_checkpoint(hf, cfg, str(hf), "tied")
    assert "lm_head.weight is not loaded" in note
    rewrite(hf, lambda t: t.__setitem__("lm_head.weight", t[EMBED][:10].clone()))
    with pytest.raises(WeightsError, match=r"'lm_head.weight' has shape \[10, 64\]"):
        check_checkpoint(hf, cfg, str(hf), "tied")


def test_saved_buffers_the_model_computes_are_ignored(dirs, tmp_path):
    """Old saves hold rotary inv_freq tables; transformers ignores them, and so does the check."""
    hf = copy(dirs, "dense", tmp_path)
    key = "model.language_model.rotary_emb.inv_freq"
    rewrite(hf, lambda t: t.__setitem__(key, torch.ones(8)))
    assert run_preflight(hf).notes == []


# ------------------------------------------------------------------------------------- refused
def _wrong_shape(t):
    t[Q_PROJ] = t[Q_PROJ][:32].clone()


def _integer(t):
    t[Q_PROJ] = t[Q_PROJ].to(torch.int64)


def _float8(t):
    t[Q_PROJ] = t[Q_PROJ].to(torch.float8_e4m3fn)


def _missing(t):
    del t[Q_PROJ]


def _unexpected(t):
    t[Q_PROJ + "_scale_inv"] = torch.ones(1)


@pytest.mark.parametrize(
    "change, match",
    [
        (_wrong_shape, rf"model.safetensors: tensor '{Q_PROJ}' has shape \[32, 64\]; \[model\] "
         r"flavor 'debugmodel' needs \[64, 64\]"),
        (_integer, rf"model.safetensors: tensor '{Q_PROJ}' is I64, a non-floating-point type"),
        (_float8, rf"model.safetensors: tensor '{Q_PROJ}' is F8_E4M3, a quantized type"),
        (_missing, rf"tensor '{Q_PROJ}' that \[model\] flavor 'debugmodel' needs is missing: no "
         r"\*.safetensors in .*/dense holds it"),
        (_unexpected, rf"model.safetensors: tensor '{Q_PROJ}_scale_inv' is not a weight of"),
    ],
    ids=["wrong-shape", "integer", "float8", "missing", "unexpected"],
)  # fmt: skip
def test_tensors_that_do_not_fit_are_one_line(dirs, tmp_path, change, match):
    hf = copy(dirs, "dense", tmp_path)
    rewrite(hf, change)
    assert_match(refused(hf), match)


def test_moe_experts_in_neither_layout_are_refused(dirs, tmp_path):
    hf = copy(dirs, "moe", tmp_path)
    rewrite(hf, lambda t: t.__setitem__(GATE_UP, t[GATE_UP][:, :, :60].contiguous()))
    assert_match(
        refused(hf, "debugmodel_moe"),
        rf"'{GATE_UP}' has shape \[4, 96, 60\]; .* needs \[4, 64, 96\] \(or \[4, 96, 64\]: either",
    )


def test_deleted_shard_is_named(dirs, tmp_path):
    hf = copy(dirs, "sharded", tmp_path)
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    name = shards[1].name
    assert_match(
        refused(hf),
        rf"model.safetensors.index.json puts '.*'( and \d+ more tensors)? in {name}, which is missing",
    )


def test_a_tensor_the_index_places_in_a_shard_without_it(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = copy(dirs, "sharded", tmp_path)
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    shard = hf / index[EMBED]
    tensors = load_file(str(shard))
    del tensors[EMBED]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert_match(refused(hf), rf"'{EMBED}' .*missing: .*{shard.name} does not hold it")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda b: b[: len(b) - 100], r"truncated: the header describes \d+ bytes, the file"),
        (lambda b: b[:8] + b"\xff" * 40 + b[48:], r"the header is not JSON"),
        (lambda b: b"garbage", r"7 bytes, shorter than the 8-byte header length"),
        (lambda b: (10**12).to_bytes(8, "little") + b[8:], r"header length 1000000000000 does"),
    ],
    ids=["truncated", "garbled-header", "garbage", "huge-header-length"],
)
def test_damaged_files_are_named(dirs, tmp_path, damage, match):
    hf = copy(dirs, "sharded", tmp_path)
    shard = sorted(hf.glob("model-*.safetensors"))[-1]
    shard.write_bytes(damage(shard.read_bytes()))
    assert_match(refused(hf), rf"{shard}: not a readable safetensors file \(.*{match}")
    with pytest.raises(WeightsError):
        read_header(shard)


def test_a_garbled_index_is_named(dirs, tmp_path):
    hf = copy(dirs, "sharded", tmp_path)
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert_match(refused(hf), r"model.safetensors.index.json: not a safetensors index \(JSON")


def test_two_checkpoints_in_one_directory_are_refused(dirs, tmp_path):
    hf = copy(dirs, "dense", tmp_path)
    shutil.copy(hf / "model.safetensors", hf / "model-old.safetensors")
    assert_match(refused(hf), r"model.safetensors: tensor '.*' is also in model-old.safetensors")


def test_initial_load_path_is_the_one_checked(dirs, tmp_path):
    """With ``initial_load_path`` the checkpointer loads from there, not from hf_assets_path."""
    bad = copy(dirs, "dense", tmp_path)
    rewrite(bad, _wrong_shape)
    assert_match(
        refused(dirs["dense"], "debugmodel", "--checkpoint.initial_load_path", str(bad)),
        r"\(\[checkpoint\] initial_load_path\) do not fit: .*q_proj",
    )


def test_a_job_that_resumes_does_not_read_the_hf_weights(dirs, tmp_path):
    """torchtitan loads HF weights only when checkpoint.folder has no step to resume from."""
    import torch.distributed.checkpoint as dcp

    hf = copy(dirs, "dense", tmp_path)
    rewrite(hf, _wrong_shape)
    refused(hf)
    dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(hf.parent / "out" / "checkpoint" / "step-1"))
    assert run_preflight(hf).notes == []


# ------------------------------------------------------------------------------------ launcher
@pytest.mark.integration
def test_launcher_exits_2_with_one_line_before_building(dirs, tmp_path):
    hf = copy(dirs, "dense", tmp_path)
    rewrite(hf, _wrong_shape)
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHTITAN_EXT_CACHE=str(tmp_path / "home"))
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", "--config-file", str(TINY)]
        + ["--hf_assets_path", str(hf), "--dump_folder", str(tmp_path / "out")]
        + ["--checkpoint.initial_load_in_hf", "--checkpoint.load_only"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 2, log
    errors = [line for line in out.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and Q_PROJ in errors[0] and str(hf / "model.safetensors") in errors[0]
    after = log[log.index("preflight: checking") :].splitlines()[1:]
    assert after == errors, log  # nothing built, no traceback
    assert not (tmp_path / "out").exists()
