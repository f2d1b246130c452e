"""Packed rows of :class:`~torchtitan_ext.text.streaming.StreamingTextDataset`: the per-token
document bookkeeping, the sample tensors, and the JSON form of the packer's state.

The bookkeeping (*track*) is a deque of ``[doc_id, epoch, tokens left, segment length]`` per
buffered document segment, in packer order; a row of ``n`` valid tokens consumes ``n`` tokens of
it. Why it exists: ``doc_ids`` / ``doc_epochs`` / ``doc_offsets`` let the diversity checks
(``scripts/verify_data_diversity.py``) prove that no document is repeated or lost, and the
track is small (a few ints per buffered document), so it is part of the checkpoint.

The state here is ints, lists of ints and numpy arrays (no pickle; :func:`as_json` makes it
JSON-serialisable, the checkpoint envelope stores arrays as little-endian bytes).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from torchtitan_ext.text.packing import ConcatSplitPacker, row_to_example

Sample = tuple[dict[str, torch.Tensor], torch.Tensor]


def take_doc_ids(track: deque[list[int]], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Consume ``n`` tokens of ``track``: per-token doc id, epoch and offset inside the document
    (offset 0 = the document starts here); -1 past the tracked tokens."""
    ids = np.full(n, -1, dtype=np.int64)
    eps = np.full(n, -1, dtype=np.int64)
    offs = np.full(n, -1, dtype=np.int64)
    i = 0
    while i < n and track:
        t = track[0]
        take = min(t[2], n - i)
        ids[i : i + take] = t[0]
        eps[i : i + take] = t[1]
        start = t[3] - t[2]
        offs[i : i + take] = np.arange(start, start + take)
        i += take
        t[2] -= take
        if t[2] == 0:
            track.popleft()
    return ids, eps, offs


def make_sample(
    row: Any, doc_ids: tuple[np.ndarray, np.ndarray, np.ndarray] | None, seq_len: int
) -> Sample:
    """``({"input", "positions"[, "doc_ids", "doc_epochs", "doc_offsets"]}, labels)`` from a
    packed row of ``seq_len + 1`` tokens; the per-token doc fields only when ``doc_ids`` is
    given (from :func:`take_doc_ids` on the row's valid tokens), -1 on padding."""
    inp, labels, pos = row_to_example(row)
    d = {"input": torch.from_numpy(inp.copy()), "positions": torch.from_numpy(pos.copy())}
    if doc_ids is not None:
        for key, vals in zip(("doc_ids", "doc_epochs", "doc_offsets"), doc_ids, strict=True):
            full = np.full(seq_len + 1, -1, dtype=np.int64)
            full[: row.valid] = vals
            d[key] = torch.from_numpy(full[:-1])
    return d, torch.from_numpy(labels)


def packer_state(packer: ConcatSplitPacker) -> dict[str, Any]:
    """The packer's state: ints and two fresh arrays (``lengths`` of the pending segments, int64;
    their ``tokens`` concatenated, int32 from our tokenizer), never changed once returned. Cheap enough to take after
    every batch (one concatenate; lists of Python ints cost ~2 % of a 8 x 2048 batch)."""
    p = packer.state_dict()
    return {
        "kind": int(p["kind"]),
        "row_len": int(p["row_len"]),
        "lengths": p["lengths"],
        "tokens": p["tokens"],
        "counters": {k: int(v) for k, v in p["counters"].items()},
    }


def as_json(state: dict[str, Any]) -> dict[str, Any]:
    """A slot state with its packer arrays as lists of ints (JSON-serialisable), for users of
    the dataset's ``state_dict()`` outside the checkpoint envelope (which encodes arrays)."""
    pk = state["packer"]
    lists = {k: np.asarray(pk[k]).tolist() for k in ("lengths", "tokens")}
    return {**state, "packer": {**pk, **lists}}


def packer_from_state(packer: ConcatSplitPacker, pk: dict[str, Any]) -> None:
    """Load :func:`packer_state`'s output (arrays or lists) into ``packer`` (which checks kind
    and sizes)."""
    packer.load_state_dict(
        {
            "kind": pk["kind"],
            "row_len": pk["row_len"],
            "lengths": np.asarray(pk["lengths"], dtype=np.int64),
            "tokens": pk["tokens"],  # the packer keeps int32 arrays as they are
            "counters": pk["counters"],
        }
    )
