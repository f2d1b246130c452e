"""The packed Qwen3-VL cache reader (``VLCache``) and ``verify``; the format is ``vl/format.py``.

Reading never unpickles and never writes
----------------------------------------
The reader does not use tensordict at all: every column's dtype is fixed by the format
(``format.COLUMNS``) and its shape follows from the shard's counts in the manifest, so a shard is mapped with
``np.memmap(mode="c")``: the file is opened ``O_RDONLY`` and mapped copy-on-write, so nothing a
process does to a pack's arrays reaches the file, and a read-only cache directory works. A
``meta.json`` is only compared with the manifest's record (an extra entry, such as a pickled
``NonTensorData``, is an error naming it); no ``other.pickle`` is ever opened. (A tool that
wants a shard as a TensorDict should load it with ``TensorDict.load_memmap(d, mode="r",
allow_pickle=False)``.)

What ``open`` checks, and what ``verify`` adds
---------------------------------------------
``VLCache.open`` raises :class:`CacheError` (a ``ValueError`` whose message starts with the file)
before mapping anything when:

* ``metadata.json`` is missing, not JSON, not an object, of another format version, or does not
  match its own digest (``format.manifest_digest``; the error names the changed field, e.g.
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

Cost, and why shards are mapped lazily: a 10k-pack cache of 8k-token packs at the default 1,024
rows per shard has ~43 packs per shard, ~230 shards and ~2,300 files. Opening it with one
``TensorDict.load_memmap`` per shard (the previous reader) cost 92-108 ms here, ~0.4 ms per
shard; ``VLCache.open`` (digest, ~2,300 ``stat`` calls, ~230 ``meta.json`` reads, directory
listings, no mapping) cost 24-34 ms in the same run, and a shard's eight arrays are mapped and
its index checked on its first ``pack(i)`` (0.3-0.7 ms, once per process). At 1k packs: 1.2 ms
vs 4.4 ms; at 100: 0.2 ms vs 0.5 ms. (``python -m benchmarks vl_dataset --set cases=open``,
interleaved, shared 2-core box, medians of 10; ranges in ``benchmarks/results``.)
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.data.cachedir import sha256_file
from torchtitan_ext.vl.assemble import assemble_pack
from torchtitan_ext.vl.cache_shard import _Shard
from torchtitan_ext.vl.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PACKING_STATS,
    SHARD_META,
    SHARD_STATS,
    SHARDS,
    CacheError,
    read_manifest,
    shard_meta_problem,
    video_patch_dim,
)

STORE_NO_LIMIT = 2**31 - 1
"""The length bound of a sample store's entries (a store without ``truncate`` keeps samples of
any length; each plan skips those longer than its own ``seq_len``)."""

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CacheError",
    "VLCache",
    "resolve_cache_dir",
    "verify_cache",
]

# ----------------------------------------------------------------------------------------------
# the reader


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
        self.video_dim = video_patch_dim(self.image_params)
        self.is_store = bool(metadata["config"].get("store", False))
        """A sample store (``vl/plan.py``): every "pack" is one unpadded sample."""
        # a store's entries are bounded by its longest sample, which its index checks itself
        self.seq_len = int(metadata["config"].get("seq_len", STORE_NO_LIMIT))
        self._shards = [
            _Shard(
                path / SHARDS / s["name"],
                f"{SHARDS}/{s['name']}",
                s,
                self.patch_dim,
                self.video_dim,
            )  # fmt: skip
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
        for problem in cache.layout_problems():
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

    def layout_problems(self, writing: bool = False) -> Iterator[str]:
        """The checks of ``open``, lazily: manifest vs shard counts, files on disk vs manifest,
        meta.json vs its record, files that should not be here. One message per problem, each
        naming its file. ``writing``: the writer's own check before it commits the manifest."""
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

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def shard_arrays(self, s: int) -> dict[str, np.ndarray]:
        """Shard ``s``'s columns (mapped and index-checked on first use)."""
        return self._arrays(s)

    def shard_sample_lengths(self, s: int) -> np.ndarray:
        """Token count of each sample of shard ``s`` (int32, the shard's ``sample_lens``)."""
        return self._arrays(s)["sample_lens"]

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
        """Pack i as tensors: ``input_ids``, ``labels``, ``position_ids``, ``seq_lens``, ``pixel_u8``,
        ``image_grid_thw``, ``num_tokens`` (docs/vl-cache.md describes the format), and, only
        when the pack holds a video, ``video_u8`` / ``video_grid_thw`` (``vl/video_batch.py``).

        ``copy_pixels=False`` returns ``pixel_u8`` as a zero-copy view of the file mapping (for a
        consumer that copies it straight into a pinned buffer). The mapping is copy-on-write:
        writing into the view changes only this process's copy, never the cache file. The
        default returns a private copy.
        """
        s, j = self._locate(i)
        a = self._arrays(s)
        o = a["pack_offsets"]
        (s0, t0, i0, p0), (s1, t1, i1, p1) = o[j].tolist(), o[j + 1].tolist()
        (v0, q0), (v1, q1) = a["video_offsets"][j].tolist(), a["video_offsets"][j + 1].tolist()
        return assemble_pack(
            a["tokens"][t0:t1], a["label_mask"][t0:t1], a["sample_lens"][s0:s1],
            a["grid_thw"][i0:i1], a["pixels"][p0:p1], int(a["pack_len"][j]),
            self.special_tokens, self.spatial_merge_size, copy_pixels,
            video_grid_thw=a["video_grid_thw"][v0:v1], video_pixels=a["video_pixels"][q0:q1],
        )  # fmt: skip

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
        problems = list(self.layout_problems())
        metas = {f"{sh.rel}/{SHARD_META}" for sh in self._shards}  # hashed by layout_problems
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
