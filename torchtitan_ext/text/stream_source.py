"""Reading side of :class:`~torchtitan_ext.text.streaming.StreamingTextDataset`: which files a
source names, how Hugging Face ``datasets`` opens them, the raw rows of one piece, and
:class:`StreamSource`, which ties them to the window and gives a slot its epoch stream.

Contract: Hugging Face only *reads* rows here; every position (which shard, which rows, in which
order) is decided by :mod:`~torchtitan_ext.text.stream_window`. Errors name the file (and row
where one is known) before anything expensive is built.
"""

from __future__ import annotations

import atexit
import glob as _glob
import os
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torchtitan_ext.text.columns import text_kind
from torchtitan_ext.text.errors import BadInputError, SkipLog
from torchtitan_ext.text.stream_window import (
    Piece,
    block_shuffled,
    doc_id,
    is_shard_level,
    make_pieces,
    piece_size,
    shard_offsets,
    slot_items,
)

EXT_BUILDER = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".txt": "text",
    ".text": "text",
}
"""File suffix -> the ``datasets`` packaged builder that reads it."""

READ_BATCH = 256  # rows per datasets batch read

# The datasets readers still open (a script usually ends mid-stream). They are closed at exit,
# while modules are intact: left to interpreter teardown, a reader's cleanup prints
# "Exception ignored in: <generator object Parquet._generate_tables ...> AttributeError:
# 'NoneType' object has no attribute 'ArrowInvalid'" (datasets' module globals already None).
_OPEN_READERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_readers() -> None:
    for it in list(_OPEN_READERS):
        try:
            it.close()
        except Exception:  # noqa: BLE001, S110 - at exit, a reader that cannot close is moot
            pass


MISSING = object()  # the text column is absent from a record


FORMATS = {"parquet": "parquet", "json": "json", "jsonl": "json", "text": "text", "txt": "text"}
"""``format`` (a ``[dataloader]`` key, and a mixture source's) -> the ``datasets`` builder; it
overrides the suffix, so files of any name are read as that format."""


def resolve_local_files(
    path: str | Sequence[str], split: str = "train", fmt: str | None = None
) -> tuple[str, list[str]] | None:
    """``(builder, files)`` for a local file / directory / glob (or list of them), or ``None`` if
    ``path`` is not local (then it is treated as a Hugging Face hub dataset id). A directory
    whose files follow the Hugging Face split naming (``train-*.parquet``, ``val-*``, or a
    ``train/`` folder) contributes only the files of ``split``. ``fmt`` (a key of
    :data:`FORMATS`): read every file as that format, whatever its suffix (a directory then
    contributes all its files but hidden ones)."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is unknown; use one of {sorted(FORMATS)} or none")
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    files: list[str] = []
    for p in paths:
        p = str(p)
        if any(ch in p for ch in "*?["):
            files += sorted(_glob.glob(p, recursive=True))
        elif os.path.isdir(p):
            found = sorted(
                f
                for f in Path(p).rglob("*")
                if f.is_file()
                and (f.suffix.lower() in EXT_BUILDER if fmt is None else not f.name.startswith("."))
            )
            in_split = [
                f
                for f in found
                if f.name.startswith((f"{split}-", f"{split}_", f"{split}."))
                or split in f.relative_to(p).parts[:-1]
            ]
            files += [str(f) for f in (in_split or found)]
        elif os.path.isfile(p):
            files.append(p)
        elif isinstance(path, str):
            return None  # not local: a hub id
        else:
            raise FileNotFoundError(f"data file not found: {p}")
    if not files:
        raise FileNotFoundError(f"no .parquet/.jsonl/.json/.txt files match {path!r}")
    if fmt is not None:
        return FORMATS[fmt], files
    builders = {EXT_BUILDER.get(Path(f).suffix.lower()) for f in files}
    if None in builders:
        bad = [f for f in files if Path(f).suffix.lower() not in EXT_BUILDER][:3]
        raise ValueError(f"unsupported file type(s) {bad}; use .parquet, .jsonl/.json or .txt")
    if len(builders) != 1:
        raise ValueError(f"mixed file formats {sorted(builders)} in {path!r}; use one format")
    return builders.pop(), files


def parquet_footers(files: list[str], text_column: str) -> tuple[list[int], bool]:
    """Rows per local Parquet file, from the footers, and whether the text column can be read as
    bytes from every file (it is a text column in all of them: see
    :mod:`torchtitan_ext.text.columns`; otherwise values are judged one by one)."""
    import pyarrow.parquet as pq

    rows, kinds = [], []
    for f in files:
        try:
            pf = pq.ParquetFile(f)
            rows.append(pf.metadata.num_rows)
            schema = pf.schema_arrow
        except Exception as e:  # re-raised with the file named
            raise BadInputError(f"unreadable Parquet footer: {e}", file=f, hint=False) from e
        i = schema.get_field_index(text_column)
        kinds.append(text_kind(schema.field(i).type) if i >= 0 else None)
    return rows, bool(kinds) and None not in kinds


def open_local(
    builder: str,
    files: list[str],
    *,
    text_column: str,
    text_sample_by: str,
    read_text_as_binary: bool,
    load_kwargs: dict[str, Any],
):
    """``load_dataset(builder, data_files=files, streaming=True)``; a failure names the files."""
    from datasets import load_dataset

    kw = dict(load_kwargs)
    if builder == "text":
        kw.setdefault("sample_by", text_sample_by)
    if read_text_as_binary and not {"columns", "features"} & kw.keys():
        # Only the text column, as bytes, whatever string/binary/dictionary/view layout each
        # file has: datasets casts every file to the *first* file's type otherwise, and some
        # casts do not exist (dictionary<binary> -> string_view). Decoded per value by the
        # dataset (an invalid value is one counted skip).
        from datasets import Features, Value

        kw["columns"] = [text_column]
        kw["features"] = Features({text_column: Value("large_binary")})
    try:
        return load_dataset(builder, data_files=files, split="train", streaming=True, **kw)
    except Exception as e:  # schema inference reads the first file: name the files
        shown = ", ".join(files[:3]) + (" ..." if len(files) > 3 else "")
        raise BadInputError(
            f"cannot open as {builder} ({type(e).__name__}: {e})", file=shown, hint=False
        ) from e


def piece_rows(
    ds: Any,
    n_shards: int,
    piece: Piece,
    text_column: str,
    *,
    file: str,
    on_bad_input: str,
    skips: SkipLog | None,
) -> Iterator[tuple[int, Any]]:
    """``(row, text value)`` for the rows of one piece of ``ds``, in file order (:data:`MISSING`
    when the text column is absent). A read error is a BadInputError naming ``file`` and the
    row reached (or, with ``on_bad_input="skip"``, a skip of the rest of the shard counted in
    ``skips``); a counting pass (``skips=None``) just stops there, since the reading pass will
    hit and report the same error.

    Reads with ``IterableDataset.iter(batch_size)``: batched (fast) and, unlike ``__iter__``,
    it does not re-shard itself inside a DataLoader worker (the caller already did)."""
    sub = ds.shard(num_shards=n_shards, index=piece.shard, contiguous=True)
    row = 0
    it = sub.iter(batch_size=READ_BATCH)
    _OPEN_READERS.add(it)
    while piece.hi is None or row < piece.hi:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception as e:  # a corrupt file / line: name it, then raise or count
            if skips is None:  # a counting pass: the reading pass meets and reports it
                return
            err = BadInputError(
                f"unreadable record at or after this row ({type(e).__name__}: {e})",
                file=file,
                row=row,
            )
            if on_bad_input == "error":
                raise err from e
            skips.skip("unreadable", err.location)
            return
        col = batch.get(text_column)
        n = len(next(iter(batch.values()))) if batch else 0
        if col is None:
            col = [MISSING] * n
        for value in col:
            if piece.hi is not None and row >= piece.hi:
                return
            if row >= piece.lo:
                yield row, value
            row += 1


class StreamSource:
    """A source's shards clipped to a document window, and the epoch stream of one slot.

    Holds what is known about the files (builder, rows per shard as far as counted) and the
    Hugging Face handle (rebuilt lazily after pickling, so a DataLoader worker opens its own).
    Row counts come from Parquet footers when every file has one, otherwise from counting
    passes over the shards *up to the window's end* only (a hub stream with
    ``skip_first=100000`` counts its first shards, not the whole dataset)."""

    def __init__(
        self,
        source: str | Sequence[str],
        *,
        split: str,
        name: str | None,
        text_column: str,
        text_sample_by: str,
        load_kwargs: dict[str, Any],
        skip_first: int,
        max_documents: int | None,
        fmt: str | None = None,
    ) -> None:
        self.source = source
        self.split = split
        self.name = name
        self.text_column = text_column
        self.text_sample_by = text_sample_by
        self.load_kwargs = load_kwargs
        self.skip_first = skip_first
        self.max_documents = max_documents
        local = resolve_local_files(source, split, fmt)
        self.builder, self.files = local if local else (None, None)
        self.read_text_as_binary = False
        footer_rows: list[int] = []
        if self.builder == "parquet":
            footer_rows, self.read_text_as_binary = parquet_footers(self.files, text_column)
        self._hf = None
        self.n_shards = int(self.hf_dataset().n_shards)
        self.known: dict[int, int] = {}  # rows per shard, as far as known
        if footer_rows and len(footer_rows) == self.n_shards:
            self.known = dict(enumerate(footer_rows))
        # Document ids: the global raw index when all row counts are known up front, else
        # shard << 40 | row. Fixed here so that a later num_documents() cannot change them.
        self._offsets: list[int] | None = None
        self._global_ids = len(self.known) == self.n_shards
        self.pieces = self.make_pieces()

    def hf_dataset(self):
        """The ``datasets`` streaming handle (opened on first use)."""
        if self._hf is None:
            if self.builder is not None:
                self._hf = open_local(
                    self.builder,
                    self.files,
                    text_column=self.text_column,
                    text_sample_by=self.text_sample_by,
                    read_text_as_binary=self.read_text_as_binary,
                    load_kwargs=self.load_kwargs,
                )
            else:
                from datasets import load_dataset

                self._hf = load_dataset(
                    str(self.source),
                    self.name,
                    split=self.split,
                    streaming=True,
                    **self.load_kwargs,
                )
        return self._hf

    def __getstate__(self) -> dict[str, Any]:
        # Workers rebuild the HF handle lazily (cheap for local files); nothing else is special.
        d = dict(self.__dict__)
        d["_hf"] = None
        return d

    def shard_name(self, shard: int) -> str:
        """The file behind a shard (packaged builders read one file per shard)."""
        if self.files is not None and len(self.files) == self.n_shards:
            return self.files[shard]
        return f"{self.source} shard {shard}/{self.n_shards}"

    def count(self, shard: int) -> int:
        """Rows of one shard (one reading pass when the format has no metadata; cached)."""
        if shard not in self.known:
            rows = self.rows(Piece(shard, 0, None), on_bad_input="error", skips=None)
            self.known[shard] = sum(1 for _ in rows)
        return self.known[shard]

    def make_pieces(self, count_all: bool = False) -> list[Piece]:
        return make_pieces(
            self.n_shards,
            self.count,
            self.known,
            self.skip_first,
            self.max_documents,
            count_all=count_all,
            source=self.source,
        )

    def num_documents(self) -> int:
        """Documents in the window (rows, including ones that will be skipped as bad). Counts
        every shard of the window that has no metadata."""
        return sum(piece_size(p, self.known) for p in self.make_pieces(count_all=True))

    def doc_id(self, shard: int, row: int) -> int:
        """See :func:`~torchtitan_ext.text.stream_window.doc_id`."""
        if self._global_ids and self._offsets is None:
            self._offsets = shard_offsets([self.known[i] for i in range(self.n_shards)])
        return doc_id(shard, row, self._offsets if self._global_ids else None)

    def rows(
        self, piece: Piece, *, on_bad_input: str, skips: SkipLog | None
    ) -> Iterator[tuple[int, Any]]:
        """Rows of one piece (see :func:`piece_rows`; ``skips=None``: a counting pass)."""
        yield from piece_rows(
            self.hf_dataset(),
            self.n_shards,
            piece,
            self.text_column,
            file=self.shard_name(piece.shard),
            on_bad_input=on_bad_input,
            skips=skips,
        )

    def shard_level(self, nslots: int) -> bool:
        return is_shard_level(self.pieces, nslots, self.known)

    def epoch_stream(
        self,
        epoch: int,
        start: int,
        slot: int,
        nslots: int,
        *,
        seed: int,
        shuffle: bool,
        block_size: int,
        on_bad_input: str,
        skips: SkipLog,
    ) -> Iterator[tuple[int, int, Any]]:
        """The slot's shuffled epoch stream ``(shard, row, text value)`` from item ``start`` on
        (block shuffle of ``block_size``; see :mod:`~torchtitan_ext.text.stream_window`)."""
        items = slot_items(
            self.pieces,
            lambda p: self.rows(p, on_bad_input=on_bad_input, skips=skips),
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            slot=slot,
            nslots=nslots,
            shard_level=self.shard_level(nslots),
        )
        return block_shuffled(items, start, block_size, seed=seed, epoch=epoch, slot=slot)
