"""The packer's part of :class:`~torchtitan_ext.text.prefetch.PrefetchingParquetLoader`'s state,
encoded pickle-free: ints, and int64 arrays as little-endian ``bytes`` (one blob per buffered
document for the best-fit packers).

Why bytes rather than lists of ints or tensors: wrappers such as ``AsyncDeviceLoader`` take
``deepcopy(state_dict())`` after *every* batch. ``bytes`` are immutable, so that copy shares them
(a list of ~450k ints would cost ~30 ms under the GIL per batch), and the per-document blobs are
cached across batches: only the ~40 documents that entered the buffer since the last call are
serialised (~0.2 ms per call for 1000 buffered documents). Tensors cannot be used because
torch.distributed.checkpoint loads them in place into a fresh loader's template, whose buffer has
a different size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchtitan_ext.text.packing import BestFitPacker, ConcatSplitPacker


def _to_bytes(values: Any) -> bytes:
    """int64 values as little-endian bytes (our checkpoint encoding of variable-length arrays)."""
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def _from_bytes(blob: bytes) -> np.ndarray:
    if not isinstance(blob, (bytes, bytearray)) or len(blob) % 8:
        raise ValueError(f"loader state: expected int64 bytes, got {type(blob).__name__}")
    return np.frombuffer(blob, dtype="<i8").astype(np.int64)


def encode_packer(
    snap: dict[str, Any],
    packer: BestFitPacker | ConcatSplitPacker,
    packing: str,
    cache: dict[int, bytes],
) -> tuple[dict[str, Any], dict[int, bytes]]:
    """The checkpoint form of the packer snapshot ``snap`` (taken from ``packer``, a
    ``packing`` packer), and the per-document blob cache for the next call (best-fit: blobs
    by insertion number, reused from ``cache``)."""
    row_len = packer.row_len
    if "keys" in snap:  # best-fit: per-document blobs, cached by insertion number
        keys, docs = snap["keys"], snap["docs"]
        blobs: list[bytes] = []
        fresh: dict[int, bytes] = {}
        for _, seq in keys:
            b = cache.get(seq)
            if b is None:
                b = _to_bytes(docs[seq])
            fresh[seq] = b
            blobs.append(b)
        return {
            "kind": 0 if packing == "best_fit" else 1,
            "row_len": row_len,
            "next_seq": int(snap["next_seq"]),
            "lengths": _to_bytes([k[0] for k in keys]),
            "seqs": _to_bytes([k[1] for k in keys]),
            "docs": blobs,
        }, fresh
    # concat-split: a short buffer, serialised whole
    ps = packer.state_from_snapshot(snap)
    return {
        "kind": 2,
        "row_len": row_len,
        "lengths": _to_bytes(ps["lengths"]),
        "tokens": _to_bytes(ps["tokens"]),
    }, cache


def decode_packer(ps: dict[str, Any], counters: dict[str, Any]) -> dict[str, Any]:
    """The packer's ``load_state_dict`` input from :func:`encode_packer`'s output (``ps``) and
    the packer's counters; the packer validates kind, row length and sizes."""
    packer_state: dict[str, Any] = {
        "kind": int(ps["kind"]),
        "row_len": int(ps["row_len"]),
        "lengths": _from_bytes(ps["lengths"]),
        "counters": counters,
    }
    if "docs" in ps:
        packer_state["next_seq"] = int(ps["next_seq"])
        packer_state["seqs"] = _from_bytes(ps["seqs"])
        docs = [_from_bytes(b) for b in ps["docs"]]
        packer_state["tokens"] = np.concatenate(docs) if docs else np.zeros(0, np.int64)
    else:
        packer_state["tokens"] = _from_bytes(ps["tokens"])
    return packer_state
