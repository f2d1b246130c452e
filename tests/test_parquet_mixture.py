"""Mixtures of the Parquet loader (``torchtitan_ext/text/parquet_mix.py``): per-source rows and
shares, the padded end of a finite mixture, ``max_epochs`` per source and its log, exact resume
through the envelope, refused checkpoints, bad sources named before any read, the per-corpus
embedded data, and the shipped mixture config trained for a few steps (integration).

The resume harness runs the mixture too: ``parquet_mix`` in ``tests/support/loader_specs.py``
(``tests/test_resume_matrix.py``: DP 1 -> 1 and 2 -> 2 bitwise, 2 -> 3 -> 1 every document once).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.support.loader_specs import PQ_SEQ_LEN, doc_ids_of, parquet_id_corpus
from tests.support.resume import assert_resume_exact, same, take
from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.checkpoint import LoaderStateError
from torchtitan_ext.pipeline.mix import BLOCK, MixtureError, SourceSpec, draws_block, normalized
from torchtitan_ext.text.parquet_mix import check_parquet_sources
from torchtitan_ext.text.parquet_source import ParquetOptions, ParquetSource

REPO = Path(__file__).resolve().parents[1]
B = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Any]:
    """The id corpus (every document's id readable from its tokens) in three sources: ``a``
    (files 0-1, 200 documents), ``b`` (file 2, 100) and ``c`` (a copy of ``b``'s file)."""
    root = tmp_path_factory.mktemp("mix")
    data, tok_dir, id_of = parquet_id_corpus(root)
    for name, files in (("a", (0, 1)), ("b", (2,))):
        (data / name).mkdir()
        for f in files:
            (data / f"train-{f}.parquet").rename(data / name / f"train-{f}.parquet")
    (data / "c").mkdir()
    (data / "c" / "train-2.parquet").write_bytes((data / "b" / "train-2.parquet").read_bytes())
    a_ids = set(range(200))  # parquet_id_corpus: document i is row i of the files in order
    return {"data": data, "tok": tok_dir, "id_of": id_of, "a": a_ids, "b": set(range(200, 300))}


def spec(corpus, name: str, weight: float, **kw: Any) -> SourceSpec:
    return SourceSpec(name=name, weight=weight, path=str(corpus["data"] / name), **kw)


def build(corpus, sources, rank=0, world=1, infinite=True, batch=B, **kw: Any):
    cfg = PrefetchingParquetDataLoader.Config(
        sources=sources, tokenizer_path=str(corpus["tok"]), val_files="none", infinite=infinite,
        packing="concat_split", buffer_docs=4, chunk_rows=4, queue_size=2, seed=3, **kw,
    )  # fmt: skip
    return cfg.build(
        dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=PQ_SEQ_LEN,
        local_batch_size=batch,
    )  # fmt: skip


def row_ids(corpus, batch) -> list[list[int]]:
    """The documents starting in each row of a batch."""
    ids = doc_ids_of(corpus["id_of"])
    x, y = batch
    return [ids(({"input": x["input"][i : i + 1]}, y[i : i + 1])) for i in range(len(y))]


def test_rows_hold_one_source_and_shares_follow_the_draws(corpus):
    """Each row is one source's; the realised shares in the stats are exactly those of the
    mixture's draws (a pure function of seed and rank) and within binomial bounds."""
    ld = build(corpus, [spec(corpus, "a", 3), spec(corpus, "b", 1)])
    steps = 60
    batches = [next(ld) for _ in range(steps)]
    stats = ld.get_stats()
    ld.close()
    rows = [r for b in batches for r in row_ids(corpus, b)]
    for r in rows:
        assert set(r) <= corpus["a"] or set(r) <= corpus["b"], r  # never two sources
    src = draws_block(3, 0, 0, normalized([SourceSpec(name="x", weight=3, path="p"),
                                            SourceSpec(name="y", weight=1, path="p")]))  # fmt: skip
    n = steps * B
    taken_b = int((src[:n] == 1).sum())  # no source ended: every draw was served
    s = stats["sources"]
    assert (s["a"]["items"], s["b"]["items"]) == (n - taken_b, taken_b)
    assert s["b"]["share"] == pytest.approx(taken_b / n) and s["b"]["target"] == 0.25
    assert abs(taken_b - n / 4) <= 5 * math.sqrt(n * 0.25 * 0.75)
    # the mixture reports the single loader's keys, totals over its sources
    assert stats["batches"] == steps
    assert stats["docs_read"] == s["a"]["docs_read"] + s["b"]["docs_read"]
    assert stats["epoch"] == max(s["a"]["epoch"], s["b"]["epoch"])
    assert 0 <= stats["fill_pct"] <= 100


def test_a_finite_mixture_reads_every_document_once_and_pads_its_last_batch(corpus):
    ld = build(corpus, [spec(corpus, "a", 1), spec(corpus, "b", 1)], infinite=False, batch=7)
    batches = list(ld)
    ld.close()
    ids = [d for b in batches for r in row_ids(corpus, b) for d in r]
    assert sorted(ids) == sorted(corpus["a"] | corpus["b"])
    assert all(b[0]["input"].shape == (7, PQ_SEQ_LEN) for b in batches)
    x, y = batches[-1]  # 120 rows = 17 batches of 7 + 1 row: 6 padding rows
    assert len(batches) == 18 and bool((y[1:] == IGNORE_INDEX).all())
    assert bool((x["positions"][1:] == 0).all()) and bool((x["input"][1:] == 2).all())  # pad id


def test_a_mixture_of_one_drawn_source_makes_the_single_loaders_batches_bitwise(corpus):
    """``a`` with weight 1 and ``b`` with 0: every row is ``a``'s, so the batches, the padded
    last one included (80 rows = 11 batches of 7 + 3 rows), are bitwise those of ``a`` alone:
    the row batcher pads exactly as the single-source packer does."""
    mixed = build(corpus, [spec(corpus, "a", 1), spec(corpus, "b", 0)], infinite=False, batch=7)
    single = build(corpus, None, infinite=False, batch=7, dataset_path=str(corpus["data"] / "a"))
    got, want = list(mixed), list(single)
    mixed.close()
    single.close()
    assert len(got) == len(want) == 12
    assert all(same(g, w) for g, w in zip(got, want, strict=True))
    assert bool((want[-1][1][3:] == IGNORE_INDEX).all())


def test_max_epochs_ends_a_source_and_each_epoch_is_logged_by_name(corpus, caplog):
    o = ParquetOptions(val_files="none", max_epochs=2, chunk_rows=10, read_ahead=0)
    src = ParquetSource(str(corpus["data"] / "b"), o, name="code")
    with caplog.at_level(logging.INFO, logger="torchtitan_ext.text.prefetch"):
        rows = sum(c.rows_read for c in itertools.islice(src, 100))  # 2 passes: 20 chunks
    assert rows == 2 * 100
    assert "parquet_prefetch: source 'code' starts epoch 1 (max_epochs 2)" in caplog.text
    assert "starts epoch 2" not in caplog.text
    src.close()
    # in a mixture: b (max_epochs 2) leaves after two passes, a goes on alone
    ld = build(corpus, [spec(corpus, "a", 1), spec(corpus, "b", 1, max_epochs=2)])
    for _ in range(150):
        next(ld)
    s = ld.get_stats()["sources"]
    ld.close()
    assert s["b"]["ended"] and s["b"]["docs_read"] == 200 and not s["a"]["ended"]


def test_first_exhausted_ends_the_mixture_when_one_source_ends(corpus):
    ld = build(
        corpus, [spec(corpus, "a", 1), spec(corpus, "b", 1, max_epochs=1)],
        mix_stop="first_exhausted",
    )  # fmt: skip
    batches = take(ld, 1000)  # bounded: a mixture that does not stop fails, it does not hang
    ld.close()
    ids = [d for b in batches for r in row_ids(corpus, b) for d in r]
    assert len(set(ids) & corpus["b"]) <= 100 and len(ids) < 400  # a stopped with b


def test_exact_resume_with_a_source_ended_and_through_a_chain_of_restarts(corpus):
    from tests.support.resume import LoaderSpec

    sources = [spec(corpus, "a", 1), spec(corpus, "b", 2, max_epochs=1)]

    def state(loaders):
        return checkpoint.envelope("parquet_prefetch", [ld.rank_state() for ld in loaders])

    s = LoaderSpec("parquet_mix", lambda r, w, inf: build(corpus, sources, r, w, inf), state=state)
    got = assert_resume_exact(s, cuts=(5, 40, 30), dp_from=2)  # b ends in the 2nd segment
    assert got is not None and all(len(g) == 75 for g in got)
    ids = [[d for b in g for r in row_ids(corpus, b) for d in r] for g in got]
    assert all(set(i[:10]) & corpus["b"] and not set(i[-20:]) & corpus["b"] for i in ids)


def _saved(corpus, sources, steps=3) -> dict:
    ld = build(corpus, sources)
    for _ in range(steps):
        next(ld)
    sd = ld.state_dict()
    ld.close()
    return sd


@pytest.mark.parametrize(
    "saved_names, now_names, words",
    [
        (("a", "b"), ("a", "c"), ["added 'c'", "removed 'b'"]),
        (("a", "b"), ("a",), ["removed 'b'"]),
        (("a", "b"), None, ["is a mixture of 'a', 'b'", "reads one dataset"]),
        (None, ("a", "b"), ["is a single dataset", "mixture of 'a', 'b'"]),
    ],
)
def test_a_checkpoint_of_another_stream_is_refused_in_one_line(
    corpus, saved_names, now_names, words
):
    def sources(names):
        return None if names is None else [spec(corpus, n, 1) for n in names]

    def make(names):
        if names is None:
            return build(corpus, None, dataset_path=str(corpus["data"] / "a"))
        return build(corpus, sources(names))

    ld = make(saved_names)
    next(ld)
    sd = ld.state_dict()
    ld.close()
    ld = make(now_names)
    with pytest.raises(LoaderStateError) as e:
        ld.load_state_dict(sd)
    ld.close()
    msg = str(e.value)
    assert "\n" not in msg and "--checkpoint.exclude_from_loading dataloader" in msg
    for w in words:
        assert w in msg, msg


def _empty_dir(root: Path) -> Path:
    d = root / "empty"
    d.mkdir(exist_ok=True)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "train-0.parquet")
    return d


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", ["source 'm'", "nothere", "no such Parquet file"]),
        ("empty", ["source 'm'", "is an empty source", "0 rows"]),
        ("dataset", ["source 'm'", "give 'path'"]),
        ("weight", ["source 'm'", "weight must be a finite number"]),
        ("duplicate", ["source 'a'", "used twice"]),
    ],
)
def test_a_bad_source_is_one_line_naming_it_before_any_read(corpus, tmp_path, case, words):
    good = spec(corpus, "a", 1)
    bad = {
        "missing": [good, SourceSpec(name="m", path=str(tmp_path / "nothere"))],
        "empty": [good, SourceSpec(name="m", path=str(_empty_dir(tmp_path)))],
        "dataset": [good, SourceSpec(name="m", dataset="org/data")],
        "weight": [good, SourceSpec(name="m", weight=float("nan"), path=str(tmp_path))],
        "duplicate": [good, spec(corpus, "a", 2)],
    }[case]
    with pytest.raises(MixtureError) as e:
        check_parquet_sources(bad, val_files="none")
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)
    with pytest.raises(MixtureError):  # the loader refuses it the same way
        build(corpus, bad)
    with pytest.raises(MixtureError, match="dataset_path .* both set"):
        build(corpus, [good], dataset_path=str(corpus["data"] / "a"))


def test_each_embedded_corpus_alone_is_the_default_corpus_split_by_text(tmp_path):
    from torchtitan_ext.data.embedded import (
        SOURCES,
        corpus_documents,
        documents_by_source,
        ensure_embedded_corpus,
    )

    by = documents_by_source()
    assert [d for name in SOURCES for d in by[name]] == corpus_documents()
    for name, text in (("war_and_peace", SOURCES[0]), ("shakespeare", SOURCES[1])):
        d = ensure_embedded_corpus(name, tmp_path)
        docs = [
            t
            for p in sorted(d.glob("train-*.parquet")) + sorted(d.glob("val-*.parquet"))
            for t in pq.read_table(p)["text"].to_pylist()
        ]
        assert docs == by[text]
        assert pq.ParquetFile(next(d.glob("train-*"))).metadata.num_row_groups >= 2
    with pytest.raises(ValueError, match="embedded:war_and_peace"):
        ensure_embedded_corpus("nope", tmp_path)


# ------------------------------------------------------------------------------ the shipped job
@pytest.mark.integration
def test_the_shipped_mixture_config_trains_and_realises_its_shares(tmp_path):
    """``train_configs/llama3_mixture_cpu.toml`` for 3 steps of 8 rows; the loader's stats from
    the last checkpoint: the realised shares are the draws' (seed 0, rank 0) and near 0.7/0.3."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    steps, rows = 3, 8
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "torchtitan_ext.train", "--config-file",
        str(REPO / "train_configs" / "llama3_mixture_cpu.toml"), "--training.steps", str(steps),
        "--training.local_batch_size", str(rows), "--dump_folder", str(tmp_path / "run"),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "a mixture of 2 sources: 'war_and_peace' (weight 0.7)" in log
    dcp_to_torch_save(tmp_path / "run" / "checkpoint" / f"step-{steps}", tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt", weights_only=False)["dataloader"]
    cfg = PrefetchingParquetDataLoader.Config(
        sources=[
            SourceSpec(name="war_and_peace", weight=0.7, path="embedded:war_and_peace"),
            SourceSpec(name="shakespeare", weight=0.3, path="embedded:shakespeare"),
        ],
        packing="zero_discard", buffer_docs=256, chunk_rows=64, queue_size=4,
    )  # fmt: skip
    ld = cfg.build(seq_len=256, local_batch_size=rows)
    ld.load_state_dict(saved)
    stats = ld.get_stats()
    ld.close()
    n = steps * rows
    p = np.array([0.7, 0.3])
    drawn = draws_block(0, 0, 0, p / p.sum())[:n]
    assert n < BLOCK
    s = stats["sources"]
    assert s["shakespeare"]["items"] == int((drawn == 1).sum())
    assert s["war_and_peace"]["items"] + s["shakespeare"]["items"] == n
    assert s["shakespeare"]["share"] == pytest.approx(float((drawn == 1).mean()))
    assert abs(s["shakespeare"]["share"] - 0.3) <= 5 * math.sqrt(0.3 * 0.7 / n)
    assert stats["batches"] == steps and s["war_and_peace"]["target"] == pytest.approx(0.7)


def test_without_sources_the_loader_is_the_single_source_one(corpus):
    """``sources`` unset: the very same batches as the single-source loader built directly."""
    from torchtitan_ext.text.prefetch import PrefetchingParquetLoader

    ld = build(corpus, None, dataset_path=str(corpus["data"] / "a"))
    direct = PrefetchingParquetLoader(
        str(corpus["data"] / "a"), str(corpus["tok"]), seq_len=PQ_SEQ_LEN, batch_size=B,
        val_files="none", packing="concat_split", buffer_docs=4, chunk_rows=4, queue_size=2,
        seed=3,
    )  # fmt: skip
    for _ in range(30):
        assert same(next(ld), next(direct))
    assert "sources" not in ld.get_stats()
    ld.close()
    direct.close()
