"""PrefetchingParquetLoader and its torchtitan glue: batches, thread errors and shutdown, exact
resume (direct, through DCP, per DP rank), bad-input accounting, finite passes."""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.resume import LoaderSpec, assert_resume_exact
from torchtitan_ext.data.embedded import ensure_embedded_data
from torchtitan_ext.pipeline.priority import can_leave_idle
from torchtitan_ext.text.errors import BadInputError
from torchtitan_ext.text.prefetch import PrefetchingParquetLoader
from torchtitan_ext.text.tokenize import TextTokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return ensure_embedded_data(tmp_path_factory.getbasetemp() / "embedded")


@pytest.fixture(scope="session")
def tok(data_dir) -> TextTokenizer:
    return TextTokenizer.from_path(data_dir / "tokenizer")


def _prefetch_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name.startswith(("parquet-prefetch", "parquet-read"))
    ]


@pytest.fixture(autouse=True)
def no_thread_leak():
    """The prefetch threads alive before the test (another test's in the same process, e.g. a
    pytest-xdist worker's, not yet collected): a test checks only those it started itself."""
    before = set(_prefetch_threads())
    yield before
    gc.collect()
    leaked = [t for t in _prefetch_threads() if t not in before and t.is_alive()]
    assert not leaked, f"leaked prefetch threads: {leaked}"


def _started_here(before: set[threading.Thread]) -> list[threading.Thread]:
    """The prefetch threads alive now that were not before the test."""
    return [t for t in _prefetch_threads() if t not in before and t.is_alive()]


def _loader(data_dir, tok, **kw) -> PrefetchingParquetLoader:
    kw.setdefault("seq_len", 64)
    kw.setdefault("batch_size", 2)
    kw.setdefault("buffer_docs", 16)
    kw.setdefault("chunk_rows", 32)
    kw.setdefault("queue_size", 4)
    return PrefetchingParquetLoader(data_dir, tok, **kw)


def _spec(data_dir, tok, **kw) -> LoaderSpec:
    """A :class:`_loader` for the resume harness (its own ``state_dict()``, one rank)."""
    return LoaderSpec(
        "parquet_loader",
        lambda rank, world, infinite: _loader(data_dir, tok, **kw),
        state=lambda loaders: loaders[0].state_dict(),
    )


def _same(a, b) -> bool:
    return (
        torch.equal(a[0]["input"], b[0]["input"])
        and torch.equal(a[0]["positions"], b[0]["positions"])
        and torch.equal(a[1], b[1])
    )


# ---------------------------------------------------------------------------- batches
def test_batches_are_shifted_bos_aligned_and_positioned(data_dir, tok):
    with _loader(data_dir, tok, seq_len=96, batch_size=3) as loader:
        for _ in range(10):
            inp, labels = next(loader)
            x, pos = inp["input"], inp["positions"]
            assert x.shape == labels.shape == pos.shape == (3, 96)
            assert x.dtype == labels.dtype == pos.dtype == torch.int64
            assert torch.equal(labels[:, :-1], x[:, 1:])  # labels are the next tokens
            assert torch.all(x[:, 0] == tok.bos_id)  # every row starts with BOS
            assert torch.equal(pos == 0, x == tok.bos_id)  # positions restart at each document
            # positions count up by one inside a document
            step = pos[:, 1:] - pos[:, :-1]
            assert torch.all((step == 1) | (pos[:, 1:] == 0))
        stats = loader.get_stats()
        assert stats["thread_alive"] and stats["queue_capacity"] == 4
        assert stats["docs_read"] > 0 and stats["tokens_read"] > 0 and stats["fill_pct"] == 100.0
        for key in ("queue_depth", "tokens_cropped", "consumer_wait_ms", "docs_skipped"):
            assert key in stats
    assert not loader.get_stats()["thread_alive"]


def test_rows_decode_to_corpus_text(data_dir, tok):
    corpus = "\n".join(
        t
        for f in sorted(data_dir.glob("train-*.parquet"))
        for t in pq.read_table(f)["text"].to_pylist()
    )
    with _loader(data_dir, tok, seq_len=128, batch_size=2) as loader:
        inp, _ = next(loader)
    row = inp["input"][0].tolist()
    starts = [i for i, t in enumerate(row) if t == tok.bos_id] + [len(row)]
    for a, b in zip(starts, starts[1:], strict=False):
        piece = tok.decode(row[a + 1 : b])
        assert piece[:-3] in corpus  # (the last bytes may be a split multi-byte token)


# ---------------------------------------------------------------------------- thread lifecycle
def test_close_context_manager_and_gc_stop_the_thread(data_dir, tok, no_thread_leak):
    loader = _loader(data_dir, tok)
    next(loader)
    # the producer and its read-ahead I/O helpers (up to read_ahead=4 concurrent reads)
    kinds = sorted(t.name.split("-")[1] for t in _started_here(no_thread_leak))
    assert (
        kinds[0] == "prefetch"
        and 1 <= kinds.count("read") <= 4
        and len(kinds) == 1 + kinds.count("read")
    )
    loader.close()
    loader.close()  # idempotent
    assert not _started_here(no_thread_leak)
    with pytest.raises(RuntimeError, match="closed"):
        next(loader)
    with _loader(data_dir, tok) as other:
        next(other)
    assert not _started_here(no_thread_leak)
    dropped = _loader(data_dir, tok)
    next(dropped)
    del dropped  # no close(): the weakref finalizer stops the thread
    gc.collect()
    assert not _started_here(no_thread_leak)


@pytest.mark.integration
def test_interpreter_exit_stops_the_thread(data_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import threading
        from torchtitan_ext.pipeline import prefetch as stage
        from torchtitan_ext.text import prefetch
        original_stop = stage._Worker.stop
        def stop(self, timeout=10.0):
            original_stop(self, timeout)
            print("stopped at exit; thread alive:", self.thread.is_alive(), flush=True)
        stage._Worker.stop = stop
        loader = prefetch.PrefetchingParquetLoader(
            {str(data_dir)!r}, {str(data_dir / "tokenizer")!r},
            seq_len=64, batch_size=2, buffer_docs=8, queue_size=2)
        next(loader)
        print("ok", flush=True)
        # no close(): the interpreter exits with the producer blocked on a full queue
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == ["ok", "stopped at exit; thread alive: False"]


def test_thread_exception_reraised_with_original_traceback(tmp_path, tok, no_thread_leak):
    texts = [f"document number {i} " * 5 for i in range(40)]
    texts[33] = None
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=16)
    loader = PrefetchingParquetLoader(
        tmp_path / "d.parquet",
        tok,
        seq_len=16,
        batch_size=2,
        buffer_docs=4,
        chunk_rows=8,
        val_files="none",
        shuffle=False,
        queue_size=2,
    )
    with pytest.raises(BadInputError) as ei:
        for _ in range(200):
            next(loader)
    err = ei.value
    assert "d.parquet row_group=2 row=1" in str(err) and "NULL" in str(err)
    frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
    assert "_run" in frames and "_texts" in frames  # the producer thread's frames are kept
    assert "__next__" in frames
    assert any("background thread" in n for n in getattr(err, "__notes__", []))
    assert not _started_here(no_thread_leak)  # the failed producer is gone
    loader.close()


def test_skip_mode_counts_reconcile(tmp_path, tok):
    texts = [f"text {i} " * 3 for i in range(30)]
    texts[3] = None
    texts[7] = ""
    texts[20] = None
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet", row_group_size=10)
    with PrefetchingParquetLoader(
        tmp_path / "d.parquet",
        tok,
        seq_len=16,
        batch_size=2,
        buffer_docs=4,
        val_files="none",
        infinite=False,
        on_bad_input="skip",
    ) as loader:
        n = sum(1 for _ in loader)
        s = loader.get_stats()
        assert n > 0
        assert loader.skip_counts == {"null": 2, "empty": 1}
        assert s["rows_read"] == 30 == s["docs_read"] + s["docs_skipped"]


def test_unreadable_file_in_skip_mode_is_reported_not_silent(tmp_path, tok, caplog):
    pq.write_table(pa.table({"text": ["some text"] * 20}), tmp_path / "a.parquet")
    junk = tmp_path / "b.parquet"
    junk.write_bytes(b"not parquet" * 10)
    with (
        caplog.at_level("WARNING"),
        PrefetchingParquetLoader(
            [tmp_path / "a.parquet", junk],
            tok,
            seq_len=16,
            batch_size=2,
            val_files="none",
            infinite=False,
            on_bad_input="skip",
        ) as loader,
    ):
        assert sum(1 for _ in loader) > 0
        assert loader.get_stats()["files_skipped"] == 1
        assert loader.skip_examples["unreadable_file"] == [str(junk)]
        assert "1 unreadable file(s) skipped" in loader.source.describe()
    assert any("b.parquet: unreadable Parquet file" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- finite passes
def test_finite_val_pass_covers_split_and_pads_last_batch(data_dir, tok):
    n_val = sum(pq.ParquetFile(f).metadata.num_rows for f in data_dir.glob("val-*.parquet"))
    with _loader(
        data_dir, tok, split="val", infinite=False, packing="zero_discard", batch_size=4
    ) as loader:
        batches = list(loader)
        s = loader.get_stats()
    assert s["docs_read"] == n_val and s["rows_read"] == n_val
    labels = batches[-1][1]
    assert (labels == -100).any()  # the last batch is padded, shapes unchanged
    assert all(b[1].shape == (4, 64) for b in batches)
    # zero-discard over a finite pass: every token read is trained on (BOS re-inserted aside)
    n_label_tokens = sum(int((b[1] != -100).sum()) for b in batches)
    assert n_label_tokens + len(batches) * 4 >= s["tokens_read"] - 1


# ---------------------------------------------------------------------------- exact resume
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    k=st.integers(0, 12),
    seq_len=st.sampled_from([16, 48, 100]),
    batch=st.integers(1, 3),
    mode=st.sampled_from(["best_fit", "zero_discard", "concat_split"]),
)
def test_resume_is_bitwise_exact(data_dir, tok, k, seq_len, batch, mode):
    kw = dict(seq_len=seq_len, batch_size=batch, packing=mode, seed=5)
    at_cut: list[int] = []

    def check(loader, event):  # the data counters resume with the position
        if event == "save":
            at_cut.append(loader.get_stats()["docs_read"])
        elif event == "load":
            assert loader.get_stats()["docs_read"] == at_cut[-1]

    assert_resume_exact(_spec(data_dir, tok, **kw), cuts=(k, 14 - k), check=check)
    assert len(at_cut) == 1


def test_resume_across_epochs_and_after_load_on_a_running_loader(data_dir, tok):
    kw = dict(split="val", seq_len=32, batch_size=4)  # the small val split wraps epochs quickly
    epochs: list[int] = []

    def check(loader, event):
        if event == "end":
            epochs.append(loader.get_stats()["epoch"])

    # 37 batches, save; the resumed loader reads 5 of its own first (its thread running from
    # cursor 0: the load must restart it), then 23 more == batches 37..59 of one run
    assert_resume_exact(_spec(data_dir, tok, **kw), cuts=(37, 23), running=5, check=check)
    assert epochs[0] >= 2  # the uninterrupted 60 batches cross two epoch boundaries


def test_state_dict_is_pickle_free_compact_and_checked(data_dir, tok):
    with _loader(data_dir, tok) as loader:
        next(loader)
        state = loader.state_dict()

    def check(v, path="state"):
        if isinstance(v, dict):
            for k2, v2 in v.items():
                assert isinstance(k2, str)
                check(v2, f"{path}.{k2}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                check(x, f"{path}[{i}]")
        else:
            assert isinstance(v, (int, float, str, bytes)), (path, type(v))

    check(state)
    tokens = state["packer"]["tokens"]
    assert tokens["__ndarray__"] == "<i4" and len(tokens["data"]) > 0  # int32: 4 bytes a token
    with _loader(data_dir, tok, seq_len=65) as other, pytest.raises(ValueError, match="seq_len"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    "key,value", [("batch_size", 3), ("seq_len", 65), ("dp_rank", 1), ("dp_world_size", 3)]
)
def test_resume_refuses_another_batch_size_seq_len_or_dp_layout(data_dir, tok, key, value):
    """A resumed data stream cannot change shape, and a rank's state resumes only that rank: the
    state of a (batch 2, seq 64, rank 0 of 2) loader is refused by a loader that differs in any
    one of them, naming the key (another DP degree goes through the adapter's envelope)."""
    base = dict(batch_size=2, seq_len=64, dp_rank=0, dp_world_size=2)
    with _loader(data_dir, tok, **base) as a:
        next(a)
        state = a.state_dict()
    with _loader(data_dir, tok, **{**base, key: value}) as b:
        with pytest.raises(ValueError, match=rf"{key}={base[key]}.*{key}={value}"):
            b.load_state_dict(state)
        assert b.get_stats()["docs_read"] == 0  # nothing of the refused state was applied
    with _loader(data_dir, tok, **base) as same:
        same.load_state_dict(state)  # the control: an identical loader takes it


# ---------------------------------------------------------------------------- torchtitan glue
def _glue_cfg(data_dir, **kw):
    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader

    kw.setdefault("buffer_docs", 16)
    kw.setdefault("queue_size", 4)
    return PrefetchingParquetDataLoader.Config(
        dataset_path=str(data_dir), tokenizer_path=str(data_dir / "tokenizer"), **kw
    )


def _build(cfg, rank=0, world=1, **kw):
    return cfg.build(
        dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=48, local_batch_size=2, **kw
    )


def test_registry_and_config(data_dir):
    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader
    from torchtitan_ext.registry import get_loader_config

    assert get_loader_config("parquet_prefetch") is PrefetchingParquetDataLoader.Config
    cfg = _glue_cfg(data_dir)
    assert dataclasses.replace(cfg, infinite=False).infinite is False  # what the validator does
    fields = {f.name for f in dataclasses.fields(PrefetchingParquetDataLoader.Config)}
    assert {"infinite", "dataset_path", "tokenizer_path", "text_column", "packing"} <= fields


def test_glue_with_torchtitan_tokenizer_and_finite_reiteration(data_dir):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader

    tt_tok = HuggingFaceTokenizer(tokenizer_path=str(data_dir / "tokenizer"))
    cfg = PrefetchingParquetDataLoader.Config(
        dataset_path=str(data_dir), split="val", infinite=False, buffer_docs=8
    )
    dl = cfg.build(
        dp_rank=0,
        dp_world_size=1,
        tokenizer=tt_tok,
        seq_len=32,
        local_batch_size=2,
        snapshot_every_n_steps=5,
        max_context_length=32,
    )
    first = list(iter(dl))
    second = list(iter(dl))  # a new iter() over a finished pass starts a new pass
    assert len(first) == len(second) > 0
    assert all(_same(a, b) for a, b in zip(first, second, strict=True))
    assert "queue_depth" in dl.get_stats()
    dl.close()


def _dcp_roundtrip(states: dict, templates: dict, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="single process"):
        dcp.save(states, checkpoint_id=str(tmp_path))
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(templates, checkpoint_id=str(tmp_path))


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_checkpoint_roundtrip_of_the_envelope(data_dir, tmp_path, world):
    """The one envelope (every rank's state under one "global" key, as gather() makes it on
    every rank) survives torch.distributed.checkpoint, and each rank resumes bitwise from it."""
    from torchtitan_ext.pipeline import checkpoint

    cfg = _glue_cfg(data_dir, seed=11)
    refs = [_build(cfg, r, world) for r in range(world)]
    want = [[next(iter(dl)) for _ in range(12)] for dl in refs]
    for dl in refs:
        dl.close()
    runs = [_build(cfg, r, world) for r in range(world)]
    for dl in runs:
        for _ in range(5):
            next(iter(dl))
    env = checkpoint.envelope("parquet_prefetch", [dl.rank_state() for dl in runs], "any")
    if world == 1:
        assert runs[0].state_dict() == env  # one rank: state_dict() needs no collective
    fresh = [_build(cfg, r, world) for r in range(world)]
    template = checkpoint.envelope("parquet_prefetch", [dl.rank_state() for dl in fresh], "any")
    box = {"dataloader": template}
    _dcp_roundtrip({"dataloader": env}, box, tmp_path)
    for r, dl in enumerate(fresh):
        dl.load_state_dict(box["dataloader"])
        got = [next(iter(dl)) for _ in range(7)]
        assert all(_same(a, b) for a, b in zip(got, want[r][5:12], strict=True))
    if world == 2:
        # the ranks read different data
        assert not torch.equal(want[0][0][0]["input"], want[1][0][0]["input"])
    for dl in runs + fresh:
        dl.close()


def test_glue_load_state_at_another_world_size_and_refusals(data_dir):
    from torchtitan_ext.pipeline import checkpoint

    cfg = _glue_cfg(data_dir)
    a = [_build(cfg, r, 2) for r in range(2)]
    for dl in a:
        next(iter(dl))
    env = checkpoint.envelope("parquet_prefetch", [dl.rank_state() for dl in a], "any")
    b = _build(cfg, 0, 1)
    b.load_state_dict(env)  # 2 ranks -> 1: resumed (elastic), not refused
    assert b.get_stats()["docs_read"] == sum(dl.get_stats()["docs_read"] for dl in a)
    next(iter(b))
    b.load_state_dict({})  # an empty state is a fresh start
    with pytest.raises(checkpoint.LoaderStateError, match="written by 'streaming_text'"):
        b.load_state_dict(checkpoint.envelope("streaming_text", [{}], "any"))
    for dl in [*a, b]:
        dl.close()


@pytest.mark.slow
def test_text_loaders_benchmark_quick_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path))
    from benchmarks.common import BenchArgs
    from benchmarks.text_loaders import run

    extra = {"mb": "0.5", "batches": "3", "steps": "3", "warmup": "1", "workers1": "0"}
    rows = {r.case: r for r in run(BenchArgs(quick=True, extra=extra))}
    for name in ("ours", "sync", "torchtitan"):
        assert rows[f"tokens/s wall {name}"].value > 0
    assert rows["wait share ours"].unit == "%"
    assert "next() p99 ours slow storage" in rows
    assert rows["state snapshot ours"].value > 0 and rows["state snapshot ours"].unit == "ms"
    assert "loop time lost ours, normal priority" in rows
    assert {f"wait share CPU-bound loop, {p}" for p in ("adaptive", "idle", "normal")} <= set(rows)


def test_tokenizer_parallelism_default_respects_user_setting(data_dir, tok, monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    _loader(data_dir, tok).close()
    import os

    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    _loader(data_dir, tok).close()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


def test_add_eos_appends_exactly_one_eos_per_document(tmp_path, tok):
    pq.write_table(
        pa.table({"text": ["alpha beta", "gamma delta epsilon"] * 4}), tmp_path / "d.parquet"
    )
    for packing in ("best_fit", "concat_split"):
        with PrefetchingParquetLoader(
            tmp_path / "d.parquet",
            tok,
            seq_len=256,
            batch_size=1,
            buffer_docs=1,
            val_files="none",
            shuffle=False,
            infinite=False,
            add_eos=True,
            packing=packing,
        ) as loader:
            (inp, labels), *_ = list(loader)
        row = inp["input"][0].tolist()
        n_bos = row.count(tok.bos_id)
        assert n_bos == 8 and row.count(tok.eos_id) == 8, packing
        for i, t in enumerate(row[1:], 1):
            if t == tok.bos_id:
                assert row[i - 1] == tok.eos_id  # each document ends with one EOS


# ---------------------------------------------------------------------------- thread policy
@pytest.mark.skipif(
    not (hasattr(os, "SCHED_IDLE") and can_leave_idle()),
    reason="this process may not leave SCHED_IDLE (no CAP_SYS_NICE)",
)
def test_adaptive_priority_idles_when_full_and_recovers_when_behind(data_dir, tok):
    # Slow storage and big batches: a fast consumer is sure to drain the queue below its
    # promotion point before the producer can refill it.
    with _loader(
        data_dir, tok, seq_len=512, batch_size=8, read_ahead=0, read_delay_s=0.3, queue_size=4
    ) as loader:
        it = iter(loader)
        next(it)
        p = loader.pipeline.worker
        deadline = time.monotonic() + 30
        while not loader.get_stats()["threads_idle"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader.get_stats()["threads_idle"] == 1
        assert os.sched_getscheduler(p.thread.native_id) == os.SCHED_IDLE
        for _ in range(40):
            next(it)
            if not loader.get_stats()["threads_idle"]:
                break
        stats = loader.get_stats()
        assert stats["threads_idle"] == 0 and stats["priority_switches"] >= 2
        assert os.sched_getscheduler(p.thread.native_id) == os.SCHED_OTHER
        for _ in range(8):  # and idle again once it has caught up
            next(it)
            time.sleep(0.2)

    # No thread of the process keeps the idle policy after close (threads started by idle
    # members, e.g. library pools, would have inherited it). Joined threads may still be
    # tearing down for a moment, hence the poll.
    def idle_threads() -> list[str]:
        tids = os.listdir("/proc/self/task")
        return [t for t in tids if os.sched_getscheduler(int(t)) == os.SCHED_IDLE]

    deadline = time.monotonic() + 5
    while (idle := idle_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    info = [(t, open(f"/proc/self/task/{t}/comm").read().strip()) for t in idle]
    assert not idle, f"threads left at SCHED_IDLE: {info}"


def test_normal_priority_leaves_the_threads_alone(data_dir, tok):
    with _loader(data_dir, tok, thread_priority="normal") as loader:
        it = iter(loader)
        for _ in range(8):
            next(it)
        time.sleep(0.2)  # the queue (4) fills
        p = loader.pipeline.worker
        assert loader.get_stats()["threads_idle"] == 0
        assert loader.get_stats()["priority_switches"] == 0
        if hasattr(os, "sched_getscheduler"):
            assert os.sched_getscheduler(p.thread.native_id) == os.SCHED_OTHER
    with pytest.raises(ValueError, match="thread_priority"):
        _loader(data_dir, tok, thread_priority="low")
