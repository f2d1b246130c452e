"""Streaming text: tokens/s per core of StreamingTextDataLoader vs torchtitan 0.3.0's HuggingFaceTextDataLoader.

Both loaders stream the same local Parquet shards (``benchmarks/text_corpus.py``: long-tailed
documents, GPT-2 tokenizer) through Hugging Face ``datasets`` streaming, with the same tokenizer
file, seq_len 2048, batch 8, in one process (``num_workers=0``) so that "per core" is well defined:
the headline is tokens per **CPU second** of the process (``time.process_time``, all its threads),
plus wall-clock tokens/s. torchtitan's loader is pointed at the files by registering a
``DatasetConfig`` whose loader is ``load_dataset("parquet", data_files=..., streaming=True)`` — the
same call ours makes. The three loaders run interleaved (a fresh loader per sample, rotating
order; ``benchmarks.common.interleave``). Also measured: the latency of the first batch after a resume deep into an
epoch (ours re-reads, without tokenizing, the rows before the resume point).

Options (``--set key=value``): ``mb`` (40; quick 2), ``batches`` (60; quick 4), ``seq_len`` (2048),
``batch`` (8).
"""

from __future__ import annotations

import copy
import json
import time

from benchmarks.common import BenchArgs, Row, compare, interleave, row_from
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


def _rates(make, n_batches, warmup_batches=2):
    """One sample: a fresh loader, warm-up batches, then tokens per CPU second and per wall
    second over ``n_batches``."""

    def go() -> dict[str, float]:
        it = iter(make())
        for _ in range(warmup_batches):
            next(it)
        c0, w0 = time.process_time(), time.perf_counter()
        tokens = 0
        for _ in range(n_batches):
            x, _y = next(it)
            tokens += x["input"].numel()
        c1, w1 = time.process_time(), time.perf_counter()
        return {"cpu": tokens / max(c1 - c0, 1e-9), "wall": tokens / max(w1 - w0, 1e-9)}

    return go


def _resume(corpus, tok, seq_len, batch, k):
    """One sample: save after k batches, time a fresh loader's first batch after loading."""

    def go() -> dict[str, float]:
        dl = _our_loader(corpus, tok, seq_len, batch)
        it = iter(dl)
        for _ in range(k):
            next(it)
        state = copy.deepcopy(dl.state_dict())  # the envelope: plain values and bytes
        t0 = time.perf_counter()
        dl2 = _our_loader(corpus, tok, seq_len, batch)
        dl2.load_state_dict(state)
        next(iter(dl2))
        return {"s": time.perf_counter() - t0,
                "consumed": state["global"]["ranks"][0]["workers"][0]["consumed"]}  # fmt: skip

    return go


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

    fns = {
        "ours": _rates(lambda: _our_loader(corpus, tok, seq_len, batch), n),
        "stock": _rates(lambda: _stock_loader(corpus, tok, seq_len, batch), n),
        "noshuf": _rates(lambda: _our_loader(corpus, tok, seq_len, batch, shuffle=False), n),
    }
    t = interleave(fns, repeats, 0, args.guard(max_retakes=1))
    g = "rates"
    ours = "tokens/s per core: ours (streaming_text)"
    stock = "tokens/s per core: torchtitan HF loader"
    rows = [
        row_from(ours, t["ours"], "tok/cpu-s", key="cpu", group=g, higher_is_better=True,
                 info=common, target=">= 1x"),
        row_from(stock, t["stock"], "tok/cpu-s", key="cpu", group=g, higher_is_better=True),
        row_from("tokens/s per core: ours, shuffle off", t["noshuf"], "tok/cpu-s", key="cpu",
                 group=g, higher_is_better=True),
        row_from("wall tokens/s: ours", t["ours"], "tok/s", key="wall", group=g,
                 higher_is_better=True),
        row_from("wall tokens/s: torchtitan HF loader", t["stock"], "tok/s", key="wall", group=g,
                 higher_is_better=True),
    ]  # fmt: skip
    compare(rows, ours, stock)
    compare(rows, "tokens/s per core: ours, shuffle off", stock)
    compare(rows, "wall tokens/s: ours", "wall tokens/s: torchtitan HF loader")
    rows[0].met = rows[0].ratio is not None and rows[0].ratio >= 1.0

    # Resume latency: save after k batches, time a fresh loader's first batch after loading.
    k = max(2, n)
    r = interleave({"resume": _resume(corpus, tok, seq_len, batch, k)}, repeats, 0, args.guard())
    res = r["resume"]
    rows.append(
        row_from(
            "resume: first batch after load (ours)", res, "ms", 1e3, key="s",
            info={"after_batches": k, "rows_reread_at_most": res.results[-1]["consumed"]},
        )
    )  # fmt: skip
    return rows
