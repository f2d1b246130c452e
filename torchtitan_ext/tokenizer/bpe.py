"""Parallel byte-level BPE training with the exact semantics of Stanford CS336 assignment 1.

``train_bpe(path, vocab_size, special_tokens)`` returns ``(vocab, merges)``: ids are the special
tokens first, then the 256 single bytes, then one token per merge in order.

Algorithm, one module per step:

1. **Pre-tokenization (streaming, parallel)** — :mod:`~torchtitan_ext.tokenizer.chunks` cuts
   the file into chunks that pre-tokenize independently (at special tokens, or before a safe
   newline), :mod:`~torchtitan_ext.tokenizer.pretokenize` counts GPT-2 pre-tokens in a pool of
   worker processes fed byte ranges by a reader thread, one counter back per worker. The
   counting is C (``_pretok.c``: GPT-2's pattern unrolled by hand over a character-class table
   taken from the ``regex`` package, counts in a C hash table), with ``regex.findall`` as the
   fallback giving identical counts (``pretokenizer=``).
2. **Merging (unique words only)** — :mod:`~torchtitan_ext.tokenizer.merge`: incremental pair
   counts, an inverted index pair -> words and a lazy-deletion max-heap, ties to the
   lexicographically greatest ``(bytes, bytes)``; in C (``_native.c``) with a pure-Python
   fallback giving identical merges.

This module is the public API (:func:`train_bpe`, :func:`train_bpe_from_texts`) and re-exports
the names of the step modules that callers import from here.

Why hand-written: Hugging Face ``tokenizers``' ``BpeTrainer`` and nanochat's ``rustbpe`` are
fast but break ties differently (so they cannot reproduce CS336's reference merges); no library
implements CS336's exact rule. The ``regex`` package stays the reference of the pre-tokens: the
C scanner takes its character classes from it and the tests compare both.

Cost: ``python -m benchmarks bpe`` runs ours (C and Python merge loops, C and regex
pre-tokenizers, 2 workers) against ``rustbpe`` (with GPT-2's pattern: same pre-tokens) and HF
``BpeTrainer`` at vocab 10k, on a 5.2 MB corpus of the shipped public-domain texts or, with
``--set corpus_mb=100``, a synthetic 100 MB corpus whose vocabulary grows like natural text's;
the figures are in ``benchmarks/RESULTS.md`` (section *bpe*).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

from torchtitan_ext.tokenizer.chunks import (
    DEFAULT_CHUNK_BYTES,
    check_specials,
    iter_chunk_bounds,
    iter_chunks,
)
from torchtitan_ext.tokenizer.merge import (
    check_engine,
    merge_words,
    native_available,
    vocab_from_merges,
)
from torchtitan_ext.tokenizer.pretokenize import (
    GPT2_PATTERN,
    SMALL_FILE_BYTES,
    BPEStats,
    count_file_pretoken_bytes,
    count_file_pretokens,
    count_pretokens,
    default_workers,
)

__all__ = [
    "GPT2_PATTERN",
    "BPEStats",
    "count_file_pretokens",
    "count_pretokens",
    "iter_chunk_bounds",
    "iter_chunks",
    "merge_words",
    "native_available",
    "train_bpe",
    "train_bpe_from_texts",
    "DEFAULT_CHUNK_BYTES",
    "SMALL_FILE_BYTES",
]


def train_bpe(
    input_path: str | os.PathLike,
    vocab_size: int,
    special_tokens: list[str] | tuple[str, ...] = (),
    num_workers: int | None = None,
    *,
    chunk_bytes: int | None = None,
    engine: str = "auto",
    progress: bool = False,
    stats: BPEStats | None = None,
    mp_context: str | None = None,
    pretokenizer: str = "auto",
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on a UTF-8 text file (CS336 assignment 1 semantics).

    Args:
        input_path: UTF-8 text file; documents are typically separated by a special token.
        vocab_size: final vocabulary size (specials + 256 bytes + merges); training stops early
            if no pair is left.
        special_tokens: strings added to the vocabulary first (ids 0..); the text is split on
            them before pre-tokenization, so they never take part in a merge.
        num_workers: pre-tokenization worker processes; ``None`` = the usable CPUs (or ``0``
            for files under ``SMALL_FILE_BYTES``), ``0`` = count in this process (no pool).
        chunk_bytes: target chunk size (default: up to 1 MiB, smaller for small files so each
            worker gets ~16 chunks). Any value gives identical results.
        engine: merge engine, ``"auto"`` | ``"native"`` | ``"python"`` (same results).
        progress: show tqdm progress bars (pre-tokenization bytes, merges).
        stats: a ``BPEStats`` to fill with timings and counts.
        mp_context: multiprocessing start method (default: the platform's).
        pretokenizer: ``"auto"`` | ``"native"`` (the C scanner) | ``"regex"`` (same results).

    Returns:
        ``(vocab, merges)``: ``vocab`` maps id -> token bytes; ``merges`` lists
        ``(left, right)`` byte pairs in the order they were learned.
    """
    path = os.fspath(input_path)
    specials = check_specials(special_tokens)
    check_engine(engine)
    if not isinstance(vocab_size, int) or vocab_size < 256 + len(specials):
        raise ValueError(
            f"vocab_size must be an int >= 256 + {len(specials)} special tokens, got {vocab_size!r}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"BPE training input not found: {path}")
    size = os.path.getsize(path)
    workers = default_workers(size) if num_workers is None else int(num_workers)
    if workers < 0:
        raise ValueError(f"num_workers must be >= 0 or None, got {num_workers}")
    st = stats if stats is not None else BPEStats()
    st.workers = workers
    st.engine = "python" if (engine == "python" or not native_available()) else "native"
    num_merges = vocab_size - 256 - len(specials)
    words, counts = _pretokenize(
        path, size, specials, workers, chunk_bytes, progress, st, mp_context, pretokenizer
    )
    pairs = _merge(words, counts, num_merges, engine, progress, st)
    return vocab_from_merges(pairs, specials)


def _pretokenize(
    path: str,
    size: int,
    specials: list[str],
    workers: int,
    chunk_bytes: int | None,
    progress: bool,
    st: BPEStats,
    mp_context: str | None,
    pretokenizer: str,
) -> tuple[list[bytes], list[int]]:
    """Step 1 of :func:`train_bpe`, timed into ``st``: the unique pre-tokens as UTF-8 words and
    their counts."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=size, unit="B", unit_scale=True, desc="pre-tokenize")
    t0 = time.perf_counter()
    try:
        counter = count_file_pretoken_bytes(
            path,
            specials,
            workers,
            chunk_bytes,
            bar.update if bar else None,
            st,
            mp_context,
            pretokenizer,
        )
    finally:
        if bar is not None:
            bar.close()
    st.pretokenize_s = time.perf_counter() - t0
    st.unique_pretokens = len(counter)
    st.pretokens = sum(counter.values())
    t1 = time.perf_counter()
    words = list(counter)
    counts = list(counter.values())
    st.merge_s = time.perf_counter() - t1  # building the words counts as merging (BPEStats)
    return words, counts


def _merge(
    words: list[bytes],
    counts: list[int],
    num_merges: int,
    engine: str,
    progress: bool,
    st: BPEStats,
) -> list[tuple[int, int]]:
    """Step 2 of :func:`train_bpe`, timed into ``st``: the merged id pairs in order."""
    t1 = time.perf_counter()
    if progress:
        from tqdm.auto import tqdm

        with tqdm(total=num_merges, desc="merge", unit="merge") as mbar:
            pairs = merge_words(words, counts, num_merges, engine)
            mbar.update(len(pairs))
    else:
        pairs = merge_words(words, counts, num_merges, engine)
    st.merge_s += time.perf_counter() - t1
    st.merges = len(pairs)
    return pairs


def train_bpe_from_texts(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: list[str] | tuple[str, ...],
    num_workers: int | None = None,
    *,
    separator: str | None = None,
    tmp_dir: str | os.PathLike | None = None,
    **kwargs,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """``train_bpe`` on in-memory documents (e.g. a list of str from a dataset).

    The documents are streamed to a temporary file joined by ``separator`` (default: the first
    special token), which must be a special token so that no pre-token or merge spans two
    documents; the file is removed afterwards. ``kwargs`` go to ``train_bpe``.
    """
    specials = check_specials(special_tokens)
    sep = specials[0] if separator is None and specials else separator
    if sep is None or sep not in specials:
        raise ValueError(
            f"separator {sep!r} must be one of the special tokens {specials}: documents are "
            "joined by it so that no pre-token or merge spans two documents"
        )
    import tempfile

    fd, path = tempfile.mkstemp(prefix="bpe_texts_", suffix=".txt", dir=tmp_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}")
                if i:
                    f.write(sep)
                f.write(t)
        return train_bpe(path, vocab_size, specials, num_workers, **kwargs)
    finally:
        os.unlink(path)
