"""Qwen3-VL through torchtitan's launcher and trainer on CPU (the qwen3_vl model module fed by
the offline cache): the loss falls, a checkpoint resumes with exactly the uninterrupted losses
(DP=1 and DP=2, dense and MoE), packed samples stay independent inside the trainer, and HF
weights loaded by the trainer's checkpointer give transformers' own logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, step_losses, torchrun

pytestmark = pytest.mark.integration
TINY = REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml"


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, Path]:
    """One asset root (offline processor, sample set) and one cache dir for the whole module,
    so the sample cache for a given key is built once."""
    root = tmp_path_factory.mktemp("qwen3_vl_train")
    return {"root": root, "home": root / "home", "cache": root / "cache"}


def run(
    shared: dict[str, Path],
    args: list[str],
    nproc: int = 1,
    module: str = "torchtitan_ext.train",
    timeout: int = 300,
) -> tuple[str, dict[int, str]]:
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        TORCHTITAN_EXT_CACHE=str(shared["home"]),
    )
    target = ["-m", *module.split()]
    cmd = [sys.executable, *target] if nproc == 1 else torchrun(nproc, *target)
    common = ["--config-file", str(TINY), "--debug.seed", "0", "--debug.deterministic"]
    common += ["--dataloader.cache_dir", str(shared["cache"])]
    out = subprocess.run(
        cmd + common + args, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
    )
    return step_losses(out)


def test_tiny_config_trains_on_cpu_and_the_loss_falls(shared, tmp_path):
    """Overfit two packs (12 samples): the loss of the last step is below half of step 1's."""
    text, losses = run(
        shared,
        ["--training.steps", "12", "--dataloader.max_samples", "12", "--checkpoint.no-enable"]
        + ["--dump_folder", str(tmp_path)],
    )
    assert sorted(losses) == list(range(1, 13))
    first, last = float(losses[1]), float(losses[12])
    assert last < 0.5 * first, losses
    line = next(ln for ln in text.splitlines() if "step: 12" in ln)
    for field in ("tps:", "data_wait:", "images/step:", "patches/step:"):
        assert field in line, line
    assert re.search(r"images/step: [1-9]", line) and re.search(r"patches/step: [1-9]", line)


@pytest.fixture(scope="module")
def reference_losses(shared, tmp_path_factory) -> dict[int, str]:
    """3 steps of the tiny config, plain: the reference for the switches below."""
    return run(shared, SWITCH_ARGS + ["--dump_folder", str(tmp_path_factory.mktemp("ref"))])[1]


SWITCH_ARGS = ["--training.steps", "3", "--dataloader.max_samples", "24", "--checkpoint.no-enable"]


@pytest.mark.parametrize(
    "switch, exact",
    [
        (["activation-checkpoint:full"], True),
        (["--staging.enable", "--dataloader.normalize_on", "device"], True),
        (["--compile.enable", "--compile.backend", "aot_eager"], False),
    ],
    ids=["full-ac", "staging-device-normalisation", "compile-per-block"],
)
def test_switches_keep_the_losses(shared, tmp_path, reference_losses, switch, exact):
    """Activation checkpointing (torchtitan's policy on every decoder layer and vision block),
    async staging with pixels normalised after the copy, and per-block torch.compile (the CPU
    aot_eager backend: the wiring, not inductor's kernels) train the same model on the same
    batches: the losses equal the plain run's (compile: to 1e-4)."""
    text, losses = run(shared, SWITCH_ARGS + ["--dump_folder", str(tmp_path)] + switch)
    assert sorted(losses) == [1, 2, 3]
    if exact:
        assert losses == reference_losses
    else:
        assert "Compiling" in text or "compile" in text.lower()
        for k in (1, 2, 3):
            assert float(losses[k]) == pytest.approx(float(reference_losses[k]), rel=1e-4)


@pytest.mark.parametrize(
    "nproc, flavor",
    [(1, "debugmodel"), (1, "debugmodel_moe"), (2, "debugmodel"), (2, "debugmodel_moe")],
    ids=["dp1-dense", "dp1-moe", "dp2-dense", "dp2-moe"],
)
def test_checkpoint_resume_gives_the_uninterrupted_losses(shared, tmp_path, nproc, flavor):
    """Run 4 steps with checkpoints at 2 and 4 (the uninterrupted reference), drop step 4, run
    again: it loads step 2 (model, optimizer, scheduler, loader position) and steps 3-4 repeat
    the reference's losses exactly. 48 samples = several packs per rank and epoch, so a loader
    that lost its position would feed different packs."""
    args = ["--model.flavor", flavor, "--training.steps", "4", "--checkpoint.interval", "2"]
    args += ["--dataloader.max_samples", "48", "--dump_folder", str(tmp_path)]
    _, full = run(shared, args, nproc)
    assert sorted(full) == [1, 2, 3, 4]
    ckpt = tmp_path / "checkpoint"
    assert (ckpt / "step-2").is_dir() and (ckpt / "step-4").is_dir()
    shutil.rmtree(ckpt / "step-4")
    text, resumed = run(shared, args, nproc)
    assert "Training starts at step 3" in text
    assert sorted(resumed) == [3, 4]
    assert resumed == {3: full[3], 4: full[4]}, (full, resumed)


def test_packed_samples_stay_independent_in_the_trainer(shared, tmp_path):
    """A pack through the torchtitan-built model and the trainer's input path gives, token for
    token, the logits of each of its samples run alone; the summed losses agree."""
    out = tmp_path / "pack.json"
    args = ["--dataloader.max_samples", "24", "--checkpoint.no-enable"]
    run(
        shared,
        args + ["--dump_folder", str(tmp_path)],
        module=f"tests.support.qwen3_vl_probe pack {out}",
    )
    r = json.loads(out.read_text())
    assert r["samples"] >= 3 and r["images"] >= 2, r
    assert r["max_abs_dlogit"] <= 1e-5, r
    assert r["packed_loss_sum"] == pytest.approx(r["alone_loss_sum"], rel=1e-5)


def make_hf_dir(out: Path, flavor: str, published_layout: bool = False) -> Path:
    """A tiny random Qwen3-VL saved by transformers' ``save_pretrained`` (weights perturbed so
    no tensor keeps its init value), with the offline processor's tokenizer and image processor.
    ``published_layout``: fused expert tensors rewritten as the released MoE checkpoints store
    them ([E, H, 2I] / [E, I, H]; save_pretrained keeps the model's [E, 2I, H] / [E, H, I])."""
    from safetensors.torch import load_file, save_file

    from tests.support.qwen3_vl_flavors import TEST_FLAVORS
    from torchtitan_ext.models.qwen3_vl.flavors import flavor_config
    from torchtitan_ext.models.qwen3_vl.model import build_hf_model
    from torchtitan_ext.vl.processor import build_offline_processor

    torch.manual_seed(1234)
    model = build_hf_model(TEST_FLAVORS.get(flavor) or flavor_config(flavor))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    for f in build_offline_processor(out.parent / "processor").iterdir():
        shutil.copy(f, out / f.name)
    if published_layout:
        st = out / "model.safetensors"
        tensors = load_file(str(st))
        for k in list(tensors):
            if ".mlp.experts." in k:
                tensors[k] = tensors[k].transpose(1, 2).contiguous()
        save_file(tensors, str(st), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "flavor, nproc, published",
    [
        ("debugmodel", 1, False),
        ("debugmodel_moe", 1, False),
        ("debugmodel_moe", 2, True),
        ("debugmodel_tied", 2, False),
    ],
    ids=["dense", "moe", "moe-published-layout-dp2", "tied-dp2"],
)
def test_hf_weights_through_a_toml_give_the_hf_models_logits(
    shared, tmp_path, flavor, nproc, published
):
    """hf_assets_path -> a save_pretrained directory; the trainer's checkpointer loads it (each
    rank reading its FSDP shards); one pack's logits equal transformers' from_pretrained."""
    hf = make_hf_dir(tmp_path / "hf", flavor, published)
    out = tmp_path / "logits"
    args = ["--model.flavor", flavor, "--hf_assets_path", str(hf), "--dump_folder", str(tmp_path)]
    args += ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.load_only"]
    args += ["--dataloader.max_samples", "24", "--training.local_batch_size", "1"]
    run(shared, args, nproc, module=f"tests.support.qwen3_vl_probe logits {out}")
    for rank in range(nproc):
        r = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert r["max_abs_dlogit"] <= 1e-5, r
        assert r["logit_scale"] > 0.5, r  # real logits, not an all-zero model


def test_launcher_refuses_a_bad_job_before_building_anything(shared, tmp_path):
    """Through the real launcher: a batch format that does not match the model is a one-line
    config error (exit 2) before any model, cache or process group exists."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHTITAN_EXT_CACHE=str(shared["home"]))
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", "--config-file", str(TINY)]
        + ["--dataloader.batch_format", "torchtitan", "--dump_folder", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert (
        "config error:" in out.stderr and "batch_format = 'torchtitan' does not match" in out.stderr
    )
    assert "Building qwen3_vl" not in out.stdout + out.stderr
    assert not (tmp_path / "checkpoint").exists()
