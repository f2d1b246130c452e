"""The embedded corpus: deterministic, long-tailed, clean text, and a working tokenizer."""

from __future__ import annotations

import pyarrow.parquet as pq

from torchtitan_ext.data.cachedir import MANIFEST
from torchtitan_ext.data.embedded import (
    corpus_documents,
    ensure_embedded_data,
    source_text,
)
from torchtitan_ext.text.tokenize import TextTokenizer


def test_shipped_texts_are_clean():
    for name in ("war_and_peace.txt.gz", "tinyshakespeare.txt.gz"):
        t = source_text(name)
        assert "Ã" not in t and "Â" not in t, name
    assert "Emperor Alexander Pávlovich" in source_text("war_and_peace.txt.gz")


def test_corpus_is_deterministic_and_long_tailed():
    a, b = corpus_documents(), corpus_documents()
    assert a == b
    lens = sorted(len(d) for d in a)
    assert lens[len(lens) // 2] < 3000 < lens[-1] // 10  # median ~1.6 kB, tail >30 kB


def test_embedded_dir_has_disjoint_train_and_val_and_a_tokenizer(tmp_path):
    d = ensure_embedded_data(tmp_path)
    train = [
        t for p in sorted(d.glob("train-*.parquet")) for t in pq.read_table(p)["text"].to_pylist()
    ]
    val = [t for p in sorted(d.glob("val-*.parquet")) for t in pq.read_table(p)["text"].to_pylist()]
    assert train and val and not set(train) & set(val)
    assert train + val == corpus_documents()
    tok = TextTokenizer.from_path(d / "tokenizer")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2) and tok.vocab_size == 2048
    text = "Pávlovich said: “Well, Prince!”"
    assert tok.decode(tok.encode(text, add_bos=False)) == text
    built = (d / MANIFEST).stat()
    assert ensure_embedded_data(tmp_path) == d
    again = (d / MANIFEST).stat()
    assert (again.st_ino, again.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)  # built once
