"""Parquet shards of one split: file listing, the train/validation split, footers, and reading
validated text from a row group. The stream over them (epoch order, DP deal, read-ahead,
resumable position) is the source stage in :mod:`~torchtitan_ext.text.parquet_source`.

Listing. ``path`` is a directory (every ``*.parquet`` in it, sorted), a glob, or a list of either.
The validation split is chosen by ``val_files``:

* ``"auto"`` (default): files whose name starts with ``val`` (``val-*.parquet``,
  ``validation-*.parquet``) if there are any, else the last shard in sorted order when there are at
  least two, else no validation split;
* ``"last_shard"``: the last shard in sorted order;
* ``"none"``: no validation split;
* any other string: a directory or glob naming the validation files.

The training split is *every listed file minus the validation files* (compared as resolved paths),
so the two never overlap even when the training glob also matches the validation files.

Row groups. :class:`ParquetFiles` lists every row group of the split, in (sorted file, row-group
index) order, from the footers; row group ``i`` of that list is the reading unit ``i`` of an
epoch (:class:`~torchtitan_ext.pipeline.elastic.Unit`). Files are reopened for reads, at most 8
per reading thread (LRU), so a split of thousands of shards never exhausts file descriptors.

Bad input is handled per :mod:`torchtitan_ext.text.errors`: a missing column, NULL or non-string
values, empty documents, invalid UTF-8 (binary columns are decoded strictly) and unreadable files
or row groups raise :class:`BadInputError` naming file / row group / row, or are counted as skips.
Text columns may be plain, large, view or dictionary-encoded strings or binaries
(:mod:`torchtitan_ext.text.columns`).
"""

from __future__ import annotations

import glob as _glob
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from torchtitan_ext.text.columns import as_text, text_kind
from torchtitan_ext.text.errors import BadInputError, OnBadInput, check_on_bad_input, where

logger = logging.getLogger(__name__)

_OPEN_FILES = 8  # Parquet files kept open per reading thread (LRU)


def _expand(spec: str | os.PathLike | list) -> list[Path]:
    if isinstance(spec, (list, tuple)):
        out: list[Path] = []
        for s in spec:
            out.extend(_expand(s))
        return out
    s = os.path.expanduser(str(spec))
    p = Path(s)
    if p.is_dir():
        return sorted(p.glob("*.parquet"))
    if any(ch in s for ch in "*?["):
        return sorted(Path(x) for x in _glob.glob(s, recursive=True))
    if p.exists():
        return [p]
    raise FileNotFoundError(f"no such Parquet file, directory or glob: {s!r}")


@dataclass(frozen=True)
class SplitFiles:
    """The files of both splits and the rule that chose the validation files (for the log)."""

    train: list[Path]
    val: list[Path]
    rule: str


def split_files(path: str | os.PathLike | list, val_files: str = "auto") -> SplitFiles:
    """Both splits of ``path``; see the module docstring for ``val_files``. The training split
    may be empty here (:func:`list_split` refuses that)."""
    files = _expand(path)
    if not files:
        raise FileNotFoundError(f"no Parquet files match {path!r}")
    if val_files == "none":
        val: list[Path] = []
        rule = "val_files='none': no validation files"
    elif val_files == "auto":
        val = [f for f in files if f.name.lower().startswith("val")]
        rule = "val_files='auto': the files named val*"
        if not val and len(files) >= 2:
            val = [files[-1]]
            rule = "val_files='auto': no file is named val*, so the last shard in sorted order"
        elif not val:
            rule = "val_files='auto': a single file and none named val*, so no validation files"
    elif val_files == "last_shard":
        if len(files) < 2:
            raise ValueError(
                f"val_files='last_shard' needs at least 2 shards, {path!r} has {len(files)}"
            )
        val = [files[-1]]
        rule = "val_files='last_shard': the last shard in sorted order"
    else:
        val = _expand(val_files)
        if not val:
            raise FileNotFoundError(f"val_files={val_files!r} matches no Parquet file")
        rule = f"val_files={val_files!r}"
    val_set = {f.resolve() for f in val}
    train = [f for f in files if f.resolve() not in val_set]
    return SplitFiles(train, sorted(val), rule)


def list_split(
    path: str | os.PathLike | list, split: str = "train", val_files: str = "auto"
) -> list[Path]:
    """The files of ``split`` ("train" or "val"); see the module docstring for ``val_files``."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    files = split_files(path, val_files)
    if split == "val":
        if not files.val:
            raise ValueError(
                f"no validation split for {path!r} (val_files={val_files!r}); set val_files to a "
                "glob or 'last_shard'"
            )
        return files.val
    if not files.train:
        raise ValueError(
            f"the training split of {path!r} is empty after holding out validation files "
            f"{[str(f) for f in files.val]}"
        )
    return files.train


@dataclass(frozen=True)
class RowGroup:
    file: str
    index: int
    num_rows: int


@dataclass
class Chunk:
    """Up to ``chunk_rows`` usable documents from one row group, plus what was skipped."""

    texts: list[str]
    rows_read: int
    """Rows of the row group consumed by this chunk (usable + skipped)."""
    skips: list[tuple[str, str, int]] = field(default_factory=list)
    """(reason, where, count) for each skipped record or range."""
    position: Any = None
    """The source's position right after this chunk (a ``parquet_position.Position``)."""


class ParquetFiles:
    """The row groups of one split (from the footers) and validated reads of their text."""

    def __init__(
        self,
        path: str | os.PathLike | list,
        *,
        text_column: str = "text",
        split: str = "train",
        val_files: str = "auto",
        on_bad_input: OnBadInput = "error",
        read_delay_s: float = 0.0,
    ) -> None:
        self.text_column = text_column
        self.split = split
        self.on_bad_input = check_on_bad_input(on_bad_input)
        self.read_delay_s = float(read_delay_s)
        self.files = [str(f) for f in list_split(path, split, val_files)]
        # Files that could not even be opened (skip mode only): no rows are known for them, so
        # they are reported separately from the per-row reconciliation.
        self.unreadable_files: list[str] = []
        self.row_groups: list[RowGroup] = self._read_footers()
        # Open files per reading thread: concurrent read-ahead threads never share a ParquetFile
        # (nor close one another is reading); each keeps its own small LRU.
        self._local = threading.local()

    def _read_footers(self) -> list[RowGroup]:
        """The row groups of every file, from its footer (files are closed again). An unreadable
        file or a missing text column is a BadInputError naming the file in error mode; in
        skip mode an unreadable file is listed in ``unreadable_files``."""
        all_groups: list[RowGroup] = []
        for f in self.files:
            try:
                pf = pq.ParquetFile(f)
                md, names = pf.metadata, pf.schema_arrow.names
                pf.close()  # only the footer is needed now; reads reopen (a few files at a time)
            except (OSError, pa.ArrowException) as e:
                if self.on_bad_input == "error":
                    raise BadInputError(f"unreadable Parquet file ({e})", file=f) from e
                # Counted, not silent: the file is listed in describe() (logged by the torchtitan
                # glue) and the loader's get_stats()["files_skipped"]; its rows cannot be counted
                # because its footer is unreadable.
                logger.warning(f"{f}: unreadable Parquet file ({e}); skipped (on_bad_input='skip')")
                self.unreadable_files.append(f)
                continue
            if self.text_column not in names and self.on_bad_input == "error":
                # Fail fast at construction; in skip mode the row groups are counted as skipped
                # ("missing_column") when the stream reaches them.
                raise BadInputError(
                    f"column {self.text_column!r} not found (columns: {names})",
                    file=f,
                    key=self.text_column,
                )
            for i in range(md.num_row_groups):
                all_groups.append(RowGroup(f, i, md.row_group(i).num_rows))
        return all_groups

    @property
    def total_rows(self) -> int:
        return sum(g.num_rows for g in self.row_groups)

    def files_named(self, groups: list[int] | None = None, limit: int = 3) -> str:
        """The files (of ``groups``, indices into :attr:`row_groups`; all by default), for
        messages: the first few, then how many more."""
        idx = range(len(self.row_groups)) if groups is None else groups
        files = sorted({self.row_groups[i].file for i in idx}) or list(self.files)
        more = f" and {len(files) - limit} more" if len(files) > limit else ""
        return ", ".join(files[:limit]) + more

    # ------------------------------------------------------------------ reading
    def _file(self, path: str) -> pq.ParquetFile:
        cache: OrderedDict[str, pq.ParquetFile] | None = getattr(self._local, "files", None)
        if cache is None:
            cache = self._local.files = OrderedDict()
        pf = cache.get(path)
        if pf is None:
            pf = pq.ParquetFile(path)
            cache[path] = pf
            while len(cache) > _OPEN_FILES:
                cache.popitem(last=False)[1].close()
        else:
            cache.move_to_end(path)
        return pf

    def read_row_group(self, g: RowGroup) -> pa.ChunkedArray:
        """The text column of one row group (overridable: benchmarks add a storage delay)."""
        if self.read_delay_s > 0:
            time.sleep(self.read_delay_s)  # simulated slow storage (benchmarks)
        pf = self._file(g.file)
        if self.text_column not in pf.schema_arrow.names:
            # pyarrow silently returns an empty table for an unknown column: check explicitly.
            raise KeyError(
                f"column {self.text_column!r} not found (columns: {pf.schema_arrow.names})"
            )
        # use_threads=False: decode on this (GIL-free) reader thread instead of Arrow's pool of
        # one thread per core, which would briefly take every core from the training loop.
        return pf.read_row_group(g.index, columns=[self.text_column], use_threads=False).column(0)

    def _bad(self, reason: str, short: str, g: RowGroup, row: int | None, n: int, skips: list):
        loc = where(g.file, g.index, row, self.text_column)
        if self.on_bad_input == "error":
            raise BadInputError(
                reason, file=g.file, row_group=g.index, row=row, key=self.text_column
            )
        skips.append((short, loc, n))

    def load(self, g: RowGroup, skips: list, fut: Future | None = None) -> pa.ChunkedArray | None:
        """Read (or collect the read-ahead ``fut`` of) and type-check ``g``'s column; ``None``
        (with the skip recorded, counted as ``g.num_rows`` rows) if unusable."""
        try:
            col = fut.result() if fut is not None else self.read_row_group(g)
        except KeyError as e:
            self._bad(str(e.args[0]), "missing_column", g, None, g.num_rows, skips)
            return None
        except (OSError, pa.ArrowException) as e:
            self._bad(
                f"unreadable row group ({e})", "unreadable_row_group", g, None, g.num_rows, skips
            )
            return None
        typ = col.type
        if text_kind(typ) is None:
            # Checked per column, not per row: every value has the column's type.
            self._bad(
                f"column type is {typ}, expected a string (or UTF-8 binary) column",
                "not_string",
                g,
                None,
                g.num_rows,
                skips,
            )
            return None
        return col

    def _texts(
        self, g: RowGroup, col: pa.ChunkedArray, start: int, stop: int, skips: list
    ) -> list[str]:
        """Validated texts of rows ``[start, stop)`` of ``g``; bad rows raise or are skipped."""
        out: list[str] = []
        for k, v in enumerate(col.slice(start, stop - start).to_pylist()):
            text = as_text(v)
            if type(text) is str:
                out.append(text)
            else:
                self._bad(text.message, text.reason, g, start + k, 1, skips)
        return out

    def chunks(
        self, g: RowGroup, lo: int, hi: int, chunk_rows: int, fut: Future | None = None
    ) -> Iterator[tuple[list[str], int, list[tuple[str, str, int]]]]:
        """Rows ``[lo, hi)`` of ``g`` as ``(texts, rows consumed, skips)`` pieces of up to
        ``chunk_rows`` rows; an unusable row group is one piece of all its rows, skipped."""
        skips: list[tuple[str, str, int]] = []
        col = self.load(g, skips, fut)
        if col is None:  # whole row group skipped (counted as its remaining rows)
            reason, loc, _ = skips[0]
            yield [], hi - lo, [(reason, loc, hi - lo)]
            return
        row = lo
        while row < hi:
            end = min(row + chunk_rows, hi)
            skips = []
            texts = self._texts(g, col, row, end, skips)
            yield texts, end - row, skips
            row = end
