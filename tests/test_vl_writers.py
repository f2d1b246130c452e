"""VL cache writers: one lock per key whatever the rank layout, stray temp files of killed runs
removed by the next build, a SIGKILL inside the atomic JSON write then a rerun gives the clean
build's bytes, whole-file fingerprints (cached by size and mtime), every per-row failure a
counted skip, no ``assert`` in the data path."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from torchtitan_ext.vl import build as B
from torchtitan_ext.vl import sources as S
from torchtitan_ext.vl.cache import VLCache
from torchtitan_ext.vl.write import JSON_TMP_PREFIX

REPO = Path(__file__).resolve().parents[1]
SEQ = 1024
ARGS = dict(buckets=[512, 768], rows_per_shard=6, max_samples=30)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("vl_writers")
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    data = sample_dataset_path(n=30, bad_rows=True, root=root / "data")
    clean = B.build_cache(data, "train", root / "clean", SEQ, 8, show_progress=False, **ARGS)
    yield {"root": root, "data": data, "clean": clean, "home": root / "home"}
    mp.undo()


def _tree(kdir: Path) -> dict[str, bytes]:
    """Every file under the key directory, hidden ones included, with its bytes."""
    return {
        str(p.relative_to(kdir)): p.read_bytes() for p in sorted(kdir.rglob("*")) if p.is_file()
    }


def _writer_script(cache_dir: Path, env, rank: int, world: int, hook: str = "") -> list[str]:
    """A writer process: ``hook`` (Python) runs first, then build_cache for this rank."""
    head = "import os, signal, sys, time\nfrom pathlib import Path\nfrom torchtitan_ext.vl import build, write\n"
    tail = textwrap.dedent(
        f"""
        build.build_cache({str(env["data"])!r}, "train", {str(cache_dir)!r}, {SEQ}, 8,
                          rank={rank}, world_size={world}, show_progress=False, **{ARGS!r})
        print("DONE")
        """
    )
    return [sys.executable, "-c", head + textwrap.dedent(hook) + tail]


def _run_env(env) -> dict[str, str]:
    return dict(os.environ, TORCHTITAN_EXT_CACHE=str(env["home"]))


# ---------------------------------------------------------------------------------- layouts


_SLOW_SHARDS = """
real_publish = write.publish_shard
def slow_publish(tmp, final):
    time.sleep(0.6)
    return real_publish(tmp, final)
build.publish_shard = slow_publish
"""


@pytest.mark.slow
def test_two_layouts_on_one_key_are_kept_apart(env, tmp_path):
    """A WORLD_SIZE=2 job is building; a WORLD_SIZE=1 writer on the same key is refused with a
    clear error (while the job runs), the job finishes, and the result equals a clean build."""
    cd = tmp_path / "c"
    r0 = subprocess.Popen(_writer_script(cd, env, 0, 2, _SLOW_SHARDS), env=_run_env(env),
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    kdir = cd / env["clean"].name
    lock = cd / f".{kdir.name}.lock"
    deadline = time.monotonic() + 120
    while not list((kdir / "shards").glob(".tmp-*")) and time.monotonic() < deadline:
        assert r0.poll() is None, r0.stderr.read()
        time.sleep(0.05)
    assert lock.read_text().strip() == "2"
    with pytest.raises(B.CacheLockedError, match=r"WORLD_SIZE=2 is building .* WORLD_SIZE=1"):
        B.build_cache(env["data"], "train", cd, SEQ, 8, rank=0, world_size=1,
                      show_progress=False, **ARGS)  # fmt: skip
    r1 = subprocess.run(_writer_script(cd, env, 1, 2), env=_run_env(env), cwd=REPO,
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    out0, err0 = r0.communicate(timeout=300)
    assert r0.returncode == 0 and r1.returncode == 0, (err0[-2000:], r1.stderr[-2000:])
    assert _tree(kdir) == _tree(env["clean"])
    # the other layout now finds the complete cache
    assert B.build_cache(env["data"], "train", cd, SEQ, 8, rank=0, world_size=1,
                         show_progress=False, **ARGS) == kdir  # fmt: skip


@pytest.mark.slow
def test_killed_layout_then_other_layout_cleans_and_matches(env, tmp_path):
    """A WORLD_SIZE=2 rank is SIGKILLed with a shard half written; a WORLD_SIZE=1 rerun removes
    its leftovers and gives the clean build's bytes, with no extra file."""
    cd = tmp_path / "c"
    hook = """
real_write = write.write_shard
def write_then_die(out, *a, **k):
    st = real_write(out, *a, **k)
    if sorted(Path(out).parent.glob("0000*")):  # one shard is done: die inside the next
        os.kill(os.getpid(), signal.SIGKILL)
    return st
build.write_shard = write_then_die
"""
    r = subprocess.run(_writer_script(cd, env, 0, 2, hook), env=_run_env(env), cwd=REPO,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    kdir = cd / env["clean"].name
    strays = list((kdir / "shards").glob(".tmp-*"))
    assert strays and not (kdir / "metadata.json").exists()
    assert B.build_cache(env["data"], "train", cd, SEQ, 8, rank=0, world_size=1,
                         show_progress=False, **ARGS) == kdir  # fmt: skip
    assert _tree(kdir) == _tree(env["clean"])


@pytest.mark.slow
@pytest.mark.parametrize("target", ["metadata.json", "packing_stats.json"])
def test_sigkill_inside_atomic_json_write_then_rerun(env, tmp_path, target):
    cd = tmp_path / "c"
    hook = f"""
real_replace = os.replace
def replace(src, dst, *a, **k):
    if os.path.basename(str(src)).startswith({JSON_TMP_PREFIX + target!r}):
        os.kill(os.getpid(), signal.SIGKILL)  # the temp file is written and fsynced
    return real_replace(src, dst, *a, **k)
os.replace = replace
"""
    r = subprocess.run(_writer_script(cd, env, 0, 1, hook), env=_run_env(env), cwd=REPO,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    kdir = cd / env["clean"].name
    assert list(kdir.glob(f"{JSON_TMP_PREFIX}{target}.*")), "the kill left its temp file"
    assert not (kdir / "metadata.json").exists()
    r = subprocess.run(_writer_script(cd, env, 0, 1), env=_run_env(env), cwd=REPO,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0 and "DONE" in r.stdout, r.stderr[-2000:]
    assert _tree(kdir) == _tree(env["clean"])
    assert VLCache.open(kdir).verify() == []


def test_finalisation_removes_only_its_own_temp_files(env, tmp_path):
    """While another writer is alive (it holds the key lock), a finishing writer removes no
    shard temp directory (it may be that writer's live one); stray JSON temp files, which only
    finalisers write, it removes."""
    import shutil

    cd = tmp_path / "c"
    kdir = cd / env["clean"].name
    (kdir / "shards").mkdir(parents=True)
    for d in (env["clean"] / "shards").iterdir():  # every shard done, no manifest yet
        shutil.copytree(d, kdir / "shards" / d.name)
    live = kdir / "shards" / ".tmp-00002-r1of2-999999"
    live.mkdir()
    (live / "tokens.memmap").write_bytes(b"in progress")
    (kdir / f"{JSON_TMP_PREFIX}metadata.json.999999").write_text("{")
    lock = cd / f".{kdir.name}.lock"
    lock.write_text("1")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a live peer
        B.build_cache(env["data"], "train", cd, SEQ, 8, rank=0, world_size=1,
                      show_progress=False, **ARGS)  # fmt: skip
        assert (live / "tokens.memmap").read_bytes() == b"in progress"
        assert not list(kdir.glob(f"{JSON_TMP_PREFIX}*"))
    finally:
        os.close(fd)
    shutil.rmtree(live)  # the peer finishes
    assert _tree(kdir) == _tree(env["clean"])


def test_same_rank_twice_is_refused(env, tmp_path):
    """Two writers of the same rank of one layout: the second gets CacheLockedError at once."""
    cd = tmp_path / "c"
    started, release = threading.Event(), threading.Event()
    real = B._ShardBuilder.run

    def slow_run(self, mine):
        started.set()
        release.wait(60)
        return real(self, mine)

    errors = []

    def first():
        try:
            B.build_cache(env["data"], "train", cd, SEQ, 8, rank=0, world_size=1,
                          show_progress=False, **ARGS)  # fmt: skip
        except Exception as e:  # re-raised below
            errors.append(e)

    B._ShardBuilder.run = slow_run
    try:
        t = threading.Thread(target=first)
        t.start()
        assert started.wait(60)
        B._ShardBuilder.run = real
        with pytest.raises(B.CacheLockedError, match="rank0of1.lock"):
            B.build_cache(env["data"], "train", cd, SEQ, 8, rank=0, world_size=1,
                          show_progress=False, **ARGS)  # fmt: skip
    finally:
        B._ShardBuilder.run = real
        release.set()
        t.join()
    assert not errors, errors
    assert _tree(cd / env["clean"].name) == _tree(env["clean"])


# ---------------------------------------------------------------------------------- fingerprint


def _big_dataset(out: Path) -> Path:
    """~3 MB of Parquet (noise PNGs), so that its middle is outside the first/last MiB."""
    import numpy as np
    from PIL import Image

    from torchtitan_ext.vl.sample_data import write_vl_parquet

    rng = np.random.default_rng(0)
    rows = []
    for i in range(4):
        import io

        b = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (420, 640, 3), dtype=np.uint8)).save(b, "PNG")
        rows.append({"image": {"bytes": b.getvalue(), "path": None}, "question": f"q{i}",
                     "answer": f"a{i}"})  # fmt: skip
    out.mkdir(parents=True)
    write_vl_parquet(rows, out / "train-0.parquet", batch_size=1)
    return out


def test_full_fingerprint_sees_a_same_size_edit_mid_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path / "home"))
    ds = _big_dataset(tmp_path / "ds")
    f = ds / "train-0.parquet"
    size = f.stat().st_size
    assert size > 3 << 20  # the middle is outside the first and last MiB
    cfg = B.config_from(ds, "train", 8192, 8)
    full0 = B._resolve(cfg)[2]
    quick_cfg = B.config_from(ds, "train", 8192, 8, fingerprint="quick")
    quick0 = B._resolve(quick_cfg)[2]
    assert full0 != quick0  # the mode is part of the key
    b = bytearray(f.read_bytes())
    b[size // 2] ^= 0xFF  # inside an image, same size
    f.write_bytes(bytes(b))
    assert f.stat().st_size == size
    assert B._resolve(cfg)[2] != full0, "full fingerprint must see the edit"
    assert B._resolve(quick_cfg)[2] == quick0  # the documented limit of "quick"


def test_full_hash_is_remembered_by_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path / "home"))
    f = tmp_path / "x.parquet"
    f.write_bytes(os.urandom(3 << 20))
    calls = []
    real = S._sha256_stream
    monkeypatch.setattr(S, "_sha256_stream", lambda p: calls.append(p) or real(p))
    h1 = S.file_fingerprint(f, "full")["sha256"]
    h2 = S.file_fingerprint(f, "full")["sha256"]
    assert h1 == h2 and len(calls) == 1, "the second check re-hashed the file"
    b = bytearray(f.read_bytes())
    b[1 << 20] ^= 1
    f.write_bytes(bytes(b))  # same size, new mtime/ctime
    h3 = S.file_fingerprint(f, "full")["sha256"]
    assert len(calls) == 2 and h3 != h1
    os.chmod(tmp_path / "home", 0o555)  # an unwritable store still works (not remembered)
    try:
        f.write_bytes(bytes(b[::-1]))
        assert S.file_fingerprint(f, "full")["sha256"] != h3
    finally:
        os.chmod(tmp_path / "home", 0o755)


# ---------------------------------------------------------------------------------- rows


def test_every_row_failure_is_a_counted_skip_with_its_type(env, tmp_path, monkeypatch):
    """An unforeseen exception in decoding or in processing skips that row (decode_error /
    processor_error with the exception's class) and the counts reconcile; --strict names it."""
    from PIL import Image, ImageFile

    from torchtitan_ext.vl import sample as VS

    real_load, real_patches = Image.Image.load, VS.image_to_patches
    calls = {"load": 0, "patch": 0}

    def flaky_load(self, *a, **k):  # the first decode of a file-backed image
        if isinstance(self, ImageFile.ImageFile) and not hasattr(self, "_flaky_seen"):
            self._flaky_seen = True
            calls["load"] += 1
            if calls["load"] % 7 == 3:
                raise KeyError("plugin table")
        return real_load(self, *a, **k)

    def flaky_patches(img, p):
        calls["patch"] += 1
        if calls["patch"] % 5 == 2:
            raise ZeroDivisionError("odd size")
        return real_patches(img, p)

    monkeypatch.setattr(Image.Image, "load", flaky_load)
    monkeypatch.setattr(VS, "image_to_patches", flaky_patches)
    k = B.build_cache(env["data"], "train", tmp_path / "c", SEQ, 8, show_progress=False,
                      num_workers=0, **ARGS)  # fmt: skip
    st = json.loads((k / "packing_stats.json").read_text())
    assert (
        st["skipped"].get("decode_error", 0) >= 1 and st["skipped"].get("processor_error", 0) >= 1
    )
    assert st["skipped_error_types"]["decode_error"] == {"KeyError": st["skipped"]["decode_error"]}
    assert st["skipped_error_types"]["processor_error"] == {
        "ZeroDivisionError": st["skipped"]["processor_error"]
    }
    assert st["rows_read"] == st["samples_packed"] + st["skipped_total"] == 30
    calls.update(load=0, patch=0)
    with pytest.raises(ValueError, match=r"row \d+: (decode_error|corrupt_image|processor_error)"):
        B.build_cache(env["data"], "train", tmp_path / "s", SEQ, 8, show_progress=False,
                      num_workers=0, strict=True, **ARGS)  # fmt: skip


def test_malformed_cell_is_a_skip_not_a_crash(env, tmp_path):
    from torchtitan_ext.vl.sample_data import write_vl_parquet

    good = S.open_source(env["data"], "train").read(0, 1)[0]["image"]
    rows = [
        {"image": good, "question": "q", "answer": "a"},
        {"image": {"bytes": b"\x89PNG\r\n\x1a\n" + b"\0" * 40, "path": None}, "question": "q",
         "answer": "a"},
    ]  # fmt: skip
    (tmp_path / "ds").mkdir()
    write_vl_parquet(rows, tmp_path / "ds" / "train-0.parquet")
    k = B.build_cache(tmp_path / "ds", "train", tmp_path / "c", SEQ, 8, show_progress=False)
    st = json.loads((k / "packing_stats.json").read_text())
    assert st["rows_read"] == 2 and st["samples_packed"] == 1 and st["skipped_total"] == 1


def test_no_assert_in_the_data_path():
    """``python -O`` strips asserts: the data path must not rely on any."""
    root = REPO / "torchtitan_ext"
    files = sorted((root / "vl").glob("*.py")) + [root / "loaders" / "vl.py"]
    found = [
        f"{f.relative_to(REPO)}:{n.lineno}"
        for f in files
        for n in ast.walk(ast.parse(f.read_text()))
        if isinstance(n, ast.Assert)
    ]
    assert not found, found


def test_layout_is_a_separate_step(env):
    """A source yields raw rows of the layout's columns; the layout alone parses them."""
    rows = S.open_source(env["data"], "train")
    assert isinstance(rows.layout, S.VQALayout)
    raw = rows.read(0, 2)
    assert set(raw[0]) == {"image", "question", "answer"}
    sample = rows.parse(raw[0])
    assert isinstance(sample, S.ChatSample) and len(sample.images) == 1
    vqa2 = S.VQALayout("img", "q", "answers").parse(
        {"img": [b"x", b"y"], "q": "?", "answers": [{"answer": "yes"}, {"answer": "no"}]}
    )
    assert vqa2.images == [b"x", b"y"] and vqa2.messages[-1]["content"] == "yes"
    with pytest.raises(ValueError, match="no answer column"):
        S.VQALayout.detect(["image", "question"], "somewhere.parquet")
    assert rows.layout.describe() == {
        "layout": "vqa", "columns": {"image": "image", "question": "question", "answer": "answer"}
    }  # fmt: skip


def test_a_shard_of_only_skipped_rows(env, tmp_path):
    """A shard whose every row is skipped has no data files, only its index: it opens, verifies
    and serves the other shards' packs."""
    from torchtitan_ext.vl.sample_data import write_vl_parquet

    good = S.open_source(env["data"], "train").read(0, 3)
    bad = [{"image": {"bytes": b"not an image", "path": None}, "question": "q", "answer": "a"}] * 3
    (tmp_path / "ds").mkdir()
    write_vl_parquet(bad + good, tmp_path / "ds" / "train-0.parquet")
    k = B.build_cache(tmp_path / "ds", "train", tmp_path / "c", SEQ, 8, rows_per_shard=3,
                      show_progress=False)  # fmt: skip
    assert sorted(p.name for p in (k / "shards" / "00000").iterdir()) == [
        "meta.json", "pack_offsets.memmap", "stats.json"
    ]  # fmt: skip
    c = VLCache.open(k)
    assert c.verify() == [] and len(c) >= 1
    rows = sorted(r for i in range(len(c)) for r in c.pack_rows(i))
    assert rows == [3, 4, 5]
    assert c.metadata["shards"][0]["packs"] == 0
