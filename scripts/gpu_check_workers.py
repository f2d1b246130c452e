"""The measurements ``scripts/gpu_check.py`` runs each in a process of its own
(``gpu_check.py --worker KIND RESULT.json ...``): they import torch, transformers and the trainer,
which the parent never does, so a crash or an out-of-memory in one leaves the others' rows."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml"


def patch_embed(res: str) -> None:
    import torch
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchEmbed

    from torchtitan_ext.models.qwen3_vl import patch_embed
    from torchtitan_ext.models.qwen3_vl.flavors import flavor_config

    cfg = Qwen3VLConfig(**flavor_config("2B")).vision_config
    dev = torch.device("cuda")
    torch.manual_seed(0)
    conv = Qwen3VLVisionPatchEmbed(cfg).to(dev, torch.bfloat16)
    mm = Qwen3VLVisionPatchEmbed(cfg).to(dev, torch.bfloat16)
    mm.load_state_dict(conv.state_dict())
    patch_embed.apply(mm, "matmul")
    n = 16384
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    x = torch.randn(n, width, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def time_ms(m: torch.nn.Module) -> float:
        for _ in range(3):
            m(x).float().sum().backward()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            m(x).float().sum().backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 20 * 1e3

    with torch.no_grad():
        diff = (conv(x) - mm(x)).abs().max().item()
    doc = {"conv_ms": time_ms(conv), "matmul_ms": time_ms(mm), "max_abs_diff": diff, "patches": n}
    Path(res).write_text(json.dumps(doc))


def midsize(res: str, flavor: str, quick: bool, argv: list[str]) -> None:
    import torch

    from torchtitan_ext.models.qwen3_vl.flavors import OFFLINE_TOKEN_IDS
    from torchtitan_ext.train import build_trainer

    seq = 4096
    args = ["--model.flavor", flavor, "--training.seq_len", str(seq)]
    args += ["--training.local_batch_size", "1", "--training.mixed_precision_param", "bfloat16"]
    args += ["--dataloader.buckets", "2048", "3072", "--dataloader.normalize_on", "device"]
    args += ["--staging.enable", "--checkpoint.no-enable"]
    args += ["--dump_folder", str(Path(res).parent / f"mid_{flavor}"), "--training.steps", "1000"]

    def embedded_ids(cfg) -> None:  # the embedded processor's special-token ids
        cfg.model_spec.model.hf_config.update(OFFLINE_TOKEN_IDS)

    trainer = build_trainer(str(TINY), args + argv, edit=embedded_ids)
    mp = trainer.metrics_processor
    mp.log = lambda *a, **k: None  # no log lines (and no reset of the wait list) while timing
    it = trainer.batch_generator(trainer.dataloader)
    warmup, steps = (3, 5) if quick else (5, 20)
    step_s, wait_s, tokens = [], [], []
    cuda = torch.cuda.is_available()  # False only in the CPU smoke test of this worker
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    from torchtitan_ext.models.qwen3_vl.compile import compile_counts

    frames = []  # dynamo's frames compiled so far, before each step (0 throughout when eager)
    for _ in range(warmup + steps):
        frames.append(compile_counts()["frames"])
        mp.data_loading_times.clear()
        mp.ntokens_since_last_log = 0
        trainer.step += 1
        t0 = time.perf_counter()
        trainer.train_step(it)
        sync()
        step_s.append(time.perf_counter() - t0)
        wait_s.append(sum(mp.data_loading_times))
        tokens.append(mp.ntokens_since_last_log)
    timed = slice(warmup, None)
    step = statistics.median(step_s[timed])
    tps = statistics.median(t / s for t, s in zip(tokens[timed], step_s[timed], strict=True))
    doc = {
        "step_ms": 1e3 * step,
        "first_step_s": step_s[0],
        "mfu": 100 * mp.num_flops_per_token * tps / mp.gpu_peak_flops,
        "wait_share": 100
        * statistics.median(w / s for w, s in zip(wait_s[timed], step_s[timed], strict=True)),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "tokens": int(statistics.median(tokens[timed])),
        "steps": steps,
        "warmup": warmup,
        # frames compiled by the timed steps: a compiled run that still recompiles shows it here
        "frames_after_warmup": compile_counts()["frames"] - frames[warmup],
        "frames_total": compile_counts()["frames"],
    }
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    Path(res).write_text(json.dumps(doc))


def worker(argv: list[str]) -> int:
    """``KIND RESULT.json [FLAVOR [--quick] -- TRAINER ARGS...]`` -> writes RESULT.json."""
    kind, res = argv[0], argv[1]
    if kind == "patch_embed":
        patch_embed(res)
    else:
        rest = argv[2:]
        sep = rest.index("--") if "--" in rest else len(rest)
        flags = rest[:sep]
        midsize(res, flags[0], "--quick" in flags, rest[sep + 1 :])
    return 0
