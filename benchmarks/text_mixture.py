"""Text mixture overhead: tokens/s of a 2-source ``parquet_prefetch`` mixture vs the single-source loader on the same data.

The data is the text-loader corpus (``benchmarks/text_corpus.py``, ``mb`` MB of long-tailed
documents, 8 shards) with the GPT-2 tokenizer, B=8, T=2048, as in ``text_loaders``:

* ``single``: :class:`~torchtitan_ext.text.prefetch.PrefetchingParquetLoader` over all 8 shards;
* ``mixture``: :class:`~torchtitan_ext.text.parquet_mix.MixedParquetLoader` over the same shards
  split in two sources (shards 0-3 and 4-7, weights 1:1): two readers, two packers
  (``batch_size=1``: one row per item), the weighted draw per row and the row batcher.

What the mixture adds per batch is the draw, one ``PackedBatches.next()`` per row instead of per
batch, the rows' copy into the batch and a state with two sources; reading, tokenizing and
packing the same tokens cost the same. So the target is the same tokens/s within 3 %.

1. Throughput: each loader warmed up (``warmup`` batches) and drained for ``batches`` batches, a
   fresh loader per sample, the two alternating within each of ``repeats`` rounds
   (``benchmarks.common.interleave``); wall tokens/s and tokens per CPU-second; the ratio
   mixture/single per round gives the paired range.
2. Data-wait: a consumer at 50 % of the single loader's capacity (measured in situ) for
   ``steps`` steps (``benchmarks.common.timed_steps``): share of the loop spent in ``next()``
   and p50/p99 latency, both loaders at the same step time, alternating per round.

Options (``--set key=value``): ``mb`` (20; quick 2), ``batches`` (150; quick 10), ``steps``
(200; quick 10), ``warmup`` (10; quick 2).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import BenchArgs, Row, compare, interleave, percentile, row_from, timed_steps
from benchmarks.text_corpus import build_corpus, corpus_files, gpt2_tokenizer_dir
from torchtitan_ext.pipeline.mix import SourceSpec
from torchtitan_ext.text.parquet_mix import MixedParquetLoader
from torchtitan_ext.text.parquet_source import ParquetOptions
from torchtitan_ext.text.prefetch import PrefetchingParquetLoader
from torchtitan_ext.text.tokenize import TextTokenizer

B, T = 8, 2048


def split_corpus(corpus: Path, out: Path) -> list[SourceSpec]:
    """The corpus's shards as two sources of symlinks (first half, second half), weights 1:1."""
    files = corpus_files(corpus)
    half = len(files) // 2
    specs = []
    for name, part in (("first", files[:half]), ("second", files[half:])):
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        for f in part:
            link = d / Path(f).name
            if not link.exists():
                link.symlink_to(f)
        specs.append(SourceSpec(name=name, weight=1.0, path=str(d)))
    return specs


def _close(loader: Any) -> None:
    loader.close()
    gc.collect()


def throughput(make: Callable[[], Any], batches: int, warmup: int) -> dict[str, float]:
    loader = make()
    for _ in range(warmup):
        next(loader)
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(batches):
        next(loader)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    _close(loader)
    ntok = batches * B * T
    return {"wall_tps": ntok / wall, "cpu_tps": ntok / cpu, "s_per_batch": wall / batches}


def data_wait(make: Callable[[], Any], steps: int, warmup: int, step_s: float) -> dict[str, float]:
    loader = make()
    for _ in range(warmup):
        next(loader)
        time.sleep(step_s)
    lat, total = timed_steps(loader, steps, time.sleep, step_s)
    _close(loader)
    return {
        "wait_pct": 100.0 * sum(lat) / total,
        "p50_ms": 1e3 * percentile(lat, 50),
        "p99_ms": 1e3 * percentile(lat, 99),
    }


def run(args: BenchArgs) -> list[Row]:
    q, ex = args.quick, args.extra
    mb = float(ex.get("mb", 2 if q else 20))
    n_batches = int(ex.get("batches", 10 if q else 150))
    steps = int(ex.get("steps", 10 if q else 200))
    warm = int(ex.get("warmup", 2 if q else 10))
    reps = 1 if q else max(1, args.repeats)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    corpus = build_corpus(target_mb=mb)
    tok = TextTokenizer.from_path(str(gpt2_tokenizer_dir()))
    tmp = Path(tempfile.mkdtemp(prefix="text_mixture-"))
    specs = split_corpus(corpus, tmp)
    src = ParquetOptions(val_files="none")
    makers: dict[str, Callable[[], Any]] = {
        "single": lambda: PrefetchingParquetLoader(
            corpus, tok, seq_len=T, batch_size=B, val_files="none"
        ),
        "mixture": lambda: MixedParquetLoader(specs, tok, seq_len=T, batch_size=B, source=src),
    }
    rows: list[Row] = []
    t = interleave(
        {n: (lambda mk=mk: throughput(mk, n_batches, warm)) for n, mk in makers.items()},
        reps, 0, args.guard(max_retakes=1),
    )  # fmt: skip
    for name in makers:
        rows.append(row_from(f"tokens/s wall {name}", t[name], "tok/s", key="wall_tps",
                             group="tput", higher_is_better=True))  # fmt: skip
        rows.append(row_from(f"tokens/CPU-s {name}", t[name], "tok/cpu-s", key="cpu_tps",
                             group="tput", higher_is_better=True))  # fmt: skip
    r = compare(rows, "tokens/s wall mixture", "tokens/s wall single")
    r.target, r.met = ">= 0.97x", r.ratio >= 0.97
    compare(rows, "tokens/CPU-s mixture", "tokens/CPU-s single")

    # -------- data-wait at 50 % of the single loader's measured capacity, same step for both
    step_s = 2.0 * min(t["single"].values("s_per_batch"))
    w = interleave(
        {n: (lambda mk=mk: data_wait(mk, steps, warm, step_s)) for n, mk in makers.items()},
        max(1, reps // 2 + 1) if not q else 1, 0, args.guard(max_retakes=1),
    )  # fmt: skip
    for name in makers:
        rows.append(row_from(f"data-wait share {name} (consumer at 50 %)", w[name], "%",
                             key="wait_pct", group="wait",
                             info={"step_ms": 1e3 * step_s}))  # fmt: skip
        rows.append(row_from(f"next() p99 {name}", w[name], "ms", key="p99_ms", group="wait"))
    return rows
