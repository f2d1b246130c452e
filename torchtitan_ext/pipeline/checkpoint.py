"""The one checkpoint format of every loader: pickle-free, versioned, and saying where it resumes.

A loader's checkpoint value (what its ``state_dict()`` returns to torchtitan) is one envelope::

    {"global": {
        "format": "torchtitan_ext.loader",  "version": 1,
        "loader": "parquet_prefetch",        # who wrote it (a different loader is refused)
        "dp_world_size": 2,                  # DP ranks that wrote it
        "resumable_at": "any",               # "any" DP degree, or "same" (this one only)
        "ranks": (<rank 0 state>, <rank 1 state>),   # encoded stage states, by DP rank
    }}

Why one envelope under one key, identical on every rank: torchtitan's checkpointer hands the
value to torch.distributed.checkpoint, which keeps one copy of a non-tensor value that every
rank saves under the same key; on load every rank then sees every old rank's state, which is
what resuming at another DP degree needs (an old rank's unread data must go to someone). The
ranks' states are gathered when the checkpoint is taken (:func:`gather`, one collective at
checkpoint time, never per batch). A loader whose position is a pure function of the global
step (VL) saves the same state on every rank and needs no gather; it still uses the envelope.

Encoding (:func:`encode` / :func:`decode`): numpy arrays become ``{"__ndarray__": dtype,
"shape": [...], "data": <little-endian bytes>}``; tuples become lists; everything else must be
``int``/``float``/``str``/``bytes``/``bool``/``None``/list/dict (str keys) — anything else is
refused at save time, naming the path inside the state. Nothing is pickled by us, so a
checkpoint never runs code when it is loaded, and DCP's own copy of the value is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

FORMAT = "torchtitan_ext.loader"
VERSION = 1
KEY = "global"
RESUMABLE_AT = ("any", "same")


class LoaderStateError(ValueError):
    """A loader checkpoint cannot be resumed by this loader (one line: what and why)."""


def encode(tree: Any, path: str = "state") -> Any:
    """A pickle-free copy of ``tree`` (numpy arrays as little-endian bytes)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: key {k!r} is not a str (loader states are str-keyed)")
            out[k] = encode(v, f"{path}.{k}")
        return out
    if isinstance(tree, (list, tuple)):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(tree)]
    if isinstance(tree, np.ndarray):
        arr = np.ascontiguousarray(tree)
        le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        return {"__ndarray__": le.dtype.str, "shape": list(arr.shape), "data": le.tobytes()}
    if isinstance(tree, np.generic):
        return tree.item()
    if tree is None or isinstance(tree, (bool, int, float, str, bytes)):
        return tree
    raise TypeError(f"{path}: {type(tree).__name__} is not allowed in a loader state")


def decode(tree: Any) -> Any:
    """Inverse of :func:`encode` (arrays come back writable and native-endian)."""
    if isinstance(tree, dict):
        if "__ndarray__" in tree:
            arr = np.frombuffer(bytes(tree["data"]), dtype=np.dtype(str(tree["__ndarray__"])))
            return arr.astype(arr.dtype.newbyteorder("="), copy=True).reshape(
                [int(x) for x in tree["shape"]]
            )
        return {k: decode(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [decode(v) for v in tree]
    if hasattr(tree, "item") and not isinstance(tree, (bytes, str)):  # a 0-d tensor after DCP
        return tree.item()
    return tree


def envelope(loader: str, rank_states: Sequence[Any], resumable_at: str = "any") -> dict[str, Any]:
    """The checkpoint value for ``rank_states`` (one stage state per DP rank, in rank order)."""
    if resumable_at not in RESUMABLE_AT:
        raise ValueError(f"resumable_at must be one of {RESUMABLE_AT}, got {resumable_at!r}")
    return {
        KEY: {
            "format": FORMAT,
            "version": VERSION,
            "loader": loader,
            "dp_world_size": len(rank_states),
            "resumable_at": resumable_at,
            # A tuple: torch.distributed.checkpoint keeps it as ONE leaf. A list of dicts it
            # flattens key by key, and a load then asks only for the keys of the loading side's
            # own state: another DP degree fails ("Missing key ...ranks.1..."), and keys the
            # fresh state lacks (a skip reason, an elastic history entry) are silently dropped.
            "ranks": tuple(encode(s, f"{loader}.ranks[{i}]") for i, s in enumerate(rank_states)),
        }
    }


def open_envelope(
    value: dict[str, Any], loader: str, dp_world_size: int, like: dict[str, Any] | None = None
) -> list[Any]:
    """The decoded per-rank states of a checkpoint value, after checking that ``loader`` at
    ``dp_world_size`` ranks may resume from it; :class:`LoaderStateError` (one line) if not.
    ``like``: a state of this loader (its own ``rank_state()``); every saved rank state must be
    a dict holding at least its keys, so a damaged or foreign state is named here rather than
    failing with a bare ``KeyError`` deep in a stage (or, worse, resuming from defaults)."""
    env = value.get(KEY) if isinstance(value, dict) else None
    if not isinstance(env, dict) or env.get("format") != FORMAT:
        keys = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise LoaderStateError(
            f"{loader}: the checkpoint's dataloader state is not in this version's format "
            f"(keys {keys}); resume it with the release that wrote it, or start the data "
            "stream afresh with --checkpoint.exclude_from_loading dataloader"
        )
    version = int(env["version"])
    if version != VERSION:
        raise LoaderStateError(
            f"{loader}: dataloader state format version {version}, this release reads {VERSION}"
        )
    if env["loader"] != loader:
        raise LoaderStateError(
            f"{loader}: the checkpoint's dataloader state was written by {env['loader']!r}; "
            "a different loader cannot continue its stream (--checkpoint.exclude_from_loading "
            "dataloader starts afresh)"
        )
    saved = int(env["dp_world_size"])
    if env["resumable_at"] == "same" and saved != dp_world_size:
        raise LoaderStateError(
            f"{loader}: the dataloader state was saved by {saved} DP ranks and resumes only at "
            f"that degree, this run has {dp_world_size}"
        )
    raw = env["ranks"]
    if not isinstance(raw, (list, tuple)):
        raise LoaderStateError(
            f"{loader}: the dataloader state's ranks are a {type(raw).__name__}, not a list of "
            "rank states (a damaged checkpoint?)"
        )
    ranks = [decode(s) for s in raw]
    if len(ranks) != saved:
        raise LoaderStateError(
            f"{loader}: the dataloader state names {saved} DP ranks but holds {len(ranks)}"
        )
    for i, r in enumerate(ranks):
        if not isinstance(r, dict):
            raise LoaderStateError(
                f"{loader}: DP rank {i}'s saved state is a {type(r).__name__}, not a dict "
                "(a damaged checkpoint?)"
            )
    if like is not None:
        check_like(ranks, like, loader)
    return ranks


def check_like(ranks: list[dict[str, Any]], like: dict[str, Any], loader: str) -> None:
    """Every saved rank state holds at least the keys of ``like`` (a state of this loader);
    :class:`LoaderStateError` naming the rank and the keys if not."""
    for i, r in enumerate(ranks):
        missing = sorted(set(like) - set(r))
        if missing:
            raise LoaderStateError(
                f"{loader}: DP rank {i}'s saved state lacks {', '.join(missing)} "
                "(a damaged checkpoint, or one of another loader version?)"
            )


def gather(local_state: Any, dp_rank: int, dp_world_size: int) -> list[Any]:
    """Every DP rank's state, in rank order, on every rank (``[local_state]`` alone without
    torch.distributed or with one DP rank).

    One ``all_gather_object`` over the default group at checkpoint time. Ranks that share a DP
    rank (tensor / context parallel peers) hold the same data position; the first one's state is
    kept. The local state is encoded first, so only plain values cross the wire.
    """
    if dp_world_size == 1:
        return [local_state]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise LoaderStateError(
            f"dp_world_size={dp_world_size} but torch.distributed is not initialised: the "
            "ranks' loader states cannot be gathered (build the loader with the real DP layout)"
        )
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (dp_rank, encode(local_state)))
    by_rank: dict[int, Any] = {}
    for r, s in got:
        by_rank.setdefault(int(r), s)
    missing = [r for r in range(dp_world_size) if r not in by_rank]
    if missing:
        raise LoaderStateError(f"loader state gather: no state from DP ranks {missing}")
    return [decode(by_rank[r]) for r in range(dp_world_size)]
