"""BPE training: train_bpe vs HF tokenizers' BpeTrainer; pre-tokenization at 1 vs 2 workers.

Corpus: the public-domain text shipped in ``torchtitan_ext/data`` (*War and Peace* + tiny
Shakespeare, ~4.4 MB) cut into documents of ~20 paragraphs joined by ``<|endoftext|>``; to
reach >= 5 MB the documents are repeated in a seeded shuffled order, upper-cased (so the repeat
adds new words instead of only doubling counts). Deterministic; written once to a temp file.

Options (``--set key=value``): ``mb`` corpus size (default 5.2; quick: 0.3), ``vocab`` (10000;
quick: 1000), ``workers`` worker count for the "ours" total (default 2).
"""

from __future__ import annotations

import gzip
import os
import random
import statistics
import tempfile
import time
from importlib import resources

from benchmarks.common import BenchArgs, Row, compare, median_time

SPECIAL = "<|endoftext|>"
_SOURCES = ("war_and_peace.txt.gz", "tinyshakespeare.txt.gz")


def _shipped_texts() -> list[str]:
    texts = []
    for name in _SOURCES:
        ref = resources.files("torchtitan_ext.data").joinpath(name)
        if ref.is_file():
            with ref.open("rb") as f:
                texts.append(gzip.decompress(f.read()).decode("utf-8"))
    if not texts:
        raise FileNotFoundError(
            f"benchmarks/bpe.py needs the shipped texts {_SOURCES} in torchtitan_ext/data"
        )
    return texts


def build_corpus(path: str, target_bytes: int, seed: int = 0) -> int:
    """Write the benchmark corpus to ``path``; returns its size in bytes."""
    docs: list[str] = []
    for text in _shipped_texts():
        paras = [p for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]
        docs += ["\n\n".join(paras[i : i + 20]) for i in range(0, len(paras), 20)]
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    order = list(range(len(docs)))
    rep = 0
    while size < target_bytes:
        for i in order:
            doc = docs[i] if rep == 0 else docs[i].upper()
            out.append(doc)
            size += len(doc.encode("utf-8")) + len(SPECIAL)
            if size >= target_bytes:
                break
        rep += 1
        rng.shuffle(order)
    data = SPECIAL.join(out).encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _idle_fraction(seconds: float = 1.0) -> float | None:
    """Fraction of all CPUs idle over ``seconds`` (Linux /proc/stat; None elsewhere).

    Recorded next to the 1-vs-2-worker rows: on a shared box another job on one core turns a
    1.8x speed-up into ~1.0x, and this says whether that happened."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v), v[3] + v[4]

    try:
        t1, i1 = snap()
        time.sleep(seconds)
        t2, i2 = snap()
    except OSError:  # no /proc (not Linux): the diagnostic is simply absent
        return None
    return (i2 - i1) / max(1, t2 - t1)


def _hf_train(path: str, vocab: int) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([path], trainer)
    return tok.get_vocab_size()


def run(args: BenchArgs) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench_bpe_") as tmp:
        return _run(args, os.path.join(tmp, "corpus.txt"))


def _run(args: BenchArgs, path: str) -> list[Row]:
    from torchtitan_ext.tokenizer.bpe import (
        BPEStats,
        count_file_pretokens,
        native_available,
        train_bpe,
    )

    mb = float(args.extra.get("mb", 0.3 if args.quick else 5.2))
    vocab = int(args.extra.get("vocab", 1000 if args.quick else 10000))
    workers = int(args.extra.get("workers", 2))
    repeats = 1 if args.quick else args.repeats
    warmup = 0 if args.quick else args.warmup

    size = build_corpus(path, int(mb * 1e6))
    info = {"corpus_bytes": size, "vocab_size": vocab, "native": native_available()}

    rows: list[Row] = []
    # Pre-tokenization first (the rows most sensitive to other jobs on a shared box), 1 vs 2
    # workers interleaved (1, 2, 1, 2, ...): the load drifts between runs, and
    # interleaving exposes both settings to the same drift.
    idle_before = _idle_fraction()
    samples_w: dict[int, list[float]] = {1: [], 2: []}
    cpu_w: dict[int, list[BPEStats]] = {1: [], 2: []}
    for rep in range(warmup + repeats):
        for w in (1, 2):
            st = BPEStats()
            t0 = time.perf_counter()
            count_file_pretokens(path, [SPECIAL], num_workers=w, stats=st)
            if rep >= warmup:
                samples_w[w].append(time.perf_counter() - t0)
                cpu_w[w].append(st)
    for w in (1, 2):
        rows.append(
            Row(
                f"ours pre-tokenize+count, {w} worker(s)",
                statistics.median(samples_w[w]),
                "s",
                higher_is_better=False,
                samples=samples_w[w],
                info={
                    "worker_cpu_s_max": statistics.median(
                        x.extra["worker_cpu_s_max"] for x in cpu_w[w]
                    ),
                    "worker_cpu_s_sum": statistics.median(
                        x.extra["worker_cpu_s_sum"] for x in cpu_w[w]
                    ),
                    "cpu_idle_before": idle_before,
                    "load_avg_1min": os.getloadavg()[0],
                },
            )
        )
    r2 = compare(rows, rows[-1].case, rows[-2].case)
    if not args.quick:  # targets are about the 5 MB / 10k setting, not the smoke run
        r2.target = ">=1.8x"
        r2.met = r2.ratio >= 1.8
    # CPU-time view, immune to other processes: the 1-worker CPU work over the busiest worker's
    # CPU time at 2 workers is the speed-up two free cores would give (plus the serial tail).
    r2.info["cpu_critical_path_speedup"] = (
        rows[-2].info["worker_cpu_s_sum"] / r2.info["worker_cpu_s_max"]
    )
    t, samples = median_time(
        lambda: count_file_pretokens(path, [SPECIAL], num_workers=0), repeats, warmup
    )
    rows.append(
        Row(
            "ours pre-tokenize+count, in-process (0)",
            t,
            "s",
            higher_is_better=False,
            samples=samples,
        )
    )
    hf_s, hf_samples = median_time(lambda: _hf_train(path, vocab), repeats, warmup)
    hf_row = Row(
        "HF tokenizers BpeTrainer (total)",
        hf_s,
        "s",
        higher_is_better=False,
        samples=hf_samples,
        info={**info, "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM")},
    )
    rows.append(hf_row)

    last: dict[str, object] = {}

    def ours(engine: str) -> None:
        st = BPEStats()
        v, m = train_bpe(path, vocab, [SPECIAL], workers, engine=engine, stats=st)
        last[engine] = (m, st)

    engines = ["native", "python"] if native_available() else ["python"]
    for engine in engines:
        t, samples = median_time(lambda e=engine: ours(e), repeats, warmup)
        m, st = last[engine]
        row = Row(
            f"ours train_bpe {engine} merges, {workers} workers",
            t,
            "s",
            higher_is_better=False,
            samples=samples,
            info={
                "pretokenize_s": st.pretokenize_s,
                "merge_s": st.merge_s,
                "merges": st.merges,
                "unique_pretokens": st.unique_pretokens,
            },
        )
        rows.append(row)
        compare(rows, row.case, hf_row.case)
        if engine == engines[0] and not args.quick:
            row.target = "ratio>=1.0"  # time(ours) <= time(HF)
            row.met = row.ratio >= 1.0
    if len(engines) == 2:
        rows[-1].info["identical_merges_to_native"] = last["native"][0] == last["python"][0]

    return rows
