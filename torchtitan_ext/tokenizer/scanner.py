"""The C pre-tokenizer's Python side (step 1 of :func:`~torchtitan_ext.tokenizer.bpe.train_bpe`):
whether ``_pretok`` is built, the character-class table it scans with, and the counters
("sinks") the pre-tokenization loop counts into.

``_pretok.c`` unrolls GPT-2's pattern by hand; the only knowledge it takes from outside is which
code points are ``\\p{L}``, ``\\p{N}`` and ``\\s``, and that comes from the ``regex`` package
itself (:func:`class_table`), so the pre-tokens are the reference engine's by construction (and
tests/test_bpe_rustbpe.py compares both).
"""

from __future__ import annotations

import collections
import functools

import regex

__all__ = [
    "PRETOKENIZERS",
    "check_pretokenizer",
    "class_table",
    "native_pretokenizer_available",
    "new_sink",
    "sink_as_bytes",
]

try:  # the C scanner; optional so a checkout without a compiler still works (regex path)
    from torchtitan_ext.tokenizer import _pretok  # type: ignore[attr-defined]
except ImportError:  # safe to swallow: the regex path below gives identical counts
    _pretok = None

PRETOKENIZERS = ("auto", "native", "regex")
"""``pretokenizer=`` values: ``native`` = the C scanner of ``_pretok.c`` (GPT-2's pattern
unrolled by hand, character classes taken from ``regex``), ``regex`` = ``regex.findall`` with
:data:`~torchtitan_ext.tokenizer.pretokenize.GPT2_PATTERN`, ``auto`` = native when built. Both give identical counts (tests)."""


def native_pretokenizer_available() -> bool:
    """True when the C pre-tokenizer (``torchtitan_ext.tokenizer._pretok``) was built."""
    return _pretok is not None and class_table() is not None


@functools.cache
def class_table() -> bytes | None:
    """The character class of every code point as the ``regex`` package sees it, one byte each
    (1 ``\\p{L}``, 2 ``\\p{N}``, 3 ``\\s``, 0 other): the C scanner classifies with this table,
    so its classes are the reference engine's by construction (~40 ms, once per process; forked
    workers inherit it). ``None`` if the classes overlap, which GPT-2's pattern does not expect
    (the scanner is then not used)."""
    import numpy as np  # only here: every code point as one str in ~20 ms (a join takes 0.2 s)

    every = np.arange(0x110000, dtype="<u4").tobytes().decode("utf-32-le", "surrogatepass")
    table = bytearray(0x110000)
    for code, pattern in ((1, r"\p{L}+"), (2, r"\p{N}+"), (3, r"\s+")):
        for m in regex.finditer(pattern, every):
            a, b = m.span()
            if any(table[a:b]):
                return None
            table[a:b] = bytes([code]) * (b - a)
    return bytes(table)


def check_pretokenizer(pretokenizer: str) -> bool:
    """Whether to use the C scanner for ``pretokenizer``; a one-line error for a bad value."""
    if pretokenizer not in PRETOKENIZERS:
        raise ValueError(f"pretokenizer must be one of {PRETOKENIZERS}, got {pretokenizer!r}")
    if pretokenizer == "regex":
        return False
    if not native_pretokenizer_available():
        if pretokenizer == "native":
            raise RuntimeError(
                "pretokenizer='native' but torchtitan_ext.tokenizer._pretok is not built; run "
                "`pip install -e .` (needs a C compiler) or use pretokenizer='regex'"
            )
        return False
    return True


def new_sink(native: bool):
    """Where a worker counts: the C counter (bytes keys) or a ``Counter`` of str."""
    return _pretok.Counter(class_table()) if native else collections.Counter()


def sink_as_bytes(sink) -> dict[bytes, int]:
    if isinstance(sink, collections.Counter):
        return {k.encode("utf-8"): v for k, v in sink.items()}
    return sink.to_dict()
