"""Where the VL cache builder's rows come from: row sources, row layouts, source fingerprints.

Reading a row is two separate steps, so that a new layout never touches a reader:

1. A **source** (:class:`ParquetSource` for local files, :class:`HubSource` for a Hugging Face
   dataset) gives random access to *raw* rows: ``read(start, stop, columns)`` returns one dict per
   row holding the named columns exactly as pyarrow / ``datasets`` return them (an image cell is
   bytes, a ``{"bytes", "path"}`` struct or a list of them). It also fingerprints its data for the
   cache key and knows its column names.
2. A **layout** (``vl/layouts.py``: ``vqa``, ``messages``, ``llava``, ``cauldron``) chooses its
   columns from the source's schema and turns a raw row into a conversation (``parse``); the
   layout's ``describe()`` is part of the cache key.

:func:`open_source` pairs the two (:class:`Rows`) and knows the dataset directory that relative
image paths are read from. Nothing here decodes an image.

Fingerprint (``fingerprint="full"``, the default): the sha256 of the whole of every source file,
streamed (~1 GB/s on one core), remembered per file under the asset cache
(``$TORCHTITAN_EXT_CACHE/file_digests``) keyed by path, size, mtime, ctime and inode, so that
checking for an existing cache re-hashes nothing until a file changes; processes on one machine
hash a file once (a per-file lock). ``fingerprint="quick"`` hashes only the first and last MiB
plus the size (what Parquet's header and footer live in): instant on huge data, but a same-size
edit in the middle of a file keeps the old key.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from torchtitan_ext.data.cachedir import sha256_file as _sha256_stream
from torchtitan_ext.vl.conversation import ChatSample
from torchtitan_ext.vl.layouts import Layout, VQALayout, choose_layout

__all__ = [
    "ChatSample", "HubSource", "Layout", "ParquetSource", "RowSource", "Rows", "VQALayout",
    "open_source",
]  # fmt: skip

Fingerprint = Literal["full", "quick"]
FINGERPRINTS: tuple[str, ...] = ("full", "quick")
DEFAULT_FINGERPRINT: Fingerprint = "full"


# ----------------------------------------------------------------------------------------------
# fingerprints


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _digest_store() -> Path:
    from torchtitan_ext.vl.processor import default_cache_root

    return default_cache_root() / "file_digests"


@contextlib.contextmanager
def _digest_lock(lock: Path) -> Iterator[None]:
    """An exclusive lock while one process hashes a file (the others wait, then read its
    result); no lock when the store is not writable (then every process hashes for itself)."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def full_file_sha256(path: Path) -> str:
    """sha256 of the whole file, remembered by (path, size, mtime, ctime, inode)."""
    real = os.path.realpath(path)
    store = _digest_store()
    name = hashlib.sha256(real.encode()).hexdigest()[:32]
    rec_path = store / f"{name}.json"

    def cached() -> str | None:
        try:
            rec = json.loads(rec_path.read_text())
            if rec["path"] == real and rec["stat"] == _stat_key(os.stat(real)):
                return str(rec["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return None

    hit = cached()
    if hit is not None:
        return hit
    with _digest_lock(store / f"{name}.lock"):
        hit = cached()  # another process may have hashed it while this one waited
        if hit is not None:
            return hit
        before = os.stat(real)
        digest = _sha256_stream(Path(real))
        if _stat_key(os.stat(real)) == _stat_key(before):  # unchanged while hashing
            rec = {"path": real, "stat": _stat_key(before), "sha256": digest}
            tmp = rec_path.with_name(f".{rec_path.name}.tmp{os.getpid()}")
            with contextlib.suppress(OSError):  # a read-only store: just do not remember
                tmp.write_text(json.dumps(rec))
                os.replace(tmp, rec_path)
        return digest


def file_fingerprint(path: Path, mode: Fingerprint) -> dict[str, Any]:
    """Name, size and a content hash of one source file (see the module docstring)."""
    size = path.stat().st_size
    if mode == "full":
        return {"name": path.name, "size": size, "sha256": full_file_sha256(path)}
    if mode != "quick":
        raise ValueError(f"fingerprint must be one of {FINGERPRINTS}, got {mode!r}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
        elif size > 1 << 20:
            h.update(f.read())
    return {"name": path.name, "size": size, "sha256_head_tail": h.hexdigest()}


# ----------------------------------------------------------------------------------------------
# sources: raw rows


class RowSource:
    """Random access to raw rows (dicts of the requested columns); see the module docstring."""

    name: str
    """Short dataset name (used in the cache directory name)."""
    num_rows: int
    column_names: list[str]
    where: str
    """What to name in an error about this source (a file or dataset id)."""
    root: Path | None = None
    """The dataset directory: relative image paths in the rows are read relative to it."""

    def fingerprint(self) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, start: int, stop: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        raise NotImplementedError


_HF_STYLE = re.compile(r"(\w+?)-\d+-of-\d+")
_SPLIT_WORD = re.compile(r"(train|test|validation|valid|val|dev|eval)(?:[-_.][^/]*)?\.parquet$")


def _split_named(filename: str) -> str | None:
    """The split a Parquet file's name states (``train-00000-of-00001.parquet``,
    ``test.parquet``, ``validation_2.parquet``), or None."""
    m = _HF_STYLE.match(filename) or _SPLIT_WORD.match(filename)
    return m.group(1) if m else None


def _resolve_files(dataset: str, split: str) -> list[Path]:
    """The Parquet files of ``split`` under a file, directory or glob (see ParquetSource)."""
    p = Path(dataset)
    if p.is_file():
        return [p]
    if p.is_dir():
        for pat in (
            f"{split}-*.parquet",
            f"{split}/*.parquet",
            f"**/{split}-*.parquet",
            f"**/{split}/*.parquet",
            f"*{split}*.parquet",
        ):
            files = sorted(p.glob(pat))
            if files:
                return files
        files = sorted(p.glob("**/*.parquet"))
        # Names that name their split (HF-style "train-00000-of-00001.parquet", or "train.parquet"
        # beside "test.parquet"): a split that is not among them is an error, not "use
        # everything" (which would read the test files into a validation split).
        named = [_split_named(f.name) for f in files]
        if files and all(named):
            raise FileNotFoundError(
                f"--dataset {dataset}: no files for split {split!r} "
                f"(splits here: {sorted(set(named))})"  # type: ignore[type-var]
            )
        if files:
            return files
        raise FileNotFoundError(f"--dataset {dataset}: no .parquet files in the directory")
    files = sorted(Path(f) for f in glob.glob(dataset, recursive=True))
    if files:
        return files
    raise FileNotFoundError(f"--dataset {dataset}: no such file, directory or glob match")


class ParquetSource(RowSource):
    """Local Parquet files (a file, a directory, or a glob), read by row group with pyarrow.

    A directory is searched for ``{split}-*.parquet``, ``{split}/*.parquet`` (also nested) and
    ``*{split}*.parquet``; else every ``.parquet`` file in it, unless their HF-style names
    (``train-00000-of-00001``) show that ``split`` is not among them.
    """

    def __init__(self, dataset: str | Path, split: str, fingerprint: Fingerprint):
        import pyarrow.parquet as pq

        self.files = _resolve_files(str(dataset), split)
        self.name = Path(str(dataset).rstrip("/")).stem or "dataset"
        d = Path(dataset)
        self.root = d if d.is_dir() else Path(os.path.commonpath([f.parent for f in self.files]))
        self.where = str(self.files[0])
        self._pq = pq
        self._meta = [pq.ParquetFile(f).metadata for f in self.files]
        counts = [m.num_rows for m in self._meta]
        self._starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.num_rows = int(self._starts[-1])
        self.column_names = list(pq.ParquetFile(self.files[0]).schema_arrow.names)
        self._fingerprint_mode = fingerprint
        self._open: dict[int, Any] = {}

    def fingerprint(self) -> dict[str, Any]:
        files = [file_fingerprint(f, self._fingerprint_mode) for f in self.files]
        return {"kind": "parquet", "mode": self._fingerprint_mode, "files": files}

    def _groups(self, fi: int, lo: int, hi: int) -> tuple[list[int], int]:
        """Row groups of file ``fi`` overlapping rows [lo, hi) and the first one's start row."""
        md = self._meta[fi]
        rg_start, groups, first = 0, [], 0
        for g in range(md.num_row_groups):
            n = md.row_group(g).num_rows
            if rg_start + n > lo and rg_start < hi:
                if not groups:
                    first = rg_start
                groups.append(g)
            rg_start += n
        return groups, first

    def read(self, start: int, stop: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        fi = int(np.searchsorted(self._starts, start, side="right") - 1)
        pos = start
        while pos < stop and fi < len(self.files):
            f0, f1 = int(self._starts[fi]), int(self._starts[fi + 1])
            lo, hi = pos - f0, min(stop, f1) - f0
            pf = self._open.get(fi)
            if pf is None:
                pf = self._open[fi] = self._pq.ParquetFile(self.files[fi])
            groups, first = self._groups(fi, lo, hi)
            tbl = pf.read_row_groups(groups, columns=list(columns)).slice(lo - first, hi - lo)
            rows += tbl.to_pylist()
            pos = f1
            fi += 1
        return rows


class HubSource(RowSource):
    """A Hugging Face hub dataset (downloaded by ``datasets``; images not decoded). Untested
    here: the tests and the demo use local Parquet."""

    def __init__(self, dataset: str, split: str):
        import datasets

        self.ds = datasets.load_dataset(dataset, split=split)
        self.name = dataset.replace("/", "_")
        self.where = dataset
        self.column_names = list(self.ds.column_names)
        for c, feat in self.ds.features.items():  # raw {"bytes", "path"}: decoded by us
            if isinstance(feat, datasets.Image):
                self.ds = self.ds.cast_column(c, datasets.Image(decode=False))
            elif isinstance(getattr(feat, "feature", None), datasets.Image):  # a list of images
                self.ds = self.ds.cast_column(c, datasets.List(datasets.Image(decode=False)))
        self.num_rows = len(self.ds)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "hub", "name": self.where, "fingerprint": self.ds._fingerprint}

    def read(self, start: int, stop: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        sel = self.ds.select(range(start, stop)).select_columns(list(columns))
        return list(sel)


# ----------------------------------------------------------------------------------------------
# source + layout


class Rows:
    """A source read through a layout: ``read`` gives raw rows, ``parse`` turns one into a
    conversation. ``name``, ``num_rows``, ``root``, ``fingerprint()`` are the source's."""

    def __init__(self, source: RowSource, layout: Layout):
        self.source, self.layout = source, layout
        self.name, self.num_rows, self.root = source.name, source.num_rows, source.root

    def fingerprint(self) -> dict[str, Any]:
        return self.source.fingerprint()

    def read(self, start: int, stop: int) -> list[dict[str, Any]]:
        """Raw rows ``[start, stop)``, holding the layout's columns."""
        return self.source.read(start, stop, self.layout.columns)

    def parse(self, raw: dict[str, Any]) -> ChatSample:
        return self.layout.parse(raw)


def open_source(
    dataset: str | Path,
    split: str,
    fingerprint: Fingerprint = DEFAULT_FINGERPRINT,
    format: str = "auto",
    columns: Mapping[str, str] | None = None,
) -> Rows:
    """Local path (file, dir, glob) -> Parquet; anything else -> a hub dataset; the layout is
    ``format`` (``"auto"``: detected from the columns), ``columns`` naming role -> column where
    detection should not guess (``vl/layouts.py``)."""
    if fingerprint not in FINGERPRINTS:
        raise ValueError(f"fingerprint must be one of {FINGERPRINTS}, got {fingerprint!r}")
    s = str(dataset)
    src: RowSource
    if Path(s).exists() or any(ch in s for ch in "*?["):
        src = ParquetSource(s, split, fingerprint)
    elif s.startswith((".", "/", "~")):
        raise FileNotFoundError(f"--dataset {s}: no such local path")
    else:
        src = HubSource(s, split)
    return Rows(src, choose_layout(src.column_names, src.where, format, columns or {}))
