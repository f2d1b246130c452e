"""Packed VL cache: packing invariants, content vs direct processing, skips, verify, lock, resume
after SIGKILL (byte-identical), 2 ranks == 1 rank."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_ext.vl import build as B
from torchtitan_ext.vl import cache as C
from torchtitan_ext.vl import processor as P
from torchtitan_ext.vl import sources as S
from torchtitan_ext.vl.packing import best_fit_packs, bucket_length, normalize_buckets
from torchtitan_ext.vl.sample_data import BAD_ROW_REASONS

from .support.opens import needs_inotify, watch_opens
from .support.vl_chat import pil, positions_reference, vqa_reference
from .support.vl_sample import bad_rows_dataset

REPO = Path(__file__).resolve().parents[1]
SEQ = 1024


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Private asset cache (offline processor) + a small dataset with all the bad rows."""
    with bad_rows_dataset(tmp_path_factory, "vlcache", n=40) as env:
        yield env


def _build(env, cache_dir, **kw):
    args = dict(
        dataset=env["ds"],
        split="train",
        cache_dir=cache_dir,
        seq_len=SEQ,
        buffer_size=8,
        rows_per_shard=16,
        num_workers=0,
        show_progress=False,
        buckets=[512, 768],
    )
    args.update(kw)
    return B.build_cache(**args)


@pytest.fixture(scope="module")
def built(env):
    return _build(env, env["root"] / "c1")


def _content_files(kdir: Path) -> dict[str, bytes]:
    meta = json.loads((kdir / "metadata.json").read_text())
    out = {rel: (kdir / rel).read_bytes() for rel in meta["files"]}
    out["metadata.json"] = (kdir / "metadata.json").read_bytes()
    return out


# ---------------------------------------------------------------- packing


def naive_best_fit(lengths: list[int], seq_len: int, buffer_size: int) -> list[list[int]]:
    """The documented rule (vl/packing.py), written the slow, obvious way: samples enter a
    buffer in order; whenever it holds ``buffer_size`` samples, and then until it is empty, one
    pack is emitted: the longest buffered sample that still fits the space left, ties to the
    earliest arrival, again and again until none fits."""
    buf: list[int] = []
    packs: list[list[int]] = []

    def emit() -> list[int]:
        pack, space = [], seq_len
        while fits := [i for i in buf if lengths[i] <= space]:
            best = max(fits, key=lambda i: (lengths[i], -i))
            pack.append(best)
            buf.remove(best)
            space -= lengths[best]
        return pack

    for i in range(len(lengths)):
        buf.append(i)
        if len(buf) == buffer_size:
            packs.append(emit())
    while buf:
        packs.append(emit())
    return packs


def test_best_fit_by_hand():
    # buffer of 4: 60 + 40 (longest that fits 40), then 50 + 30 + 20 after 10 and 20 arrive
    assert list(best_fit_packs([60, 50, 40, 30, 20, 10], 100, 4)) == [[0, 2], [1, 3, 4], [5]]
    # equal lengths: the earliest first; buffer 1 is greedy in arrival order
    assert list(best_fit_packs([30, 30, 30, 30], 100, 4)) == [[0, 1, 2], [3]]
    assert list(best_fit_packs([70, 20, 50], 100, 1)) == [[0], [1], [2]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=60), st.integers(1, 20))
def test_best_fit_equals_the_naive_packer(lengths, buf):
    packs = list(best_fit_packs(lengths, 100, buf))
    assert packs == naive_best_fit(lengths, 100, buf)
    flat = sorted(i for p in packs for i in p)
    assert flat == list(range(len(lengths)))  # every sample exactly once
    assert all(sum(lengths[i] for i in p) <= 100 for p in packs)


def test_packing_rejects_overlong_and_buckets():
    with pytest.raises(ValueError, match="length 11"):
        list(best_fit_packs([3, 11], 10, 4))
    b = normalize_buckets(1024, [512, 256, 512])
    assert b == [256, 512, 1024]
    assert bucket_length(1, b) == 256 and bucket_length(257, b) == 512
    assert bucket_length(1024, b) == 1024
    with pytest.raises(ValueError):
        normalize_buckets(512, [1024])


# ---------------------------------------------------------------- content


@pytest.fixture(scope="module")
def rope_model():
    from .support.tiny_qwen3vl import rope_model as make

    return make()


def test_pack_content_matches_hf_reference(env, built, rope_model):
    """Every sample of every pack equals transformers' processing of its source row, read with
    pyarrow and decoded by PIL: ids and image grids from ``Qwen3VLProcessor`` on the chat
    template's text, labels on the assistant spans found in those ids, normalised pixels equal
    to its ``pixel_values``, mRoPE rows from ``get_rope_index`` (tests/support/vl_chat.py)."""
    cache = C.VLCache.open(built)
    proc = P.load_processor(None)
    rows = pq.read_table(sorted(env["ds"].glob("*.parquet"))).to_pylist()
    tok = proc.tokenizer
    ids = cache.special_tokens
    assert ids["pad_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert ids["image_pad_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    n_samples = 0
    for i in range(len(cache)):
        p = cache.pack(i)
        L = cache.pack_shape(i)
        assert L in (512, 768, 1024)
        assert p["input_ids"].shape == (L,) and p["labels"].shape == (L,)
        assert p["position_ids"].shape == (4, L)
        assert int(p["seq_lens"].sum()) == int(p["num_tokens"]) <= L
        n = int(p["num_tokens"])
        assert (p["input_ids"][n:] == ids["pad_id"]).all() and (p["labels"][n:] == -100).all()
        assert (p["position_ids"][:, n:] == 0).all()
        a = pix = img = 0
        for row, ln in zip(cache.pack_rows(i), p["seq_lens"].tolist(), strict=True):
            r = rows[row]
            ref = vqa_reference(proc, [pil(r["image"]["bytes"])], r["question"], r["answer"])
            assert torch.equal(p["input_ids"][a : a + ln], ref["input_ids"]), row
            assert torch.equal(p["labels"][a : a + ln], ref["labels"]), row
            g = ref["image_grid_thw"]
            assert torch.equal(p["image_grid_thw"][img : img + len(g)], g), row
            k = int(g.prod(dim=1).sum())
            got = P.normalize_patches(p["pixel_u8"][pix : pix + k])
            assert torch.equal(got, ref["pixel_values"]), row
            want = positions_reference(rope_model, ref["input_ids"], g, ids["image_pad_id"])
            assert torch.equal(p["position_ids"][:, a : a + ln], want), row
            a, pix, img = a + ln, pix + k, img + len(g)
            n_samples += 1
        assert pix == p["pixel_u8"].shape[0] and p["pixel_u8"].dtype == torch.uint8
        assert img == p["image_grid_thw"].shape[0]
    assert n_samples == cache.metadata["counts"]["samples"]
    kinds = {rows[r]["kind"] for i in range(len(cache)) for r in cache.pack_rows(i)}
    assert kinds == {"ok", "one_pixel"}, "only good rows are packed"


def test_counts_reconcile_and_skip_reasons(env, built):
    stats = json.loads((built / "packing_stats.json").read_text())
    meta = json.loads((built / "metadata.json").read_text())
    assert stats["rows_read"] == 49 == stats["samples_packed"] + stats["skipped_total"]
    expected: dict[str, int] = {}
    for reason in BAD_ROW_REASONS.values():
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    assert stats["skipped"] == expected
    assert meta["counts"]["packs"] == stats["packs"] == len(C.VLCache.open(built))
    assert set(meta["versions"]) >= {"torch", "transformers", "tensordict"}
    for rel, f in meta["files"].items():  # the manifest records each file as it is
        data = (built / rel).read_bytes()
        assert f["size"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest(), rel
    # no pickle anywhere: every file is JSON or a raw memmap
    for p in built.rglob("*"):
        if p.is_file():
            assert p.suffix in (".json", ".memmap") or p.name == ".manifest.lock", p


def test_strict_names_the_row(env):
    with pytest.raises(ValueError, match=r"row 3: corrupt_image"):
        _build(env, env["root"] / "strict", strict=True)


def test_key_find_and_force(env, built):
    assert (
        B.find_cache(
            env["ds"], "train", env["root"] / "c1", SEQ, 8, buckets=[512, 768], rows_per_shard=16
        )
        == built
    )
    assert (
        B.find_cache(
            env["ds"], "train", env["root"] / "c1", SEQ, 8, buckets=None, rows_per_shard=16
        )
        is None
    )  # other buckets -> other key
    assert (
        B.find_cache(
            env["ds"], "train", env["root"] / "c1", 2048, 8, buckets=[512, 768], rows_per_shard=16
        )
        is None
    )
    # reuse: a second build returns at once without touching files
    before = (built / "metadata.json").stat().st_mtime_ns
    assert _build(env, env["root"] / "c1") == built
    assert (built / "metadata.json").stat().st_mtime_ns == before


def test_force_rebuilds_identically(env, tmp_path):
    k = _build(env, tmp_path, max_samples=20)
    first = _content_files(k)
    m0 = (k / "shards" / "00000" / "tokens.memmap").stat().st_mtime_ns
    time.sleep(0.01)
    assert _build(env, tmp_path, max_samples=20, force=True) == k
    assert (k / "shards" / "00000" / "tokens.memmap").stat().st_mtime_ns != m0
    assert _content_files(k) == first


def test_verify_names_corrupt_file(env, tmp_path):
    k = _build(env, tmp_path, max_samples=20)
    cache = C.VLCache.open(k)
    assert cache.verify() == []
    pix = k / "shards" / "00000" / "pixels.memmap"
    data = bytearray(pix.read_bytes())
    data[100] ^= 0xFF
    pix.write_bytes(bytes(data))
    probs = C.VLCache.open(k).verify()
    assert len(probs) == 1 and "shards/00000/pixels.memmap" in probs[0] and "sha256" in probs[0]
    tok = k / "shards" / "00001" / "tokens.memmap"
    tok.write_bytes(tok.read_bytes()[:-4])
    probs = C.verify_cache(k)  # a truncated file is an error at open: verify_cache reports it
    assert any("shards/00001/tokens.memmap" in p and "size" in p for p in probs)


def test_lock_keeps_second_writer_off(env, tmp_path):
    src, _, key = B._resolve(
        B.BuildConfig(
            dataset=str(env["ds"]),
            seq_len=SEQ,
            buffer_size=8,
            buckets=[512, 768, 1024],
            max_samples=20,
            rows_per_shard=16,
        )
    )
    name = B.key_dir_name(
        B.BuildConfig(dataset=str(env["ds"]), seq_len=SEQ, buffer_size=8), src.name, key
    )
    lock = tmp_path / f".{name}.rank0of1.lock"
    with B._flock(lock, False, "test"), pytest.raises(B.CacheLockedError, match="lock"):
        _build(env, tmp_path, max_samples=20)
    _build(env, tmp_path, max_samples=20)  # released: builds


def test_two_ranks_equal_one_rank(env, tmp_path, built):
    errors = []

    def run(rank):
        try:
            _build(env, tmp_path, rank=rank, world_size=2, wait_timeout=120)
        except Exception as e:  # re-raised in the main thread below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    k2 = tmp_path / built.name
    assert _content_files(k2) == _content_files(built)


def _preprocess_cli(env, rows_per_shard: int) -> list[str]:
    """The preprocess_cached command line of the subprocess tests (cache dir added by each)."""
    return [
        sys.executable, "-m", "torchtitan_ext.vl.preprocess", "--dataset", str(env["ds"]),
        "--seq-len", str(SEQ), "--buffer-size", "8", "--rows-per-shard", str(rows_per_shard),
        "--num-workers", "0", "--quiet", "--buckets", "512,768", "--packed",
    ]  # fmt: skip


@pytest.mark.integration
def test_sigkill_resume_is_byte_identical(env, tmp_path):
    """Kill a CLI build with SIGKILL mid-way, restart with the same args: same bytes as a clean
    build, and the shards completed before the kill are not rebuilt."""
    args = _preprocess_cli(env, rows_per_shard=2)
    killed = tmp_path / "killed"
    e = dict(os.environ)
    proc = subprocess.Popen(
        args + ["--cache-dir", str(killed)],
        env=e,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    shards_dir = None
    while time.monotonic() < deadline:
        found = list(killed.glob("*/shards/00002"))
        if found:
            shards_dir = found[0].parent
            break
        if proc.poll() is not None:
            pytest.fail(f"build ended before it could be killed: {proc.stderr.read().decode()}")
        time.sleep(0.02)
    assert shards_dir is not None, "no shard appeared in time"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kdir = shards_dir.parent
    assert not (kdir / "metadata.json").exists()
    done_before = sorted(p.name for p in shards_dir.iterdir() if not p.name.startswith("."))
    assert 3 <= len(done_before) < 25
    inode = {n: (shards_dir / n / "tokens.memmap").stat().st_ino for n in done_before}
    r = subprocess.run(
        args + ["--cache-dir", str(killed)], env=e, cwd=REPO, capture_output=True, timeout=300
    )
    assert r.returncode == 0, r.stderr.decode()
    assert {n: (shards_dir / n / "tokens.memmap").stat().st_ino for n in done_before} == inode
    assert not [p for p in shards_dir.iterdir() if p.name.startswith(".tmp")]
    clean = B.build_cache(
        dataset=env["ds"],
        split="train",
        cache_dir=tmp_path / "clean",
        seq_len=SEQ,
        buffer_size=8,
        rows_per_shard=2,
        num_workers=0,
        show_progress=False,
        buckets=[512, 768],
    )
    assert clean.name == kdir.name
    assert _content_files(kdir) == _content_files(clean)


@needs_inotify
def test_open_reads_index_only(built):
    """Opening reads the manifest and the shards' meta.json, never a data file (the kernel
    reports every open: tests/support/opens.py). The first ``pack(i)`` of a shard maps that
    shard's files and no other shard's."""
    shards = C.VLCache.open(built).metadata["shards"]
    assert len(shards) >= 3, "the fixture needs several shards"
    with watch_opens([built / "shards" / s["name"] for s in shards]) as opened:
        cache = C.VLCache.open(built)
        # the watch works (open reads every meta.json) and saw nothing else
        assert opened() == {(s["name"], "meta.json") for s in shards}
        first = next(s["name"] for s in shards if s["packs"])
        cache.pack(0)
        seen = opened()
        assert {shard for shard, _ in seen} == {first}
        assert {"tokens.memmap", "pixels.memmap", "pack_offsets.memmap"} <= {n for _, n in seen}


def test_in_process_build_keeps_the_callers_threads(env, tmp_path):
    """Building in this process (num_workers=0) runs the workers' one-thread set-up here; the
    caller's torch intra-op thread count is restored afterwards, so a test or a training job
    that builds a cache does not compute on one thread from then on."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _build(env, tmp_path, max_samples=6)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_multiprocess_workers_same_bytes(env, tmp_path, built):
    k = _build(env, tmp_path, num_workers=2)
    assert _content_files(k) == _content_files(built)


def test_position_ids_padding_and_first_label(built):
    cache = C.VLCache.open(built)
    p = cache.pack(0)
    starts = np.concatenate(([0], np.cumsum(p["seq_lens"].numpy())[:-1]))
    assert (p["labels"][starts] == -100).all()
    assert (p["position_ids"][:, starts] == 0).all()  # restart at 0 per sample


def test_rank_world_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert B._dist_env(None, None) == (1, 3)
    assert B._dist_env(0, 1) == (0, 1)  # explicit arguments win
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="RANK"):
        B._dist_env(None, None)


def test_local_split_selection(env, tmp_path):
    assert S.open_source(env["ds"], "train").num_rows == 49
    with pytest.raises(FileNotFoundError, match=r"split 'validation' \(splits here: \['train'\]\)"):
        S.open_source(env["ds"], "validation")
    glob_src = S.open_source(str(env["ds"] / "*.parquet"), "anything")  # a glob: used as given
    assert glob_src.num_rows == 49
    with pytest.raises(FileNotFoundError, match="no such local path"):
        S.open_source(str(tmp_path / "missing"), "train")


@pytest.mark.integration
def test_two_ranks_via_env_cli(env, tmp_path, built, monkeypatch):
    """RANK/WORLD_SIZE from the environment, as torchrun sets them: rank 1 is a CLI subprocess,
    rank 0 runs here; the finished cache equals the single-process one byte for byte."""
    cli = _preprocess_cli(env, rows_per_shard=16) + [
        "--cache-dir",
        str(tmp_path),
    ]
    p1 = subprocess.Popen(
        cli,
        env=dict(os.environ, RANK="1", WORLD_SIZE="2"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    k = _build(env, tmp_path, wait_timeout=180)
    out, err = p1.communicate(timeout=180)
    assert p1.returncode == 0, err.decode()
    assert str(k) in out.decode()
    assert _content_files(k) == _content_files(built)


@pytest.mark.parametrize("cores, workers", [(None, 0), (1, 0), (2, 0), (3, 2), (16, 15)])
def test_default_build_workers(monkeypatch, cores, workers):
    """In process below 3 cores (one decoding worker only adds the pixels' trip between
    processes; RESULTS.md vl_build_workers), else one core left to the main process."""
    from torchtitan_ext.vl import build

    monkeypatch.setattr(build.os, "cpu_count", lambda: cores)
    assert build.default_num_workers() == workers
