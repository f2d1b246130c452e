"""A synthetic English-like corpus of any size whose vocabulary grows like natural text's.

Why not concatenate the shipped texts: a copy adds no new word, so the unique pre-tokens (what
the merge loop works on) stop growing and only counts double: BPE gets unrealistically easy and
the pre-tokenizer's hash table stays small. Natural text instead follows

* **Zipf's law**: the r-th most frequent word has frequency ~ 1 / (r + q)^s (s ~ 1);
* **Heaps' law**: the number of distinct words in n running words grows as ~ K n^b (b ~ 0.5-0.7),
  which is what i.i.d. sampling from a Zipf distribution over an unbounded vocabulary gives.

So the corpus is i.i.d. samples of a two-regime Zipf-Mandelbrot law (constants below) over a vocabulary of
``vocab_words`` ranks: the top ranks are the real words of the shipped texts (*War and Peace* +
tiny Shakespeare) in their frequency order, the rest synthetic words of 1-4 English-like
syllables (onset + vowel + coda, syllables themselves Zipf-weighted, so sub-words repeat as in
English and BPE has realistic merges to find). Around the words: capitalised sentence starts,
commas, full stops, paragraphs (blank lines), ~1 % numbers, ~1 % ``'s`` contractions, and
``<|endoftext|>`` between documents of ~1500 words. The vocabulary is large enough that it never
saturates at the sizes benchmarked: :func:`unique_word_growth` measures the Heaps exponent
(printed into the benchmark rows' info). Deterministic for a seed; written block by block, so
memory stays ~ one block.
"""

from __future__ import annotations

import collections
import re

import numpy as np

_ONSETS = (
    "", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
    "y", "z", "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sc", "sh",
    "sk", "sl", "sm", "sn", "sp", "st", "str", "sw", "th", "tr", "tw", "wh", "qu",
)  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "ie", "oo", "ou", "y")
_CODAS = (
    "", "", "", "b", "d", "ck", "ff", "g", "l", "ll", "m", "n", "nd", "ng", "nt", "p", "r", "rd",
    "rn", "s", "ss", "st", "t", "th", "x", "ght", "tion", "ment", "ness", "er", "ed", "ing",
)  # fmt: skip

ZIPF_S = 1.0
"""Zipf-Mandelbrot exponent of the head (English: ~1.0 for the commonest ~10^4 words)."""
ZIPF_Q = 2.7
"""Zipf-Mandelbrot offset (flattens the head: 'the' is ~5 %, not ~20 %, of the words)."""
ZIPF_KNEE = 8000
"""Rank where the tail's steeper exponent takes over (two-regime Zipf, as measured on large
English corpora: Ferrer i Cancho & Sole 2001)."""
ZIPF_TAIL_S = 1.8
"""Tail exponent: i.i.d. sampling then gives Heaps' exponent ~ 1 / 1.8 ~ 0.55."""


def zipf_weights(n: int) -> np.ndarray:
    """Unnormalised two-regime Zipf-Mandelbrot weights of ranks 1..n."""
    r = np.arange(1, n + 1, dtype=np.float64)
    w = 1.0 / (r + ZIPF_Q) ** ZIPF_S
    knee = min(ZIPF_KNEE, n)
    tail = r > knee
    w[tail] = w[knee - 1] * (r[tail] / knee) ** -ZIPF_TAIL_S
    return w


def _real_words(texts: list[str]) -> list[str]:
    counts = collections.Counter(w.lower() for t in texts for w in re.findall(r"[^\W\d_]+", t))
    return [w for w, _ in counts.most_common()]


def build_vocabulary(texts: list[str], vocab_words: int, seed: int) -> np.ndarray:
    """``vocab_words`` distinct words: the texts' words by frequency, then synthetic words."""
    rng = np.random.default_rng(seed)
    real = _real_words(texts)[:vocab_words]
    syll = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    syll = list(dict.fromkeys(syll))
    rng.shuffle(syll)
    w = 1.0 / np.arange(1, len(syll) + 1) ** 0.9
    w /= w.sum()
    syll_arr = np.array([""] + syll)  # index 0: no syllable
    words = dict.fromkeys(real)
    while len(words) < vocab_words:
        n = int((vocab_words - len(words)) * 1.5) + 1000
        nsyl = rng.choice([1, 2, 3, 4], size=n, p=[0.15, 0.45, 0.3, 0.1])
        parts = rng.choice(len(syll), size=(n, 4), p=w) + 1
        parts[np.arange(4)[None, :] >= nsyl[:, None]] = 0
        new = syll_arr[parts[:, 0]]
        for k in range(1, 4):
            new = np.char.add(new, syll_arr[parts[:, k]])
        words.update(dict.fromkeys(new.tolist()))  # distinct, in first-drawn order
    words = np.array(list(words)[:vocab_words], dtype=object)
    return words


def _block(vocab: np.ndarray, cdf: np.ndarray, n: int, rng: np.random.Generator) -> str:
    """``n`` running words with punctuation, as one string (documents end in the special)."""
    idx = np.searchsorted(cdf, rng.random(n) * cdf[-1])
    words = vocab[idx]
    num = rng.random(n) < 0.01
    words[num] = [str(x) for x in rng.integers(0, 3000, size=int(num.sum()))]
    pos = rng.random(n) < 0.01
    words[pos] = [w + "'s" for w in words[pos]]
    r = rng.random(n)
    seps = np.full(n, " ", dtype=object)
    seps[r < 0.06] = ", "
    end = r > 1 - 1 / 14  # sentence ends: the next word is capitalised
    seps[end] = ". "
    seps[end & (rng.random(n) < 0.15)] = ".\n\n"
    seps[rng.random(n) < 1 / 1500] = ".<|endoftext|>"
    cap = np.flatnonzero(end[:-1]) + 1
    words[cap] = [w[:1].upper() + w[1:] for w in words[cap]]
    out = np.empty(2 * n, dtype=object)
    out[0::2] = words
    out[1::2] = seps
    return "".join(out.tolist())


def write_corpus(
    path: str,
    target_bytes: int,
    texts: list[str],
    seed: int = 0,
    vocab_words: int = 1_000_000,
    block_words: int = 1 << 20,
) -> int:
    """Write at least ``target_bytes`` of the corpus to ``path`` (cut at a document end when
    one is near); returns the size in bytes."""
    rng = np.random.default_rng(seed)
    vocab = build_vocabulary(texts, vocab_words, seed)
    cdf = np.cumsum(zipf_weights(len(vocab)))
    size = 0
    with open(path, "wb") as f:
        while size < target_bytes:
            data = _block(vocab, cdf, block_words, rng).encode("utf-8")
            if size + len(data) > target_bytes:
                data = data[: target_bytes - size]
                # end on a whole character
                data = data.decode("utf-8", "ignore").encode("utf-8")
            f.write(data)
            size += len(data)
    return size


def unique_word_growth(path: str, sizes: tuple[int, ...]) -> dict[int, int]:
    """Distinct lower-cased words in the first ``size`` bytes of ``path``, for each size (to
    check Heaps' law: doubling the text should multiply this by ~2^b, b ~ 0.5-0.7)."""
    out: dict[int, int] = {}
    with open(path, "rb") as f:
        data = f.read(max(sizes)).decode("utf-8", "ignore")
    for s in sizes:
        out[s] = len(set(re.findall(r"[^\W\d_]+", data[:s].lower())))
    return out
