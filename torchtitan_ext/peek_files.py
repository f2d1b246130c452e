"""``peek``'s files: loader state without pickle (:func:`save_state` / :func:`load_state`) and
batch archives (:func:`write_batches` / :func:`load_batches`, one batch flattened by
:func:`flatten_batch`). Their formats are described in :mod:`torchtitan_ext.peek`'s docstring
("Batch files", "Loader state"); this module holds the code so that the CLI module is the CLI.

Both are plain ``np.savez`` archives read with ``allow_pickle=False``: JSON for the structure,
arrays for every tensor, numpy array and long int list.
"""

from __future__ import annotations

import hashlib
import json
import math
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

BATCH_FORMAT = "torchtitan_ext.peek.batches/1"
STATE_FORMAT = "torchtitan_ext.peek.state/1"
META_KEY = "__meta__"
STRUCTURE_KEY = "__structure__"


# =========================================================================== pickle-free state
# Long lists of plain ints (a packer's token buffer: 10^5-10^6 entries) become one int64 array
# instead of JSON text (measured: ~1.5x faster to write, ~2.5x faster to read). Short lists stay
# readable in the JSON.
_INTLIST_MIN = 16
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_TAGS = (
    "__tuple__",
    "__dict__",
    "__bytes__",
    "__float__",
    "__tensor__",
    "__ndarray__",
    "__npscalar__",
    "__intlist__",
)


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, a: np.ndarray) -> str:
        name = f"a{len(self.arrays)}"
        self.arrays[name] = a
        return name

    def enc(self, v: Any, where: str) -> Any:
        import torch

        if isinstance(v, np.generic):  # first: np.float64 is also a Python float
            return {"__npscalar__": self.add(np.asarray(v))}
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            if math.isfinite(v):
                return v
            return {"__float__": repr(v)}  # strict JSON has no NaN/inf
        if isinstance(v, (bytes, bytearray)):
            name = self.add(np.frombuffer(bytes(v), dtype=np.uint8).copy())
            return {"__bytes__": name, "bytearray": isinstance(v, bytearray)}
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            try:
                a = t.numpy()
                raw = False
            except TypeError:
                # numpy lacks the dtype (bfloat16, float8...): keep the raw bytes, restore the view
                a = t.reshape(-1).view(torch.uint8).numpy()
                raw = True
            return {
                "__tensor__": self.add(a.copy()),
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "raw": raw,
            }
        if isinstance(v, np.ndarray):
            if v.dtype.hasobject:
                raise TypeError(f"state{where}: numpy object array cannot be stored without pickle")
            return {"__ndarray__": self.add(np.ascontiguousarray(v))}
        if isinstance(v, list):
            if (
                len(v) >= _INTLIST_MIN
                and all(type(x) is int for x in v)
                and min(v) >= _I64_MIN
                and max(v) <= _I64_MAX
            ):
                return {"__intlist__": self.add(np.asarray(v, dtype=np.int64))}
            return [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, tuple):
            return {"__tuple__": [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, Mapping):
            plain = all(
                isinstance(k, str) and not (k.startswith("__") and k.endswith("__")) for k in v
            )
            if plain:
                return {k: self.enc(x, f"{where}.{k}") for k, x in v.items()}
            return {
                "__dict__": [
                    [self.enc(k, f"{where}<key>"), self.enc(x, f"{where}[{k!r}]")]
                    for k, x in v.items()
                ]
            }
        raise TypeError(
            f"state{where}: {type(v).__name__} cannot be stored without pickle (supported: dict, "
            "list, tuple, int, float, bool, str, bytes, None, torch.Tensor, numpy arrays/scalars)"
        )


def _decode(v: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    import torch

    if isinstance(v, list):
        return [_decode(x, arrays) for x in v]
    if not isinstance(v, dict):
        return v
    tag = next((t for t in _TAGS if t in v), None)
    if tag is None:
        return {k: _decode(x, arrays) for k, x in v.items()}
    if tag == "__tuple__":
        return tuple(_decode(x, arrays) for x in v[tag])
    if tag == "__dict__":
        return {_hashable(_decode(k, arrays)): _decode(x, arrays) for k, x in v[tag]}
    if tag == "__float__":
        return float(v[tag])
    if tag == "__bytes__":
        b = arrays[v[tag]].tobytes()
        return bytearray(b) if v.get("bytearray") else b
    if tag == "__tensor__":
        a = arrays[v[tag]]
        dtype = getattr(torch, v["dtype"])
        t = torch.from_numpy(a.copy())
        if v["raw"]:
            t = t.view(dtype)
        return t.reshape(v["shape"])
    if tag == "__ndarray__":
        return arrays[v[tag]].copy()
    if tag == "__npscalar__":
        return arrays[v[tag]][()]
    if tag == "__intlist__":
        return arrays[v[tag]].tolist()
    raise AssertionError(tag)  # unreachable: tag comes from _TAGS


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def save_state(state: Any, path: str | Path) -> Path:
    """Write a loader ``state_dict()`` to ``path`` without pickle (JSON structure + npz arrays).

    Supports nested dicts (any hashable JSON-able keys), lists, tuples, int, float (incl. NaN/inf),
    bool, str, bytes, None, torch tensors (any dtype, incl. bfloat16) and numpy arrays/scalars.
    Anything else raises TypeError naming where it sits in the state.
    """
    enc = _Encoder()
    structure = {"format": STATE_FORMAT, "state": enc.enc(state, "")}
    blob = json.dumps(structure, allow_nan=False).encode()
    arrays = dict(enc.arrays)
    arrays[STRUCTURE_KEY] = np.frombuffer(blob, dtype=np.uint8)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a str path
        np.savez(f, **arrays)
    tmp.replace(p)  # atomic: a crash never leaves a half-written state behind
    return p


def load_state(path: str | Path) -> Any:
    """Read a state written by :func:`save_state` (``allow_pickle=False``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"loader state file not found: {p}")
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise ValueError(f"{p}: not a peek state file ({type(e).__name__}: {e})") from None
    if STRUCTURE_KEY not in arrays:
        raise ValueError(f"{p}: not a peek state file (no {STRUCTURE_KEY!r} entry)")
    structure = json.loads(arrays.pop(STRUCTURE_KEY).tobytes().decode())
    if structure.get("format") != STATE_FORMAT:
        raise ValueError(
            f"{p}: state format {structure.get('format')!r}, expected {STATE_FORMAT!r}"
        )
    return _decode(structure["state"], arrays)


# =========================================================================== batches
def flatten_batch(batch: Any) -> dict[str, Any]:
    """Leaves of a batch by flat key: ``(input_dict, labels)`` -> input_dict's keys + ``labels``;
    a dict -> its keys; nested containers join keys with ``"."``; list/tuple items use indices."""
    out: dict[str, Any] = {}

    def walk(key: str, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, x in v.items():
                walk(f"{key}.{k}" if key else str(k), x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{key}.{i}" if key else str(i), x)
        else:
            out[key or "batch"] = v

    if (
        isinstance(batch, (tuple, list))  # a DataLoader's default collate turns tuples into lists
        and len(batch) == 2
        and isinstance(batch[0], Mapping)
        and not isinstance(batch[1], (Mapping, list, tuple))
    ):
        walk("", batch[0])
        if "labels" in out:
            raise ValueError("batch input dict already has a 'labels' key; cannot name the labels")
        out["labels"] = batch[1]
    else:
        walk("", batch)
    return out


def _to_numpy(v: Any) -> tuple[np.ndarray, str | None]:
    """A batch leaf as a fresh numpy array (+ the torch dtype name when numpy lacks it)."""
    import torch

    if isinstance(v, torch.Tensor):
        t = v.detach().cpu()
        try:
            return t.numpy().copy(), None
        except TypeError:
            return t.contiguous().view(torch.int16).numpy().copy(), str(t.dtype).removeprefix(
                "torch."
            )
    return np.array(v, copy=True), None


def batch_arrays(batch: Any, pixels: str = "raw") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Numpy copies of a batch's leaves (copied: staging buffers are reused) and the non-array
    leaves / dtype notes for the metadata."""
    arrays: dict[str, np.ndarray] = {}
    notes: dict[str, Any] = {"other": {}, "dtypes": {}, "sha256_of": {}}
    for key, v in flatten_batch(batch).items():
        if v is None or isinstance(v, str):
            notes["other"][key] = v
            continue
        if not (hasattr(v, "shape") or isinstance(v, (int, float, bool))):
            notes["other"][key] = repr(v)
            continue
        a, tdtype = _to_numpy(v)
        if tdtype is not None:
            notes["dtypes"][key] = tdtype
        if pixels == "sha256" and "pixel_values" in key:
            a = np.ascontiguousarray(a)
            digest = hashlib.sha256(a.tobytes()).digest()
            notes["sha256_of"][key] = {"shape": list(a.shape), "dtype": str(a.dtype)}
            arrays[f"{key}.sha256"] = np.frombuffer(digest, dtype=np.uint8).copy()
            continue
        arrays[key] = a
    return arrays, notes


def write_batches(
    path: str | Path, batches: list[dict[str, np.ndarray]], meta: dict[str, Any]
) -> Path:
    """``np.savez`` archive: ``"{i}/{key}"`` arrays + ``"__meta__"`` (JSON as uint8)."""
    arrays: dict[str, np.ndarray] = {}
    for i, b in enumerate(batches):
        for k, a in b.items():
            arrays[f"{i}/{k}"] = a
    blob = json.dumps({"format": BATCH_FORMAT, **meta}, default=_json_default).encode()
    arrays[META_KEY] = np.frombuffer(blob, dtype=np.uint8)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        np.savez(f, **arrays)
    return p


def load_batches(path: str | Path) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
    """Read a ``--out`` file: (list of per-batch ``{key: array}``, metadata dict)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z[META_KEY].tobytes().decode())
        batches: list[dict[str, np.ndarray]] = [{} for _ in range(int(meta["num_batches"]))]
        for name in z.files:
            if name == META_KEY:
                continue
            i, key = name.split("/", 1)
            batches[int(i)][key] = z[name]
    return batches, meta


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def json_safe(v: Any) -> Any:
    """get_stats() output as JSON-able values (nested dicts kept)."""
    if isinstance(v, Mapping):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, np.generic):
        return v.item()
    return repr(v)
