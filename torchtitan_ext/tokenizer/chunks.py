"""Cutting a BPE training file into chunks that pre-tokenize independently (step 1 of
:func:`~torchtitan_ext.tokenizer.bpe.train_bpe`), and the check of the special tokens.

Contract: concatenating the chunks gives the file back exactly, and pre-tokenizing each chunk
alone gives the same pre-tokens as pre-tokenizing the whole file. A chunk ends right after a
special token that is certainly complete (a document boundary, never inside a UTF-8 character),
or, in a document longer than a chunk, just before a ``\\n`` that follows a printable ASCII byte,
where GPT-2's regex provably splits. :func:`iter_chunks` reads a file object;
:func:`iter_chunk_bounds` makes the same cuts on an in-memory buffer (a memory map) as offsets.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "check_specials",
    "iter_chunk_bounds",
    "iter_chunks",
    "split_regex",
]

DEFAULT_CHUNK_BYTES = 1 << 20
"""Upper bound of one chunk handed to a worker (bytes). Large chunks keep queue overhead low; the
actual size is lowered for small files so each worker gets several chunks (load balance)."""

_ASCII_GRAPHIC = frozenset(range(0x21, 0x7F))


def check_specials(special_tokens: Iterable[str]) -> list[str]:
    """The special tokens as a list of distinct non-empty str; a one-line error otherwise (a
    single string is refused: iterating it would make each character a special token)."""
    if isinstance(special_tokens, str | bytes):
        raise TypeError(
            f"special_tokens must be a list of str, got the single string {special_tokens!r}"
        )
    specials = list(special_tokens)
    seen: set[str] = set()
    for i, s in enumerate(specials):
        if not isinstance(s, str) or not s:
            raise ValueError(f"special_tokens[{i}] must be a non-empty str, got {s!r}")
        if s in seen:
            raise ValueError(f"special_tokens[{i}] {s!r} is listed twice")
        seen.add(s)
    return specials


def split_regex(specials: list[str], as_bytes: bool) -> re.Pattern | None:
    """Alternation of the specials, longest first: at one position the longest special wins."""
    if not specials:
        return None
    ordered = sorted(specials, key=len, reverse=True)
    if as_bytes:
        return re.compile(b"|".join(re.escape(s.encode("utf-8")) for s in ordered))
    return re.compile("|".join(re.escape(s) for s in ordered))


def _safe_newline_cut(block: bytes, start: int) -> int:
    """Largest p > start with block[p] == '\\n' and block[p-1] printable ASCII, else -1.

    GPT-2's pattern always ends a pre-token between such a pair: only whitespace tokens contain
    '\\n', they start at whitespace, and no rule before p looks past the class change at p, so
    pre-tokenizing block[:p] and block[p:] separately gives the same pre-tokens as the whole.
    """
    return _safe_newline_cut_range(block, start, len(block))


def _safe_newline_cut_range(buf, start: int, end: int) -> int:
    """``_safe_newline_cut`` on ``buf[start:end]`` without slicing; absolute offset or -1."""
    p = end
    while True:
        p = buf.rfind(b"\n", start + 1, p)
        if p <= start:
            return -1
        if buf[p - 1] in _ASCII_GRAPHIC:
            return p


def _cut_rules(special_tokens: list[str], chunk_bytes: int) -> tuple[re.Pattern | None, int, bool]:
    """What both chunkers cut on: the specials' byte regex, the longest special's length (a
    match is final once that many bytes follow its start) and whether a safe newline may cut
    (not when a special token contains a newline)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    enc = [s.encode("utf-8") for s in special_tokens]
    maxlen = max((len(s) for s in enc), default=0)
    newline_ok = not any(b"\n" in s for s in enc)
    return split_regex(special_tokens, as_bytes=True), maxlen, newline_ok


def iter_chunks(
    f, special_tokens: list[str], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes]:
    """Yield consecutive byte chunks of binary file ``f`` that can be pre-tokenized independently.

    A chunk ends right after a special token (a document boundary) whenever the block holds one;
    only a special whose every possible longer variant would also fit in the block counts, so a
    longer special straddling the block end is never cut. Without one, it ends before a safe
    newline (see ``_safe_newline_cut``; not used if a special token contains a newline). If
    neither exists the block grows until one does (a giant single line is read whole).
    Concatenating the chunks gives the file back exactly.
    """
    pat, maxlen, newline_ok = _cut_rules(special_tokens, chunk_bytes)
    buf = b""
    while True:
        data = f.read(chunk_bytes)
        if not data:
            break
        buf += data
        while len(buf) >= chunk_bytes:
            cut = -1
            if pat is not None:
                # The leftmost-longest scan is sequential, so a match starting at m is final once
                # m + maxlen bytes are present (no longer special could still start at m).
                for m in pat.finditer(buf):
                    if m.start() + maxlen <= len(buf):
                        cut = m.end()
                    else:
                        break
            if cut <= 0 and newline_ok:
                cut = _safe_newline_cut(buf, 0)
            if cut <= 0:
                break  # no safe boundary yet: read more
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def iter_chunk_bounds(
    buf, special_tokens: list[str], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tuple[int, int]]:
    """``iter_chunks`` over an in-memory buffer (e.g. an ``mmap``), as ``(start, end)`` offsets.

    Emulates ``iter_chunks`` reading ``buf`` with ``read(chunk_bytes)`` exactly (same cuts; the
    tests check it), but copies nothing: the scans use ``pos``/``endpos`` on the buffer.
    """
    pat, maxlen, newline_ok = _cut_rules(special_tokens, chunk_bytes)
    n = len(buf)
    start = end = 0  # the emulated read buffer is buf[start:end]
    while end < n:
        end = min(n, end + chunk_bytes)
        while end - start >= chunk_bytes:
            cut = -1
            if pat is not None:
                for m in pat.finditer(buf, start, end):
                    if m.start() + maxlen <= end:
                        cut = m.end()
                    else:
                        break
            if cut <= start and newline_ok:
                cut = _safe_newline_cut_range(buf, start, end)
            if cut <= start:
                break
            yield start, cut
            start = cut
    if start < n:
        yield start, n
