"""Preflight check of the checkpoint a job would resume from.

torchtitan resumes from the latest ``dump_folder/checkpoint/step-N`` (or ``load_step``) with the
data loader's state in it. That state belongs to the job that saved it: a loader keyed per rank
(``dataloader.dp_rank_{r}``) cannot be read by a job with another data-parallel degree (torch
fails with "Missing key in checkpoint state_dict: dataloader.dp_rank_1...", under a long
traceback per rank), and a changed ``seq_len``, batch size or loader is refused by the loader
with a raw ValueError — all after the model was built. And a job that already reached
``training.steps`` builds everything, then says "Training completed" having trained nothing.

What a checkpoint was saved with comes from a small record ``ExtTrainer`` writes next to each
save (:data:`RECORD`: loader, data-parallel degree, seq_len, local batch size; and the model,
:func:`model_record`, for ``torchtitan-ext-export``), and from the DCP metadata's loader keys.
This package's loaders save one checkpoint envelope (:mod:`torchtitan_ext.pipeline.checkpoint`)
that resumes at any data-parallel degree, so only other loaders (keyed per rank, like
torchtitan's own) are held to the degree; a checkpoint of ours still keyed per rank was written
by an earlier release, whose loader state this one cannot continue: said before the build.

The fix offered is always the same three ways out: another ``--dump_folder``, deleting the old
one (``make clean-demo`` for the demo), or keeping the model and optimizer while the data starts
from scratch: ``--checkpoint.exclude_from_loading dataloader``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torchtitan_ext.preflight import Job, JobComplete, loader_name
from torchtitan_ext.toml_config import ConfigError

RECORD = "torchtitan_ext_job.json"
_STEP = re.compile(r"step-(\d+)$")
_RANK_KEY = re.compile(r"^dataloader\.dp_rank_(\d+)(\.|$)")
ENVELOPE_LOADERS = frozenset(("parquet_prefetch", "streaming_text", "cached_vl"))
"""This package's loaders: their state is the one envelope, resumable at any DP degree."""


def job_record(config: Any, dp_degree: int) -> dict[str, Any]:
    """What a checkpoint's data state depends on (written with each save)."""
    return {
        "loader": loader_name(config.dataloader),
        "dp_degree": int(dp_degree),
        "seq_len": int(config.training.seq_len),
        "local_batch_size": int(config.training.local_batch_size),
    }


def model_record(config: Any) -> dict[str, Any]:
    """Which model a checkpoint holds (the ``model`` entry of its record): the model spec's name
    and flavor, and for a model that exports to Hugging Face (qwen3_vl) what
    ``torchtitan-ext-export`` needs to export it from the checkpoint folder alone (its HF config
    and processor directory: :func:`torchtitan_ext.models.qwen3_vl.export.export_record`)."""
    spec = config.model_spec
    out: dict[str, Any] = {"name": spec.name, "flavor": spec.flavor}
    if getattr(spec.model, "freeze", None):
        out["freeze"] = sorted(spec.model.freeze)
    if spec.name == "qwen3_vl":
        from torchtitan_ext.models.qwen3_vl.export import export_record

        out.update(export_record(config))
    return out


def write_record(step_dir: str | Path, record: dict[str, Any]) -> None:
    d = Path(step_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(d / RECORD)


def _valid(step_dir: Path) -> bool:
    # torchtitan's own rule (checkpointer/dcp.py _find_load_step)
    return (step_dir / ".metadata").is_file() or (
        step_dir / "model.safetensors.index.json"
    ).is_file()


def saved_steps(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in folder.iterdir() if (m := _STEP.match(p.name)) and _valid(p)
    )


_WAYS_OUT = (
    "Use another --dump_folder, or delete this one (for the demo: make clean-demo), or keep the "
    "model and start the data from scratch with --checkpoint.exclude_from_loading dataloader"
)


def _damaged(job: Job, path: Path, e: Exception) -> ConfigError:
    return ConfigError(
        f"{job.file}: the checkpoint this job would resume from has an unreadable {path.name} "
        f"({path}: {type(e).__name__}: {e}). {_WAYS_OUT}"
    )


def _metadata_ranks(job: Job, step_dir: Path) -> int | None:
    """Data-parallel degree from the DCP metadata's per-rank loader keys (None: not keyed, or
    not a DCP checkpoint: an HF-format one has no ``.metadata``). A ``.metadata`` that cannot
    be read is a damaged checkpoint, named before torchtitan fails on it after the model build."""
    keys = _metadata_keys(job, step_dir)
    ranks = {int(m.group(1)) for k in keys if (m := _RANK_KEY.match(k))}
    return len(ranks) or None


def _metadata_keys(job: Job, step_dir: Path) -> set[str]:
    meta = step_dir / ".metadata"
    if not meta.is_file():
        return set()
    try:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    except Exception as e:  # damaged: named, with the ways out
        raise _damaged(job, meta, e) from e
    return set(keys)


def check_checkpoint(job: Job) -> None:
    """The checkpoint the job would resume from fits its data state; JobComplete if it already
    reached ``training.steps``."""
    cfg = job.config
    ck = cfg.checkpoint
    if not ck.enable or ck.create_seed_checkpoint:
        return
    folder = Path(cfg.dump_folder) / ck.folder
    steps = saved_steps(folder)
    if ck.load_step != -1:
        if ck.load_step not in steps:
            raise ConfigError(
                f"{job.file}: [checkpoint] load_step = {ck.load_step}: no checkpoint step-"
                f"{ck.load_step} in {folder} (saved steps: {steps or 'none'})"
            )
        step = ck.load_step
    elif not steps:
        return  # a fresh start
    else:
        step = steps[-1]
    step_dir = folder / f"step-{step}"
    if "dataloader" not in ck.exclude_from_loading:  # else the data starts from scratch
        _check_data_state(job, step_dir)
    if "optimizer" not in ck.exclude_from_loading:
        _check_frozen(job, step_dir)
    # after the data check: torchtitan loads the checkpoint (and fails on a mismatch) even when
    # nothing is left to train
    if step >= cfg.training.steps:
        raise JobComplete(
            f"{step_dir} already holds step {step} and training.steps = {cfg.training.steps}: "
            "nothing left to train. Train further with a larger --training.steps, or start over "
            "with another --dump_folder (or delete this one; for the demo: make clean-demo)"
        )


def _saved_record(job: Job, step_dir: Path) -> dict[str, Any]:
    """The step's job record ({} when it has none)."""
    record = step_dir / RECORD
    if not record.is_file():
        return {}
    try:
        saved = json.loads(record.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON object was expected, got {type(saved).__name__}")
    except (ValueError, OSError) as e:  # garbled or truncated: named, with the ways out
        raise _damaged(job, record, e) from e
    return saved


def _check_frozen(job: Job, step_dir: Path) -> None:
    """A component frozen when the checkpoint was saved has no optimizer state in it: resuming
    with it trainable fails in torchtitan's load, after the build ("Missing key in checkpoint
    state_dict: optimizer.state...")."""
    model = _saved_record(job, step_dir).get("model")
    saved = model.get("freeze", []) if isinstance(model, dict) else []
    now = set(getattr(job.config.model_spec.model, "freeze", None) or [])
    thawed = sorted(set(saved) - now)
    if thawed:
        raise ConfigError(
            f"{job.file}: [model] freeze: the checkpoint this job would resume from, {step_dir}, "
            f"was trained with {', '.join(thawed)} frozen, so it holds no optimizer state for "
            f"them. To train them now, keep the weights and start the optimizer afresh with "
            "--checkpoint.exclude_from_loading optimizer, or start a new --dump_folder from "
            f"[checkpoint] initial_load_path = '{step_dir}'"
        )


def _check_data_state(job: Job, step_dir: Path) -> None:
    cfg = job.config
    saved = _saved_record(job, step_dir)
    ranks = _metadata_ranks(job, step_dir)
    now = job_record(cfg, job.dp_degree)
    diffs = []
    if saved.get("loader", now["loader"]) != now["loader"]:
        diffs.append(f"loader {saved['loader']!r} (this job: {now['loader']!r})")
    if now["loader"] in ENVELOPE_LOADERS and saved.get("loader", now["loader"]) == now["loader"]:
        if ranks is not None:
            raise ConfigError(
                f"{job.file}: the checkpoint this job would resume from, {step_dir}, holds "
                f"{now['loader']}'s data-loader state in an earlier release's per-rank format, "
                f"which this release cannot continue. {_WAYS_OUT}"
            )
    elif ranks is not None and ranks != now["dp_degree"]:
        diffs.append(f"data-parallel degree {ranks} (this job: {now['dp_degree']})")
    for key in ("seq_len", "local_batch_size"):
        if saved.get(key, now[key]) != now[key]:
            diffs.append(f"{key} {saved[key]} (this job: {now[key]})")
    if diffs:
        raise ConfigError(
            f"{job.file}: the checkpoint this job would resume from, {step_dir}, was saved with "
            f"{', '.join(diffs)}, so its data-loader state does not fit. {_WAYS_OUT}"
        )
    from torchtitan_ext.preflight.mixture import check_saved_mixture

    check_saved_mixture(job, step_dir)  # the same sources, read from the saved envelope
