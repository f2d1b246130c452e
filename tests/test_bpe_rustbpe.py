"""The C pre-tokenizer fast path (``_pretok.c``) gives exactly the ``regex`` path's pre-tokens,
hence identical merges and vocab; the benchmark's rustbpe rows and Heaps-law corpus."""

from __future__ import annotations

import collections
import random

import pytest
import regex
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torchtitan_ext.tokenizer import pretokenize, scanner
from torchtitan_ext.tokenizer.bpe import count_file_pretokens, count_pretokens, train_bpe
from torchtitan_ext.tokenizer.export import read_gpt2_merges

from .conftest import TEST_DATA

DATA = TEST_DATA / "bpe"
EOT = "<|endoftext|>"

needs_native = pytest.mark.skipif(
    not pretokenize.native_pretokenizer_available(), reason="C pre-tokenizer not built"
)

# OpenAI's published GPT-2 pattern, spelled here on purpose: the reference shares no code with
# the module (neither its pattern nor its character-class table).
_OPENAI = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def _reference(text: str) -> collections.Counter:
    return collections.Counter(_OPENAI.findall(text))


# Characters chosen for the scanner's branches: contractions and near-misses, the ASCII space
# before each class, whitespace of several widths (\x1c-\x1f and \x85 are \s in regex, \u200b is
# not), letters/numbers outside ASCII (Nl, No, Nd), combining marks and symbols ("other").
_PIECES = [
    "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'l", "'r", "'", "''", "' s",
    " ", "  ", "   ", "\n", "\n\n", "\r\n", "\t", "\x0b", "\x0c", "\x1c", "\x85", "\u00a0",
    "\u2028", "\u3000", "\u200b", " \n", "\n ",
    "a", "the", "Zoë", "é", "ß", "中文", "ǅ", "\u0301", "1", "42", "²", "Ⅻ", "٣", "½",
    ".", "!?", "--", "🙂", "$", "@", "\u00ad", "\ufeff",
]  # fmt: skip


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=60))
@example(["'s", "'s", " ", "'ll"])
@example(["\u3000", "\u3000", "a"])
@example([" ", "\u00a0", "1"])
@example(["\n", " ", "a"])
def test_scanner_equals_openai_pattern(pieces):
    text = "".join(pieces)
    assert count_pretokens(text, [], pretokenizer="native") == _reference(text)


@needs_native
def test_code_points_are_classified_as_regex_does():
    # Each code point in a run, after the ASCII space, between a letter and a digit, and next
    # to whitespace: a class the table got wrong changes the pre-tokens. Every code point below
    # U+3400 (all the scripts with case, the digits of most scripts, every \s character, the
    # punctuation and symbol blocks) and every 31st above (CJK, supplementary planes): ~50k,
    # all 1.1M would take ~10 s of the regex reference.
    cps = [c for c in range(0x110000) if c < 0x3400 or c % 31 == 0]
    cps = [c for c in cps if not 0xD800 <= c < 0xE000]
    text = "".join(f" {c}{c}x{c}1\n{c}" for c in map(chr, cps))
    assert count_pretokens(text, [], pretokenizer="native") == _reference(text)


@needs_native
@pytest.mark.parametrize("workers", [0, 2])
def test_cs336_fixtures_identical_merges_and_vocab(workers):
    ref_merges = read_gpt2_merges(DATA / "train-bpe-reference-merges.txt")
    native = train_bpe(DATA / "corpus.en", 500, [EOT], workers, pretokenizer="native")
    assert native[1] == ref_merges
    assert native == train_bpe(DATA / "corpus.en", 500, [EOT], workers, pretokenizer="regex")
    path = DATA / "tinystories_sample.txt"
    assert train_bpe(path, 800, [EOT], workers, pretokenizer="native") == train_bpe(
        path, 800, [EOT], workers, pretokenizer="regex"
    )


def _random_corpus(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    alphabet = "aaeeiioouu" + "bcdfghklmnprstvwyz" + "éßüçñ中文ΩЖ" + "0123456789²٣"
    words = ["".join(rng.choices(alphabet, k=rng.randint(1, 9))) for _ in range(3000)]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", "'s ", "'ll ", " '", "\t", "\u00a0",
            "\u3000", "!? ", " 🙂 ", EOT, "\r\n", "   \n"]  # fmt: skip
    out = []
    for _ in range(n_words):
        out.append(rng.choice(words) if rng.random() < 0.9 else str(rng.randint(0, 99999)))
        out.append(rng.choice(seps))
    return "".join(out)


@needs_native
@pytest.mark.parametrize("seed", [0, 1])
def test_random_corpus_identical_counts_merges_and_vocab(tmp_path, seed):
    text = _random_corpus(seed, 40_000)
    p = tmp_path / "r.txt"
    p.write_text(text, encoding="utf-8")
    want = collections.Counter(m for doc in text.split(EOT) for m in _OPENAI.findall(doc))
    for workers in (0, 2):
        assert count_file_pretokens(p, [EOT], workers, chunk_bytes=7000) == want
    regex_path = train_bpe(p, 1500, [EOT], 0, pretokenizer="regex")
    assert train_bpe(p, 1500, [EOT], 0, pretokenizer="native") == regex_path
    assert train_bpe(p, 1500, [EOT], 2, chunk_bytes=5000, pretokenizer="native") == regex_path


def test_lone_surrogates_fall_back_to_regex():
    # not from a file (a file is decoded as strict UTF-8), but a str may hold them
    text = "ab\ud800cd 'll \udfff"
    assert count_pretokens(text, [EOT], pretokenizer="native") == _reference(text)


def test_pretokenizer_argument_errors(tmp_path, monkeypatch):
    p = tmp_path / "x.txt"
    p.write_text("abc", encoding="utf-8")
    with pytest.raises(ValueError, match="pretokenizer must be one of"):
        train_bpe(p, 300, [EOT], pretokenizer="rust")
    monkeypatch.setattr(scanner, "_pretok", None)
    assert not pretokenize.native_pretokenizer_available()
    with pytest.raises(RuntimeError, match="_pretok is not built"):
        train_bpe(p, 300, [EOT], pretokenizer="native")
    # auto falls back to the regex path with the same result
    assert train_bpe(DATA / "corpus.en", 500, [EOT], 0)[1] == read_gpt2_merges(
        DATA / "train-bpe-reference-merges.txt"
    )


@needs_native
def test_counter_rejects_bytes_and_bad_tables():
    from torchtitan_ext.tokenizer import _pretok

    with pytest.raises(ValueError, match="classes must be"):
        _pretok.Counter(b"\x00" * 10)
    c = _pretok.Counter(scanner.class_table())
    with pytest.raises(TypeError, match="needs a str"):
        c.add(b"abc")
    c.add("ab ab")
    c.add("ab")
    assert c.to_dict() == {b"ab": 2, b" ab": 1} and len(c) == 2
    # what a worker ships: dump() merged into another counter adds the counts
    other = _pretok.Counter(scanner.class_table())
    other.add("ab cd é")
    other.merge(c.dump())
    other.merge(c.dump())
    assert other.to_dict() == {b"ab": 5, b" ab": 2, b" cd": 1, b" \xc3\xa9": 1}
    with pytest.raises(ValueError, match="Counter.dump"):
        other.merge(c.dump()[:-1])


# ---------------------------------------------------------------------------------------------
# Benchmark: the Heaps-law corpus and the rustbpe rows
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heaps_corpus(tmp_path_factory):
    from benchmarks.bpe import _shipped_texts
    from benchmarks.bpe_corpus import write_corpus

    path = tmp_path_factory.mktemp("heaps") / "c.txt"
    write_corpus(str(path), 4 << 20, _shipped_texts(), vocab_words=200_000)
    return path


def test_synthetic_corpus_vocabulary_grows_like_natural_text(heaps_corpus):
    from benchmarks.bpe_corpus import unique_word_growth

    sizes = (1 << 20, 2 << 20, 4 << 20)
    u = unique_word_growth(str(heaps_corpus), sizes)
    # Heaps' law: each doubling multiplies the distinct words by 2^b with 0.4 <= b <= 0.75
    # (copies of a fixed text would give b ~ 0)
    for a, b in zip(sizes, sizes[1:], strict=False):
        assert 2**0.4 <= u[b] / u[a] <= 2**0.75, u
    text = heaps_corpus.read_text("utf-8")
    assert text.count(EOT) >= 100 and "'s " in text and "\n\n" in text


def test_benchmark_skips_rustbpe_rows_with_a_note(monkeypatch):
    from benchmarks import bpe
    from benchmarks.common import BenchArgs

    monkeypatch.setattr(bpe, "_rustbpe_installed", lambda: False)
    rows = bpe.run(BenchArgs(repeats=1, warmup=0, quick=True, extra={"mb": "0.05", "vocab": "300"}))
    assert not any("rustbpe" in r.case for r in rows)
    main = next(r for r in rows if r.case.startswith("ours train_bpe native"))
    assert "rustbpe is not installed" in main.note


def test_benchmark_rustbpe_rows_when_installed():
    pytest.importorskip("rustbpe")  # the optional bench extra
    from benchmarks import bpe
    from benchmarks.common import BenchArgs

    rows = bpe.run(BenchArgs(repeats=1, warmup=0, quick=True, extra={"mb": "0.05", "vocab": "300"}))
    by = {r.case: r for r in rows}
    base = by["rustbpe, GPT-2 pattern (total)"]
    assert base.info["vocab_size"] == 299  # the same number of merges as ours (one special)
    main = next(r for r in rows if r.case.startswith("ours train_bpe native"))
    assert main.baseline == base.case and main.ratio > 0
    assert main.info["pretokenize_ratio_vs_rustbpe"] > 0
    before = next(r for r in rows if "regex pre-tokenizer (before)" in r.case)
    assert before.info["identical_merges_to_c_scanner"] is True
