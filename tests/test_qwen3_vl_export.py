"""Qwen3-VL export to Hugging Face: ``[checkpoint] last_save_in_hf`` at the end of training and
``torchtitan-ext-export`` on a saved DCP step both write a directory that transformers'
``from_pretrained`` loads with no missing or unexpected keys, whose logits equal the trained
model's (as the trainer held it when it saved that step), with the job's processor and
``config.json``. One training run per case, shared by the tests (module-scope fixture).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.test_qwen3_vl_train import make_hf_dir, run

EXPERTS = ".mlp.experts."
# debugmodel_moe: 4 experts, hidden 64, expert ffn 48 -> the published layout [E, H, 2I] / [E, I, H]
PUBLISHED = {"gate_up_proj": (4, 64, 96), "down_proj": (4, 48, 64)}
HF_SAVE = ["--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf", "true"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_vl_export")
    return {"root": root, "home": root / "home", "cache": root / "cache"}


CASES = {
    # 3 steps: step 2 a full DCP checkpoint (interval), step 3 the last save, in HF format
    "dense": (1, ["--model.flavor", "debugmodel", "--training.steps", "3"]),
    "moe": (1, ["--model.flavor", "debugmodel_moe", "--training.steps", "3"]),
    # tied embeddings (the published 2B / 4B): no lm_head.weight in the export; a test-only
    # flavor, so the export command also shows it needs no flavor table, only the job record
    "tied": (1, ["--model.flavor", "debugmodel_tied", "--training.steps", "3"]),
    # from HF weights in the released MoE layout, 2 ranks (FSDP shards written by each rank)
    "moe-published": (2, ["--model.flavor", "debugmodel_moe", "--training.steps", "1"]),
}


@pytest.fixture(scope="module")
def trained(shared):
    """case -> (checkpoint folder, {"logits": {step: tensor}, "batch": HF kwargs}); trained on
    first use."""
    done: dict[str, tuple[Path, dict]] = {}

    def get(case: str) -> tuple[Path, dict]:
        if case not in done:
            nproc, args = CASES[case]
            dump = shared["root"] / case
            args = [*args, "--checkpoint.interval", "2", *HF_SAVE, "--dump_folder", str(dump)]
            args += ["--dataloader.max_samples", "24"]
            if case == "moe-published":
                hf = make_hf_dir(shared["root"] / "hf_published", "debugmodel_moe", True)
                args += ["--hf_assets_path", str(hf), "--checkpoint.initial_load_in_hf", "true"]
            probe = dump / "probe.pt"
            run(shared, args, nproc, module=f"tests.support.qwen3_vl_export_probe {probe}")
            done[case] = (dump / "checkpoint", torch.load(probe, weights_only=False))
        return done[case]

    return get


def expert_shapes(hf_dir: Path) -> dict[str, tuple[int, ...]]:
    from torchtitan_ext.models.qwen3_vl.state_dict_adapter import safetensors_shapes

    return {k: v for k, v in safetensors_shapes(hf_dir).items() if EXPERTS in k}


def recorded_processor(step_dir: Path) -> Path:
    """The processor directory the job recorded with a checkpoint step."""
    return Path(
        json.loads((step_dir / "torchtitan_ext_job.json").read_text())["model"]["processor"]
    )


def check_hf_dir(
    hf_dir: Path, logits: torch.Tensor, batch: dict, moe: bool, processor: Path
) -> None:
    """from_pretrained loads every weight and nothing else; config.json names the class, the
    model type and the weights' dtype; the logits are the trained model's; the processor is
    the job's."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    from torchtitan_ext.models.qwen3_vl.state_dict_adapter import safetensors_shapes

    cls = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["architectures"] == [cls.__name__]
    assert cfg["model_type"] == ("qwen3_vl_moe" if moe else "qwen3_vl")
    assert cfg["dtype"] == "float32"
    tied = cfg["tie_word_embeddings"]
    assert ("lm_head.weight" in safetensors_shapes(hf_dir)) != tied  # tied: the embedding only
    model, info = cls.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        ref = model.eval()(**batch).logits.float()
    assert ref.shape == logits.shape
    assert (ref - logits).abs().max().item() <= 1e-6  # fp32 on CPU: the same arithmetic
    assert logits.abs().max().item() > 0.5  # real logits, not an all-zero model
    if moe:
        for k, shape in expert_shapes(hf_dir).items():
            assert shape == PUBLISHED[k.rsplit(".", 1)[1]], (k, shape)
    check_processor(hf_dir, processor)


def check_processor(hf_dir: Path, src: Path) -> None:
    """The exported processor is the one the job recorded (same tokenizer, chat template and
    image settings). ``AutoProcessor`` builds Qwen3-VL's video processor, which needs
    torchvision: without it, its tokenizer and image processor are loaded the same way."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    from torchtitan_ext.vl.processor import load_processor, processor_fingerprint

    assert processor_fingerprint(load_processor(hf_dir)) == processor_fingerprint(
        load_processor(src)
    )
    assert (hf_dir / "chat_template.jinja").is_file()
    try:
        import torchvision  # noqa: F401
    except ImportError:
        AutoTokenizer.from_pretrained(hf_dir)
        AutoImageProcessor.from_pretrained(hf_dir)
    else:
        assert AutoProcessor.from_pretrained(hf_dir).chat_template


def export(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHTITAN_EXT_CACHE=str(home))
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.export", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )


@pytest.mark.integration
@pytest.mark.parametrize("case", ["dense", "moe", "tied"])
def test_last_save_in_hf_loads_in_transformers(trained, case):
    """The final save (step 3, ``last_save_in_hf``) is a complete HF directory: MoE experts in
    the published layout (the save used to fail on their transposed views)."""
    ckpt, probe = trained(case)
    step = ckpt / "step-3"
    moe = case == "moe"
    check_hf_dir(step, probe["logits"][3], probe["batch"], moe, recorded_processor(step))


@pytest.mark.integration
def test_moe_from_published_layout_exports_back(trained):
    """Weights loaded from the released expert layout, trained on 2 ranks, exported: the same
    layout comes back and transformers reads the trained model."""
    ckpt, probe = trained("moe-published")
    step = ckpt / "step-1"
    processor = recorded_processor(step)
    assert processor == (ckpt.parent.parent / "hf_published").resolve()  # hf_assets_path's own
    check_hf_dir(step, probe["logits"][1], probe["batch"], True, processor)


@pytest.mark.integration
@pytest.mark.parametrize("case", ["dense", "moe", "tied"])
def test_export_command_converts_a_full_checkpoint(trained, shared, tmp_path, case):
    """``torchtitan-ext-export`` on step 2 (a full training checkpoint: model, optimizer,
    scheduler, loader) writes the model alone, equal to the model the trainer saved."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt, probe = trained(case)
    keys = FileSystemReader(str(ckpt / "step-2")).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer.") for k in keys)  # a full checkpoint
    out = tmp_path / "hf"
    r = export(["--checkpoint", str(ckpt), "--step", "2", "--out", str(out)], shared["home"])
    assert r.returncode == 0, r.stdout + r.stderr
    processor = recorded_processor(ckpt / "step-2")
    check_hf_dir(out, probe["logits"][2], probe["batch"], case == "moe", processor)


def test_export_command_refuses_a_missing_step_in_one_line(tmp_path):
    """A step that was not saved: exit 2, one line naming the step and the saved ones."""
    step = tmp_path / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    r = export(
        ["--checkpoint", str(step.parent), "--step", "5", "--out", str(tmp_path / "o")],
        tmp_path / "home",
    )
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export error: --step 5"), r.stderr
    assert "saved steps: 2" in lines[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "record, expected",
    [
        (None, "not a checkpoint of a torchtitan_ext job"),
        ({"loader": "text"}, "does not name the model"),
        ({"model": {"name": "llama3", "flavor": "debugmodel"}}, "holds a 'llama3' model"),
    ],
    ids=["no-record", "old-record", "llama3"],
)
def test_export_refuses_what_is_not_a_qwen3_vl_checkpoint(tmp_path, capsys, record, expected):
    from torchtitan_ext.export import main
    from torchtitan_ext.preflight.checkpoint import RECORD

    step = tmp_path / "checkpoint" / "step-4"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    if record is not None:
        (step / RECORD).write_text(json.dumps(record))
    rc = main(["--checkpoint", str(step.parent), "--step", "4", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "o").exists()


def test_export_help_names_every_option(capsys):
    from torchtitan_ext.export import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--checkpoint", "--step", "--out", "--processor", "--dtype"):
        assert opt in text


@pytest.mark.parametrize("layout", ["published", "model"])
def test_adapter_writes_the_published_layout_and_reads_in_place(tmp_path, layout):
    """A save (``exporting()``, or no HF checkpoint to read) gets the published layout as
    contiguous tensors, whatever layout ``hf_assets_path`` holds; a load gets views in the
    checkpoint's layout that share the parameters' storage (the reader fills them in place)."""
    from safetensors.torch import save_file

    from torchtitan_ext.models.qwen3_vl.flavors import flavor_config
    from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel
    from torchtitan_ext.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter

    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    sd = {key: torch.randn(4, 96, 64)}  # the model's layout
    disk = sd[key].shape if layout == "model" else (4, 64, 96)
    save_file({key: torch.zeros(disk)}, str(tmp_path / "model.safetensors"))
    cfg = Qwen3VLModel.Config(hf_config=flavor_config("debugmodel_moe"))
    adapter = Qwen3VLStateDictAdapter(cfg, str(tmp_path))
    loading = adapter.to_hf(sd)[key]
    assert loading.shape == disk and loading.untyped_storage().data_ptr() == (
        sd[key].untyped_storage().data_ptr()
    )
    for a in (adapter, Qwen3VLStateDictAdapter(cfg, None)):
        with a.exporting() if a is adapter else contextlib.nullcontext():
            saving = a.to_hf(sd)[key]
        assert saving.shape == PUBLISHED["gate_up_proj"] and saving.is_contiguous()
        assert torch.equal(saving, sd[key].transpose(1, 2))
    assert adapter.to_hf(sd)[key].shape == disk  # exporting() ends with its block
