"""The packed Qwen3-VL cache format: constants, the manifest digest, the reader, verify.

Layout (one directory per cache key, ``<name>_<split>_seq<L>_buf<B>_<key12>/``; written by
``vl/build.py``)::

    metadata.json        the manifest: config, key, versions, counts, shard table, every file's
                         size + sha256, and a digest of all of it (last written: commit marker)
    packing_stats.json   packs, samples/pack, fill %, images/pack, buckets, skips by reason
    shards/00000/        one TensorDict memmap per shard of ``rows_per_shard`` input rows
        meta.json        (tensordict's, JSON)        tokens.memmap      int32 [T]
        label_mask.memmap uint8 [T] (1 = target)     pixels.memmap      uint8 [P, 3*patch²]
        grid_thw.memmap  int32 [I, 3]                sample_lens.memmap int32 [S]
        sample_rows.memmap int64 [S] (input row)     pack_offsets.memmap int64 [K+1, 4]
        pack_len.memmap  int32 [K] (padded length)   stats.json  (shard counts, skips, checksums)

A column with no rows has no file (tensordict writes none). Only content tokens are stored
(padding is added at read time) and ``position_ids`` are not stored: they are a pure function of
the tokens and ``image_grid_thw`` (``processor.position_rows``, ~0.1 ms per pack). Labels are a
1-byte mask. So a pack costs 768 B per patch + 5 B per token, vs 6144 B per patch + 48 B per token
for a float32/int64 layout: <= 1/8 of its bytes, losslessly.

Reading never unpickles and never writes
----------------------------------------
The reader does not use tensordict at all: every column's dtype is fixed here (:data:`COLUMNS`)
and its shape follows from the shard's counts in the manifest, so a shard is mapped with
``np.memmap(mode="c")``: the file is opened ``O_RDONLY`` and mapped copy-on-write, so nothing a
process does to a pack's arrays reaches the file, and a read-only cache directory works. A
``meta.json`` is only compared with the manifest's record (an extra entry, such as a pickled
``NonTensorData``, is an error naming it); no ``other.pickle`` is ever opened. (A tool that
wants a shard as a TensorDict should load it with ``TensorDict.load_memmap(d, mode="r",
allow_pickle=False)``.)

What ``open`` checks (cheap; ~20 ms at 10k packs / 240 shards on a loaded 2-core box) and what
``verify`` adds
-----------------------------------------------------------------------------------------------
``VLCache.open`` raises :class:`CacheError` (a ``ValueError`` whose message starts with the file)
before mapping anything when:

* ``metadata.json`` is missing, not JSON, not an object, of another format version, or does not
  match its own digest (:func:`manifest_digest`; the error names the changed field, e.g.
  ``special_tokens.pad_id``), or lacks a field the reader needs;
* a recorded file is missing or its size differs from the manifest (truncated or appended), or a
  manifest size disagrees with the shard's counts;
* a shard's ``meta.json`` differs from its recorded sha256 (the error names the differing field,
  e.g. ``tokens.shape``, or an unexpected entry);
* a file or directory the format does not have sits in the cache (a planted file).

A shard's index (pack offsets, padded lengths, sample lengths, image grids) is checked against
its counts when the shard is first mapped, so a changed index is an error, never a wrong pack.
The bytes of tokens and pixels are covered only by their sha256, which ``verify()`` (and
``inspect-cache --verify``) recomputes for every file (~1 GB/s).

The digest is a self-check against corruption and accidental edits, not a signature: whoever can
write the directory can write a matching digest.

Why lazy shards: opening a 10k-pack cache of 8k-token packs at the default 1,024 rows per shard
(~43 packs per shard, ~240 shards) with one ``TensorDict.load_memmap`` per shard cost ~190 ms
(~0.8 ms per shard); here open reads the manifest, stats every file and reads each shard's
``meta.json``, and a shard's eight arrays are mapped on its first ``pack(i)`` (~0.2 ms).
Measured in ``python -m benchmarks vl_dataset`` (open rows).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_NAME = "torchtitan_ext.vl_cache"
FORMAT_VERSION = 2
MANIFEST = "metadata.json"
PACKING_STATS = "packing_stats.json"
SHARDS = "shards"
SHARD_META = "meta.json"
SHARD_STATS = "stats.json"
IGNORE_INDEX = -100


class CacheError(ValueError):
    """A cache that cannot be served as it is: damaged, edited, foreign or incomplete. The
    message starts with the file and says what is wrong with it."""


@dataclass(frozen=True)
class Column:
    """One array of a shard: ``<name>.memmap``, ``dtype``, ``rows`` from the shard's count
    ``count`` (+1 for ``pack_offsets``), and a fixed row width (0: a 1-D array; -1: the patch
    width ``3 * patch_size**2``)."""

    name: str
    dtype: str
    count: str
    width: int = 0
    plus_one: bool = False


COLUMNS: tuple[Column, ...] = (
    Column("tokens", "int32", "tokens"),
    Column("label_mask", "uint8", "tokens"),
    Column("pixels", "uint8", "patches", width=-1),
    Column("grid_thw", "int32", "images", width=3),
    Column("sample_lens", "int32", "samples"),
    Column("sample_rows", "int64", "samples"),
    Column("pack_offsets", "int64", "packs", width=4, plus_one=True),
    Column("pack_len", "int32", "packs"),
)
SHARD_COUNTS = ("packs", "samples", "tokens", "images", "patches")
"""Counts each shard entry of the manifest carries (they give every column's shape)."""


def column_shape(col: Column, shard: dict[str, Any], patch_dim: int) -> tuple[int, ...]:
    n = int(shard[col.count]) + (1 if col.plus_one else 0)
    width = patch_dim if col.width == -1 else col.width
    return (n, width) if width else (n,)


_ITEMSIZE = {c.name: np.dtype(c.dtype).itemsize for c in COLUMNS}


def torch_dtype_name(dtype: str) -> str:
    return f"torch.{dtype}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# the manifest digest


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _h16(obj: Any) -> str:
    return hashlib.sha256(canonical(obj).encode()).hexdigest()[:16]


def _field_digests(body: dict[str, Any]) -> dict[str, str]:
    """Short digests per field, two levels deep (``config.seq_len``, ``shards[3]``), to name
    what changed; the ``files`` records are grouped by directory (``files[shards/00003]``)."""
    out: dict[str, str] = {}
    for k, v in body.items():
        if k == "files" and isinstance(v, dict):
            groups: dict[str, dict[str, Any]] = {}
            for rel, rec in v.items():
                groups.setdefault(os.path.dirname(rel) or ".", {})[rel] = rec
            out.update({f"files[{d}]": _h16(g) for d, g in groups.items()})
        elif isinstance(v, dict) and v:
            out.update({f"{k}.{k2}": _h16(v2) for k2, v2 in v.items()})
        elif isinstance(v, list) and v:
            out.update({f"{k}[{i}]": _h16(v2) for i, v2 in enumerate(v)})
        else:
            out[k] = _h16(v)
    return out


def manifest_digest(meta: dict[str, Any]) -> dict[str, Any]:
    """The ``digest`` entry of a manifest: sha256 over every other field (and over the field
    digests, so that those cannot change unnoticed either)."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    fields = _field_digests(body)
    root = hashlib.sha256(canonical({"body": body, "fields": fields}).encode()).hexdigest()
    return {"algorithm": "sha256", "root": root, "fields": fields}


def check_digest(meta: dict[str, Any], mf: Path) -> None:
    """Raise CacheError naming the changed field(s) unless ``meta`` matches its digest.

    Cost: one canonical serialisation + sha256 of the manifest (~3 ms at 10k packs); the
    per-field digests are only recomputed to name what changed."""
    d = meta.get("digest")
    if not isinstance(d, dict) or not isinstance(d.get("fields"), dict):
        raise CacheError(f"{mf}: field digest is missing or not an object (edited or corrupted)")
    if sorted(d) != ["algorithm", "fields", "root"] or d["algorithm"] != "sha256":
        raise CacheError(
            f"{mf}: field digest.algorithm (or the digest's keys) changed: {sorted(d)}"
        )
    body = {k: v for k, v in meta.items() if k != "digest"}
    stored = d["fields"]
    root = hashlib.sha256(canonical({"body": body, "fields": stored}).encode()).hexdigest()
    if root == d.get("root"):
        return
    actual = _field_digests(body)
    changed = sorted(k for k in stored.keys() | actual.keys() if stored.get(k) != actual.get(k))
    if not changed:
        what = "field digest.root was changed"
    elif len(changed) == 1:
        what = f"field {changed[0]} does not match its recorded digest"
    else:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        what = f"fields {', '.join(changed[:3])}{more} do not match their recorded digests"
    raise CacheError(f"{mf}: {what} (edited or corrupted after the cache was written)")


# ----------------------------------------------------------------------------------------------
# reading the manifest


def _need(cond: bool, mf: Path, field: str, what: str) -> None:
    if not cond:
        raise CacheError(f"{mf}: field {field} {what}")


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse and check ``metadata.json`` of the cache at ``path`` (format, digest, the fields the
    reader uses); raises CacheError naming the file and field."""
    mf = path / MANIFEST
    try:
        text = mf.read_bytes()
    except FileNotFoundError:
        raise CacheError(f"{mf}: missing (not a complete VL cache)") from None
    except OSError as e:
        raise CacheError(f"{mf}: cannot read ({e.strerror or e})") from None
    try:
        meta = json.loads(text)
    except ValueError as e:
        raise CacheError(f"{mf}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CacheError(f"{mf}: not a JSON object (got {type(meta).__name__})")
    if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
        raise CacheError(
            f"{mf}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT_NAME} v{FORMAT_VERSION}; rebuild the cache (preprocess-cached --force)"
        )
    check_digest(meta, mf)
    _check_fields(meta, mf)
    return meta


def _check_fields(meta: dict[str, Any], mf: Path) -> None:
    """The fields the reader relies on exist with the right types (a manifest with a valid
    digest but written by something else must still fail with a named field, not a KeyError)."""
    cfg = meta.get("config")
    _need(isinstance(cfg, dict), mf, "config", "is missing or not an object")
    _need(
        _is_count(cfg.get("seq_len")) and cfg["seq_len"] > 0,
        mf,
        "config.seq_len",
        "is not positive",
    )
    sp = meta.get("special_tokens")
    _need(isinstance(sp, dict), mf, "special_tokens", "is missing or not an object")
    for k in ("pad_id", "image_pad_id"):
        _need(_is_count(sp.get(k)), mf, f"special_tokens.{k}", "is missing or not an id")
    ip = meta.get("image_params")
    _need(isinstance(ip, dict), mf, "image_params", "is missing or not an object")
    for k in ("patch_size", "merge_size"):
        _need(_is_count(ip.get(k)) and ip[k] > 0, mf, f"image_params.{k}", "is not positive")
    files = meta.get("files")
    _need(isinstance(files, dict), mf, "files", "is missing or not an object")
    for rel, rec in files.items():  # plain checks: ~2,400 records at 10k packs
        if not (isinstance(rec, dict) and _is_count(rec.get("size"))
                and isinstance(rec.get("sha256"), str)):  # fmt: skip
            _need(False, mf, f"files[{rel}]", "is malformed")
        if rel.startswith("/") or ".." in rel.split("/"):
            _need(False, mf, f"files[{rel}]", "is not a path inside the cache")
    shards = meta.get("shards")
    _need(isinstance(shards, list), mf, "shards", "is missing or not a list")
    names = set()
    for i, s in enumerate(shards):
        _need(isinstance(s, dict), mf, f"shards[{i}]", "is not an object")
        name = s.get("name")
        _need(isinstance(name, str) and name.isdigit(), mf, f"shards[{i}].name", "is malformed")
        _need(name not in names, mf, f"shards[{i}].name", f"repeats {name}")
        names.add(name)
        for c in SHARD_COUNTS:
            if not _is_count(s.get(c)):
                _need(False, mf, f"shards[{i}].{c}", "is missing or negative")
    counts = meta.get("counts")
    _need(isinstance(counts, dict), mf, "counts", "is missing or not an object")
    total = sum(int(s["packs"]) for s in shards)
    _need(counts.get("packs") == total, mf, "counts.packs", f"is not the shards' sum {total}")


# ----------------------------------------------------------------------------------------------
# a shard's meta.json (tensordict's)


def shard_meta_template(doc: dict[str, Any]) -> dict[str, Any]:
    """What every shard's ``meta.json`` shares, taken from one of them: its top-level scalars
    (tensordict's class and format version, ...) and the per-entry fields other than shape and
    dtype. Stored in the manifest as ``shard_meta``."""
    entry = next((v for v in doc.values() if isinstance(v, dict)), {})
    return {
        "header": {k: v for k, v in doc.items() if not isinstance(v, dict)},
        "entry": {k: v for k, v in entry.items() if k not in ("shape", "dtype")},
    }


def shard_meta_problem(
    doc: Any, shapes: dict[str, tuple[int, ...]], template: dict[str, Any]
) -> str | None:
    """What is wrong with a shard's parsed ``meta.json`` (naming the field), or None: exactly one
    tensor entry per non-empty column with the manifest's shape and dtype, nothing else."""
    if not isinstance(doc, dict):
        return f"not a JSON object (got {type(doc).__name__})"
    known = {c.name for c in COLUMNS}
    for k, v in doc.items():
        if k not in known and isinstance(v, dict):
            return (
                f"unexpected entry {k!r} (this format holds tensors only; non-tensor or pickled "
                "data is refused, never loaded)"
            )
    for c in COLUMNS:
        entry = doc.get(c.name)
        if entry is None:
            if int(np.prod(shapes[c.name])):
                return f"entry {c.name} is missing"
            continue
        if not isinstance(entry, dict):
            return f"field {c.name} is {entry!r}, expected an entry"
        want = {
            "shape": list(shapes[c.name]),
            "dtype": torch_dtype_name(c.dtype),
            **template.get("entry", {}),
        }
        for k in sorted(entry.keys() | want.keys()):
            if entry.get(k) != want.get(k):
                return f"field {c.name}.{k} is {entry.get(k)!r}, expected {want.get(k)!r}"
    header = template.get("header", {})
    for k in sorted((doc.keys() - known) | header.keys()):
        if doc.get(k) != header.get(k):
            return f"field {k} is {doc.get(k)!r}, expected {header.get(k)!r}"
    return None


# ----------------------------------------------------------------------------------------------
# the reader


class _Shard:
    """One shard's arrays, mapped read-only (copy-on-write) on first use and index-checked."""

    __slots__ = ("cols", "doc", "path", "rel", "shapes")

    def __init__(self, path: Path, rel: str, doc: dict[str, Any], patch_dim: int):
        self.path, self.rel, self.doc = path, rel, doc
        self.shapes = {c.name: column_shape(c, doc, patch_dim) for c in COLUMNS}
        self.cols: dict[str, np.ndarray] | None = None

    def files(self) -> dict[str, int]:
        """``name.memmap`` -> expected bytes, for the columns that have rows (and so a file)."""
        out = {}
        for name, shape in self.shapes.items():
            n = shape[0] * (shape[1] if len(shape) > 1 else 1) * _ITEMSIZE[name]
            if n:
                out[f"{name}.memmap"] = n
        return out

    def arrays(self, seq_len: int) -> dict[str, np.ndarray]:
        if self.cols is None:
            cols = {}
            for c in COLUMNS:
                shape = self.shapes[c.name]
                if int(np.prod(shape)) == 0:
                    cols[c.name] = np.zeros(shape, dtype=c.dtype)
                else:  # mode "c": O_RDONLY + MAP_PRIVATE: writes never reach the file
                    mm = np.memmap(self.path / f"{c.name}.memmap", c.dtype, "c", shape=shape)
                    cols[c.name] = np.asarray(mm)
            _check_index(cols, self.doc, seq_len, f"{self.path}/")
            self.cols = cols
        return self.cols


def _check_index(cols: dict[str, np.ndarray], doc: dict[str, Any], seq_len: int, where: str):
    """The pack index of a shard agrees with its counts and with itself (cheap: K, S, I ints)."""
    o, plen = cols["pack_offsets"], cols["pack_len"].astype(np.int64)

    def bad(name: str, what: str) -> CacheError:
        return CacheError(f"{where}{name}: {what} (damaged; run inspect-cache --verify)")

    last = [doc["samples"], doc["tokens"], doc["images"], doc["patches"]]
    if o[0].tolist() != [0, 0, 0, 0] or o[-1].tolist() != last:
        raise bad("pack_offsets.memmap", f"first/last rows {o[0].tolist()}/{o[-1].tolist()}, counts say "
                                  f"[0, 0, 0, 0]/{last}")  # fmt: skip
    if (np.diff(o, axis=0) < 0).any():
        raise bad("pack_offsets.memmap", "offsets decrease")
    ntok = np.diff(o[:, 1])
    if ((plen < ntok) | (plen > seq_len)).any():
        raise bad(
            "pack_len.memmap", f"a padded length is below its pack's tokens or above {seq_len}"
        )
    lens = cols["sample_lens"].astype(np.int64)
    if (lens <= 0).any() or np.diff(np.concatenate(([0], np.cumsum(lens)))[o[:, 0]]).tolist() != (
        ntok.tolist()
    ):
        raise bad(
            "sample_lens.memmap / pack_offsets.memmap",
            "sample lengths do not add up to the packs' token counts",
        )
    grid = cols["grid_thw"].astype(np.int64)
    if (grid <= 0).any():
        raise bad("grid_thw.memmap", "an image grid is not positive")
    per_img = np.concatenate(([0], np.cumsum(grid.prod(axis=1))))
    if np.diff(per_img[o[:, 2]]).tolist() != np.diff(o[:, 3]).tolist():
        raise bad(
            "grid_thw.memmap / pack_offsets.memmap",
            "image grids do not add up to the packs' patch counts",
        )


class VLCache:
    """Read-only view of a complete cache: ``len``, ``pack(i)``, ``pack_shape(i)``,
    ``pack_rows(i)``, ``verify()``. Open it with :meth:`open` (checks: module docstring)."""

    def __init__(self, path: Path, metadata: dict[str, Any]):
        self.path = path
        self.metadata = metadata
        self.special_tokens: dict[str, int] = dict(metadata["special_tokens"])
        self.image_params: dict[str, Any] = metadata["image_params"]
        self.spatial_merge_size = int(self.image_params["merge_size"])
        self.patch_dim = 3 * int(self.image_params["patch_size"]) ** 2
        self.seq_len = int(metadata["config"]["seq_len"])
        self._shards = [
            _Shard(path / SHARDS / s["name"], f"{SHARDS}/{s['name']}", s, self.patch_dim)
            for s in metadata["shards"]
        ]
        counts = [int(s["packs"]) for s in metadata["shards"]]
        self._starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self._n = int(self._starts[-1])

    @classmethod
    def open(cls, path: str | Path) -> VLCache:
        """Open the cache at ``path`` (a key directory); raises CacheError when it is damaged."""
        p = Path(path)
        cache = cls(p, read_manifest(p))
        for problem in cache._layout_problems():
            raise CacheError(problem)
        return cache

    def __len__(self) -> int:
        return self._n

    # -- checks ---------------------------------------------------------------------------------
    def _expected_files(self) -> dict[str, int | None]:
        """Every file the format puts here -> its size from the shard counts (None: only the
        manifest knows it)."""
        out: dict[str, int | None] = {PACKING_STATS: None}
        for sh in self._shards:
            out[f"{sh.rel}/{SHARD_META}"] = None
            out[f"{sh.rel}/{SHARD_STATS}"] = None
            out.update({f"{sh.rel}/{n}": size for n, size in sh.files().items()})
        return out

    def _layout_problems(self, writing: bool = False) -> Iterator[str]:
        """Manifest vs shard counts, files on disk vs manifest, meta.json vs its record, files
        that should not be here. One message per problem, each naming its file."""
        files = self.metadata["files"]
        expected = self._expected_files()
        mf = self.path / MANIFEST
        for rel in sorted(expected.keys() - files.keys()):
            yield f"{mf}: field files has no record of {rel}"
        for rel in sorted(files.keys() - expected.keys()):
            yield f"{mf}: field files[{rel}] records a file the shard counts do not have"
        for rel, size in expected.items():
            rec = files.get(rel)
            if rec is not None and size is not None and rec["size"] != size:
                yield f"{mf}: field files[{rel}].size is {rec['size']}, the counts give {size}"
        shards = {f"{sh.rel}/{SHARD_META}": sh for sh in self._shards}
        root = str(self.path)
        for rel, rec in files.items():
            if rel in shards:  # compared by content, so that the error names the field
                problem = self._meta_json_problem(shards[rel], rec)
                if problem:
                    yield problem
                continue
            f = f"{root}/{rel}"
            try:
                st = os.stat(f)
            except FileNotFoundError:
                yield f"{f}: missing (the manifest records {rec['size']} bytes)"
                continue
            if st.st_size != rec["size"]:
                yield (
                    f"{f}: size {st.st_size} bytes, the manifest records {rec['size']} "
                    f"({'truncated' if st.st_size < rec['size'] else 'appended to'})"
                )
        yield from self._unexpected_entries(files, writing)

    def _meta_json_problem(self, sh: _Shard, rec: dict[str, Any]) -> str | None:
        f = f"{sh.path}/{SHARD_META}"
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return f"{f}: missing (the manifest records {rec['size']} bytes)"
        if hashlib.sha256(data).hexdigest() == rec["sha256"]:
            return None
        try:
            doc = json.loads(data)
        except ValueError as e:
            return f"{f}: not valid JSON ({e})"
        problem = shard_meta_problem(doc, sh.shapes, self.metadata.get("shard_meta", {}))
        return f"{f}: {problem or 'content differs from its recorded sha256'}"

    def _unexpected_entries(self, files: dict[str, Any], writing: bool) -> Iterator[str]:
        """Names in the key directory, ``shards/`` and each shard that the format lacks
        (``writing``: the writer's commit check, which leaves a live writer's ``.tmp-*`` be)."""
        allowed: dict[str, set[str]] = {".": {MANIFEST, SHARDS}, SHARDS: set()}
        for rel in files:
            d, _, name = rel.rpartition("/")
            allowed.setdefault(d or ".", set()).add(name)
            if d.startswith(f"{SHARDS}/"):
                allowed[SHARDS].add(d[len(SHARDS) + 1 :])
        root = str(self.path)
        for d, names in allowed.items():
            try:
                present = os.listdir(f"{root}/{d}")
            except OSError:
                continue  # a missing shard directory: its files are reported missing
            for name in sorted(set(present) - names):
                if writing and d == SHARDS and name.startswith(".tmp-"):
                    continue
                kind = "directory" if (self.path / d / name).is_dir() else "file"
                yield (
                    f"{self.path / d / name}: a {kind} that is not part of this cache "
                    "(planted or left over; the cache is not used with it)"
                )

    # -- packs ----------------------------------------------------------------------------------
    def _locate(self, i: int) -> tuple[int, int]:
        if not -self._n <= i < self._n:
            raise IndexError(f"pack {i} out of range (cache has {self._n} packs)")
        i %= self._n
        s = bisect.bisect_right(self._starts, i) - 1
        return s, i - int(self._starts[s])

    def _arrays(self, s: int) -> dict[str, np.ndarray]:
        return self._shards[s].arrays(self.seq_len)

    def pack_shape(self, i: int) -> int:
        """Padded length L of pack i (its bucket)."""
        s, j = self._locate(i)
        return int(self._arrays(s)["pack_len"][j])

    def pack_lengths(self) -> np.ndarray:
        """Padded lengths of all packs (int64 [len]); maps every shard."""
        if not self._shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(
            [self._arrays(s)["pack_len"] for s in range(len(self._shards))]
        ).astype(np.int64)

    def pack(self, i: int, copy_pixels: bool = True) -> dict[str, torch.Tensor]:
        """Pack i as tensors (see VL-CONTRACT.md).

        ``copy_pixels=False`` returns ``pixel_u8`` as a zero-copy view of the file mapping (for a
        consumer that copies it straight into a pinned buffer). The mapping is copy-on-write:
        writing into the view changes only this process's copy, never the cache file. The
        default returns a private copy.
        """
        from torchtitan_ext.vl.processor import position_rows

        s, j = self._locate(i)
        a = self._arrays(s)
        o = a["pack_offsets"]
        (s0, t0, i0, p0), (s1, t1, i1, p1) = o[j].tolist(), o[j + 1].tolist()
        L = int(a["pack_len"][j])
        lens = a["sample_lens"][s0:s1]
        tok = a["tokens"][t0:t1].astype(np.int64)
        mask = a["label_mask"][t0:t1].astype(bool)
        grid = a["grid_thw"][i0:i1].astype(np.int64)
        n = t1 - t0
        ids = np.full(L, self.special_tokens["pad_id"], dtype=np.int64)
        ids[:n] = tok
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        labels[:n] = np.where(mask, tok, IGNORE_INDEX)
        pos = np.zeros((4, L), dtype=np.int64)
        img_pad = self.special_tokens["image_pad_id"]
        at, gi = 0, 0
        for ln in lens.tolist():
            seg = tok[at : at + ln]
            n_img = int(
                np.count_nonzero(
                    np.diff(np.concatenate(([0], (seg == img_pad).view(np.int8)))) == 1
                )
            )
            labels[at] = IGNORE_INDEX
            pos[:, at : at + ln] = position_rows(
                seg, grid[gi : gi + n_img], img_pad, self.spatial_merge_size
            )
            at += ln
            gi += n_img
        pixels = a["pixels"][p0:p1]
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(pos),
            "seq_lens": torch.from_numpy(lens.astype(np.int32)),
            # numpy's copy: torch's clone of a file-backed tensor measured ~20 ms per 1.5 MB here
            "pixel_u8": torch.from_numpy(pixels.copy() if copy_pixels else pixels),
            "image_grid_thw": torch.from_numpy(grid),
            "num_tokens": torch.tensor(n, dtype=torch.int64),
        }

    def pack_rows(self, i: int) -> list[int]:
        """Input row index of each sample of pack i."""
        s, j = self._locate(i)
        a = self._arrays(s)
        o = a["pack_offsets"]
        return a["sample_rows"][int(o[j, 0]) : int(o[j + 1, 0])].tolist()

    # -- verify ---------------------------------------------------------------------------------
    def verify(self) -> list[str]:
        """Every check of ``open`` (all problems, not the first), every shard's index, and the
        sha256 of every recorded file; [] when OK. Each problem names its file."""
        problems = list(self._layout_problems())
        metas = {f"{sh.rel}/{SHARD_META}" for sh in self._shards}  # hashed by _layout_problems
        for rel, rec in self.metadata["files"].items():
            f = self.path / rel
            if rel in metas:
                continue
            try:
                if f.stat().st_size != rec["size"] or sha256_file(f) == rec["sha256"]:
                    continue  # a size problem is already listed
            except OSError:
                continue  # already listed as missing
            problems.append(f"{f}: sha256 mismatch (content changed, size unchanged)")
        if problems:
            return problems
        for s in range(len(self._shards)):
            try:
                self._arrays(s)
            except CacheError as e:
                problems.append(str(e))
        return problems


def verify_cache(path: str | Path) -> list[str]:
    """``VLCache.open(path).verify()`` that reports a cache that cannot even be opened as its
    one problem instead of raising; [] when the cache is intact."""
    try:
        cache = VLCache.open(path)
    except CacheError as e:
        first = [str(e)]
        try:  # list the rest too when the manifest itself is sound
            return first + [p for p in VLCache(Path(path), read_manifest(Path(path))).verify()
                            if p != first[0]]  # fmt: skip
        except CacheError:
            return first
    return cache.verify()


def resolve_cache_dir(path: str | Path) -> Path:
    """A cache key directory, or a cache root holding exactly one complete key directory."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if not p.is_dir():
        raise FileNotFoundError(f"VL cache {p} does not exist")
    keys = sorted(d for d in p.iterdir() if (d / MANIFEST).is_file())
    if len(keys) == 1:
        return keys[0]
    if not keys:
        raise FileNotFoundError(f"{p} is not a VL cache (no {MANIFEST} in it or below)")
    raise ValueError(
        f"{p} holds {len(keys)} caches ({', '.join(k.name for k in keys)}); pass one of them"
    )
