"""Streaming text: tokens/s per core of StreamingTextDataLoader vs torchtitan 0.3.0's HuggingFaceTextDataLoader.

Both loaders stream the same local Parquet shards (``benchmarks/text_corpus.py``: long-tailed
documents, GPT-2 tokenizer) through Hugging Face ``datasets`` streaming, with the same tokenizer
file, seq_len 2048, batch 8, in one process (``num_workers=0``) so that "per core" is well defined:
the headline is tokens per **CPU second** of the process (``time.process_time``, all its threads),
plus wall-clock tokens/s. torchtitan's loader is pointed at the files by registering a
``DatasetConfig`` whose loader is ``load_dataset("parquet", data_files=..., streaming=True)`` — the
same call ours makes. Also measured: the latency of the first batch after a resume deep into an
epoch (ours re-reads, without tokenizing, the rows before the resume point).

Options (``--set key=value``): ``mb`` (40; quick 2), ``batches`` (60; quick 4), ``seq_len`` (2048),
``batch`` (8).
"""

from __future__ import annotations

import json
import statistics
import time

from benchmarks.common import BenchArgs, Row, compare
from benchmarks.text_corpus import build_corpus, corpus_files, gpt2_tokenizer_dir


def _stock_loader(corpus, tok_dir, seq_len, batch):
    from datasets import load_dataset
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets as td

    files = corpus_files(corpus)
    td.DATASETS["ext_bench_local"] = DatasetConfig(
        path=str(corpus),
        loader=lambda path: load_dataset(
            "parquet", data_files=files, split="train", streaming=True
        ),
        sample_processor=lambda s: s["text"],
    )
    cfg = td.HuggingFaceTextDataLoader.Config(dataset="ext_bench_local", dataset_path=str(corpus))
    tok = HuggingFaceTokenizer(tokenizer_path=str(tok_dir))
    return cfg.build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=seq_len, local_batch_size=batch
    )


def _our_loader(corpus, tok_dir, seq_len, batch, **kw):
    from torchtitan_ext.loaders.streaming import StreamingTextDataLoader

    cfg = StreamingTextDataLoader.Config(
        dataset_path=str(corpus / "train-*.parquet"), tokenizer_path=str(tok_dir), **kw
    )
    return cfg.build(dp_world_size=1, dp_rank=0, seq_len=seq_len, local_batch_size=batch)


def _measure(make, n_batches, repeats, warmup_batches=2):
    """Median (tokens per CPU s, tokens per wall s) over fresh loaders."""
    cpu_rates, wall_rates = [], []
    for _ in range(repeats):
        it = iter(make())
        for _ in range(warmup_batches):
            next(it)
        c0, w0 = time.process_time(), time.perf_counter()
        tokens = 0
        for _ in range(n_batches):
            x, _y = next(it)
            tokens += x["input"].numel()
        c1, w1 = time.process_time(), time.perf_counter()
        cpu_rates.append(tokens / max(c1 - c0, 1e-9))
        wall_rates.append(tokens / max(w1 - w0, 1e-9))
    return statistics.median(cpu_rates), statistics.median(wall_rates), cpu_rates


def run(args: BenchArgs) -> list[Row]:
    q = args.quick
    mb = float(args.extra.get("mb", 2 if q else 40))
    n = int(args.extra.get("batches", 4 if q else 60))
    seq_len = int(args.extra.get("seq_len", 2048))
    batch = int(args.extra.get("batch", 8))
    repeats = 1 if q else max(1, args.repeats)
    corpus = build_corpus(target_mb=mb)
    tok = gpt2_tokenizer_dir()
    info = json.loads((corpus / "info.json").read_text())
    common = {
        "mb": mb,
        "documents": info["documents"],
        "seq_len": seq_len,
        "batch": batch,
        "batches": n,
    }

    rows: list[Row] = []
    ours_cpu, ours_wall, s1 = _measure(lambda: _our_loader(corpus, tok, seq_len, batch), n, repeats)
    stock_cpu, stock_wall, s2 = _measure(
        lambda: _stock_loader(corpus, tok, seq_len, batch), n, repeats
    )
    noshuf_cpu, _, s3 = _measure(
        lambda: _our_loader(corpus, tok, seq_len, batch, shuffle=False), n, repeats
    )
    rows.append(
        Row(
            "tokens/s per core: ours (streaming_text)",
            ours_cpu,
            "tok/cpu-s",
            samples=s1,
            info=common,
            target=">= 1x",
            higher_is_better=True,
        )
    )
    rows.append(Row("tokens/s per core: torchtitan HF loader", stock_cpu, "tok/cpu-s", samples=s2))
    rows.append(Row("tokens/s per core: ours, shuffle off", noshuf_cpu, "tok/cpu-s", samples=s3))
    rows.append(Row("wall tokens/s: ours", ours_wall, "tok/s"))
    rows.append(Row("wall tokens/s: torchtitan HF loader", stock_wall, "tok/s"))
    compare(
        rows, "tokens/s per core: ours (streaming_text)", "tokens/s per core: torchtitan HF loader"
    )
    compare(rows, "tokens/s per core: ours, shuffle off", "tokens/s per core: torchtitan HF loader")
    compare(rows, "wall tokens/s: ours", "wall tokens/s: torchtitan HF loader")
    r0 = rows[0]
    r0.met = r0.ratio is not None and r0.ratio >= 1.0

    # Resume latency: save after k batches, time a fresh loader's first batch after loading.
    k = max(2, n)
    lat = []
    for _ in range(repeats):
        dl = _our_loader(corpus, tok, seq_len, batch)
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = json.loads(json.dumps(dl.state_dict()))
        t0 = time.perf_counter()
        dl2 = _our_loader(corpus, tok, seq_len, batch)
        dl2.load_state_dict(state)
        next(iter(dl2))
        lat.append(time.perf_counter() - t0)
        consumed = state["dp_rank_0"]["dataset_state"]["consumed"]
    rows.append(
        Row(
            "resume: first batch after load (ours)",
            statistics.median(lat) * 1e3,
            "ms",
            higher_is_better=False,
            samples=lat,
            info={"after_batches": k, "rows_reread_at_most": consumed},
        )
    )
    return rows
