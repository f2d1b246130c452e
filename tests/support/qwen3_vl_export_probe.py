"""Train a qwen3_vl job and keep the trained model's logits at every checkpoint save (tests only).

    python -m tests.support.qwen3_vl_export_probe OUT.pt --config-file X.toml [--section.key v ...]

Builds ``ExtTrainer`` exactly as the launcher does (``qwen3_vl_probe.build_trainer``), picks one
cached pack, and wraps this trainer's ``checkpointer.save`` (which writes the job record) so that
after each save the model, as it was saved, runs that pack through the trainer's own input path.
Then it trains. Rank 0 writes ``{"logits": {step: [1, L, V] float32}, "batch": the same pack as
transformers' forward kwargs}`` to OUT.pt, so a test compares any exported directory's
``from_pretrained`` model with the weights the trainer held when it saved that step.
"""

from __future__ import annotations

import sys

import torch

from tests.support.qwen3_vl_probe import build_trainer, pick_pack, run_model


def main(argv: list[str]) -> int:
    from torchtitan_ext.vl.collate import collate_hf

    out, rest = argv[0], argv[1:]
    trainer = build_trainer(rest)
    logits: dict[int, torch.Tensor] = {}
    try:
        loader = trainer.dataloader
        cache = loader.dataset.cache
        pack = cache.pack(pick_pack(cache), copy_pixels=True)
        ckpt = trainer.checkpointer
        save = ckpt.save

        def save_and_probe(curr_step: int, last_step: bool = False) -> bool:
            saved = save(curr_step, last_step)
            if saved:
                logits[curr_step] = run_model(trainer, *loader.collate([pack]))[0].cpu()
            return saved

        ckpt.save = save_and_probe
        trainer.train()
        batch = collate_hf([pack], pad_id=loader.collate.pad_id, norm=loader.pixel_norm)
    finally:
        trainer.close()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        torch.save({"logits": logits, "batch": batch}, out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
