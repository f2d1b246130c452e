"""Tests for the parallel byte-level BPE trainer (torchtitan_ext.tokenizer)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import traceback

import pytest
import regex
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import torchtitan_ext
from torchtitan_ext.tokenizer import merge, pretok_pool, pretokenize
from torchtitan_ext.tokenizer.bpe import (
    BPEStats,
    count_file_pretokens,
    count_pretokens,
    iter_chunk_bounds,
    iter_chunks,
    merge_words,
    native_available,
    train_bpe,
    train_bpe_from_texts,
)
from torchtitan_ext.tokenizer.export import (
    bytes_to_unicode,
    read_gpt2_merges,
    read_gpt2_vocab,
    save_gpt2_files,
    save_tokenizer_dir,
    save_tokenizer_json,
    tiktoken_encoding,
)

from .conftest import REPO, TEST_DATA

DATA = TEST_DATA / "bpe"
EOT = "<|endoftext|>"
ENGINES = ["python"] + (["native"] if native_available() else [])


# GPT-2's pre-tokenization pattern exactly as OpenAI published it (gpt-2 src/encoder.py), spelled
# here on purpose rather than imported: the reference must not share code with the module.
OPENAI_GPT2_PAT = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def reference_pretokens(text: str, specials: list[str]) -> collections.Counter:
    """Independent reference for the pre-token counts: cut at the special tokens (longest first,
    left to right), then count OpenAI's GPT-2 pattern matches in each piece."""
    pieces = [text]
    if specials:
        alternation = "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True))
        pieces = regex.split(alternation, text)
    return collections.Counter(m for piece in pieces for m in OPENAI_GPT2_PAT.findall(piece))


def _reference():
    merges = read_gpt2_merges(DATA / "train-bpe-reference-merges.txt")
    vocab = read_gpt2_vocab(DATA / "train-bpe-reference-vocab.json")
    return vocab, merges


def naive_merges(word_counts: dict[bytes, int], num_merges: int) -> list[tuple[bytes, bytes]]:
    """CS336's textbook algorithm: recount every pair each step; max by (count, a, b)."""
    words = {tuple(bytes([b]) for b in w): c for w, c in word_counts.items()}
    merges = []
    for _ in range(num_merges):
        pairs: collections.Counter = collections.Counter()
        for w, c in words.items():
            for p in zip(w, w[1:], strict=False):  # adjacent pairs
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        new_words: collections.Counter = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += c
        words = new_words
    return merges


def _as_bytes(pairs: list[tuple[int, int]]) -> list[tuple[bytes, bytes]]:
    tok = [bytes([i]) for i in range(256)]
    out = []
    for a, b in pairs:
        out.append((tok[a], tok[b]))
        tok.append(tok[a] + tok[b])
    return out


# ---------------------------------------------------------------------------------------------
# CS336 reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("workers", [0, 2])
def test_reference_merges_and_vocab(engine, workers):
    ref_vocab, ref_merges = _reference()
    vocab, merges = train_bpe(DATA / "corpus.en", 500, [EOT], workers, engine=engine)
    assert merges == ref_merges
    assert set(vocab) == set(ref_vocab)
    assert set(vocab.values()) == set(ref_vocab.values())
    # id layout: specials first, then the 256 bytes, then merges in order
    assert vocab[0] == EOT.encode()
    assert [vocab[1 + i] for i in range(256)] == [bytes([i]) for i in range(256)]
    assert [vocab[257 + k] for k in range(len(merges))] == [a + b for a, b in merges]


def test_exported_from_package():
    assert torchtitan_ext.train_bpe is train_bpe


def test_stops_when_pairs_run_out(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("ab ab<|endoftext|>ab", encoding="utf-8")
    vocab, merges = train_bpe(p, 1000, [EOT], 0)
    # pre-tokens: "ab", " ab", "ab" -> merges (a,b) and (" ", ab); nothing else pairs up
    assert merges == [(b"a", b"b"), (b" ", b"ab")]
    assert len(vocab) == 1 + 256 + 2


# ---------------------------------------------------------------------------------------------
# Merge engines: naive reference == python == native (tie rule included)
# ---------------------------------------------------------------------------------------------

_words = st.dictionaries(
    st.binary(min_size=1, max_size=8).map(lambda b: bytes(x % 4 + 97 for x in b)),
    st.integers(1, 5),
    min_size=1,
    max_size=25,
)


@settings(max_examples=80, deadline=None)
@given(_words, st.integers(0, 30))
def test_engines_match_naive(word_counts, num_merges):
    expected = naive_merges(word_counts, num_merges)
    words, counts = list(word_counts), list(word_counts.values())
    for engine in ENGINES:
        assert _as_bytes(merge_words(words, counts, num_merges, engine)) == expected


def test_tie_break_prefers_greatest_bytes_pair():
    # every pair has count 1: the greatest (bytes, bytes) wins, compared element-wise
    assert naive_merges({b"ab": 1, b"ba": 1, b"ac": 1}, 1) == [(b"b", b"a")]
    for engine in ENGINES:
        got = _as_bytes(merge_words([b"ab", b"ba", b"ac"], [1, 1, 1], 1, engine))
        assert got == [(b"b", b"a")]
    # a prefix sorts before its extension: (b"a", b"bc") < (b"ab", b"c") because b"a" < b"ab"
    words = {b"xabc": 10, b"yabc": 10}
    for engine in ENGINES:
        assert _as_bytes(merge_words(list(words), list(words.values()), 6, engine)) == (
            naive_merges(words, 6)
        )


@pytest.mark.skipif(not native_available(), reason="C merge loop not built")
def test_native_and_python_identical_on_real_text(tmp_path):
    text = (DATA / "corpus.en").read_text("utf-8") + (DATA / "tinystories_sample.txt").read_text(
        "utf-8"
    )
    p = tmp_path / "t.txt"
    p.write_text(text, encoding="utf-8")
    a = train_bpe(p, 2000, [EOT], 0, engine="native")
    b = train_bpe(p, 2000, [EOT], 0, engine="python")
    assert a == b


def test_fallback_without_native(monkeypatch):
    monkeypatch.setattr(merge, "_native", None)
    assert not native_available()
    st_ = BPEStats()
    _, merges = train_bpe(DATA / "corpus.en", 300, [EOT], 0, stats=st_)
    assert st_.engine == "python"
    assert merges == _reference()[1][:43]
    with pytest.raises(RuntimeError, match="not built"):
        merge_words([b"ab"], [1], 1, engine="native")


def test_merge_words_input_errors():
    if native_available():
        with pytest.raises(TypeError, match=r"words\[0\]"):
            merge_words(["ab"], [1], 1, engine="native")
        with pytest.raises(ValueError, match="differ in length"):
            merge_words([b"ab"], [1, 2], 1, engine="native")
        assert merge_words([], [], 5, engine="native") == []
        with pytest.raises(ValueError, match="negative"):
            merge_words([b"ab"], [-1], 1, engine="native")
    with pytest.raises(ValueError, match="negative"):
        merge_words([b"ab"], [-1], 1, engine="python")
    for engine in ENGINES:  # words with count 0 never produce a merge
        assert merge_words([b"ab", b"cd"], [0, 2], 5, engine) == [(99, 100)]
    with pytest.raises(ValueError, match="engine"):
        merge_words([b"ab"], [1], 1, engine="rust")


# ---------------------------------------------------------------------------------------------
# Special tokens
# ---------------------------------------------------------------------------------------------


def test_specials_never_inside_other_tokens():
    specials = [EOT, "the"]  # "the" is frequent: it must still never be learned inside a token
    vocab, merges = train_bpe(DATA / "tinystories_sample.txt", 700, specials, 0)
    assert vocab[0] == EOT.encode() and vocab[1] == b"the"
    others = [t for i, t in vocab.items() if i >= len(specials)]
    for s in specials:
        assert not any(s.encode() in t for t in others), s
    assert all(b"<|" not in a + b or b"|>" not in a + b for a, b in merges)


def test_specials_split_before_pretokenization():
    c = count_pretokens("a<|endoftext|> b<|endoftext|><|endoftext|>", [EOT])
    assert c == collections.Counter({"a": 1, " b": 1})
    # longest special wins at a position
    specials = ["<|a|>", "<|a|><|b|>"]
    assert count_pretokens("x<|a|><|b|>y", specials) == collections.Counter({"x": 1, "y": 1})
    assert count_pretokens("x<|a|> <|b|>y", specials) == collections.Counter(
        {"x": 1, " <|": 1, "b": 1, "|>": 1, "y": 1}
    )


@pytest.mark.parametrize(
    "name,expected",
    [
        # "<|endoftext|>\n\ntesting!": the whitespace run before a letter leaves its last "\n"
        # to the next match ("\s+(?!\S)"), so two single newlines
        (
            "special_token_double_newlines_non_whitespace.txt",
            {"\n": 2, "testing": 1, "!": 1},
        ),
        ("special_token_trailing_newlines.txt", {"\n\n": 1}),  # "<|endoftext|>\n\n"
    ],
)
def test_special_token_fixtures(name, expected):
    text = (DATA / name).read_text("utf-8")
    assert reference_pretokens(text, [EOT]) == expected  # the reference agrees with the hand count
    assert count_pretokens(text, [EOT]) == expected
    for workers in (0, 2):
        assert count_file_pretokens(DATA / name, [EOT], workers) == expected


@pytest.mark.parametrize("specials", [[], [EOT]])
def test_pretokens_match_the_openai_pattern_on_real_text(specials):
    text = "\n".join(
        (DATA / n).read_text("utf-8")
        for n in ("corpus.en", "tinystories_sample.txt", "german.txt", "address.txt")
    )
    want = reference_pretokens(text, specials)
    assert count_pretokens(text, specials) == want
    assert ("<|" in want) == (not specials)  # the sample's 5 EOTs split out, or plain text


# ---------------------------------------------------------------------------------------------
# Chunking: any chunk size gives identical counts and merges
# ---------------------------------------------------------------------------------------------

_PIECES = [
    EOT, "<|eot|>", "<|endoftext|><|eot|>", "a", "b", "the", " ", "  ", "\n", "\n\n", "\t",
    "\r\n", "'s", "'ll", "'", "é", "中", "🙂", "1", "23", ".", "!?",
    "\u00a0", "\u3000", "\u2028",
]  # fmt: skip
# [EOT, EOT + "the"]: a special that extends another one (a cut after the shorter would be wrong
# if the longer one straddles the read boundary); EOT + "\nthe": a special containing a newline
# after a printable byte (the safe-newline cut must then be disabled).
_SPECIAL_SETS = [
    [],
    [EOT],
    [EOT, "<|eot|>", "<|endoftext|><|eot|>"],
    [EOT, EOT + "the"],
    [EOT + "\nthe"],
]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.sampled_from(_PIECES), max_size=120),
    st.integers(1, 40),
    st.sampled_from(range(len(_SPECIAL_SETS))),
)
@example(["a", EOT, "the", "b"], 1, 3)
@example(["a", EOT, "\n", "the", "b"], 1, 4)
@example(["a.", "\n\n", "b"], 1, 0)
def test_any_chunk_size_same_counts(tmp_path, pieces, chunk, si):
    specials = _SPECIAL_SETS[si]
    text = "".join(pieces)
    data = text.encode("utf-8")
    p = tmp_path / "c.txt"
    p.write_bytes(data)
    with open(p, "rb") as f:
        chunks = list(iter_chunks(f, specials, chunk))
    assert b"".join(chunks) == data
    # the pool's offset-based cutter makes exactly the same cuts as the streaming reader
    assert [data[a:b] for a, b in iter_chunk_bounds(data, specials, chunk)] == chunks
    for c in chunks:
        c.decode("utf-8")  # never cut inside a UTF-8 character
    assert count_file_pretokens(p, specials, 0, chunk_bytes=chunk) == reference_pretokens(
        text, specials
    )


@pytest.mark.parametrize("chunk", [1, 97, 4096, 1 << 20])
def test_chunk_size_identical_merges(chunk):
    path = DATA / "tinystories_sample.txt"
    base = train_bpe(path, 600, [EOT], 0)
    assert train_bpe(path, 600, [EOT], 0, chunk_bytes=chunk) == base


def test_pool_matches_in_process(tmp_path):
    text = "\n".join(
        (DATA / n).read_text("utf-8") for n in ("corpus.en", "tinystories_sample.txt", "german.txt")
    )
    p = tmp_path / "mix.txt"
    p.write_text(text, encoding="utf-8")
    expected = reference_pretokens(text, [EOT])
    for workers, chunk in [(1, None), (2, 1000), (3, 20000)]:
        st_ = BPEStats()
        assert count_file_pretokens(p, [EOT], workers, chunk, stats=st_) == expected
        assert st_.bytes_read == len(text.encode()) and st_.chunks >= 1
    assert train_bpe(p, 800, [EOT], 2, chunk_bytes=5000) == train_bpe(p, 800, [EOT], 0)


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_invalid_utf8_names_file_and_offset(tmp_path, workers):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"hello world" + EOT.encode() + b"ok \xff\xfe tail")
    err = ValueError if workers == 0 else RuntimeError
    with pytest.raises(err, match=r"bad\.txt: invalid UTF-8 at byte offset 27"):
        train_bpe(p, 300, [EOT], workers)


def _die(*args, **kwargs):
    os._exit(3)


@pytest.mark.skipif(sys.platform != "linux", reason="needs the fork start method")
def test_dead_worker_is_reported(tmp_path, monkeypatch):
    # forked workers inherit the patched module: the first chunk kills its worker
    monkeypatch.setattr(pretokenize, "count_pretokens", _die)
    p = tmp_path / "x.txt"
    p.write_text(("some text " * 2000 + EOT) * 20, encoding="utf-8")
    with pytest.raises(RuntimeError, match=r"worker died \(exit code 3\)"):
        count_file_pretokens(p, [EOT], 2, chunk_bytes=4096, mp_context="fork")


def _bounds_then_fail(mm, special_tokens, chunk_bytes):
    yield 0, 10
    raise OSError("the disk went away")


@pytest.mark.skipif(sys.platform != "linux", reason="needs the fork start method")
def test_reader_thread_error_is_reraised_with_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setattr(pretok_pool, "iter_chunk_bounds", _bounds_then_fail)
    p = tmp_path / "x.txt"
    p.write_text(("some text " * 200 + EOT) * 4, encoding="utf-8")
    with pytest.raises(OSError, match="the disk went away") as ei:
        count_file_pretokens(p, [EOT], 2, chunk_bytes=4096, mp_context="fork")
    frames = [f.name for f in traceback.extract_tb(ei.value.__traceback__)]
    assert "_bounds_then_fail" in frames and "feed" in frames  # the reader thread's frames
    assert any("'bpe-reader'" in n for n in ei.value.__notes__)


def test_argument_errors(tmp_path):
    p = tmp_path / "x.txt"
    p.write_text("abc", encoding="utf-8")
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(p, 256, [EOT])
    with pytest.raises(ValueError, match="listed twice"):
        train_bpe(p, 300, [EOT, EOT])
    with pytest.raises(TypeError, match="single string"):
        train_bpe(p, 300, EOT)
    with pytest.raises(ValueError, match="non-empty"):
        train_bpe(p, 300, [""])
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        train_bpe(tmp_path / "nope.txt", 300, [EOT])
    with pytest.raises(ValueError, match="num_workers"):
        train_bpe(p, 300, [EOT], -1)
    with pytest.raises(ValueError, match="engine"):
        train_bpe(p, 300, [EOT], engine="rust")


# ---------------------------------------------------------------------------------------------
# Export: tokenizer.json == tiktoken with the same ranks
# ---------------------------------------------------------------------------------------------

_SAMPLES = [
    "Hello, world! It's a test: don't we'll they've I'm you're.",
    "  leading spaces, trailing  \n\n\n  and\ttabs\r\n",
    "Unicode: héllo wörld, 中文字, emoji 🙂🚀, numbers 12345 6.7",
    f"doc one{EOT}doc two {EOT} three{EOT}",
    "",
    "''''' '''s  's",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    text = "\n".join(
        (DATA / n).read_text("utf-8") for n in ("corpus.en", "tinystories_sample.txt", "german.txt")
    )
    p = tmp_path_factory.mktemp("bpe") / "train.txt"
    p.write_text(text, encoding="utf-8")
    specials = [EOT, "<|pad|>"]
    vocab, merges = train_bpe(p, 1200, specials, 0)
    return vocab, merges, specials


def test_tokenizer_json_matches_tiktoken(trained, tmp_path):
    from tokenizers import Tokenizer

    vocab, merges, specials = trained
    path = save_tokenizer_json(vocab, merges, specials, tmp_path)
    assert path == tmp_path / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    enc = tiktoken_encoding(vocab, specials)
    texts = _SAMPLES + [
        (DATA / n).read_text("utf-8")
        for n in (
            "address.txt",
            "german.txt",
            "tinystories_sample.txt",
            "special_token_double_newlines_non_whitespace.txt",
        )
    ]
    for text in texts:
        ids = tok.encode(text).ids
        assert ids == enc.encode(text, allowed_special="all"), text[:60]
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert b"".join(vocab[i] for i in ids) == text.encode("utf-8")
    assert tok.encode(EOT + "<|pad|>").ids == [0, 1]
    assert tok.get_vocab_size() == len(vocab)
    doc = json.loads(path.read_text("utf-8"))
    assert doc["pre_tokenizer"]["type"] == "ByteLevel"
    assert doc["pre_tokenizer"]["add_prefix_space"] is False
    assert {t["content"]: t["id"] for t in doc["added_tokens"] if t["special"]} == {
        EOT: 0,
        "<|pad|>": 1,
    }


def test_gpt2_files_roundtrip(trained, tmp_path):
    vocab, merges, _ = trained
    vpath, mpath = save_gpt2_files(vocab, merges, tmp_path)
    assert read_gpt2_vocab(vpath) == vocab
    assert read_gpt2_merges(mpath) == merges
    assert len(bytes_to_unicode()) == 256 and len(set(bytes_to_unicode().values())) == 256


def test_export_rejects_unknown_special(trained, tmp_path):
    vocab, merges, _ = trained
    with pytest.raises(ValueError, match="not in the vocabulary"):
        save_tokenizer_json(vocab, merges, ["<|nope|>"], tmp_path / "t.json")


def test_train_from_texts_equals_file(tmp_path):
    docs = (DATA / "tinystories_sample.txt").read_text("utf-8").split(EOT)
    p = tmp_path / "joined.txt"
    p.write_text(EOT.join(docs), encoding="utf-8")
    specials = [EOT, "<|pad|>"]
    assert train_bpe_from_texts(docs, 600, specials, 0) == train_bpe(p, 600, specials, 0)
    with pytest.raises(ValueError, match="separator"):
        train_bpe_from_texts(docs, 600, [], 0)
    with pytest.raises(ValueError, match="separator"):
        train_bpe_from_texts(docs, 600, specials, 0, separator="\n")


def test_tokenizer_dir_loads_in_torchtitan_and_transformers(trained, tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from transformers import AutoTokenizer

    vocab, merges, specials = trained
    out = save_tokenizer_dir(vocab, merges, specials, tmp_path, eos_token=EOT, pad_token="<|pad|>")
    tt = HuggingFaceTokenizer(tokenizer_path=str(out))
    assert tt.eos_id == 0 and tt.bos_id is None
    assert tt.get_vocab_size() == len(vocab)
    enc = tiktoken_encoding(vocab, specials)
    text = _SAMPLES[0]
    assert tt.encode(text) == enc.encode(text)  # no BOS/EOS added by default
    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf(text)["input_ids"] == enc.encode(text)
    assert hf.eos_token_id == 0 and hf.pad_token_id == 1
    with pytest.raises(ValueError, match="bos_token"):
        save_tokenizer_dir(vocab, merges, specials, tmp_path / "x", bos_token="<s>")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_writes_tokenizer_and_summary(tmp_path, capsys):
    from torchtitan_ext.tokenizer.cli import main

    out = tmp_path / "tok"
    rc = main(
        [
            "--input", str(DATA / "corpus.en"), "--vocab-size", "500",
            "--special-token", EOT, "--out", str(out), "--workers", "0",
            "--eos-token", EOT, "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "pre-tokenization" in printed and "merging" in printed
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["vocab_size"] == 500 and summary["merges"] == 243
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == EOT
    assert read_gpt2_merges(out / "merges.txt") == _reference()[1]
    assert (out / "tokenizer.json").is_file()


def test_cli_errors(tmp_path, capsys):
    from torchtitan_ext.tokenizer.cli import main

    base = ["--vocab-size", "300", "--out", str(tmp_path / "o"), "--quiet"]
    assert main(["--input", str(tmp_path / "missing.txt"), *base]) == 1
    assert "missing.txt" in capsys.readouterr().err
    assert main(["--input", str(DATA / "corpus.en"), "--eos-token", "<x>", *base]) == 2


def test_script_wrapper_help():
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_tokenizer.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "--vocab-size" in r.stdout


@pytest.mark.slow
def test_benchmark_quick_smoke():
    from benchmarks import bpe as bench
    from benchmarks.common import BenchArgs

    rows = bench.run(BenchArgs(quick=True))
    names = [r.case for r in rows]
    assert any("HF" in n for n in names) and any("2 worker" in n for n in names)
    assert all(r.value > 0 for r in rows)
