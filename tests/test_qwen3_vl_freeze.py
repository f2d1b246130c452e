"""``[model] freeze`` for qwen3_vl: which parameters each component holds, the config errors, and
what a frozen component means in torchtitan's trainer (built in this process exactly as the
launcher builds it; DP=2 under torchrun): bit-identical weights after training, no optimizer
state, no share of the gradient norm, no FSDP gradient reduction.

Also a worker: ``python -m tests.test_qwen3_vl_freeze OUT STEPS --config-file X [...]`` trains
``STEPS`` steps and writes each rank's :func:`record` to ``OUT.rank{r}.json`` (torchrun ok).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO, torchrun
from tests.support.qwen3_vl_flavors import TEST_FLAVORS
from torchtitan_ext.config import ConfigError
from torchtitan_ext.models.qwen3_vl.flavors import flavor_config
from torchtitan_ext.models.qwen3_vl.freeze import component_of
from torchtitan_ext.models.qwen3_vl.model import COMPONENTS, Qwen3VLModel

TINY = REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml"
STEPS = 3
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def meta_model(flavor: str, freeze: list[str] | None = None) -> Qwen3VLModel:
    hf = TEST_FLAVORS.get(flavor) or flavor_config(flavor)
    with torch.device("meta"):
        return Qwen3VLModel(Qwen3VLModel.Config(hf_config=hf, freeze=freeze or []))


# ---------------------------------------------------------------------------- components, errors


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_every_parameter_has_its_component(flavor):
    names = [n for n, _ in meta_model(flavor).named_parameters()]
    got = {n: component_of(n) for n in names}
    assert set(got.values()) == set(COMPONENTS)
    for n, c in got.items():
        if ".merger." in n or ".deepstack_merger_list." in n:
            assert c == "merger", n
        elif n.startswith("model.visual."):  # patch + position embedding, blocks
            assert c == "vision", n
        elif ".embed_tokens." in n:
            assert c == "embeddings", n
        elif n.startswith("model.language_model."):  # layers (experts too), final norm
            assert c == "language_model", n
        else:
            assert (n, c) == ("lm_head.weight", "lm_head")
    # AC / compile wrapper segments do not change the answer; a stranger is refused
    assert component_of("model.visual.blocks.0._checkpoint_wrapped_module.attn.qkv.weight") == (
        "vision"
    )
    assert component_of("model.language_model.layers.1._orig_mod.mlp.gate.weight") == (
        "language_model"
    )
    with pytest.raises(ValueError, match="belongs to none"):
        component_of("model.something_new.weight")


def test_freeze_clears_requires_grad_and_logs_the_counts(caplog):
    """Building the model is silent (preflight checks build it on the meta device too); the
    counts are logged once, by the trainer's build (``log_counts`` in ``parallelize_qwen3_vl``)."""
    from torchtitan_ext.models.qwen3_vl.freeze import log_counts

    with caplog.at_level("INFO"):
        model = meta_model("debugmodel", ["vision", "lm_head"])
    assert not [r for r in caplog.records if "qwen3_vl parameters:" in r.getMessage()]
    with caplog.at_level("INFO"):
        log_counts(model, ["vision", "lm_head"], tied=False)
    for n, p in model.named_parameters():
        assert p.requires_grad == (component_of(n) not in ("vision", "lm_head")), n
    lines = [r.getMessage() for r in caplog.records if "qwen3_vl parameters:" in r.getMessage()]
    assert len(lines) == len(COMPONENTS) + 1, lines
    vision = sum(p.numel() for n, p in model.named_parameters() if component_of(n) == "vision")
    assert any("vision" in ln and "frozen" in ln and f"{vision:,} frozen" in ln for ln in lines)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"{total:,} trainable" in lines[-1] and "total" in lines[-1]


@pytest.mark.parametrize(
    "flavor, freeze, match",
    [
        ("debugmodel", ["vision", "visual"], r"unknown component\(s\) 'visual'; valid: vision, "),
        ("debugmodel", list(COMPONENTS), "every component is frozen"),
        ("debugmodel_tied", ["lm_head"], "'embeddings' and 'lm_head' must be frozen together"),
        ("debugmodel_tied", ["embeddings"], "'embeddings' and 'lm_head' must be frozen together"),
    ],
)
def test_model_refuses_an_impossible_freeze(flavor, freeze, match):
    with pytest.raises(ValueError, match=match):
        meta_model(flavor, freeze)


def test_tied_embeddings_freeze_together():
    model = meta_model("debugmodel_tied", ["embeddings", "lm_head"])
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not model.lm_head.weight.requires_grad


@pytest.mark.parametrize(
    "toml, cli, match",
    [
        ('freeze = ["vision", "text"]', [], r"\[model\] freeze = \['vision', 'text'\]: unknown"),
        ("", ["--model.freeze", "vision,merger,language_model,embeddings,lm_head"], "every"),
    ],
)
def test_preflight_names_the_key_and_the_valid_names(tmp_path, toml, cli, match):
    """Refused as the config loads (before the checkpoint or any other check could stop the
    job first), and by the preflight check for callers that build a config by hand."""
    from torchtitan_ext.config import load_config
    from torchtitan_ext.models.qwen3_vl.preflight import check
    from torchtitan_ext.preflight import Job

    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nmodule = "qwen3_vl"\nflavor = "debugmodel"\n{toml}\n')
    with pytest.raises(ConfigError, match=match) as e:
        load_config(path, cli)
    path.write_text('[model]\nmodule = "qwen3_vl"\nflavor = "debugmodel"\n')
    cfg = load_config(path)
    cfg.model_spec.model.freeze = ["vision", "text"] if toml else list(COMPONENTS)
    with pytest.raises(ConfigError, match=match) as e2:
        check(Job(cfg, str(path)))
    for msg in (str(e.value), str(e2.value)):
        assert "\n" not in msg and msg.startswith(str(path))
        assert "vision, merger, language_model, embeddings, lm_head" in msg


def test_a_bad_freeze_is_named_even_when_the_job_has_nothing_left_to_train(tmp_path):
    """A finished dump folder would answer "nothing to do" (exit 0) before the model checks."""
    from torchtitan_ext import preflight
    from torchtitan_ext.config import load_config

    step = tmp_path / "out" / "checkpoint" / "step-20"
    step.mkdir(parents=True)
    (step / "model.safetensors.index.json").write_text("{}")
    args = ["--dump_folder", str(tmp_path / "out"), "--model.freeze", "Vision"]
    with pytest.raises(ConfigError, match="unknown component"):
        preflight.run(load_config(REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml", args), "x")


GROUPS = """
[optimizer]
param_groups = [
  { pattern = "visual", optimizer_name = "AdamW", optimizer_kwargs = { lr = 1e-5 } },
  { pattern = ".*", optimizer_name = "AdamW", optimizer_kwargs = { lr = 1e-4 } },
]
"""


@pytest.mark.parametrize(
    "freeze, chunks, match",
    [
        ('["vision", "merger"]', 0, "pattern 'visual' matches only parameters that"),
        ('["vision"]', 0, None),  # the mergers keep the group alive
        ('["vision", "merger", "language_model", "embeddings"]', 2, "leaves only lm_head"),
        ('["vision", "language_model", "embeddings"]', 2, None),
    ],
)
def test_preflight_refuses_what_cannot_train(tmp_path, freeze, chunks, match):
    """An optimizer group left with only frozen parameters (torchtitan refuses it after the
    build), and only lm_head trainable under the chunked loss (backward would fail)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    from torchtitan_ext.config import load_config
    from torchtitan_ext.models.qwen3_vl.preflight import check
    from torchtitan_ext.preflight import Job

    path = tmp_path / "job.toml"
    path.write_text(
        f'[model]\nmodule = "qwen3_vl"\nflavor = "debugmodel"\nfreeze = {freeze}\n{GROUPS}'
    )
    cfg = load_config(path)
    if chunks:
        cfg.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(), num_chunks=chunks)
    job = Job(cfg, str(path))
    if match is None:
        check(job)
    else:
        with pytest.raises(ConfigError, match=match):
            check(job)


@pytest.mark.parametrize(
    "saved, now, exclude, refused",
    [
        (["vision"], [], [], True),  # thawed: no optimizer state for it in the checkpoint
        (["vision", "merger"], ["vision"], [], True),
        (["vision"], ["vision"], [], False),
        ([], ["vision"], [], False),  # freezing more: the extra state is not read
        (["vision"], [], ["optimizer"], False),  # the optimizer starts afresh
    ],
)
def test_resuming_with_a_thawed_component_is_one_line(tmp_path, saved, now, exclude, refused):
    """torchtitan would fail after the build ("Missing key in checkpoint state_dict:
    optimizer.state..."); the record of the saved step says what was frozen."""
    import json

    from torchtitan_ext.config import load_config
    from torchtitan_ext.preflight import Job
    from torchtitan_ext.preflight.checkpoint import RECORD, check_checkpoint

    step = tmp_path / "out" / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / "model.safetensors.index.json").write_text("{}")  # a saved step, to torchtitan
    model = {"name": "qwen3_vl", "flavor": "debugmodel", **({"freeze": saved} if saved else {})}
    (step / RECORD).write_text(json.dumps({"model": model}))
    args = ["--dump_folder", str(tmp_path / "out"), "--checkpoint.enable"]
    args += ["--model.freeze", ",".join(now)] if now else []
    args += ["--checkpoint.exclude_from_loading", *exclude] if exclude else []
    cfg = load_config(REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml", args)
    job = Job(cfg, "job.toml")
    if not refused:
        check_checkpoint(job)
        return
    with pytest.raises(ConfigError, match="exclude_from_loading optimizer") as e:
        check_checkpoint(job)
    thawed = ", ".join(sorted(set(saved) - set(now)))
    assert "\n" not in str(e.value) and f"with {thawed} frozen" in str(e.value)


@pytest.mark.integration
def test_launcher_exits_2_with_one_line_before_building(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHTITAN_EXT_CACHE=str(tmp_path / "home"))
    out = subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", "--config-file", str(TINY)]
        + ["--model.freeze", "vision,lm_heads", "--dump_folder", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("config error:")]
    assert len(errors) == 1 and "[model] freeze" in errors[0] and "'lm_heads'" in errors[0]
    assert "Building qwen3_vl" not in out.stdout + out.stderr


# ------------------------------------------------------------------------------ in the trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp_groups(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    groups = {}  # by identity: fully_shard([norm, lm_head]) puts one group on two modules
    for m in model.modules():
        if isinstance(m, FSDPModule):
            g = m._get_fsdp_state()._fsdp_param_group
            if g is not None:
                groups[id(g)] = g
    return list(groups.values())


def record(trainer: Any, steps: int, load: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps of a built trainer (``load``: through its checkpointer first, as
    ``Trainer.train`` does) and say what happened to frozen and trainable parameters."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fpg
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.checkpointer.utils import canonical_fqn

    model = trainer.model_parts[0]
    if load:
        assert trainer.checkpointer.load(step=trainer.config.checkpoint.load_step)
    params = {canonical_fqn(n): p for n, p in model.named_parameters()}
    frozen = sorted(n for n, p in params.items() if not p.requires_grad)
    before = {n: _full(p.detach()).clone() for n, p in params.items()}
    by_id = {id(p): n for n, p in params.items()}
    units = _fsdp_groups(model)
    rec: dict[str, Any] = {"frozen": frozen, "trainable": sorted(set(params) - set(frozen))}
    rec["units"] = len(units)
    rec["units_with_trainable"] = sum(
        any(fp.sharded_param.requires_grad for fp in g.fsdp_params) for g in units
    )
    rec["reduces"], rec["reduced"], rec["norms"], rec["losses"] = [], set(), [], []
    rec["nonzero_grad"] = set()
    orig_reduce, orig_clip = fpg.foreach_reduce, dist_utils.clip_grad_norm_

    def reduce(fsdp_params, *a, **k):  # FSDP2's gradient reduce-scatter of one unit
        rec["reduces"][-1] += 1
        rec["reduced"].update(by_id[id(fp.sharded_param)] for fp in fsdp_params)
        return orig_reduce(fsdp_params, *a, **k)

    def clip(parameters, *a, **k):
        parameters = list(parameters)
        with_grad = {by_id[id(p)] for p in parameters if p.grad is not None}
        sq = {n: float(_full(params[n].grad).double().pow(2).sum()) for n in sorted(with_grad)}
        rec["nonzero_grad"].update(n for n, v in sq.items() if v > 0)
        norm = orig_clip(parameters, *a, **k)
        by_hand = sum(sq.values()) ** 0.5
        rec["norms"].append({"logged": float(norm), "by_hand": by_hand, "with_grad": sorted(sq)})
        return norm

    log = trainer.metrics_processor.log
    trainer.metrics_processor.log = lambda step, loss, *a, **k: rec["losses"].append(loss)
    fpg.foreach_reduce, dist_utils.clip_grad_norm_ = reduce, clip
    try:
        it = trainer.batch_generator(trainer.dataloader)
        for _ in range(steps):
            rec["reduces"].append(0)
            trainer.step += 1
            trainer.train_step(it)
    finally:
        fpg.foreach_reduce, dist_utils.clip_grad_norm_ = orig_reduce, orig_clip
        trainer.metrics_processor.log = log
    rec["reduced"] = sorted(rec["reduced"])
    rec["zero_grad"] = sorted(set(rec["trainable"]) - rec.pop("nonzero_grad"))
    rec["changed"] = sorted(
        n for n, p in params.items() if not torch.equal(before[n], _full(p.detach()))
    )
    rec["still_frozen"] = sorted(n for n, p in params.items() if not p.requires_grad)
    state = trainer.optimizers.state_dict()
    rec["opt_state"] = sorted(
        {k.split(".", 1)[1].rsplit(".", 1)[0] for k in state if k.startswith("state.")}
    )
    rec["opt_groups"] = sorted(
        n for o in trainer.optimizers for g in o.param_groups for n in g["param_names"]
    )
    if load:  # frozen weights are the checkpoint's, still
        from safetensors.torch import load_file

        hf = load_file(str(Path(trainer.config.hf_assets_path) / "model.safetensors"))
        rec["frozen_equal_hf"] = all(torch.equal(hf[n], _full(params[n].detach())) for n in frozen)
    return rec


def common_args(root: Path, name: str) -> list[str]:
    return [
        "--config-file", str(TINY), "--debug.seed", "0", "--debug.deterministic",
        "--dataloader.cache_dir", str(root / "cache"), "--dataloader.max_samples", "24",
        "--dump_folder", str(root / name), "--training.steps", str(10 * STEPS),
    ]  # fmt: skip


def hf_args(hf: Path) -> list[str]:
    return [
        "--hf_assets_path",
        str(hf),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
    ] + ["--checkpoint.load_only"]


def train_here(argv: list[str], steps: int, load: bool) -> dict[str, Any]:
    """Build the trainer in this process exactly as the launcher does, :func:`record`, close."""
    from tests.support.qwen3_vl_probe import build_trainer

    # The launcher's rendezvous variables (RANK, MASTER_PORT, ...) are set in os.environ by the
    # build: restore the whole environment afterwards, or every later test's subprocess inherits
    # this trainer's MASTER_PORT (and LOCAL_RANK, so it would not pick a free port of its own).
    saved = dict(os.environ)
    for var in DIST_ENV:  # a fresh single-process rendezvous per trainer
        os.environ.pop(var, None)
    trainer = None
    try:
        trainer = build_trainer(argv)
        return record(trainer, steps, load)
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Three tiny trainings of STEPS steps: the dense model from HF weights with the vision
    tower and lm_head frozen (FSDP units that mix frozen and trainable: the vision root with the
    mergers, final norm + lm_head), the same unfrozen, and the MoE model from random init with
    the mergers, language model and embeddings frozen (gradients flow through the frozen
    language model into the vision tower)."""
    from tests.test_qwen3_vl_train import make_hf_dir

    root = tmp_path_factory.mktemp("freeze")
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    try:
        hf = make_hf_dir(root / "hf", "debugmodel")
        dense = common_args(root, "dense") + hf_args(hf)
        moe = common_args(root, "moe") + [
            "--model.flavor",
            "debugmodel_moe",
            "--checkpoint.no-enable",
        ]
        return {
            "dense": train_here(dense + ["--model.freeze", "vision,lm_head"], STEPS, True),
            "unfrozen": train_here(dense, 1, True),
            "moe": train_here(
                moe + ["--model.freeze", "merger,language_model,embeddings"], STEPS, False
            ),
        }
    finally:
        mp.undo()


# The debug flavors add the last deepstack merger's features after the last decoder layer, at
# image-token positions only, whose labels are ignored: its gradient is exactly zero (frozen or
# not), so training cannot move it.
LAST_DEEPSTACK = {
    f"model.visual.deepstack_merger_list.1.{m}.{w}"
    for m in ("norm", "linear_fc1", "linear_fc2")
    for w in ("weight", "bias")
}
FROZEN = {"dense": {"vision", "lm_head"}, "moe": {"merger", "language_model", "embeddings"}}


def frozen_as_asked(r: dict[str, Any], run: str) -> None:
    """The run's frozen parameters are exactly those of the components it froze."""
    assert r["frozen"] and r["trainable"]
    assert {component_of(n) for n in r["frozen"]} == FROZEN[run]
    assert not {component_of(n) for n in r["trainable"]} & FROZEN[run]


@pytest.mark.parametrize("run", ["dense", "moe"])
def test_frozen_weights_stay_bit_identical_while_the_rest_trains(runs, run):
    """requires_grad=False survives the meta build, to_empty, init_states, fully_shard and the
    checkpointer's HF load; after the steps frozen tensors are bit-identical (to the HF file's,
    where loaded) and every trainable tensor moved."""
    r = runs[run]
    frozen_as_asked(r, run)
    assert r["still_frozen"] == r["frozen"]
    assert r["changed"] == sorted(set(r["trainable"]) - set(r["zero_grad"]))
    assert set(r["zero_grad"]) <= LAST_DEEPSTACK
    if run == "dense":
        assert r["frozen_equal_hf"]


@pytest.mark.parametrize("run", ["dense", "moe"])
def test_frozen_parameters_have_no_optimizer_state(runs, run):
    r = runs[run]
    frozen_as_asked(r, run)
    assert r["opt_groups"] == r["trainable"]
    assert r["opt_state"] == r["trainable"]


@pytest.mark.parametrize("run", ["dense", "moe"])
def test_grad_norm_is_over_the_trainable_gradients(runs, run):
    """The clipped norm is the norm of the trainable gradients, computed by hand; frozen
    parameters have no gradient at all."""
    frozen_as_asked(runs[run], run)
    for step in runs[run]["norms"]:
        assert step["with_grad"] == runs[run]["trainable"]
        assert step["logged"] == pytest.approx(step["by_hand"], rel=1e-5)


def test_freezing_changes_the_grad_norm_not_the_forward(runs):
    """Same HF weights, same first batch: the same loss, and a smaller norm once the vision
    tower's and lm_head's gradients are left out."""
    dense, unfrozen = runs["dense"], runs["unfrozen"]
    assert dense["losses"][0] == unfrozen["losses"][0]
    assert dense["norms"][0]["logged"] < unfrozen["norms"][0]["logged"] * (1 - 1e-4)
    assert unfrozen["trainable"] == sorted(dense["frozen"] + dense["trainable"])


@pytest.mark.parametrize("run", ["dense", "moe"])
def test_fsdp_reduces_no_frozen_gradient(runs, run):
    """FSDP2 reduce-scatters exactly the trainable parameters: a unit whose parameters are all
    frozen issues no reduction, a mixed unit reduces only its trainable ones."""
    r = runs[run]
    assert r["reduced"] == r["trainable"]
    assert r["reduces"] == [r["units_with_trainable"]] * STEPS
    assert r["units_with_trainable"] < r["units"]


@pytest.mark.integration
def test_dp2_under_torchrun_trains_only_the_trainable(tmp_path):
    """DP=2 (gloo), from HF weights: every rank reduces only trainable gradients, frozen weights
    stay put, the norm is the trainable gradients'; DP=1 on the same global batches (rank r's
    packs are r, r + 2, ...) gives the same losses and norms."""
    from tests.test_qwen3_vl_train import make_hf_dir

    out = tmp_path / "rec"
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path / "home"))
    try:
        hf = make_hf_dir(tmp_path / "hf", "debugmodel")
        args = common_args(tmp_path, "dp") + hf_args(hf) + ["--model.freeze", "vision,lm_head"]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cmd = torchrun(2, "-m", "tests.test_qwen3_vl_freeze", str(out), "2", *args)
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        dp1 = train_here(args + ["--training.local_batch_size", "4"], 2, True)
    finally:
        mp.undo()
    for rank in range(2):
        r = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert {component_of(n) for n in r["frozen"]} == {"vision", "lm_head"}
        assert r["trainable"] == r["reduced"] == r["opt_state"]
        assert r["changed"] == sorted(set(r["trainable"]) - set(r["zero_grad"]))
        assert r["frozen_equal_hf"]
        assert r["reduces"] == [r["units_with_trainable"]] * 2
        for step in r["norms"]:
            assert step["logged"] == pytest.approx(step["by_hand"], rel=1e-5)
        assert dp1["losses"] == pytest.approx(r["losses"], rel=1e-5)
        norms = [s["logged"] for s in r["norms"]]
        assert [s["logged"] for s in dp1["norms"]] == pytest.approx(norms, rel=1e-4)


def _worker(out: str, steps: str, *argv: str) -> None:
    from tests.support.qwen3_vl_probe import build_trainer

    trainer = build_trainer(list(argv))
    rec = record(trainer, int(steps), trainer.config.checkpoint.enable)
    Path(f"{out}.rank{torch.distributed.get_rank()}.json").write_text(json.dumps(rec))
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:])
