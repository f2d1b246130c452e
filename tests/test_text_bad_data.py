"""The text loaders on data nobody designed them for: empty row groups and shards, all-NULL and
mixed files, every Arrow string/binary layout, a read that hangs. Each ends in a clear error
within seconds (never a spin), leaves no thread behind, and counts every row it read."""

from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.support.resume import LoaderSpec, assert_resume_exact
from torchtitan_ext.data.embedded import ensure_embedded_data
from torchtitan_ext.pipeline.elastic import Progress
from torchtitan_ext.text.errors import NoUsableDocuments
from torchtitan_ext.text.parquet import ParquetFiles
from torchtitan_ext.text.parquet_position import Position
from torchtitan_ext.text.parquet_source import ParquetOptions, ParquetSource
from torchtitan_ext.text.prefetch import PrefetchingParquetLoader
from torchtitan_ext.text.streaming import StreamingTextDataset
from torchtitan_ext.text.tokenize import TextTokenizer

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(120)]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_path(ensure_embedded_data() / "tokenizer")


def _loader_threads() -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(("parquet-prefetch", "parquet-read")) and t.is_alive()
    ]


@pytest.fixture(autouse=True)
def no_thread_left():
    """The loader threads alive before the test (another test's in the same process, e.g. a
    pytest-xdist worker's, not yet collected): a test checks only those it started itself."""
    before = set(_loader_threads())
    yield before
    gc.collect()
    left = [t for t in _loader_threads() if t not in before]
    assert not left, f"threads left running: {left}"


def _started_here(before: set[threading.Thread]) -> list[threading.Thread]:
    """The loader threads alive now that were not before the test."""
    return [t for t in _loader_threads() if t not in before]


def _write(path: Path, values, typ=None, row_group_size: int = 32) -> Path:
    arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, typ)
    pq.write_table(pa.table({"text": arr}), path, row_group_size=row_group_size)
    return path


def _with_empty_row_group(path: Path, texts: list[str]) -> Path:
    """A file whose row groups are: texts[:half], an empty one, texts[half:]."""
    schema = pa.schema([("text", pa.string())])
    half = len(texts) // 2
    with pq.ParquetWriter(path, schema) as w:
        w.write_table(pa.table({"text": texts[:half]}, schema=schema))
        w.write_table(pa.table({"text": pa.array([], pa.string())}))
        w.write_table(pa.table({"text": texts[half:]}, schema=schema))
    assert [pq.ParquetFile(path).metadata.row_group(i).num_rows for i in range(3)][1] == 0
    return path


def _make(path, tok, **kw) -> PrefetchingParquetLoader:
    kw.setdefault("seq_len", 32)
    kw.setdefault("batch_size", 2)
    kw.setdefault("buffer_docs", 8)
    kw.setdefault("queue_size", 2)
    kw.setdefault("val_files", "none")
    return PrefetchingParquetLoader(path, tok, **kw)


def _next_within(loader, seconds: float):
    """``next(loader)``, failing (instead of hanging the suite) if it takes over ``seconds``."""
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(next, loader)
        try:
            return fut.result(timeout=seconds)
        except FuturesTimeout:
            loader.close()
            pytest.fail(f"next() did not return within {seconds} s")


def _rows(batches) -> list[list[int]]:
    return [
        row.tolist()
        for inputs, labels in batches
        for row in torch.cat([inputs["input"], labels[:, -1:]], 1)
    ]


# ----------------------------------------------------------------------------- no endless spin
def test_only_an_empty_row_group_fails_at_construction(tmp_path, tok):
    f = _write(tmp_path / "empty.parquet", pa.array([], pa.string()))
    t0 = time.monotonic()
    for infinite in (True, False):
        with pytest.raises(ValueError, match=r"gets only empty row groups.*empty\.parquet.*0 rows"):
            _make(f, tok, infinite=infinite)
    assert time.monotonic() - t0 < 5


def test_empty_row_group_between_others_is_passed_over(tmp_path, tok):
    f = _with_empty_row_group(tmp_path / "gap.parquet", DOCS[:40])
    with _make(f, tok, infinite=False, shuffle=False) as loader:
        list(loader)
        s = loader.get_stats()
    assert s["rows_read"] == s["docs_read"] == 40 and s["docs_skipped"] == 0
    with _make(f, tok, infinite=True) as loader:  # cycles epochs through the empty group
        for _ in range(30):
            next(loader)
        assert loader.get_stats()["epoch"] >= 1


def test_empty_shard_at_dp2_is_passed_over_by_both_ranks(tmp_path, tok):
    """Each epoch's row groups are dealt anew (global order): a rank dealt only the empty row
    group in one epoch moves on to the next, where it may get the other; neither rank fails."""
    _write(tmp_path / "a.parquet", DOCS[:50], row_group_size=100)  # one row group
    _write(tmp_path / "b.parquet", pa.array([], pa.string()))  # one empty row group
    t0 = time.monotonic()
    for rank in (0, 1):
        with _make(tmp_path, tok, dp_rank=rank, dp_world_size=2) as loader:
            for _ in range(5):
                _next_within(loader, 10)
    assert time.monotonic() - t0 < 20


def test_all_null_file_in_skip_mode_ends_in_a_clear_error(tmp_path, tok, no_thread_left):
    f = _write(tmp_path / "nulls.parquet", [None] * 100, pa.string())
    loader = _make(f, tok, on_bad_input="skip")  # infinite (the training default)
    t0 = time.monotonic()
    with pytest.raises(NoUsableDocuments) as ei:
        _next_within(loader, 10)
    assert time.monotonic() - t0 < 5
    msg = str(ei.value)
    assert "nulls.parquet" in msg and "null=100" in msg and "no usable document" in msg
    # the counts cover the pass that was read before the error
    s = loader.get_stats()
    assert (s["rows_read"], s["docs_read"], s["docs_skipped"]) == (100, 0, 100)
    assert loader.skip_counts == {"null": 100}
    assert loader.close() is True
    assert not _started_here(no_thread_left)


def test_all_bad_rows_at_dp2_error_on_each_rank(tmp_path, tok):
    """Every rank's epoch is all-NULL or non-text: each rank's loader errors, none spins."""
    _write(tmp_path / "a.parquet", [None] * 40, pa.string(), row_group_size=20)
    _write(tmp_path / "b.parquet", list(range(40)), row_group_size=20)
    for rank in (0, 1):
        with _make(tmp_path, tok, on_bad_input="skip", dp_rank=rank, dp_world_size=2) as loader:
            with pytest.raises(NoUsableDocuments, match=r"dp_rank \d of 2.*skipped: "):
                _next_within(loader, 10)


def test_a_resumed_partial_epoch_without_documents_is_not_an_error(tmp_path, tok):
    """Only a whole epoch proves there is nothing to read: a position resumed past the last good
    row group runs into the next epoch, which has documents."""
    texts = DOCS[:20] + [None] * 20
    f = _write(tmp_path / "tail.parquet", texts, pa.string(), row_group_size=20)
    opts = ParquetOptions(val_files="none", shuffle=False, on_bad_input="skip")
    src = ParquetSource(f, opts)
    src.reset(Position(progress=Progress(1, 0)).to_state(0, 1))
    got = [next(src) for _ in range(10)]
    assert sum(len(c.texts) for c in got) > 0 and src.state()["epoch"] >= 1
    src.close()


def test_source_stream_ends_once_interrupted(tmp_path):
    f = _write(tmp_path / "a.parquet", DOCS, row_group_size=10)
    src = ParquetSource(f, ParquetOptions(val_files="none", chunk_rows=3))
    next(src)
    src.interrupt()
    with pytest.raises(StopIteration):  # mid row group, mid epoch of an endless stream
        next(src)
    src.close()


# ----------------------------------------------------------------------------- shutdown
def test_close_stops_a_producer_waiting_on_a_slow_read(tmp_path, tok, no_thread_left):
    f = _write(tmp_path / "a.parquet", DOCS, row_group_size=10)
    loader = _make(f, tok, read_delay_s=2.0, read_ahead=2)
    loader.pipeline.start()
    time.sleep(0.2)  # the producer now waits for its first read
    t0 = time.monotonic()
    assert loader.close() is True
    # at most the reads in flight (2 s), not the ones queued behind them (another 2 s)
    assert time.monotonic() - t0 < 3.3
    assert not _started_here(no_thread_left)


def test_close_reports_a_read_that_never_returns(
    tmp_path, tok, monkeypatch, caplog, no_thread_left
):
    f = _write(tmp_path / "a.parquet", DOCS, row_group_size=10)
    release = threading.Event()
    real = ParquetFiles.read_row_group

    def hung(self, g):
        release.wait()
        return real(self, g)

    monkeypatch.setattr(ParquetFiles, "read_row_group", hung)
    loader = _make(f, tok)
    loader.pipeline.start()
    time.sleep(0.2)
    try:
        with caplog.at_level(logging.ERROR, logger="torchtitan_ext.pipeline.prefetch"):
            t0 = time.monotonic()
            assert loader.close(timeout=0.5) is False
            assert time.monotonic() - t0 < 2
        msg = "\n".join(r.getMessage() for r in caplog.records)
        assert "did not stop within" in msg and "parquet-prefetch" in msg
    finally:
        release.set()  # the read returns: everything then ends by itself
    deadline = time.monotonic() + 5
    while _started_here(no_thread_left) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _started_here(no_thread_left)


# ----------------------------------------------------------------------------- counts
def _mixed(tmp_path: Path) -> tuple[Path, dict[str, int], int]:
    """Good documents with NULLs, empty strings and, at the very end (after the last batch is
    cut), a run of NULLs; plus a binary file with invalid UTF-8."""
    texts: list = list(DOCS[:60])
    for i in (3, 17, 40):
        texts[i] = None
    for i in (5, 41):
        texts[i] = ""
    texts += [None] * 25  # the tail: read after the last emitted batch
    _write(tmp_path / "a.parquet", texts, pa.string(), row_group_size=16)
    raw = [d.encode() for d in DOCS[60:90]]
    raw[4] = b"\xff\xfe not utf-8"
    _write(tmp_path / "b.parquet", raw, pa.binary(), row_group_size=16)
    good = 60 - 5 + 30 - 1
    return tmp_path, {"null": 28, "empty": 2, "invalid_utf8": 1}, good


@pytest.mark.parametrize("kind", ["null_only", "mixed"])
def test_skip_mode_counts_are_exact_after_one_pass(tmp_path, tok, kind):
    if kind == "null_only":
        path = _write(tmp_path / "nulls.parquet", [None] * 100, pa.string())
        want, good = {"null": 100}, 0
    else:
        path, want, good = _mixed(tmp_path)
    with _make(path, tok, infinite=False, shuffle=False, on_bad_input="skip") as loader:
        for _ in loader:
            s = loader.get_stats()
            assert s["rows_read"] == s["docs_read"] + s["docs_skipped"]
        s = loader.get_stats()
    rows = good + sum(want.values())
    assert (s["rows_read"], s["docs_read"], s["docs_skipped"]) == (rows, good, rows - good)
    assert loader.skip_counts == want


def test_counts_reconcile_at_every_batch_and_after_resume(tmp_path, tok):
    path, want, good = _mixed(tmp_path)
    kw = dict(infinite=False, on_bad_input="skip", seed=5, chunk_rows=4)
    with _make(path, tok, **kw) as loader:
        n = sum(1 for _ in loader)
        final = loader.get_stats()

    def check(loader, event):
        s = loader.get_stats()
        assert s["rows_read"] == s["docs_read"] + s["docs_skipped"]  # after a load, every batch
        if event == "end":
            assert s["rows_read"] == final["rows_read"] and loader.skip_counts == want

    spec = LoaderSpec(
        "parquet_loader",
        lambda rank, world, infinite: _make(path, tok, **kw),
        state=lambda loaders: loaders[0].state_dict(),
    )
    for k in (1, 3, n // 2 - 1):
        assert_resume_exact(spec, cuts=(k, None), infinite=False, check=check)
    # and a state taken after the end reports the whole pass (and resumes to nothing more)
    assert_resume_exact(spec, cuts=(None, None), infinite=False, check=check)


# ----------------------------------------------------------------------------- column types
def _layouts(texts: list[str]) -> dict[str, pa.Array | pa.ChunkedArray]:
    b = [t.encode() for t in texts]
    half = len(texts) // 2
    return {
        "string": pa.array(texts, pa.string()),
        "large_string": pa.array(texts, pa.large_string()),
        "string_view": pa.array(texts, pa.string_view()),
        "dictionary": pa.array(texts, pa.string()).dictionary_encode(),
        "dictionary_large": pa.array(texts, pa.large_string()).dictionary_encode(),
        "binary": pa.array(b, pa.binary()),
        "binary_view": pa.array(b, pa.binary_view()),
        "dictionary_binary": pa.array(b, pa.binary()).dictionary_encode(),
        # a categorical built in pieces: each chunk has its own dictionary
        "chunked_dictionary": pa.chunked_array(
            [
                pa.array(texts[:half], pa.string()).dictionary_encode(),
                pa.array(texts[half:], pa.string()).dictionary_encode(),
            ]
        ),
    }


@pytest.fixture(scope="module")
def layout_dirs(tmp_path_factory) -> dict[str, Path]:
    texts = DOCS[:70] + DOCS[:10]  # repeats: dictionaries with shared entries
    root = tmp_path_factory.mktemp("layouts")
    dirs = {}
    for name, arr in _layouts(texts).items():
        d = root / name
        d.mkdir()
        _write(d / "part-0.parquet", arr, row_group_size=23)
        dirs[name] = d
    # Datasets whose files each use a different layout. Which comes first matters to a reader
    # that casts every file to the first one's type (datasets does): a view first, then a
    # dictionary of binary, has no such cast; binary first makes every value bytes.
    parts = [f"part-{i}.parquet" for i in range(len(MIXED_ORDER))]
    for name, order in (("mixed_files", MIXED_ORDER), ("mixed_binary_first", MIXED_ORDER[::-1])):
        d = root / name
        d.mkdir()
        layouts = _layouts(texts[:36])
        for part, kind in zip(parts, order, strict=True):
            _write(d / part, layouts[kind], row_group_size=7)
        dirs[name] = d
    d = root / "mixed_plain"
    d.mkdir()
    for part in parts:
        _write(d / part, texts[:36], pa.string(), row_group_size=7)
    dirs["mixed_plain"] = d
    return dirs


MIXED_ORDER = [
    "string_view",
    "dictionary_binary",
    "large_string",
    "dictionary",
    "chunked_dictionary",
    "string",
    "dictionary_large",
    "binary_view",
    "binary",
]


@pytest.mark.parametrize(
    "layout",
    [
        "large_string",
        "string_view",
        "dictionary",
        "dictionary_large",
        "binary",
        "binary_view",
        "dictionary_binary",
        "chunked_dictionary",
        "mixed_files",
        "mixed_binary_first",
    ],
)
def test_every_text_layout_gives_the_batches_of_a_plain_string_column(layout_dirs, tok, layout):
    plain = layout_dirs["mixed_plain" if layout.startswith("mixed") else "string"]
    kw = dict(infinite=False, shuffle=False, on_bad_input="error")

    def parquet_rows(d):
        with _make(d, tok, **kw) as loader:
            return _rows(loader), loader.get_stats()

    want, ws = parquet_rows(plain)
    got, gs = parquet_rows(layout_dirs[layout])
    assert got == want and gs["docs_read"] == ws["docs_read"] > 0 and gs["docs_skipped"] == 0

    def streaming_rows(d):
        ds = StreamingTextDataset(str(d), tok, seq_len=24, shuffle=False, infinite=False)
        return [torch.cat([x["input"], y[-1:]]).tolist() for x, y in ds], ds.stats()

    want, ws = streaming_rows(plain)
    got, gs = streaming_rows(layout_dirs[layout])
    assert got == want and gs["docs_used"] == ws["docs_used"] > 0 and gs["skipped"] == 0


def test_invalid_utf8_in_a_binary_view_column_is_one_counted_skip(tmp_path, tok):
    raw = [d.encode() for d in DOCS[:30]]
    raw[7] = b"ok then \xc3\x28 broken"
    f = _write(tmp_path / "bv.parquet", pa.array(raw, pa.binary_view()))
    with _make(f, tok, infinite=False, on_bad_input="skip") as loader:
        list(loader)
        assert loader.skip_counts == {"invalid_utf8": 1}
    ds = StreamingTextDataset(str(f), tok, seq_len=24, infinite=False, on_bad_input="skip")
    list(ds)
    assert ds.stats()["skips"] == {"invalid_utf8": 1} and ds.stats()["docs_used"] == 29
