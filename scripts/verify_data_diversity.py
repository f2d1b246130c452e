#!/usr/bin/env python
"""Check a text loader for repeated data: duplicate rate (hashes of token windows; source
documents when the loader emits document ids), per-epoch coverage of the source, first duplicate.
Exits 1 above the thresholds.

Examples::

    # our streaming loader on the embedded corpus, 2 ranks x 2 persistent workers, 3 epochs
    python scripts/verify_data_diversity.py --ranks 2 --workers 2 --epochs 3
    # the loader configured by a train TOML ([dataloader] table, seq_len, batch size)
    python scripts/verify_data_diversity.py --config-file train_configs/streaming_text_cpu.toml --epochs 2
    # any registered loader over local files, options as --set key=value
    python scripts/verify_data_diversity.py --dataset data/train-*.parquet --tokenizer tok/ \\
        --loader streaming_text --set shuffle_buffer=64 --batches 500
    # a take(N)-style dataset rebuilt on every epoch (repeats data): flagged (exit 1)
    python scripts/verify_data_diversity.py --buggy-take-demo --workers 2 --batches 200
    # under torchrun: each process runs its rank, rank 0 merges and reports
    torchrun --nproc_per_node 2 scripts/verify_data_diversity.py --workers 2 --epochs 2

The logic lives in :mod:`torchtitan_ext.text.diversity` (importable, tested). A progress bar on
stderr counts the batches read (``-q/--quiet``: none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from torchtitan_ext.text.diversity import BuggyTakeDataset, DiversityMeter, run_check


class _Counted:
    """Iterates a loader unchanged and ticks a progress bar once per batch."""

    def __init__(self, loader: Any, bar: Any) -> None:
        self.loader, self.bar = loader, bar

    def __iter__(self):
        for batch in self.loader:
            self.bar.update(1)
            yield batch

    def __getattr__(self, name: str) -> Any:  # get_stats() (the loader's epoch), close()
        return getattr(self.loader, name)


def _with_progress(make, bar):
    return lambda rank: _Counted(make(rank), bar)


def _say(a: argparse.Namespace, msg: str) -> None:
    if not a.quiet:
        print(msg, file=sys.stderr, flush=True)


def _coerce(v: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v  # a plain string (paths, names)


def _embedded() -> tuple[str, str]:
    from torchtitan_ext.data.embedded import ensure_embedded_data

    d = ensure_embedded_data()
    return str(d / "train-*.parquet"), str(d / "tokenizer")


def build_factory(a: argparse.Namespace, ranks: int):
    """``(make_loader(rank), num_documents, workers)`` from the command line."""
    if a.buggy_take_demo:
        import glob

        from torch.utils.data import DataLoader

        from torchtitan_ext.text.streaming import resolve_local_files

        src, tok = (a.dataset, a.tokenizer) if a.dataset else _embedded()
        files = (
            resolve_local_files(src)[1]
            if not any(c in src for c in "*?[")
            else sorted(glob.glob(src))
        )

        def make(rank: int):
            ds = BuggyTakeDataset(files, tok, a.seq_len, take=a.take, seed=42)
            return DataLoader(
                ds,
                batch_size=a.batch_size,
                num_workers=a.workers,
                persistent_workers=a.workers > 0,
            )

        return make, a.take, a.workers

    from torchtitan_ext.registry import get_loader_config

    if a.config_file:
        from torchtitan_ext.config import load_config

        cfg = load_config(a.config_file)
        lcfg = cfg.dataloader
        seq_len, batch = cfg.training.seq_len, cfg.training.local_batch_size
        tokenizer: Any = cfg.hf_assets_path
    else:
        src, tok = (a.dataset, a.tokenizer) if a.dataset else _embedded()
        if tok is None:
            raise SystemExit("--tokenizer is required with --dataset")
        lcfg = get_loader_config(a.loader)(dataset_path=src)
        if hasattr(lcfg, "tokenizer_path"):
            lcfg.tokenizer_path = tok
        seq_len, batch, tokenizer = a.seq_len, a.batch_size, tok
    names = {f.name for f in dataclasses.fields(lcfg)}
    overrides = dict(kv.split("=", 1) for kv in a.set)
    if a.workers is not None:
        overrides["num_workers"] = str(a.workers)
    if "emit_doc_ids" in names:
        overrides["emit_doc_ids"] = "true"
    if "persistent_workers" in names:
        overrides.setdefault("persistent_workers", "true")
    for k, v in overrides.items():
        if k not in names:
            raise SystemExit(f"--set {k}: {type(lcfg).__qualname__} has no field {k!r}")
        setattr(lcfg, k, _coerce(v))
    workers = int(getattr(lcfg, "num_workers", 0))

    def make(rank: int):
        return lcfg.build(
            dp_rank=rank,
            dp_world_size=ranks,
            tokenizer=tokenizer,
            seq_len=seq_len,
            local_batch_size=batch,
        )

    probe = make(0)
    num_docs = probe.num_documents() if hasattr(probe, "num_documents") else None
    if hasattr(probe, "close"):
        probe.close()
    return make, num_docs, workers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_argument_group("what to run")
    src.add_argument("--config-file", help="train TOML: its [dataloader], seq_len and batch size")
    src.add_argument("--dataset", help="local file / dir / glob (default: the embedded corpus)")
    src.add_argument("--tokenizer", help="tokenizer dir or tokenizer.json (with --dataset)")
    src.add_argument("--loader", default="streaming_text", help="registry name (with --dataset)")
    src.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="loader Config field override (JSON values)",
    )
    src.add_argument(
        "--buggy-take-demo",
        action="store_true",
        help="run a take(N)-style dataset that repeats data instead (expected to FAIL)",
    )
    src.add_argument("--take", type=int, default=100, help="N of the demo's take(N)")
    run = p.add_argument_group("how long / how wide")
    run.add_argument("--ranks", type=int, default=1, help="DP ranks simulated in this process")
    run.add_argument("--workers", type=int, default=None, help="DataLoader workers per rank")
    run.add_argument("--seq-len", type=int, default=128)
    run.add_argument("--batch-size", type=int, default=8)
    g = run.add_mutually_exclusive_group()
    g.add_argument("--batches", type=int, help="batches per rank")
    g.add_argument("--epochs", type=int, help="run until every rank x worker finished E epochs")
    thr = p.add_argument_group("thresholds")
    thr.add_argument("--max-dup-rate", type=float, default=0.0)
    thr.add_argument("--min-coverage", type=float, default=1.0, help="for complete epochs")
    p.add_argument("--json", help="also write the report as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    a = p.parse_args(argv)
    if a.batches is None and a.epochs is None:
        a.batches = 200
    if a.buggy_take_demo and a.workers is None:
        a.workers = 2

    from torchtitan_ext import logs

    logs.install()  # the same quiet log as training (torchdata's set_vital notice ...)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_ids = None
    ranks = a.ranks
    if world > 1:  # torchrun: one rank per process
        import torch.distributed as dist

        dist.init_process_group("gloo")
        ranks, rank_ids = world, [dist.get_rank()]
    _say(a, "verify_data_diversity: building the loader(s) ...")
    make, num_docs, workers = build_factory(a, ranks)
    from tqdm import tqdm

    goal = f"{a.epochs} epoch(s)" if a.epochs is not None else f"{a.batches} batches per rank"
    _say(a, f"verify_data_diversity: reading {goal} from {ranks} rank(s) x {workers} worker(s)")
    with tqdm(
        total=a.batches * len(rank_ids or range(ranks)) if a.batches else None,
        unit="batch",
        disable=a.quiet or (rank_ids is not None and rank_ids[0] != 0),
        file=sys.stderr,
    ) as bar:
        meter = run_check(
            _with_progress(make, bar),
            ranks,
            workers,
            batches=a.batches,
            epochs=a.epochs,
            num_documents=num_docs,
            rank_ids=rank_ids,
        )
    if world > 1:
        import torch.distributed as dist

        states: list[Any] = [None] * world
        dist.all_gather_object(states, meter.state())
        meter = DiversityMeter.merged(states, num_docs)
        if dist.get_rank() != 0:
            dist.destroy_process_group()
            return 0
        dist.destroy_process_group()
    rep = meter.report()
    what = "buggy take() demo" if a.buggy_take_demo else (a.config_file or a.loader)
    print(f"== data diversity: {what}, {ranks} rank(s) x {workers} worker(s) ==")
    print(rep.format())
    fails = rep.failures(a.max_dup_rate, a.min_coverage)
    if a.epochs is not None and not a.buggy_take_demo and len(rep.complete_epochs) < a.epochs:
        fails.append(f"only {len(rep.complete_epochs)} complete epochs observed, wanted {a.epochs}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**rep.to_dict(), "failures": fails}, f, indent=2)
    if fails:
        print("FAIL: " + "; ".join(fails))
        return 1
    print(
        "OK: no duplicates" + (", full coverage of every complete epoch" if rep.doc_starts else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
