"""The BPE merge loop (step 2 of :func:`~torchtitan_ext.tokenizer.bpe.train_bpe`), in C and in
pure Python with identical results.

Each unique pre-token is a word of byte ids with its count. Pair counts are kept incrementally;
an inverted index maps a pair to the words that contain it, so a merge touches only those words;
a max-heap with lazy deletion picks the most frequent pair with ties going to the
lexicographically greatest ``(bytes, bytes)`` (CS336's rule). Heap entries are upper bounds: a
popped entry whose count is stale is re-pushed with the current count, so the first entry that
is current is the true maximum under the tie rule. The C engine (``_native.c``, built by
``pip install -e .``) is used when built; the Python one is the fallback (or ``engine="python"``).
Why two: the C loop is the speed (``python -m benchmarks bpe``), the Python one keeps a checkout
without a compiler working and is the readable statement of the algorithm the tests compare.
"""

from __future__ import annotations

import collections
import heapq

__all__ = ["merge_words", "native_available", "vocab_from_merges"]

try:  # the C merge loop; optional so a checkout without a compiler still works (pure Python)
    from torchtitan_ext.tokenizer import _native  # type: ignore[attr-defined]
except ImportError:  # safe to swallow: the pure-Python engine below gives identical merges
    _native = None


def native_available() -> bool:
    """True when the C merge loop (``torchtitan_ext.tokenizer._native``) was built."""
    return _native is not None


def _merge_python(words: list[bytes], counts: list[int], num_merges: int) -> list[tuple[int, int]]:
    """Learn up to ``num_merges`` merges; ids 0..255 are bytes, 256+k is merge k.

    Returns the merged id pairs in order. Same algorithm and results as ``_native.merge``.
    """
    tok_bytes: list[bytes] = [bytes([i]) for i in range(256)]

    # The heap is a min-heap, so the key inverts both orders: -count first, then a key whose
    # ascending order is descending bytes order (a prefix must sort *after* its extensions).
    def inv(b: bytes) -> tuple[int, ...]:
        return tuple(255 - x for x in b) + (256,)

    inv_key: list[tuple[int, ...]] = [inv(b) for b in tok_bytes]
    seqs: list[list[int]] = [list(w) for w in words]
    pair_count: dict[tuple[int, int], int] = collections.defaultdict(int)
    where: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for wi, (s, c) in enumerate(zip(seqs, counts, strict=True)):
        for pair in zip(s, s[1:], strict=False):  # adjacent pairs
            pair_count[pair] += c
            where[pair].append(wi)
    pushed: dict[tuple[int, int], int] = dict(pair_count)
    heap = [(-c, inv_key[a], inv_key[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    stamp = [-1] * len(seqs)
    merges: list[tuple[int, int]] = []
    while len(merges) < num_merges and heap:
        negc, _, _, a, b = heapq.heappop(heap)
        cur = pair_count.get((a, b), 0)
        if cur != -negc:  # stale upper bound: re-queue at the current count
            if 0 < cur < -negc:
                pushed[(a, b)] = cur
                heapq.heappush(heap, (-cur, inv_key[a], inv_key[b], a, b))
            continue
        if cur <= 0:
            break  # only zero-count pairs are left (words with count 0)
        new = 256 + len(merges)
        merges.append((a, b))
        tok_bytes.append(tok_bytes[a] + tok_bytes[b])
        inv_key.append(inv(tok_bytes[new]))
        touched: set[tuple[int, int]] = set()
        for wi in where.pop((a, b)):
            if stamp[wi] == new:
                continue  # already rewritten for this merge (the index holds duplicates)
            stamp[wi] = new
            s = seqs[wi]
            c = counts[wi]
            i = 0
            while i < len(s) - 1:
                if s[i] == a and s[i + 1] == b:
                    if i > 0:
                        left = s[i - 1]
                        pair_count[(left, a)] -= c
                        pair_count[(left, new)] += c
                        where[(left, new)].append(wi)
                        touched.add((left, new))
                    pair_count[(a, b)] -= c
                    if i + 2 < len(s):
                        right = s[i + 2]
                        pair_count[(b, right)] -= c
                        pair_count[(new, right)] += c
                        where[(new, right)].append(wi)
                        touched.add((new, right))
                    s[i : i + 2] = [new]
                i += 1
        pair_count.pop((a, b), None)
        for pair in touched:
            c = pair_count[pair]
            if c > pushed.get(pair, 0):
                pushed[pair] = c
                heapq.heappush(heap, (-c, inv_key[pair[0]], inv_key[pair[1]], pair[0], pair[1]))
    return merges


def check_engine(engine: str) -> None:
    if engine not in ("auto", "native", "python"):
        raise ValueError(f"engine must be 'auto', 'native' or 'python', got {engine!r}")
    if engine == "native" and _native is None:
        raise RuntimeError(
            "engine='native' but torchtitan_ext.tokenizer._native is not built; run "
            "`pip install -e .` (needs a C compiler) or use engine='python'"
        )


def merge_words(
    words: list[bytes], counts: list[int], num_merges: int, engine: str = "auto"
) -> list[tuple[int, int]]:
    """Run the merge loop on unique words (byte strings) with their counts.

    ``engine``: ``"native"`` (C; error if not built), ``"python"``, or ``"auto"`` (C when built).
    Returns id pairs: ids 0..255 are the bytes, 256 + k the token made by merge k.
    """
    check_engine(engine)
    if engine != "python" and _native is not None:
        return _native.merge(words, counts, num_merges)
    if len(words) != len(counts):
        raise ValueError(f"words ({len(words)}) and counts ({len(counts)}) differ in length")
    for i, c in enumerate(counts):
        if c < 0:
            raise ValueError(f"counts[{i}] is negative ({c})")
    return _merge_python(words, counts, num_merges)


def vocab_from_merges(
    pairs: list[tuple[int, int]], specials: list[str]
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """``(vocab, merges)`` from the merge loop's id pairs: ids are the special tokens first,
    then the 256 single bytes, then one token per merge in order."""
    tok: list[bytes] = [bytes([i]) for i in range(256)]
    merges: list[tuple[bytes, bytes]] = []
    for a, b in pairs:
        merges.append((tok[a], tok[b]))
        tok.append(tok[a] + tok[b])
    vocab: dict[int, bytes] = {i: s.encode("utf-8") for i, s in enumerate(specials)}
    base = len(specials)
    for i, t in enumerate(tok):
        vocab[base + i] = t
    return vocab, merges
