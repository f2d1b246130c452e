"""streaming_text with ``[[dataloader.sources]]``: a mixture of datasets drawn by rows.

What is pinned here (the resume matrix, tests/test_resume_matrix.py, runs the ``streaming_mix``
builder of tests/support/loader_specs.py at DP 1 -> 1, 2 -> 2 and 2 -> 3 -> 1, staging on/off,
workers 0/2):

* a mixture of one source gives the single-source loader's batches (rows, stacking, padding);
* a row never holds two sources; realised shares follow the weights; stats in ``Mix.stats``'
  shape (the same keys as one source, plus ``sources``);
* ``max_epochs`` ends a source (``all_exhausted``: the others go on; ``first_exhausted``: the
  mixture ends), a source's new epoch is logged with its name, and the last batch of a finite
  mixture is padded with rows that train on nothing;
* chained restarts through the end of a finite mixture resume bitwise;
* a checkpoint of another mixture, or one dataset vs a mixture, is one line naming the sources;
* bad sources are one line naming the source, before the tokenizer is loaded;
* the example config trains, and refuses a checkpoint whose mixture lost a source.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import REPO, step_losses
from tests.support import resume
from tests.support.loader_specs import streaming_mix_doc_starts
from tests.test_streaming import make_docs, write_jsonl, write_parquet
from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.data.embedded import ensure_embedded_data
from torchtitan_ext.loaders.streaming import StreamingTextDataLoader
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.checkpoint import LoaderStateError
from torchtitan_ext.pipeline.mix import MixtureError, SourceSpec

SEQ, BATCH = 16, 4
NA, NB = 48, 40  # documents of source a (Parquet, 4 files) and b (JSON Lines, 2 files)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mix")
    return {
        "a": write_parquet(root / "a", make_docs(NA, seed=1), 4),
        "b": write_jsonl(root / "b", make_docs(NB, seed=2), 2),
        "tok": str(ensure_embedded_data() / "tokenizer"),
        "root": str(root),
    }


def build(data, sources=None, *, workers=0, rank=0, world=1, **kw) -> StreamingTextDataLoader:
    kw.setdefault("shuffle_buffer", 8)
    kw.setdefault("emit_doc_ids", True)
    cfg = StreamingTextDataLoader.Config(
        tokenizer_path=data["tok"], num_workers=workers, sources=sources, **kw
    )
    return cfg.build(dp_rank=rank, dp_world_size=world, seq_len=SEQ, local_batch_size=BATCH)


def two(data, wa=3.0, wb=1.0, **kw) -> list[SourceSpec]:
    return [
        SourceSpec(name="a", path=data["a"], weight=wa, **kw.get("a", {})),
        SourceSpec(name="b", path=data["b"], weight=wb, **kw.get("b", {})),
    ]


def saved(loaders) -> dict:
    return checkpoint.envelope("streaming_text", [ld.rank_state() for ld in loaders], "any")


# ------------------------------------------------------------------------------ batches
@pytest.mark.parametrize("workers", [0, 2])
def test_a_mixture_of_one_source_gives_the_single_source_batches(data, workers):
    single = build(data, dataset_path=data["a"], workers=workers, rank=1, world=2)
    mixed = build(data, [SourceSpec(name="a", path=data["a"])], workers=workers, rank=1, world=2)
    want, got = resume.take(single, 12), resume.take(mixed, 12)
    single.close(), mixed.close()
    for x, y in zip(want, got, strict=True):
        x[0]["doc_sources"] = torch.zeros_like(x[0]["doc_ids"]).masked_fill(x[0]["doc_ids"] < 0, -1)
        assert resume.same(x, y)


def test_rows_never_straddle_sources_and_shares_follow_the_weights(data):
    ld = build(data, two(data, 3.0, 1.0))
    rows = 0
    for x, _ in resume.take(ld, 100):
        for src in x["doc_sources"]:
            kinds = set(src[src >= 0].tolist())
            assert len(kinds) == 1, f"a row holds sources {kinds}"
            rows += 1
    st = ld.get_stats()
    ld.close()
    assert set(st["sources"]) == {"a", "b"}
    a, b = st["sources"]["a"], st["sources"]["b"]
    assert a["items"] + b["items"] == rows == 400
    assert a["target"] == 0.75 and b["target"] == 0.25
    # binomial(400, 0.75): sd 8.7 rows; 5 sd
    assert abs(a["items"] - 300) < 44, a
    # the same keys as a single source's stats, summed over the sources
    single = build(data, dataset_path=data["a"])
    resume.take(single, 1)
    keys = set(single.get_stats())
    single.close()
    assert keys <= set(st) and st["docs_used"] == a["docs_used"] + b["docs_used"]
    assert {"items", "share", "target", "ended", "docs_used", "epoch", "tokens_read"} <= set(a)
    # tokens per source (what the step log's data/source/<name>/tokens reads): every token of
    # the 400 rows was read from some source (rows overlap by one token: seq_len + 1 windows)
    assert st["tokens_read"] == a["tokens_read"] + b["tokens_read"]
    assert a["tokens_read"] > b["tokens_read"] > 0
    assert st["tokens_read"] >= rows * x["input"].shape[-1]


def test_max_epochs_ends_a_source_and_new_epochs_name_their_source(data, caplog):
    sources = two(data, 1.0, 1.0, a={"max_epochs": 1})
    ld = build(data, sources)
    seen: list[int] = []
    batches = []
    with caplog.at_level(logging.INFO):
        it = iter(ld)
        while not ld.get_stats()["sources"]["a"]["ended"]:
            batches.append(next(it))
            assert len(batches) < 500, "source a never ended"
        batches += resume.take(ld, 40)  # b goes on, a never comes back
    for x, _ in batches:
        for ids, offs, src in zip(x["doc_ids"], x["doc_offsets"], x["doc_sources"], strict=True):
            start = offs == 0
            start[0] |= offs[0] == 1
            seen += ids[start & (src == 0)].tolist()
    st = ld.get_stats()
    ld.close()
    assert sorted(seen) == list(range(NA)), "a's one epoch: every document once, never again"
    assert st["sources"]["a"]["ended"] and not st["sources"]["b"]["ended"]
    assert st["sources"]["b"]["epoch"] >= 1
    lines = [r.getMessage() for r in caplog.records if "starts epoch" in r.getMessage()]
    assert any(m.startswith("source 'b' (") for m in lines), lines
    assert not any("'a'" in m for m in lines), "a never starts a second epoch"


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_finite_mixture_ends_with_a_padded_full_batch(data, stop):
    sources = two(data, 1.0, 1.0, a={"max_epochs": 1}, b={"max_epochs": 1})
    ld = build(data, sources, mix_stop=stop)
    batches = resume.take(ld, None)
    st = ld.get_stats()
    ld.close()
    assert all(x["input"].shape == (BATCH, SEQ) for x, _ in batches)
    x, y = batches[-1]
    pad = (x["doc_ids"] < 0).all(1)  # whole padding rows of the last batch
    assert (y[pad] == IGNORE_INDEX).all() and (x["doc_sources"][pad] == -1).all()
    ends = [st["sources"][n]["ended"] for n in ("a", "b")]
    starts = streaming_mix_doc_starts_all(batches)
    if stop == "all_exhausted":
        assert ends == [True, True] and len(starts) == NA + NB == len(set(starts))
    else:
        assert sum(ends) == 1 and len(starts) == len(set(starts)) < NA + NB


def streaming_mix_doc_starts_all(batches) -> list[int]:
    return [d for b in batches for d in streaming_mix_doc_starts(b)]


def test_the_step_epoch_is_the_furthest_sources_not_a_sum(data):
    ld = build(data, two(data, 1.0, 1.0))
    it = iter(ld)
    while min(s["epoch"] for s in ld.get_stats()["sources"].values()) < 1:
        next(it)
    st = ld.get_stats()
    ld.close()
    assert st["epoch"] == max(s["epoch"] for s in st["sources"].values()) >= 1


# ------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("workers", [0, 2])
def test_chained_restarts_through_the_end_resume_bitwise(data, workers):
    sources = two(data, 2.0, 1.0, a={"max_epochs": 1}, b={"max_epochs": 2})

    def make(rank, world, infinite):
        return build(data, sources, workers=workers, rank=rank, world=world, infinite=infinite)

    spec = resume.LoaderSpec("streaming_mix", make, state=saved)
    got = resume.assert_resume_exact(spec, dp_from=2, cuts=(3, 7, None), running=1)
    assert got is not None and len(got[0]) > 10


def test_another_mixture_or_one_dataset_is_refused_in_one_line(data):
    ld = build(data, two(data))
    resume.take(ld, 2)
    mixed = saved([ld])
    ld.close()
    single = build(data, dataset_path=data["a"])
    one = saved([single])
    cases = [
        (single, mixed, ["mixture of 'a', 'b'", "reads one dataset"]),
        (build(data, two(data)[:1] + [SourceSpec(name="c", path=data["b"])]), mixed,
         ["added 'c'", "removed 'b'"]),
        (build(data, two(data)[::-1]), mixed, ["reordered"]),
        (build(data, two(data)), one, ["reads one dataset", "mixture of 'a', 'b'"]),
    ]  # fmt: skip
    for loader, value, words in cases:
        with pytest.raises(LoaderStateError) as e:
            loader.load_state_dict(value)
        msg = str(e.value)
        assert "\n" not in msg and "exclude_from_loading dataloader" in msg, msg
        assert all(w in msg for w in words), msg
        loader.close()


# ------------------------------------------------------------------------------ bad input
def test_bad_sources_are_one_line_naming_the_source_before_the_tokenizer(data, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty / "e.parquet")
    a = SourceSpec(name="a", path=data["a"])
    cases = [
        ([a, SourceSpec(name="a", path=data["b"])], "source 'a': the name is used twice"),
        ([a, SourceSpec(name="neg", path=data["b"], weight=-1)], "source 'neg': weight"),
        ([a, SourceSpec(name="both", path=data["b"], dataset="x/y")], "source 'both': give"),
        ([a, SourceSpec(name="nofiles", path=str(tmp_path / "none-*.parquet"))],
         "source 'nofiles': no .parquet"),
        ([a, SourceSpec(name="norows", path=str(empty))], "source 'norows': "),
        ([a, SourceSpec(name="fmt", path=data["b"], format="csv")], "source 'fmt': unknown format 'csv'"),
        ([a, SourceSpec(name="ep", path=data["b"], max_epochs=0)], "source 'ep': max_epochs"),
    ]  # fmt: skip
    for sources, words in cases:
        cfg = StreamingTextDataLoader.Config(
            tokenizer_path=str(tmp_path / "no-tokenizer-here"), sources=sources
        )
        with pytest.raises(MixtureError) as e:
            cfg.build(dp_rank=0, dp_world_size=1, seq_len=SEQ, local_batch_size=BATCH)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert "norows" not in words or "0 documents" in str(e.value)
    cfg = StreamingTextDataLoader.Config(tokenizer_path=data["tok"], dataset_path=data["a"],
                                         sources=[a])  # fmt: skip
    with pytest.raises(MixtureError, match="both .* and \\[\\[dataloader.sources\\]\\]"):
        cfg.build(dp_rank=0, dp_world_size=1, seq_len=SEQ, local_batch_size=BATCH)


def test_format_reads_files_of_any_suffix_and_split_text_column_are_per_source(data, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    lines = [json.dumps({"body": d}) for d in make_docs(10, seed=5)]
    (odd / "docs.data").write_text("\n".join(lines) + "\n")
    sources = [
        SourceSpec(name="a", path=data["a"]),
        SourceSpec(name="odd", path=str(odd / "*.data"), format="jsonl", text_column="body"),
    ]
    ld = build(data, sources, infinite=False)
    starts = streaming_mix_doc_starts_all(resume.take(ld, None))
    ld.close()
    assert len(starts) == NA + 10 == len(set(starts))
    # the same keys on a single dataset (what a per-source validation pass builds from a source)
    one = build(data, dataset_path=str(odd / "*.data"), format="jsonl", text_column="body")
    assert one.num_documents() == 10
    one.close()


# ------------------------------------------------------------------------------ example config
EXAMPLE = REPO / "train_configs" / "streaming_text_mixture_cpu.toml"


def _train(config: Path, dump: Path, steps: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan_ext.train", "--config-file", str(config),
         "--training.steps", str(steps), "--training.seq_len", "64", "--validator.freq", "2",
         "--validator.steps", "2", "--checkpoint.interval", "2", "--dump_folder", str(dump)],
        capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        timeout=600,
    )  # fmt: skip


@pytest.mark.integration
def test_example_mixture_config_trains_and_refuses_a_changed_mixture(tmp_path):
    text, losses = step_losses(_train(EXAMPLE, tmp_path / "out", 2))
    assert sorted(losses) == [1, 2] and "validate step:  2" in text
    toml = EXAMPLE.read_text()
    cut = toml.index('[[dataloader.sources]]\nname = "shakespeare"')
    one = tmp_path / "one_source.toml"
    one.write_text(toml[:cut] + toml[toml.index("[validator]") :])
    out = _train(one, tmp_path / "out", 3)
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert "data mixture differs from [[dataloader.sources]]: removed 'shakespeare'" in log


def test_elastic_resume_across_epochs_keeps_each_source_epoch_whole(data):
    """DP 2 -> 3 -> 1 while the sources wrap into their second (last) epoch at different times:
    every document of every source appears once per epoch (key: source, epoch, id)."""
    sources = two(data, 2.0, 1.0, a={"max_epochs": 2}, b={"max_epochs": 2})

    def make(rank, world, infinite):  # finite through max_epochs whatever ``infinite`` says
        return build(data, sources, rank=rank, world=world)

    def keys(batch) -> list[int]:
        x, _ = batch
        ids, offs, src, ep = x["doc_ids"], x["doc_offsets"], x["doc_sources"], x["doc_epochs"]
        start = offs == 0
        start[:, 0] |= offs[:, 0] == 1
        keep = start & (ids >= 0)
        return ((src[keep] * 4 + ep[keep]) * (1 << 41) + ids[keep]).tolist()

    ids_b = [(f << 40) + r for f in (0, 1) for r in range(20)]
    epoch_docs = {(0 * 4 + e) * (1 << 41) + i for e in (0, 1) for i in range(NA)}
    epoch_docs |= {(1 * 4 + e) * (1 << 41) + i for e in (0, 1) for i in ids_b}
    spec = resume.LoaderSpec("streaming_mix", make, keys, epoch_docs, state=saved)
    resume.assert_resume_exact(spec, 30, 2, (3, 1))  # both sources wrap at DP 3, before 3 -> 1
