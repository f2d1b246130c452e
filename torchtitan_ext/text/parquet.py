"""Parquet shard source: file listing, train/validation split, DP sharding by row group, and a
resumable cursor over an infinite (or single-pass) stream of documents.

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

DP sharding. All row groups of the split, in (sorted file, row-group index) order, are dealt
round-robin to the ranks: row group ``i`` belongs to rank ``i % dp_world_size``. The assignment is
fixed for the whole run, so ranks never read each other's rows (disjoint) and every row group has
an owner (complete). Each rank's stream then cycles *its own* row groups epoch after epoch, each
epoch in an order reshuffled by ``(seed, epoch)``; a rank with fewer row groups simply starts its
next epoch earlier, so uneven counts never leave a rank without data while the others wait in a
collective. A rank that would own no row group at all, or only empty ones, fails loudly at
construction, naming the counts — we do not "borrow" another rank's row groups, because that
would silently break disjointness. An endless stream whose whole epoch yields no usable document
raises :class:`~torchtitan_ext.text.errors.NoUsableDocuments` instead of cycling forever.

Cursor. The position in a rank's stream is three ints ``(epoch, index in the epoch order, row in
the row group)``; :meth:`ParquetSource.iter_chunks` restarts from any cursor exactly, which is
what makes the prefetching loader's resume exact.

Read-ahead. With ``read_ahead > 0`` (default 4) the next ``read_ahead`` row groups are read
*concurrently* by as many helper threads (``use_threads=False``: decoding stays on that thread
instead of Arrow's per-core pool) while the caller tokenizes; results are consumed in order.
Parquet reads release the GIL, and on slow or remote storage a read is latency-bound, so k reads
in flight give ~k times the bandwidth of one: with 50 ms per 256-document row group one reader
delivers ~2.6 M GPT-2 tokens/s, barely above a consumer that wants 2 M/s, and any jitter reached
the training loop (p99 ``next()`` 3 ms); four readers keep the queue full. At most 8 files are
kept open (LRU).

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
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from torchtitan_ext.text.columns import as_text, text_kind
from torchtitan_ext.text.errors import (
    BadInputError,
    NoUsableDocuments,
    OnBadInput,
    check_on_bad_input,
    where,
)

logger = logging.getLogger(__name__)

_OPEN_FILES = 8  # Parquet files kept open per source (LRU)


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
    cursor_after: tuple[int, int, int] = (0, 0, 0)
    """Stream position right after this chunk: (epoch, index in epoch order, row)."""


@dataclass
class _EpochTally:
    """What one epoch of a rank's stream yielded (for the no-usable-document check). ``whole``:
    the stream started at the epoch's first row (a resumed, partial epoch proves nothing)."""

    whole: bool
    rows: int = 0
    docs: int = 0
    skips: Counter = field(default_factory=Counter)

    def add(self, chunk: Chunk) -> None:
        self.rows += chunk.rows_read
        self.docs += len(chunk.texts)
        for reason, _, n in chunk.skips:
            self.skips[reason] += n


class ParquetSource:
    """This rank's row groups of one split, as a resumable stream of text chunks."""

    def __init__(
        self,
        path: str | os.PathLike | list,
        *,
        text_column: str = "text",
        split: str = "train",
        val_files: str = "auto",
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        infinite: bool = True,
        on_bad_input: OnBadInput = "error",
        chunk_rows: int = 128,
        read_delay_s: float = 0.0,
        read_ahead: int = 4,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_world_size={dp_world_size})")
        self.text_column = text_column
        self.split = split
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.shuffle = shuffle
        self.infinite = infinite
        self.on_bad_input = check_on_bad_input(on_bad_input)
        self.chunk_rows = max(1, int(chunk_rows))
        self.read_delay_s = float(read_delay_s)
        self.read_ahead = max(0, int(read_ahead))
        self.files = [str(f) for f in list_split(path, split, val_files)]
        # Files that could not even be opened (skip mode only): no rows are known for them, so
        # they are reported separately from the per-row reconciliation.
        self.unreadable_files: list[str] = []
        all_groups = self._read_footers()
        self.total_row_groups = len(all_groups)
        self.row_groups = all_groups[dp_rank::dp_world_size]
        self._check_rank_share(all_groups)
        # A few open files, least recently used evicted: a rank may own thousands of shards,
        # and keeping all open would exhaust file descriptors.
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

    def _check_rank_share(self, all_groups: list[RowGroup]) -> None:
        """This rank must own at least one row group with rows: a rank with none would never
        yield (or leave the other ranks waiting in a collective)."""
        unreadable = (
            f" ({len(self.unreadable_files)} unreadable file(s) skipped)"
            if self.unreadable_files
            else ""
        )
        if not self.row_groups:
            raise ValueError(
                f"dp_rank {self.dp_rank} of {self.dp_world_size} gets no row group: the {self.split} split has "
                f"{len(all_groups)} row group(s) in {len(self.files)} file(s){unreadable} and every "
                f"rank needs at least one (write the shards with smaller row groups, or use fewer "
                f"DP ranks)"
            )
        if self.rows_per_epoch == 0:
            # Its stream would never yield a row: stop here rather than spin (or leave the other
            # ranks waiting in a collective).
            raise ValueError(
                f"dp_rank {self.dp_rank} of {self.dp_world_size} gets only empty row groups: its "
                f"{len(self.row_groups)} row group(s) in {self._files_named()} have 0 rows (the "
                f"{self.split} split has {sum(g.num_rows for g in all_groups)} rows in "
                f"{len(all_groups)} row group(s){unreadable}); drop the empty shards or use "
                f"fewer DP ranks"
            )

    # ------------------------------------------------------------------ order
    def epoch_order(self, epoch: int) -> list[int]:
        """Indices into ``self.row_groups`` for ``epoch`` (reshuffled by seed and epoch)."""
        n = len(self.row_groups)
        if not self.shuffle:
            return list(range(n))
        rng = np.random.default_rng([self.seed, epoch, self.dp_rank])
        return [int(i) for i in rng.permutation(n)]

    @property
    def rows_per_epoch(self) -> int:
        return sum(g.num_rows for g in self.row_groups)

    def _files_named(self, limit: int = 3) -> str:
        """This rank's files, for messages: the first few, then how many more."""
        files = sorted({g.file for g in self.row_groups})
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

    def _load(self, g: RowGroup, skips: list, fut: Future | None = None) -> pa.ChunkedArray | None:
        """Read (or collect the read-ahead ``fut`` of) and type-check ``g``'s column; ``None``
        (with the skip recorded) if unusable."""
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

    def _positions(self, epoch: int, pos: int) -> Iterator[tuple[int, int, RowGroup]]:
        """(epoch, index in epoch order, row group) from the given position on."""
        while self.infinite or epoch == 0:
            order = self.epoch_order(epoch)
            for p in range(pos, len(order)):
                yield epoch, p, self.row_groups[order[p]]
            epoch, pos = epoch + 1, 0

    def iter_chunks(
        self,
        cursor: tuple[int, int, int] = (0, 0, 0),
        thread_init: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Iterator[Chunk]:
        """Chunks from ``cursor`` on; infinite unless ``infinite=False`` (then one epoch).

        With ``read_ahead > 0`` the next row groups are read by ``read_ahead`` helper threads
        while the caller tokenizes the current one (consumed in order): Parquet reads release the
        GIL, so slow storage is hidden while ``read_ahead`` reads outpace tokenization. The
        helpers are shut down when the generator is closed (or garbage-collected). ``thread_init``
        runs first in each helper thread (the prefetching loader uses it to set their scheduling
        policy). Once ``stop`` is set the stream ends at the next row group or chunk, also while
        waiting for a read; its shutdown cancels the reads not started and waits for those in
        flight (at most ``read_ahead``), so that no thread outlives it.

        An infinite stream raises :class:`NoUsableDocuments` at the end of a whole epoch that
        yielded no usable document (every row skipped, or every row group empty), naming the
        files and the skip counts, instead of cycling through empty epochs forever. A finite pass
        simply ends; its chunks carry every skip."""
        epoch, pos, row = (int(x) for x in cursor)
        if not self.infinite and epoch > 0:
            return
        stop = stop if stop is not None else threading.Event()
        positions = self._positions(epoch, pos)
        pool = (
            ThreadPoolExecutor(
                self.read_ahead,
                thread_name_prefix=f"parquet-read-dp{self.dp_rank}",
                initializer=thread_init,
            )
            if self.read_ahead > 0
            else None
        )
        pending: deque[tuple[int, int, RowGroup, Future | None]] = deque()
        epoch_tally = _EpochTally(whole=pos == 0 and row == 0)
        try:
            while not stop.is_set():
                while len(pending) <= self.read_ahead:
                    nxt = next(positions, None)
                    if nxt is None:
                        break
                    e, p, g = nxt
                    pending.append((e, p, g, pool.submit(self.read_row_group, g) if pool else None))
                if not pending:
                    return
                epoch, pos, g, fut = pending.popleft()
                while fut is not None and not fut.done():
                    # Waiting for a read: a stop ends the generator now, whose shutdown then
                    # cancels the reads not yet started (not after this one returns).
                    if stop.is_set():
                        return
                    wait_futures([fut], timeout=0.05)
                for chunk in self._row_group_chunks(epoch, pos, g, fut, row):
                    epoch_tally.add(chunk)
                    yield chunk
                    if stop.is_set():
                        return
                row = 0
                if pos == len(self.row_groups) - 1:  # the epoch is complete
                    if self.infinite and epoch_tally.whole and epoch_tally.docs == 0:
                        raise NoUsableDocuments(self._no_documents_message(epoch, epoch_tally))
                    epoch_tally = _EpochTally(whole=True)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _row_group_chunks(
        self, epoch: int, pos: int, g: RowGroup, fut: Future | None, row: int
    ) -> Iterator[Chunk]:
        """The chunks of row group ``g`` (at ``pos`` of ``epoch``'s order) from ``row`` on."""
        skips: list[tuple[str, str, int]] = []
        col = self._load(g, skips, fut)
        if col is None:  # whole row group skipped (counted as its remaining rows)
            reason, loc, _ = skips[0]
            after = self._normalize((epoch, pos + 1, 0))
            yield Chunk([], g.num_rows - row, [(reason, loc, g.num_rows - row)], after)
            return
        while row < g.num_rows:
            end = min(row + self.chunk_rows, g.num_rows)
            skips = []
            texts = self._texts(g, col, row, end, skips)
            n, row = end - row, end
            after = (epoch, pos + 1, 0) if row >= g.num_rows else (epoch, pos, row)
            yield Chunk(texts, n, skips, self._normalize(after))

    def _no_documents_message(self, epoch: int, tally: _EpochTally) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(tally.skips.items())) or "none"
        return (
            f"dp_rank {self.dp_rank} of {self.dp_world_size}: epoch {epoch} of the {self.split} "
            f"split read all {len(self.row_groups)} row group(s) of this rank in "
            f"{self._files_named()} and got no usable document ({tally.rows} rows read; skipped: "
            f"{counts}). An endless stream would cycle through them forever without a batch: fix "
            f"the data or text_column={self.text_column!r}, or use fewer DP ranks."
        )

    def _normalize(self, cursor: tuple[int, int, int]) -> tuple[int, int, int]:
        e, p, r = cursor
        if p >= len(self.row_groups):
            return (e + 1, 0, 0)
        return (e, p, r)

    def describe(self) -> str:
        return (
            f"{self.split} split: {len(self.files)} file(s), {self.total_row_groups} row group(s); "
            f"dp_rank {self.dp_rank}/{self.dp_world_size} owns {len(self.row_groups)} "
            f"({self.rows_per_epoch} rows per epoch)"
            + (
                f"; {len(self.unreadable_files)} unreadable file(s) skipped: "
                + ", ".join(self.unreadable_files)
                if self.unreadable_files
                else ""
            )
        )
