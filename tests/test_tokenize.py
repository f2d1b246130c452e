"""TextTokenizer: the tiktoken engine gives exactly the ids of `tokenizers`, or is not used."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tiktoken  # noqa: F401  - pinned dependency: a missing one fails here, never skips
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from tests.conftest import REPO
from torchtitan_ext.data.embedded import EOS_TOKEN, ensure_embedded_data, iter_texts
from torchtitan_ext.text.tokenize import PROBE_TEXTS, TextTokenizer


@pytest.fixture(scope="module")
def embedded():
    return ensure_embedded_data()


def test_engines_agree_on_every_embedded_document(embedded):
    fast = TextTokenizer.from_path(embedded / "tokenizer", engine="tiktoken")
    ref = TextTokenizer.from_path(embedded / "tokenizer", engine="hf")
    assert fast.engine == "tiktoken" and ref.engine == "hf"
    docs = list(iter_texts(embedded))
    import pyarrow.parquet as pq

    for p in sorted(embedded.glob("val-*.parquet")):
        docs += pq.read_table(p).column("text").to_pylist()
    a = fast.encode_arrays(docs, add_bos=True, add_eos=True)
    b = ref.encode_arrays(docs, add_bos=True, add_eos=True)
    assert len(a) == len(b) == len(docs)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert np.array_equal(x, y), f"document {i} differs"
    assert a[0][0] == fast.bos_id and a[0][-1] == fast.eos_id
    # int32 from both engines, with and without BOS/EOS (what the packers buffer and checkpoint)
    no_ends = [fast.encode_arrays(docs[:3], add_bos=False), ref.encode_arrays(docs[:3], False)]
    assert {x.dtype for x in a + b + no_ends[0] + no_ends[1]} == {np.dtype(np.int32)}


def test_gpt2_tokenizer_uses_tiktoken_and_agrees():
    gpt2 = REPO / "benchmarks" / "data" / "gpt2"
    bpe = models.BPE.from_file(str(gpt2 / "gpt2_vocab.json"), str(gpt2 / "gpt2_merges.txt"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast, ref = TextTokenizer(tok, None, None), TextTokenizer(tok, None, None, engine="hf")
    assert fast.engine == "tiktoken"
    texts = list(PROBE_TEXTS) + [t[:5000] for t in list(iter_texts(ensure_embedded_data()))[:50]]
    assert fast.encode_batch(texts, add_bos=False) == ref.encode_batch(texts, add_bos=False)


def test_special_token_strings_in_text_are_plain_text(embedded):
    for engine in ("tiktoken", "hf"):
        t = TextTokenizer.from_path(embedded / "tokenizer", engine=engine)
        ids = t.encode(f"before {EOS_TOKEN} after", add_bos=False)
        assert t.eos_id not in ids, engine


def test_callers_tokenizer_object_is_not_modified(embedded):
    tok = Tokenizer.from_file(str(embedded / "tokenizer" / "tokenizer.json"))
    TextTokenizer(tok, 0, 1)
    assert tok.encode_special_tokens is False


def test_not_byte_level_falls_back_with_a_reason():
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = TextTokenizer(tok, None, None)
    assert t.engine == "hf" and "not BPE" in t.engine_reason
    with pytest.raises(ValueError, match="tiktoken engine not applicable"):
        TextTokenizer(tok, None, None, engine="tiktoken")


def test_normalizer_disqualifies_tiktoken(embedded):
    tok = Tokenizer.from_file(str(embedded / "tokenizer" / "tokenizer.json"))
    tok.normalizer = normalizers.Lowercase()
    t = TextTokenizer(tok, 0, 1)
    assert t.engine == "hf" and "normalizer" in t.engine_reason


def test_verification_mismatch_switches_to_tokenizers(embedded, caplog):
    t = TextTokenizer.from_path(embedded / "tokenizer")
    ref = TextTokenizer.from_path(embedded / "tokenizer", engine="hf")
    assert t.engine == "tiktoken"
    real = t._tt.encode
    t._tt.encode = lambda text: real(text)[::-1].copy()  # a deliberately wrong engine
    texts = ["a first document, long enough to differ when reversed", "second one"]
    with caplog.at_level(logging.WARNING):
        got = t.encode_batch(texts)
    assert got == ref.encode_batch(texts)  # the answer is still right
    assert t.engine == "hf" and "disagree" in caplog.text
