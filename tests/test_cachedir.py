"""Derived directories are reused only while they hold what was built (manifest of sizes and
SHA-256, and the build parameters), rebuilt otherwise; concurrent builders build once; the test
session keeps its caches away from the user's home."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import CACHE_ROOT
from torchtitan_ext.data import cachedir
from torchtitan_ext.data.cachedir import (
    MANIFEST,
    build_atomically,
    cache_root,
    verify_manifest,
    write_manifest,
)
from torchtitan_ext.data.embedded import ensure_embedded_data


class CountingFill:
    """A fill that writes two files (one in a subdirectory) and counts its calls."""

    def __init__(self, payload: bytes = b"payload") -> None:
        self.calls = 0
        self.payload = payload

    def __call__(self, tmp: Path) -> None:
        self.calls += 1
        (tmp / "data.bin").write_bytes(self.payload * 100)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "note.txt").write_text("hello")


def _tamper_same_size(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0xFF
    p.write_bytes(bytes(b))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE = {
    "flipped_byte": lambda d: _tamper_same_size(d / "data.bin"),
    "truncated": lambda d: _truncate(d / "data.bin"),
    "missing_file": lambda d: (d / "sub" / "note.txt").unlink(),
    "extra_file": lambda d: (d / "stray.parquet").write_bytes(b"x"),
    "no_manifest": lambda d: (d / MANIFEST).unlink(),  # a partial or older-format directory
    "bad_manifest": lambda d: (d / MANIFEST).write_text("{not json"),
}


def test_built_once_then_reused(tmp_path):
    fill = CountingFill()
    d = build_atomically(tmp_path / "x", fill, {"k": 1})
    assert fill.calls == 1 and verify_manifest(d, {"k": 1}) is None
    manifest = json.loads((d / MANIFEST).read_text())
    assert set(manifest["files"]) == {"data.bin", "sub/note.txt"}
    assert manifest["files"]["data.bin"]["size"] == 700
    assert build_atomically(tmp_path / "x", fill, {"k": 1}) == d
    assert fill.calls == 1  # reused, not rebuilt
    # no temporary or stale siblings are left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [".x.lock", "x"]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_directory_is_rebuilt(tmp_path, damage, caplog):
    fill = CountingFill()
    d = build_atomically(tmp_path / "x", fill)
    before = (d / MANIFEST).read_text()
    DAMAGE[damage](d)
    assert verify_manifest(d) is not None
    with caplog.at_level("WARNING", logger=cachedir.__name__):
        assert build_atomically(tmp_path / "x", fill) == d
    assert fill.calls == 2
    assert verify_manifest(d) is None and (d / MANIFEST).read_text() == before
    assert not (d / "stray.parquet").exists()
    assert any("rebuilding" in r.getMessage() and str(d) in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".x.lock", "x"]


def test_empty_or_older_format_directory_is_rebuilt(tmp_path):
    fill = CountingFill()
    (tmp_path / "empty").mkdir()
    build_atomically(tmp_path / "empty", fill)
    old = tmp_path / "old"  # written before manifests existed: a DONE marker, same files
    old.mkdir()
    (old / "data.bin").write_bytes(b"older bytes")
    (old / "DONE").write_text("ok\n")
    build_atomically(old, fill)
    assert fill.calls == 2 and verify_manifest(old) is None and not (old / "DONE").exists()


def test_somebody_elses_directory_is_never_deleted(tmp_path):
    mine = tmp_path / "x"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    (mine / "data.bin").write_bytes(b"also mine")
    with pytest.raises(FileExistsError, match=r"x: exists and holds data .*thesis\.tex"):
        build_atomically(mine, CountingFill())
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert (mine / "data.bin").read_bytes() == b"also mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".x.lock", "x"]  # no temporary left


def test_other_build_parameters_rebuild(tmp_path):
    fill = CountingFill()
    build_atomically(tmp_path / "x", fill, {"n": 1})
    assert verify_manifest(tmp_path / "x", {"n": 2}) is not None
    build_atomically(tmp_path / "x", fill, {"n": 2})
    assert fill.calls == 2 and verify_manifest(tmp_path / "x", {"n": 2}) is None


def test_a_failing_fill_leaves_nothing(tmp_path):
    def boom(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_atomically(tmp_path / "x", boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".x.lock"]


def test_leftovers_of_killed_builds_are_removed_by_the_next_build(tmp_path):
    # What a SIGKILL mid-build leaves: a temporary sibling (and one mid-replacement), no lock held.
    for left in (".x.tmp-abc123", ".x.stale-def456"):
        (tmp_path / left / "sub").mkdir(parents=True)
        (tmp_path / left / "sub" / "half.bin").write_bytes(b"x")
    (tmp_path / ".other.tmp-zzz").mkdir()  # another directory's build: not ours to remove
    build_atomically(tmp_path / "x", CountingFill())
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-zzz", ".x.lock", "x"]


def test_manifest_covers_every_file(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    write_manifest(tmp_path, {"v": (1, 2)})
    assert verify_manifest(tmp_path, {"v": (1, 2)}) is None  # tuples compare as stored lists
    (tmp_path / "a").write_bytes(b"abd")
    assert "sha256" in verify_manifest(tmp_path, {"v": (1, 2)})


def _concurrent_build(final: str, log: str, barrier) -> None:
    def fill(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough that the other builders arrive while this one works
        (tmp / "data.bin").write_bytes(b"same" * 1000)

    barrier.wait(30)
    build_atomically(Path(final), fill)


@pytest.mark.skipif(sys.platform != "linux", reason="needs the fork start method")
def test_concurrent_builders_build_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(3)
    log = tmp_path / "fills.log"
    procs = [
        ctx.Process(target=_concurrent_build, args=(str(tmp_path / "x"), str(log), barrier))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(log.read_text().splitlines()) == 1
    assert verify_manifest(tmp_path / "x") is None


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv("TORCHTITAN_EXT_CACHE")
    assert cache_root() == tmp_path / "xdg" / "torchtitan_ext"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "torchtitan_ext"
    from torchtitan_ext.vl.processor import default_cache_root

    assert default_cache_root() == cache_root()  # one cache root for text and VL assets


def test_the_session_keeps_its_caches_out_of_home():
    """tests/conftest.py points every cache the suite (and its subprocesses) may write at its
    own temporary directory; `make test` then proves HOME stays empty."""
    home = Path.home().resolve()
    for var in ("TORCHTITAN_EXT_CACHE", "HF_HOME", "HF_DATASETS_CACHE", "XDG_CACHE_HOME"):
        p = Path(os.environ[var]).resolve()
        assert p.is_relative_to(CACHE_ROOT.resolve()), var
        assert not p.is_relative_to(home), var
    assert cache_root().resolve().is_relative_to(CACHE_ROOT.resolve())


# ---------------------------------------------------------------------------- real builders
def test_embedded_data_tampered_or_partial_is_rebuilt(tmp_path):
    d = ensure_embedded_data(tmp_path)
    manifest = (d / MANIFEST).read_text()
    shard = d / "train-00001-of-00004.parquet"
    rows = pq.read_table(shard)["text"].to_pylist()
    _truncate(shard)  # a half-written shard
    assert ensure_embedded_data(tmp_path) == d
    assert pq.read_table(shard)["text"].to_pylist() == rows
    (d / "tokenizer" / "tokenizer.json").unlink()  # a partial directory
    ensure_embedded_data(tmp_path)
    assert (d / "tokenizer" / "tokenizer.json").is_file()
    assert (d / MANIFEST).read_text() == manifest  # the build is deterministic
    # parameters that are not in the directory name still count
    ensure_embedded_data(tmp_path, val_fraction=0.05)
    n_val = pq.ParquetFile(d / "val-00000-of-00001.parquet").metadata.num_rows
    assert verify_manifest(d) is not None and n_val > 30


def test_sample_dataset_tampered_is_rebuilt(tmp_path):
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    d = sample_dataset_path(n=6, root=tmp_path)
    f = d / "train-00000-of-00001.parquet"
    want = pq.read_table(f).to_pylist()
    _tamper_same_size(f)
    assert sample_dataset_path(n=6, root=tmp_path) == d
    assert pq.read_table(f).to_pylist() == want
    # another checkout's different data under the same name is not trusted
    other = pq.read_table(f).slice(0, 3)
    pq.write_table(other, f)
    sample_dataset_path(n=6, root=tmp_path)
    assert pq.read_table(f).num_rows == 6


def test_offline_processor_partial_is_rebuilt(tmp_path):
    from torchtitan_ext.vl.processor import build_offline_processor

    d = build_offline_processor(tmp_path / "proc")
    tok = (d / "tokenizer.json").read_bytes()
    (d / "tokenizer.json").unlink()
    assert build_offline_processor(tmp_path / "proc") == d
    assert (d / "tokenizer.json").read_bytes() == tok
