"""torchtitan-ext-export: a saved checkpoint step as a Hugging Face model directory.

    torchtitan-ext-export --checkpoint outputs/job/checkpoint --step 500 --out hf/my-model
    python -m torchtitan_ext.export ...   (the same)

Reads the model weights of ``CHECKPOINT/step-N`` (a torchtitan DCP checkpoint: a full training
checkpoint with optimizer and loader state, or a model-only one; only the weights are read) and
writes what ``from_pretrained`` loads: safetensors, ``config.json`` and the tokenizer, image
processor and chat template of the training job.

What the checkpoint holds comes from the job record ``ExtTrainer`` writes into every step
directory (``torchtitan_ext_job.json``: model, flavor, HF config, processor directory), not
from a config file: the record is what the weights were trained as, a config file only what
someone means to train next. ``--processor`` replaces the recorded processor directory (moved,
or another machine). Exit codes: 0 written, 2 bad input (one line ``export error: ...``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from torchtitan_ext.preflight.checkpoint import RECORD

_DTYPES = ("float32", "bfloat16", "float16")
EXPORTABLE = ("qwen3_vl",)
"""Model specs the export knows (``model.name`` in the job record)."""


class _Bad(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan-ext-export",
        description="Write a saved torchtitan checkpoint step (qwen3_vl) as a Hugging Face model "
        "directory: safetensors weights, config.json, tokenizer, processor and chat template. "
        "Optimizer, scheduler and data-loader state are left out.",
        epilog="The model, its HF config and the processor come from the job record the trainer "
        "writes into every step directory. Exit codes: 0 written; 2 bad input (one line "
        "'export error: ...').",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="the job's checkpoint folder (DUMP_FOLDER/checkpoint), holding step-N directories",
    )
    p.add_argument("--step", required=True, type=int, metavar="N", help="the step to export")
    p.add_argument(
        "--out",
        required=True,
        metavar="HF_DIR",
        help="output directory (created; must be empty or absent)",
    )
    p.add_argument(
        "--processor",
        metavar="DIR",
        default=None,
        help="processor directory to copy (tokenizer, preprocessor_config.json, chat template); "
        "default: the one recorded with the checkpoint (the one that tokenized the training data)",
    )
    p.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="cast the floating-point weights; default: keep the checkpoint's dtype",
    )
    return p


def _steps(folder: Path) -> list[int]:
    from torchtitan_ext.preflight.checkpoint import saved_steps

    return saved_steps(folder)


def _model_record(step_dir: Path) -> dict[str, Any]:
    path = step_dir / RECORD
    if not path.is_file():
        raise _Bad(
            f"{step_dir} has no {RECORD} (written by torchtitan_ext's trainer with each save): "
            "not a checkpoint of a torchtitan_ext job, so its model is unknown"
        )
    try:
        model = json.loads(path.read_text()).get("model")
    except (ValueError, OSError, AttributeError) as e:
        raise _Bad(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(model, dict):
        raise _Bad(
            f"{path} does not name the model (saved by an older torchtitan_ext); "
            "it cannot be exported"
        )
    if model.get("name") not in EXPORTABLE or "hf_config" not in model:
        raise _Bad(
            f"{step_dir} holds a {model.get('name')!r} model; torchtitan-ext-export converts "
            f"{', '.join(EXPORTABLE)} checkpoints"
        )
    return model


def _check(ns: argparse.Namespace) -> tuple[Path, dict[str, Any], Path, Path]:
    folder = Path(ns.checkpoint)
    if not folder.is_dir():
        raise _Bad(f"--checkpoint {folder}: no such directory")
    step_dir = folder / f"step-{ns.step}"
    if not step_dir.is_dir():
        steps = _steps(folder)
        raise _Bad(
            f"--step {ns.step}: no checkpoint step-{ns.step} in {folder} "
            f"(saved steps: {', '.join(map(str, steps)) or 'none'})"
        )
    model = _model_record(step_dir)
    if not (step_dir / ".metadata").is_file():
        hf = (step_dir / "config.json").is_file()
        raise _Bad(
            f"{step_dir} is not a DCP checkpoint (no .metadata)"
            + ("; it is already a Hugging Face directory: load it as is" if hf else "")
        )
    processor = Path(ns.processor or model["processor"])
    if not (processor / "preprocessor_config.json").is_file():
        how = "--processor" if ns.processor else f"the processor recorded in {RECORD}"
        raise _Bad(
            f"{how}, {processor}, is not a processor directory (no preprocessor_config.json); "
            "pass --processor DIR"
        )
    out = Path(ns.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise _Bad(f"--out {out} exists and is not an empty directory")
    return step_dir, model, processor, out


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from torchtitan_ext.models.qwen3_vl.export import ExportError, export_dcp

    try:
        step_dir, model, processor, out = _check(ns)
        import torch

        dtype = getattr(torch, ns.dtype) if ns.dtype else None
        files = export_dcp(step_dir, out, model["hf_config"], processor, dtype)
    except (_Bad, ExportError) as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {out} ({model['name']} {model.get('flavor')}, step {ns.step}): {', '.join(files)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
