"""ParquetSource: listing and validation split, each epoch's row groups dealt to the DP ranks,
resumable position, bad input."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchtitan_ext.text.errors import BadInputError, SkipLog
from torchtitan_ext.text.parquet import ParquetFiles, list_split
from torchtitan_ext.text.parquet_position import Position
from torchtitan_ext.text.parquet_source import ParquetOptions, ParquetSource


def _write(path: Path, texts: list, rows_per_group: int, column: str = "text", typ=None) -> Path:
    arr = pa.array(texts, type=typ) if typ is not None else pa.array(texts)
    pq.write_table(pa.table({column: arr}), path, row_group_size=rows_per_group)
    return path


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """5 train shards with 3, 2, 4, 1, 3 row groups (uneven) + one val shard."""
    n = 0
    for i, groups in enumerate([3, 2, 4, 1, 3]):
        texts = [f"doc {n + k}" for k in range(groups * 4)]
        n += len(texts)
        _write(tmp_path / f"train-{i:05d}.parquet", texts, 4)
    _write(tmp_path / "val-00000.parquet", [f"val {k}" for k in range(6)], 4)
    return tmp_path


def _src(path, dp_rank: int = 0, dp_world_size: int = 1, **kw) -> ParquetSource:
    kw.setdefault("chunk_rows", 128)
    return ParquetSource(path, ParquetOptions(**kw), dp_rank=dp_rank, dp_world_size=dp_world_size)


def _chunks(src: ParquetSource, state=None):
    """Every chunk from ``state`` (the start with None) to the end of a finite pass."""
    src.reset(state)
    try:
        yield from src
    finally:
        src.close()


def _all_texts(src: ParquetSource, state=None) -> list[str]:
    return [t for c in _chunks(src, state) for t in c.texts]


def test_split_auto_uses_val_files_and_never_overlaps(shards: Path):
    train = list_split(shards, "train")
    val = list_split(shards, "val")
    assert [p.name for p in val] == ["val-00000.parquet"]
    assert len(train) == 5 and not set(train) & set(val)
    # a training glob that also matches the validation file still excludes it
    train_glob = list_split(str(shards / "*.parquet"), "train", val_files=str(shards / "val-*"))
    assert set(train_glob) == set(train)
    # last_shard holds out the last file in sorted order
    last = list_split(str(shards / "train-*.parquet"), "val", val_files="last_shard")
    train_last = list_split(str(shards / "train-*.parquet"), "train", val_files="last_shard")
    assert [p.name for p in last] == ["train-00004.parquet"]
    assert last[0] not in train_last and len(train_last) == 4
    # documents: train and val are disjoint, and train covers all train shards
    tr = set(_all_texts(_src(shards, infinite=False)))
    va = set(_all_texts(_src(shards, split="val", infinite=False)))
    assert not tr & va and len(tr) == 13 * 4 and len(va) == 6


def test_split_errors(tmp_path: Path, shards: Path):
    with pytest.raises(FileNotFoundError):
        list_split(tmp_path / "nope")
    _write(tmp_path / "only.parquet", ["a"], 1)
    with pytest.raises(ValueError, match="no validation split"):
        list_split(tmp_path / "only.parquet", "val", val_files="none")
    with pytest.raises(ValueError, match="empty"):
        list_split(shards / "val-00000.parquet", "train", val_files=str(shards / "val-*"))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_dp_sharding_disjoint_and_complete(shards: Path, world: int):
    per_rank = [
        _all_texts(_src(shards, dp_rank=r, dp_world_size=world, infinite=False))
        for r in range(world)
    ]
    flat = [t for texts in per_rank for t in texts]
    assert len(flat) == len(set(flat)) == 13 * 4  # disjoint, complete, each once per epoch
    sizes = [
        len(_src(shards, dp_rank=r, dp_world_size=world).my_units(Position())) for r in range(world)
    ]
    assert max(sizes) - min(sizes) <= 1


def test_every_epoch_is_dealt_anew_disjoint_and_complete(shards: Path):
    """13 row groups over 4 ranks: every epoch, one global order (reshuffled by seed and epoch)
    is dealt round-robin, so the ranks' shares are disjoint and complete in each epoch and
    change from epoch to epoch; endless streams never run dry."""
    per_epoch: list[list[str]] = [[], [], []]
    for r in range(4):
        src = _src(shards, dp_rank=r, dp_world_size=4, seed=7, chunk_rows=3)
        while (epoch := src.state()["epoch"]) < 3:
            per_epoch[epoch] += next(src).texts
        src.close()
    for texts in per_epoch:
        assert len(texts) == len(set(texts)) == 13 * 4
    src = _src(shards, seed=7)
    orders = {tuple(u.id for u in src.epoch_units(e)) for e in range(6)}
    assert len(orders) > 1  # reshuffled
    assert src.epoch_units(2) == _src(shards, dp_rank=1, dp_world_size=3, seed=7).epoch_units(2)


def test_rank_without_row_groups_fails_loudly(shards: Path):
    with pytest.raises(ValueError, match=r"dp_rank 13 of 14 gets no row group.*13 row group"):
        _src(shards, dp_rank=13, dp_world_size=14)


def test_position_restart_is_exact(shards: Path):
    src = _src(shards, seed=3, chunk_rows=3)
    chunks, states = [], []
    for _ in range(40):
        chunks.append(next(src))
        states.append(src.state())
    src.close()
    for k in (0, 1, 5, 17, 33):
        again = _src(shards, seed=3, chunk_rows=3)
        again.reset(states[k])
        for want, want_state in zip(chunks[k + 1 :], states[k + 1 :], strict=True):
            got = next(again)
            assert got.texts == want.texts and again.state() == want_state
        again.close()
    with pytest.raises(ValueError, match="dp_rank=0, this loader has dp_rank=1"):
        _src(shards, dp_rank=1, dp_world_size=2).reset(states[3] | {"slot": [0, 2]})


# ---------------------------------------------------------------------------- bad input
def _bad_cases(tmp: Path) -> dict[str, tuple[Path, str, int]]:
    """name -> (file, reason, bad rows); each file has 2 row groups of 4 rows."""
    good = [f"ok {i}" for i in range(8)]
    cases = {}
    t = list(good)
    t[5] = None
    cases["null"] = (_write(tmp / "null.parquet", t, 4), "null", 1)
    t = list(good)
    t[2] = ""
    cases["empty"] = (_write(tmp / "empty.parquet", t, 4), "empty", 1)
    b = [s.encode() for s in good]
    b[6] = b"\xff\xfe bad"
    cases["invalid_utf8"] = (_write(tmp / "bin.parquet", b, 4, typ=pa.binary()), "invalid_utf8", 1)
    cases["not_string"] = (_write(tmp / "ints.parquet", list(range(8)), 4), "not_string", 8)
    return cases


@pytest.mark.parametrize("case", ["null", "empty", "invalid_utf8", "not_string"])
def test_bad_values_error_names_file_and_row_group(tmp_path: Path, case: str):
    f, _, _ = _bad_cases(tmp_path)[case]
    src = _src(f, val_files="none", shuffle=False, infinite=False)
    with pytest.raises(BadInputError) as ei:
        _all_texts(src)
    msg = str(ei.value)
    assert f.name in msg and "row_group=" in msg and "'text'" in msg
    if case != "not_string":
        assert "row=" in msg


@pytest.mark.parametrize("case", ["null", "empty", "invalid_utf8", "not_string"])
def test_bad_values_skip_is_counted_and_reconciles(tmp_path: Path, case: str):
    f, reason, n_bad = _bad_cases(tmp_path)[case]
    src = _src(f, val_files="none", infinite=False, on_bad_input="skip")
    log = SkipLog()
    rows = docs = 0
    for c in _chunks(src):
        rows += c.rows_read
        docs += len(c.texts)
        for r, w, n in c.skips:
            log.skip(r, w, n)
    assert log.as_dict() == {reason: n_bad}
    assert rows == 8 == docs + log.total
    assert f.name in log.examples[reason][0]


def test_missing_column_and_unreadable_file(tmp_path: Path):
    f = _write(tmp_path / "other.parquet", ["a", "b", "c"], 2, column="body")
    with pytest.raises(BadInputError, match=r"other.parquet.*'text'.*not found.*body"):
        _src(f, val_files="none")
    src = _src(f, val_files="none", infinite=False, on_bad_input="skip")
    chunks = list(_chunks(src))
    assert sum(c.rows_read for c in chunks) == 3 and not any(c.texts for c in chunks)
    assert Counter(r for c in chunks for r, _, _ in c.skips) == Counter({"missing_column": 2})
    assert sum(n for c in chunks for _, _, n in c.skips) == 3
    # a configurable column works
    assert _all_texts(
        _src(f, val_files="none", text_column="body", infinite=False, shuffle=False)
    ) == [
        "a",
        "b",
        "c",
    ]
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all" * 10)
    with pytest.raises(BadInputError, match="junk.parquet: unreadable Parquet file"):
        _src([f, junk], val_files="none", text_column="body")
    src = _src([f, junk], val_files="none", text_column="body", on_bad_input="skip")
    assert src.unreadable_files == [str(junk)]


def test_unreadable_row_group_at_read_time(tmp_path: Path, monkeypatch):
    f = _write(tmp_path / "a.parquet", [f"t{i}" for i in range(8)], 4)
    real = ParquetFiles.read_row_group

    def flaky(self, g):
        if g.index == 1:
            raise OSError("disk on fire")
        return real(self, g)

    monkeypatch.setattr(ParquetFiles, "read_row_group", flaky)
    with pytest.raises(
        BadInputError, match=r"a.parquet row_group=1 .*unreadable row group.*disk on fire"
    ):
        _all_texts(_src(f, val_files="none", infinite=False, shuffle=False))
    chunks = list(
        _chunks(_src(f, val_files="none", infinite=False, shuffle=False, on_bad_input="skip"))
    )
    assert sum(len(c.texts) for c in chunks) == 4
    assert [s[0] for c in chunks for s in c.skips] == ["unreadable_row_group"]
    assert sum(c.rows_read for c in chunks) == 8
