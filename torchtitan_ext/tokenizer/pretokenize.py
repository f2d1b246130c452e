"""Pre-tokenization and counting (step 1 of :func:`~torchtitan_ext.tokenizer.bpe.train_bpe`):
a UTF-8 file in, a ``Counter`` of GPT-2 pre-tokens out, streaming and in parallel.

The file is cut into chunks (:mod:`~torchtitan_ext.tokenizer.chunks`). A reader thread finds
the cuts on a read-only memory map of the file and feeds ``(start, end)`` offsets through a
bounded queue to a pool of worker processes; each worker reads its ranges itself as bytes (no
file data crosses a pipe), decodes, splits on the special tokens (longest first, so specials
never join a merge), runs GPT-2's pattern with the ``regex`` package (the reference engine
itself, so the pre-tokens are exact by construction) and counts them in one ``Counter`` across
all its chunks; it ships that one counter back on its sentinel, so inter-process traffic is one
buffer per worker, not one per chunk. The counting runs in C when ``_pretok`` is built (the
default, ``pretokenizer="auto"``): a hand-unrolled scanner of the same pattern whose character
classes are a table built from ``regex`` itself (:func:`~torchtitan_ext.tokenizer.scanner.class_table`), counting into a C hash
table that a worker ships as one ``dump()`` buffer; ``regex.findall`` is the fallback and the
reference (identical counts, tests/test_bpe_rustbpe.py). Memory is bounded by one chunk per worker plus the number of
unique pre-tokens (sub-linear in the corpus, Heaps' law); the mapped pages are clean page cache.
``num_workers=0`` counts in-process with a plain streaming reader (``iter_chunks``) that makes
the same cuts. The pool (reader thread, workers, result pipes) is
:mod:`~torchtitan_ext.tokenizer.pretok_pool`.

Cost: ``python -m benchmarks bpe`` times pre-tokenization at 1 and 2 workers and in-process
(``benchmarks/RESULTS.md``, section *bpe*). The C scanner counts ~60-90 MB/s per core on the
shipped texts (~5x the regex); at 5 MB the pool's fixed cost (fork, queue hand-offs) is then
larger than the counting, so in-process is as fast as 2 workers there. The figures below are
the regex path's. Why 2 workers stay below 2x, from one run of that
benchmark with both cores of the 2-core development box idle (5.2 MB corpus; not in
RESULTS.md, whose runs were on a shared machine): 0.335 s with 1 worker, 0.183 s with 2 (1.83x;
1.80-1.85x over the quiet runs), 0.327 s in-process; the regex runs at ~16 MB/s per core, the
workers' CPU critical path alone gives 1.97x, and the rest is ~15 ms of fixed cost: fork, the
last chunk's imbalance, and the serial tail of shipping and adding the two ~0.4 MB counters.
With another job on one core the 2-worker speed-up drops to ~1.0-1.2x (the benchmark records
the CPU idle fraction next to these rows).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import regex

from torchtitan_ext.tokenizer.chunks import (
    DEFAULT_CHUNK_BYTES,
    check_specials,
    iter_chunks,
    split_regex,
)
from torchtitan_ext.tokenizer.pretok_pool import count_in_pool
from torchtitan_ext.tokenizer.scanner import (
    PRETOKENIZERS,
    check_pretokenizer,
    native_pretokenizer_available,
    new_sink,
    sink_as_bytes,
)

__all__ = [
    "GPT2_PATTERN",
    "PRETOKENIZERS",
    "SMALL_FILE_BYTES",
    "BPEStats",
    "count_file_pretoken_bytes",
    "count_file_pretokens",
    "count_pretokens",
    "default_workers",
    "native_pretokenizer_available",
]

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""GPT-2's pre-tokenization regex (``regex`` syntax), as in CS336 assignment 1."""

_PAT = regex.compile(GPT2_PATTERN)


@dataclass
class BPEStats:
    """Timings and counts of one ``train_bpe`` run (filled when ``stats=`` is passed)."""

    pretokenize_s: float = 0.0
    """Wall seconds reading the file and counting pre-tokens (pool start-up included)."""
    merge_s: float = 0.0
    """Wall seconds of the merge loop (building words included)."""
    bytes_read: int = 0
    """Bytes of input consumed."""
    chunks: int = 0
    """Chunks handed to workers."""
    pretokens: int = 0
    """Pre-tokens counted (with multiplicity)."""
    unique_pretokens: int = 0
    """Distinct pre-tokens (the words the merge loop works on)."""
    merges: int = 0
    """Merges learned (fewer than asked when the corpus runs out of pairs)."""
    workers: int = 0
    """Worker processes used (0 = counted in the calling process)."""
    engine: str = ""
    """Merge engine used: ``native`` or ``python``."""
    extra: dict[str, float] = field(default_factory=dict)
    """Diagnostics: ``worker_cpu_s_sum`` / ``worker_cpu_s_max`` (CPU seconds of the workers)."""


SMALL_FILE_BYTES = 4 << 20
"""With ``num_workers=None``, files smaller than this are counted in-process: starting a pool
and shipping the counters back costs more than it saves below a few MB."""


def default_workers(size: int | None = None) -> int:
    if size is not None and size < SMALL_FILE_BYTES:
        return 0
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux: sched_getaffinity is missing
        return max(1, os.cpu_count() or 1)


def count_pretokens(
    text: str,
    special_tokens: list[str],
    counter: collections.Counter | None = None,
    pretokenizer: str = "auto",
) -> collections.Counter:
    """Count GPT-2 pre-tokens of ``text`` after removing the special tokens (CS336 semantics).

    ``counter`` (str keys) is updated and returned; internally it may also be the C counter
    (``_pretok.Counter``, bytes keys), which is then filled directly.
    """
    if counter is None or isinstance(counter, collections.Counter):
        out = collections.Counter() if counter is None else counter
        if not check_pretokenizer(pretokenizer):
            _count_docs(text, special_tokens, out)
            return out
        sink = new_sink(True)
        try:
            _count_docs(text, special_tokens, sink)
        except UnicodeEncodeError:  # lone surrogates: not UTF-8, so only the regex can split them
            _count_docs(text, special_tokens, out)
            return out
        out.update({k.decode("utf-8"): v for k, v in sink.to_dict().items()})
        return out
    _count_docs(text, special_tokens, counter)
    return counter


def _count_docs(text: str, special_tokens: list[str], sink) -> None:
    """Split ``text`` at the special tokens and count each document's pre-tokens into ``sink``
    (a ``Counter`` of str: ``regex.findall``; a ``_pretok.Counter``: the C scanner)."""
    if isinstance(sink, collections.Counter):
        findall = _PAT.findall

        def add(doc: str) -> None:
            sink.update(findall(doc))
    else:
        add = sink.add
    if not special_tokens:
        if text:
            add(text)
    elif len(special_tokens) == 1:
        # str.split scans left to right without overlap, the same as the regex split below
        for doc in text.split(special_tokens[0]):
            if doc:
                add(doc)
    else:
        for doc in split_regex(special_tokens, as_bytes=False).split(text):
            if doc:
                add(doc)


def _decode(chunk: bytes, offset: int, path: str) -> str:
    try:
        return chunk.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: invalid UTF-8 at byte offset {offset + e.start}: {e.reason}"
        ) from None


def _count_chunk(chunk: bytes, offset: int, path: str, special_tokens: list[str], sink) -> None:
    """Count one chunk read at byte ``offset`` of ``path`` into ``sink`` (a pool worker's step)."""
    count_pretokens(_decode(chunk, offset, path), special_tokens, sink)


def _auto_chunk_bytes(size: int, workers: int, chunk_bytes: int | None) -> int:
    if chunk_bytes is not None:
        return chunk_bytes
    # ~16 chunks per worker so the last chunk leaves a core idle only briefly; a chunk costs
    # little (one queue round trip and a read), but below ~64 KiB the round trips start to show
    per = size // max(1, 16 * max(1, workers)) + 1
    return max(64 << 10, min(DEFAULT_CHUNK_BYTES, per))


def count_file_pretokens(
    path: str | os.PathLike,
    special_tokens: list[str] | tuple[str, ...] = (),
    num_workers: int | None = None,
    chunk_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    stats: BPEStats | None = None,
    mp_context: str | None = None,
    pretokenizer: str = "auto",
) -> collections.Counter:
    """Pre-tokenize a UTF-8 file and count its pre-tokens (step 1 of ``train_bpe``).

    Cuts the file at special-token boundaries (``iter_chunk_bounds`` on a memory map) and feeds
    the byte ranges through a bounded queue to ``num_workers`` processes that read and count them
    (``0``: a streaming ``iter_chunks`` loop in this process; ``None``: the usable CPUs, or 0 for
    files under ``SMALL_FILE_BYTES``). ``progress`` is called with each chunk's byte count as it
    is handed out. ``pretokenizer``: see :data:`PRETOKENIZERS` (same counts either way).
    Returns a ``Counter`` of pre-token str -> count; special tokens are never counted.
    """
    counts = count_file_pretoken_bytes(
        path, special_tokens, num_workers, chunk_bytes, progress, stats, mp_context, pretokenizer
    )
    return collections.Counter({k.decode("utf-8"): v for k, v in counts.items()})


def count_file_pretoken_bytes(
    path: str | os.PathLike,
    special_tokens: list[str] | tuple[str, ...] = (),
    num_workers: int | None = None,
    chunk_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
    stats: BPEStats | None = None,
    mp_context: str | None = None,
    pretokenizer: str = "auto",
) -> collections.Counter:
    """:func:`count_file_pretokens` with the pre-tokens as UTF-8 ``bytes`` keys: what the merge
    loop takes, and what the C counter makes without building a str per pre-token."""
    path = os.fspath(path)
    special_tokens = check_specials(special_tokens)
    native = check_pretokenizer(pretokenizer)
    size = os.path.getsize(path)
    num_workers = default_workers(size) if num_workers is None else int(num_workers)
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 or None, got {num_workers}")
    stats = stats if stats is not None else BPEStats()
    cb = _auto_chunk_bytes(size, num_workers, chunk_bytes)
    stats.workers = num_workers
    if num_workers == 0:
        return _count_in_process(path, special_tokens, cb, progress, stats, native)

    return count_in_pool(
        path, size, special_tokens, cb, num_workers, _count_chunk, stats, progress, mp_context,
        native,
    )  # fmt: skip


def _count_in_process(
    path: str,
    special_tokens: list[str],
    chunk_bytes: int,
    progress: Callable[[int], None] | None,
    stats: BPEStats,
    native: bool,
) -> collections.Counter:
    """``num_workers=0``: a streaming ``iter_chunks`` loop in this process (same cuts)."""
    sink = new_sink(native)
    offset = 0
    with open(path, "rb") as f:
        for chunk in iter_chunks(f, special_tokens, chunk_bytes):
            count_pretokens(_decode(chunk, offset, path), special_tokens, sink)
            offset += len(chunk)
            stats.chunks += 1
            if progress:
                progress(len(chunk))
    stats.bytes_read = offset
    return collections.Counter(sink_as_bytes(sink))
