"""Shared text-benchmark corpus: the embedded public-domain text enlarged to tens of MB of
long-tailed documents, written once as Parquet shards (plus the offline GPT-2 tokenizer).

Not a benchmark case itself (the runner lists modules with ``run``; this one has none).

Documents. Paragraphs of the two embedded texts (*War and Peace*, tiny Shakespeare) are grouped
into documents whose target length is drawn from a seeded lognormal with median
``median_chars`` (1200 chars ~ 400 GPT-2 tokens on this text) and sigma 1.1, so most documents are a few
hundred tokens and a tail goes past 8k tokens (measured at 40 MB: 16k documents, median 407
tokens, 0.2 % of documents past 8k, max ~29k; 12.5 % of all tokens lie beyond the first 2049 of
their document), like web pre-training corpora. Each document starts at a random paragraph (wrapping around the source),
so the ~4.4 MB of source text is enlarged without consecutive documents repeating each other. Everything is
deterministic in ``seed``; the shards are written to ``$TORCHTITAN_EXT_CACHE`` (or
``~/.cache/torchtitan_ext``) under a name that encodes the parameters, via a temporary directory
and an atomic rename.

Tokenizer. GPT-2's byte-level BPE, built offline from ``benchmarks/data/gpt2/`` (OpenAI's
``encoder.json`` / ``vocab.bpe``, MIT licence; see ``DATA_LICENSES.md``) with
``<|endoftext|>`` (id 50256) as BOS and EOS — GPT-2 has no separate BOS. Saved as a
``tokenizer.json`` + ``tokenizer_config.json`` directory that both our :class:`TextTokenizer` and
torchtitan's ``HuggingFaceTokenizer`` load, so every loader uses the very same tokenizer.

Reuse (the streaming benchmark does)::

    from benchmarks.text_corpus import build_corpus, gpt2_tokenizer_dir
    corpus_dir = build_corpus(target_mb=40)          # train-*.parquet, column "text"
    tok_dir = gpt2_tokenizer_dir()
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from torchtitan_ext.data.cachedir import build_atomically, cache_root
from torchtitan_ext.data.embedded import SOURCES, source_text, write_parquet_shards

GPT2_DIR = Path(__file__).resolve().parent / "data" / "gpt2"
GPT2_EOT = "<|endoftext|>"
CORPUS_VERSION = 2


def _paragraphs() -> list[str]:
    out: list[str] = []
    for name in SOURCES:
        text = source_text(name).replace("\r\n", "\n")
        out.extend(p.strip() for p in text.split("\n\n") if p.strip())
    return out


def corpus_documents(
    target_mb: float = 40.0, seed: int = 0, median_chars: int = 1200, sigma: float = 1.1
) -> list[str]:
    """Deterministic long-tailed documents totalling about ``target_mb`` MB of text."""
    paras = _paragraphs()
    rng = random.Random(seed)
    target = int(target_mb * 1e6)
    docs: list[str] = []
    total = 0
    while total < target:
        want = max(40, int(rng.lognormvariate(0.0, sigma) * median_chars))
        i = rng.randrange(len(paras))
        parts: list[str] = []
        size = 0
        while size < want:
            p = paras[i % len(paras)]
            parts.append(p)
            size += len(p) + 2
            i += 1
        doc = "\n\n".join(parts)
        docs.append(doc)
        total += len(doc)
    return docs


def build_corpus(
    target_mb: float = 40.0,
    seed: int = 0,
    num_shards: int = 8,
    rows_per_group: int = 256,
    root: str | Path | None = None,
) -> Path:
    """Write (once) and return the corpus directory of ``train-*.parquet`` shards."""

    root = Path(root) if root is not None else cache_root()
    final = (
        root
        / f"bench_text_v{CORPUS_VERSION}_{target_mb:g}MB_s{seed}_n{num_shards}_g{rows_per_group}"
    )

    def fill(tmp: Path) -> None:
        docs = corpus_documents(target_mb, seed)
        write_parquet_shards(docs, tmp, "train", num_shards, rows_per_group)
        info = {"documents": len(docs), "chars": sum(map(len, docs)), "seed": seed}
        (tmp / "info.json").write_text(json.dumps(info, indent=2))

    return build_atomically(final, fill, {"version": CORPUS_VERSION})


def gpt2_tokenizer_dir(root: str | Path | None = None) -> Path:
    """A tokenizer dir (tokenizer.json + tokenizer_config.json) with GPT-2's BPE, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    root = Path(root) if root is not None else cache_root()
    final = root / "gpt2_tokenizer_v1"

    def fill(tmp: Path) -> None:
        bpe = models.BPE.from_file(
            str(GPT2_DIR / "gpt2_vocab.json"), str(GPT2_DIR / "gpt2_merges.txt")
        )
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([GPT2_EOT])
        tok.save(str(tmp / "tokenizer.json"))
        cfg = {
            "bos_token": GPT2_EOT,
            "eos_token": GPT2_EOT,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": 1 << 20,
            "tokenizer_class": "GPT2TokenizerFast",
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))

    return build_atomically(final, fill)


def corpus_files(corpus_dir: Path) -> list[str]:
    return [str(p) for p in sorted(Path(corpus_dir).glob("train-*.parquet"))]
