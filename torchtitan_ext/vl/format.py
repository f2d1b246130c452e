"""The packed Qwen3-VL cache's on-disk format: constants, the manifest's digest and checks, and
the check of a shard's ``meta.json``. Written by ``vl/write.py``, read by ``vl/cache.py``.

Layout (one directory per cache key, ``<name>_<split>_seq<L>_buf<B>_<key12>/``)::

    metadata.json        the manifest: config, key, versions, counts, shard table, every file's
                         size + sha256, and a digest of all of it (last written: commit marker)
    packing_stats.json   packs, samples/pack, fill %, images/pack, buckets, skips by reason
    shards/00000/        one TensorDict memmap per shard of ``rows_per_shard`` input rows
        meta.json        (tensordict's, JSON)        tokens.memmap      int32 [T]
        label_mask.memmap uint8 [T] (1 = target)     pixels.memmap      uint8 [P, 3*patch²]
        grid_thw.memmap  int32 [I, 3]                sample_lens.memmap int32 [S]
        sample_rows.memmap int64 [S] (input row)     pack_offsets.memmap int64 [K+1, 4]
        pack_len.memmap  int32 [K] (padded length)   stats.json  (shard counts, skips, checksums)
        video_pixels.memmap uint8 [VP, 3*2*patch²]  video_grid_thw.memmap int32 [V, 3]
        video_offsets.memmap int64 [K+1, 2] (video, video patch)

A column with no rows has no file (tensordict writes none). The video columns, ``video_offsets``
included, have rows only in a shard that holds a video, so a shard without video has exactly
the files of an image-only shard of version 2 (its video offsets read as zeros). Video rows are
stored as ``vl/video.py`` makes them (both temporal frames real, HF's row order), videos in
token order, like images; a pack's videos are ``video_offsets[k]..[k+1]``. Version 3 added the
three video columns and the ``videos`` / ``video_patches`` counts; a cache of version 2 is
refused with a line saying to rebuild it (its key differs too, so a lookup builds anew). Only content tokens are stored
(padding is added at read time) and ``position_ids`` are not stored: they are a pure function of
the tokens and ``image_grid_thw`` (``processor.position_rows``, ~0.1 ms per pack). Labels are a
1-byte mask. So a pack costs 768 B per patch + 5 B per token, vs 6144 B per patch + 48 B per token
for a float32/int64 layout: <= 1/8 of its bytes, losslessly.

The manifest's ``digest`` covers every other field of ``metadata.json`` (:func:`manifest_digest`):
one sha256 over the canonical JSON, checked at every open, plus a short digest per field (two
levels deep: ``config.seq_len``, ``shards[3]``, ``files[shards/00003]``) used only to name what
changed. It is a self-check against corruption and accidental edits, not a signature: whoever can
write the directory can write a matching digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "torchtitan_ext.vl_cache"
FORMAT_VERSION = 3
MANIFEST = "metadata.json"
PACKING_STATS = "packing_stats.json"
SHARDS = "shards"
SHARD_META = "meta.json"
SHARD_STATS = "stats.json"


class CacheError(ValueError):
    """A cache that cannot be served as it is: damaged, edited, foreign or incomplete. The
    message starts with the file and says what is wrong with it."""


@dataclass(frozen=True)
class Column:
    """One array of a shard: ``<name>.memmap``, ``dtype``, ``rows`` from the shard's count
    ``count`` (+1 for the offsets), and a fixed row width (0: a 1-D array; -1: the patch width
    ``3 * patch_size**2``; -2: the video patch width ``3 * temporal_patch_size * patch_size**2``)."""

    name: str
    dtype: str
    count: str
    width: int = 0
    plus_one: bool = False
    only_with: str | None = None
    """No rows at all unless the shard's count ``only_with`` is positive."""


COLUMNS: tuple[Column, ...] = (
    Column("tokens", "int32", "tokens"),
    Column("label_mask", "uint8", "tokens"),
    Column("pixels", "uint8", "patches", width=-1),
    Column("grid_thw", "int32", "images", width=3),
    Column("sample_lens", "int32", "samples"),
    Column("sample_rows", "int64", "samples"),
    Column("pack_offsets", "int64", "packs", width=4, plus_one=True),
    Column("pack_len", "int32", "packs"),
    Column("video_pixels", "uint8", "video_patches", width=-2),
    Column("video_grid_thw", "int32", "videos", width=3),
    Column("video_offsets", "int64", "packs", width=2, plus_one=True, only_with="videos"),
)
SHARD_COUNTS = ("packs", "samples", "tokens", "images", "patches", "videos", "video_patches")
"""Counts each shard entry of the manifest carries (they give every column's shape)."""


def column_shape(
    col: Column, shard: dict[str, Any], patch_dim: int, video_dim: int
) -> tuple[int, ...]:
    n = int(shard[col.count]) + (1 if col.plus_one else 0)
    if col.only_with is not None and not int(shard[col.only_with]):
        n = 0
    width = {-1: patch_dim, -2: video_dim}.get(col.width, col.width)
    return (n, width) if width else (n,)


ITEMSIZE = {c.name: np.dtype(c.dtype).itemsize for c in COLUMNS}


def video_patch_dim(image_params: dict[str, Any]) -> int:
    """Width of a stored video row: ``3 * temporal_patch_size * patch_size**2`` (1536)."""
    return 3 * int(image_params["temporal_patch_size"]) * int(image_params["patch_size"]) ** 2


def torch_dtype_name(dtype: str) -> str:
    return f"torch.{dtype}"


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
    _need(cfg.get("store", False) in (True, False), mf, "config.store", "is not a boolean")
    if not cfg.get("store") or "seq_len" in cfg:  # a store without truncate has no seq_len
        _need(
            _is_count(cfg.get("seq_len")) and cfg["seq_len"] > 0,
            mf,
            "config.seq_len",
            "is not positive",
        )
    sp = meta.get("special_tokens")
    _need(isinstance(sp, dict), mf, "special_tokens", "is missing or not an object")
    for k in ("pad_id", "image_pad_id", "video_pad_id"):
        _need(_is_count(sp.get(k)), mf, f"special_tokens.{k}", "is missing or not an id")
    ip = meta.get("image_params")
    _need(isinstance(ip, dict), mf, "image_params", "is missing or not an object")
    for k in ("patch_size", "merge_size", "temporal_patch_size"):
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
