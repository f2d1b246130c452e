"""The embedded default corpus: public-domain text shipped in the wheel, turned into Parquet
shards and a locally trained tokenizer on first use. Nothing is downloaded.

Source texts (gzip, ~1.6 MB in the package): Tolstoy's *War and Peace* (Maude translation,
Project Gutenberg #2600) and "tiny Shakespeare" — both public domain.

Documents. Real pre-training corpora have long-tailed document lengths (a few hundred tokens at the
median, a tail of tens of thousands), and packing behaves very differently on such data than on
fixed-size chunks. So the corpus is cut into documents of *lognormal* target length: consecutive
paragraphs are grouped until the group reaches a length drawn from a seeded lognormal (median
~1.6 kB ≈ 400 tokens, sigma 1.1: ~2 % of documents exceed 8k tokens). Everything is deterministic.

Layout written by :func:`ensure_embedded_parquet` (in the cache directory)::

    embedded_text_v1/
      train-00000-of-00004.parquet   # column "text"; row groups of ``rows_per_group`` docs
                                     # (256 by default: the corpus has only ~1.3k documents,
                                     # and ~1k-doc groups would leave DP sharding 2 groups)
      ...
      val-00000-of-00001.parquet     # a held-out slice, never overlapping train
      tokenizer/tokenizer.json, tokenizer_config.json   (byte-level BPE, vocab 2048, trained by
                                                        torchtitan_ext.train_bpe)

The cache directory is :func:`torchtitan_ext.data.cachedir.cache_root` (``$TORCHTITAN_EXT_CACHE``,
else ``$XDG_CACHE_HOME/torchtitan_ext`` or ``~/.cache/torchtitan_ext``). Building it takes ~2 s on
a 2-core machine and happens once: the directory carries a manifest (sizes, SHA-256, build
parameters) and is rebuilt when it no longer matches it (see :mod:`torchtitan_ext.data.cachedir`).
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from torchtitan_ext.data.cachedir import build_atomically, cache_root

FORMAT_VERSION = 3  # 2: tokenizer trained by our BPE trainer; 3: double-encoded UTF-8 repaired
SOURCES = ("war_and_peace.txt.gz", "tinyshakespeare.txt.gz")
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
DEFAULT_VOCAB_SIZE = 2048


def source_text(name: str) -> str:
    """One shipped source text, decompressed (shipped clean: ``tests/test_shipped_text.py``)."""
    with resources.files("torchtitan_ext.data").joinpath(name).open("rb") as f:
        return gzip.decompress(f.read()).decode("utf-8")


def _paragraphs(text: str) -> list[str]:
    text = text.replace("\r\n", "\n")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def corpus_documents(seed: int = 0, median_chars: int = 1600, sigma: float = 1.1) -> list[str]:
    """The embedded corpus as a deterministic list of documents with long-tailed lengths."""
    by_source = documents_by_source(seed, median_chars, sigma)
    return [d for name in SOURCES for d in by_source[name]]


def documents_by_source(
    seed: int = 0, median_chars: int = 1600, sigma: float = 1.1
) -> dict[str, list[str]]:
    """:func:`corpus_documents` per source text (file name -> its documents, in order): the
    same documents, cut with the same random sequence (one generator over the sources in
    :data:`SOURCES` order), so the concatenation is exactly ``corpus_documents()``."""
    rng = random.Random(seed)
    out: dict[str, list[str]] = {}
    for name in SOURCES:
        docs: list[str] = out.setdefault(name, [])
        cur: list[str] = []
        size = 0
        target = rng.lognormvariate(0.0, sigma) * median_chars
        for para in _paragraphs(source_text(name)):
            cur.append(para)
            size += len(para) + 2
            if size >= target:
                docs.append("\n\n".join(cur))
                cur, size = [], 0
                target = rng.lognormvariate(0.0, sigma) * median_chars
        if cur:
            docs.append("\n\n".join(cur))
    return out


def write_parquet_shards(
    docs: list[str], out_dir: Path, prefix: str, num_shards: int, rows_per_group: int
) -> list[Path]:
    """Write ``docs`` round-robin-free (contiguous) into ``num_shards`` Parquet files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    per = -(-len(docs) // num_shards)
    for i in range(num_shards):
        part = docs[i * per : (i + 1) * per]
        path = out_dir / f"{prefix}-{i:05d}-of-{num_shards:05d}.parquet"
        pq.write_table(pa.table({"text": part}), path, row_group_size=rows_per_group)
        paths.append(path)
    return paths


def train_tokenizer(docs: list[str], out_dir: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train a byte-level BPE tokenizer locally with our own trainer
    (:func:`torchtitan_ext.tokenizer.bpe.train_bpe`, exact CS336/GPT-2 semantics; ~0.2 s here)
    and save it as a torchtitan / transformers-loadable directory (tokenizer.json +
    tokenizer_config.json + GPT-2 style vocab.json / merges.txt). Special token ids: BOS=0,
    EOS=1, PAD=2."""
    from torchtitan_ext.tokenizer.bpe import train_bpe_from_texts
    from torchtitan_ext.tokenizer.export import save_tokenizer_dir

    vocab, merges = train_bpe_from_texts(
        docs, vocab_size, list(SPECIAL_TOKENS), separator=EOS_TOKEN
    )
    return save_tokenizer_dir(
        vocab,
        merges,
        SPECIAL_TOKENS,
        out_dir,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
    )


def ensure_embedded_data(
    root: str | Path | None = None,
    *,
    num_shards: int = 4,
    rows_per_group: int = 256,
    val_fraction: float = 0.02,
) -> Path:
    """Build (once) and return the embedded dataset directory (Parquet + tokenizer/)."""
    root = Path(root) if root is not None else cache_root()
    final = root / f"embedded_text_v{FORMAT_VERSION}_s{num_shards}_g{rows_per_group}"
    meta = {
        "format_version": FORMAT_VERSION,
        "num_shards": num_shards,
        "rows_per_group": rows_per_group,
        "val_fraction": val_fraction,
    }

    def fill(tmp: Path) -> None:
        docs = corpus_documents()
        n_val = max(1, int(len(docs) * val_fraction))
        # The validation split is the *last* documents, in a separate file: never in train.
        train_docs, val_docs = docs[:-n_val], docs[-n_val:]
        write_parquet_shards(train_docs, tmp, "train", num_shards, rows_per_group)
        write_parquet_shards(val_docs, tmp, "val", 1, rows_per_group)
        train_tokenizer(train_docs, tmp / "tokenizer")
        info = {
            "format_version": FORMAT_VERSION,
            "documents": {"train": len(train_docs), "val": len(val_docs)},
            "sources": list(SOURCES),
        }
        (tmp / "info.json").write_text(json.dumps(info, indent=2))

    return build_atomically(final, fill, meta)


CORPORA = {"war_and_peace": "war_and_peace.txt.gz", "shakespeare": "tinyshakespeare.txt.gz"}
"""The embedded corpora by name: ``dataset_path`` / ``[[dataloader.sources]] path`` =
``"embedded:<name>"`` reads one of them alone (:func:`ensure_embedded_corpus`)."""

EMBEDDED_PREFIX = "embedded:"


def ensure_embedded_corpus(
    name: str,
    root: str | Path | None = None,
    *,
    num_shards: int = 2,
    rows_per_group: int = 64,
    val_fraction: float = 0.02,
) -> Path:
    """Build (once) and return the Parquet directory of one embedded corpus (``name`` a key of
    :data:`CORPORA`): its documents of :func:`documents_by_source` (the same ones the default
    embedded dataset holds), the last ``val_fraction`` in ``val-*.parquet``, the rest in
    ``num_shards`` train shards of ``rows_per_group``-document row groups (small groups: one
    corpus has only a few hundred documents and every DP rank needs a row group). No tokenizer:
    the default embedded dataset's (:func:`embedded_tokenizer_dir`) covers both corpora."""
    if name not in CORPORA:
        raise ValueError(
            f"unknown embedded corpus {name!r}: use one of "
            + ", ".join(f"'{EMBEDDED_PREFIX}{k}'" for k in CORPORA)
        )
    root = Path(root) if root is not None else cache_root()
    final = root / f"embedded_{name}_v{FORMAT_VERSION}_s{num_shards}_g{rows_per_group}"
    meta = {
        "format_version": FORMAT_VERSION,
        "corpus": name,
        "num_shards": num_shards,
        "rows_per_group": rows_per_group,
        "val_fraction": val_fraction,
    }

    def fill(tmp: Path) -> None:
        docs = documents_by_source()[CORPORA[name]]
        n_val = max(1, int(len(docs) * val_fraction))
        write_parquet_shards(docs[:-n_val], tmp, "train", num_shards, rows_per_group)
        write_parquet_shards(docs[-n_val:], tmp, "val", 1, rows_per_group)
        info = {
            "format_version": FORMAT_VERSION,
            "documents": {"train": len(docs) - n_val, "val": n_val},
            "sources": [CORPORA[name]],
        }
        (tmp / "info.json").write_text(json.dumps(info, indent=2))

    return build_atomically(final, fill, meta)


def resolve_embedded(path: str) -> str:
    """``"embedded:<name>"`` -> that corpus's directory (built on first use); any other path
    unchanged."""
    if isinstance(path, str) and path.startswith(EMBEDDED_PREFIX):
        return str(ensure_embedded_corpus(path[len(EMBEDDED_PREFIX) :]))
    return path


def embedded_tokenizer_dir(root: str | Path | None = None) -> Path:
    return ensure_embedded_data(root) / "tokenizer"


def iter_texts(path: str | Path) -> Iterator[str]:
    """Iterate the ``text`` column of every train shard of an embedded dataset dir (tests, tools)."""
    import pyarrow.parquet as pq

    for p in sorted(Path(path).glob("train-*.parquet")):
        yield from pq.read_table(p, columns=["text"]).column("text").to_pylist()
