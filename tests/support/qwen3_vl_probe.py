"""Probes of the qwen3_vl model *as torchtitan's trainer builds and calls it* (tests only).

    python -m tests.support.qwen3_vl_probe pack   OUT.json --config-file X.toml [--section.key v ...]
    python -m tests.support.qwen3_vl_probe logits OUT.json --config-file X.toml [...]   (torchrun ok)

Both build ``ExtTrainer`` from the config exactly like ``python -m torchtitan_ext.train`` (same
config layering, cpu_compat and preflight, same model build / parallelize / init), then feed
batches the way ``Trainer.forward_backward_step`` does: tensors to the device, ``post_dataloading_process``,
``model_parts[0](inputs, **extra_kwargs)``, ``loss_fn(pred, labels, global_valid_tokens)``.

- ``pack``: a pack with several samples and images, run packed, then each of its samples alone
  (cut out of the pack by token ranges, with only its own images); writes the worst logit
  difference and the packed vs per-sample losses.
- ``logits``: loads the HF checkpoint in ``hf_assets_path`` through the trainer's checkpointer,
  runs one pack, and compares with ``transformers``' ``from_pretrained`` of the same directory on
  the same pack (``batch_format = "hf"`` collate); every rank writes ``OUT.rank{r}.json``.

Test-only flavors (``tests.support.qwen3_vl_flavors``) join the flavor table of this process.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from tests.support.qwen3_vl_flavors import TEST_FLAVORS
from torchtitan_ext.models.qwen3_vl.flavors import FLAVORS

FLAVORS.update(TEST_FLAVORS)  # this process only


def build_trainer(argv: list[str]) -> Any:
    """``--config-file X [--section.key v ...]`` -> the trainer, built as the launcher does."""
    from torchtitan_ext.train import build_trainer as build
    from torchtitan_ext.train import parse_launcher_args

    ns, rest = parse_launcher_args(argv)
    return build(ns.config_file, rest)


def run_model(trainer: Any, input_dict: dict, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``Trainer.forward_backward_step``'s forward and loss, without the backward."""
    input_dict = {
        k: v.to(trainer.device) if torch.is_tensor(v) else v for k, v in input_dict.items()
    }
    labels = labels.to(trainer.device)
    inputs, labels, extra = trainer.post_dataloading_process(input_dict, labels)
    with torch.no_grad():
        pred = trainer.model_parts[0](inputs, **extra)
        n = (labels != -100).sum()
        loss, _ = trainer.loss_fn(pred, labels, n)
    return pred.float(), float(loss) * int(n)  # summed loss (the trainer divides by the count)


def split_pack(pack: dict[str, torch.Tensor], image_pad: int, merge: int) -> list[dict]:
    """Each sample of a cached pack as its own one-sample pack (tokens, labels, positions,
    and only the pixels / grids of its own images). Independent of the cache's own code."""
    out, tok, img, row = [], 0, 0, 0
    grids = pack["image_grid_thw"]
    for n in pack["seq_lens"].tolist():
        ids = pack["input_ids"][tok : tok + n]
        pads = int((ids == image_pad).sum())
        k, covered = img, 0
        while covered < pads:
            covered += int(grids[k].prod()) // (merge * merge)
            k += 1
        rows = int(grids[img:k].prod(dim=-1).sum())
        out.append(
            {
                "input_ids": ids.clone(),
                "labels": pack["labels"][tok : tok + n].clone(),
                "position_ids": pack["position_ids"][:, tok : tok + n].clone(),
                "seq_lens": torch.tensor([n]),
                "pixel_u8": pack["pixel_u8"][row : row + rows].clone(),
                "image_grid_thw": grids[img:k].clone(),
                "num_tokens": torch.tensor(n),
            }
        )
        tok, img, row = tok + n, k, row + rows
    return out


def pick_pack(cache: Any, min_samples: int = 2) -> int:
    """The first pack with at least ``min_samples`` samples and an image in two of them."""
    for i in range(len(cache)):
        p = cache.pack(i, copy_pixels=True)
        if len(p["seq_lens"]) >= min_samples and p["image_grid_thw"].shape[0] >= 2:
            return i
    raise RuntimeError("no pack with several samples and images in the cache")


def probe_pack(trainer: Any) -> dict[str, Any]:
    loader = trainer.dataloader
    cache = loader.dataset.cache
    special = loader.special_tokens
    i = pick_pack(cache)
    pack = cache.pack(i)
    samples = split_pack(pack, special["image_pad_id"], loader.pixel_norm.merge_size)
    logits, loss = run_model(trainer, *loader.collate([pack]))
    worst, alone_loss, o = 0.0, 0.0, 0
    for s in samples:
        n = int(s["num_tokens"])
        alone, s_loss = run_model(trainer, *loader.collate([s]))
        # the last token's target lies in the next sample (-100 in both runs): compare all n
        worst = max(worst, (logits[0, o : o + n] - alone[0, :n]).abs().max().item())
        alone_loss += s_loss
        o += n
    return {
        "pack": i,
        "samples": len(samples),
        "images": int(pack["image_grid_thw"].shape[0]),
        "max_abs_dlogit": worst,
        "packed_loss_sum": loss,
        "alone_loss_sum": alone_loss,
        "logit_scale": logits.abs().max().item(),
    }


def probe_logits(trainer: Any) -> dict[str, Any]:
    from transformers import AutoModelForImageTextToText

    from torchtitan_ext.vl.collate import collate_hf

    if not trainer.checkpointer.load():
        raise RuntimeError("the checkpointer loaded nothing (no HF weights configured?)")
    loader = trainer.dataloader
    cache = loader.dataset.cache
    pack = cache.pack(pick_pack(cache))
    logits, _ = run_model(trainer, *loader.collate([pack]))
    hf = AutoModelForImageTextToText.from_pretrained(
        trainer.config.hf_assets_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    batch = collate_hf([pack], pad_id=loader.collate.pad_id, norm=loader.pixel_norm)
    with torch.no_grad():
        ref = hf(**batch).logits.float()
    return {
        "max_abs_dlogit": (logits.cpu() - ref).abs().max().item(),
        "logit_scale": ref.abs().max().item(),
        "hf_class": type(hf).__name__,
    }


def main(argv: list[str]) -> int:
    what, out, rest = argv[0], argv[1], argv[2:]
    trainer = build_trainer(rest)
    try:
        result = {"pack": probe_pack, "logits": probe_logits}[what](trainer)
    finally:
        trainer.close()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = out if rank == 0 and what == "pack" else f"{out}.rank{rank}.json"
    with open(path, "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
