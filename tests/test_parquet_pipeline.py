"""parquet_prefetch as stages: exact resume at the same DP degree, elastic resume at others
(every document of the epoch once), the merge arithmetic, the checkpoint format, options."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.support.loader_specs import PQ_SEQ_LEN, doc_ids_of, parquet_id_corpus
from tests.support.resume import LoaderSpec, assert_resume_exact, save, take
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.elastic import Progress, deal, replay
from torchtitan_ext.pipeline.prefetch import PrefetchOptions
from torchtitan_ext.pipeline.stage import options
from torchtitan_ext.text.diversity import DiversityMeter
from torchtitan_ext.text.pack_stage import PackOptions
from torchtitan_ext.text.parquet_position import Position, epoch_units
from torchtitan_ext.text.parquet_resume import merge_positions
from torchtitan_ext.text.parquet_source import ParquetOptions

SEQ_LEN = PQ_SEQ_LEN


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path, dict[int, int]]:
    """See :func:`tests.support.loader_specs.parquet_id_corpus`."""
    return parquet_id_corpus(tmp_path_factory.mktemp("docs"))


def _spec(corpus, packing: str) -> LoaderSpec:
    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader

    root, tok_dir, id_of = corpus

    def build(rank: int, world: int, infinite: bool):
        cfg = PrefetchingParquetDataLoader.Config(
            dataset_path=str(root),
            tokenizer_path=str(tok_dir),
            val_files="none",
            infinite=infinite,
            packing=packing,
            buffer_docs=4,
            chunk_rows=4,
            queue_size=2,
            seed=3,
        )
        return cfg.build(
            dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=SEQ_LEN, local_batch_size=2
        )

    return LoaderSpec("parquet_prefetch", build, doc_ids_of(id_of), set(id_of.values()))


# ---------------------------------------------------------------------------- resume harness
@pytest.mark.parametrize("packing", ["best_fit", "concat_split"])
@pytest.mark.parametrize("world", [1, 2])
def test_same_degree_resume_is_bitwise(corpus, packing, world):
    assert_resume_exact(_spec(corpus, packing), 9, world, world)


@pytest.mark.parametrize("packing", ["best_fit", "concat_split"])
def test_dp_2_to_3_to_1_mid_epoch_emits_every_document_once(corpus, packing):
    assert_resume_exact(_spec(corpus, packing), 7, 2, (3, 1))


def test_elastic_output_has_no_duplicate_window(corpus):
    """The diversity meter of scripts/verify_data_diversity.py over a DP 2 -> 3 run: no
    ``seq_len + 1`` window twice, and every document's word is trained on."""
    spec = _spec(corpus, "best_fit")
    meter, words = DiversityMeter(), set()
    two = [spec.build(r, 2, False) for r in range(2)]
    for r, ld in enumerate(two):
        for b in take(ld, 8):
            meter.add_batch(b, rank=r)
    saved = save(spec, two)
    three = [spec.build(r, 3, False) for r in range(3)]
    for r, ld in enumerate(three):
        ld.load_state_dict(saved)
        for b in take(ld, None):
            meter.add_batch(b, rank=r)
            words |= set(spec.doc_ids(b))
    for ld in two + three:
        ld.close()
    rep = meter.report()
    assert rep.rows > 0 and rep.window_duplicates == 0, rep.format()
    assert not rep.failures()


# ---------------------------------------------------------------------------- merge arithmetic
def _read_rows(units, pos: Position, slot: int, n: int, upto: Progress | None) -> list[tuple]:
    """(unit id, row) pairs slot ``slot`` of ``n`` reads from ``pos`` (its epoch) to ``upto``
    (the end of its deal with None)."""
    mine = deal(replay(units, pos.phases), slot, n)
    end = upto or Progress(len(mine), 0)
    out = []
    for k in range(pos.progress.units_done, min(end.units_done + 1, len(mine))):
        u = mine[k]
        lo = u.lo + (pos.progress.rows_done if k == pos.progress.units_done else 0)
        hi = u.hi if k < end.units_done else u.lo + end.rows_done
        out += [(u.id, r) for r in range(lo, hi)]
    return out


@pytest.mark.parametrize("trial", range(40))
def test_merge_positions_reads_every_row_of_every_epoch_once(trial):
    """Old slots in *different* epochs (as infinite ranks drift apart): old reads + new reads
    cover each epoch in [lowest, highest] exactly once, over two degree changes."""
    rng = random.Random(trial)
    rows = [rng.randint(0, 6) for _ in range(rng.randint(3, 12))]
    units_of = lambda e: epoch_units(rows, e, 7, True)  # noqa: E731
    read: dict[int, list] = {}
    n = rng.randint(1, 4)
    positions = [Position(epoch=0) for _ in range(n)]
    for _change in range(2):
        new = []
        for s, p in enumerate(positions):  # each old slot reads on, possibly into later epochs
            for _ in range(rng.randint(0, 2)):
                read.setdefault(p.epoch, []).extend(_read_rows(units_of(p.epoch), p, s, n, None))
                p = Position(p.epoch, p.phases, Progress(), p.ahead).next_epoch()
            mine = deal(replay(units_of(p.epoch), p.phases), s, n)
            k = rng.randint(p.progress.units_done, len(mine))
            r = rng.randint(0, mine[k].rows) if k < len(mine) else 0
            stop = Progress(k, r if k < len(mine) else 0)
            if (stop.units_done, stop.rows_done) < (p.progress.units_done, p.progress.rows_done):
                stop = p.progress
            read.setdefault(p.epoch, []).extend(_read_rows(units_of(p.epoch), p, s, n, stop))
            new.append(Position(p.epoch, p.phases, stop, p.ahead))
        merged = merge_positions(new, units_of)
        n = rng.randint(1, 4)
        positions = [merged] * n
    hi = max(read)
    for s, p in enumerate(positions):  # the last degree reads to the end of epoch `hi`
        while p.epoch <= hi:
            read.setdefault(p.epoch, []).extend(_read_rows(units_of(p.epoch), p, s, n, None))
            p = Position(p.epoch, p.phases, Progress(), p.ahead).next_epoch()
    for e in range(min(read), hi + 1):
        got = read.get(e, [])
        want = [(u.id, r) for u in units_of(e) for r in range(u.lo, u.hi)]
        assert sorted(got) == sorted(want), f"epoch {e}"


# ---------------------------------------------------------------------------- checkpoint format
def test_old_per_rank_format_is_refused_in_one_line_and_empty_is_fresh(corpus):
    spec = _spec(corpus, "best_fit")
    ld = spec.build(0, 1, True)
    try:
        first = next(iter(ld))
        ld.load_state_dict({})  # an empty value: a fresh start
        with pytest.raises(checkpoint.LoaderStateError, match="not in this version's format") as ei:
            ld.load_state_dict({"dp_rank_0": {"cursor": [0, 0, 0]}, "world_size": 1})
        assert "\n" not in str(ei.value) and "dp_rank_0" in str(ei.value)
        again = next(iter(ld))  # nothing of the refused value was applied
        assert not torch.equal(first[0]["input"], again[0]["input"])
    finally:
        ld.close()


def test_rank_state_is_compact_and_round_trips_the_envelope(corpus):
    spec = _spec(corpus, "best_fit")
    ld = spec.build(0, 1, True)
    try:
        take(ld, 3)
        st = ld.rank_state()
        assert st["packer"]["tokens"].dtype == np.int32  # 4 bytes per buffered token
        assert st["packer"]["lengths"].dtype == np.int32
        env = ld.state_dict()  # one rank: no collective
        assert env["global"]["loader"] == "parquet_prefetch" and env["global"]["dp_world_size"] == 1
        assert env["global"]["resumable_at"] == "any"
        (back,) = checkpoint.open_envelope(env, "parquet_prefetch", 1)
        assert np.array_equal(back["packer"]["tokens"], st["packer"]["tokens"])
    finally:
        ld.close()


# ---------------------------------------------------------------------------- options
def test_config_is_made_of_the_stage_options():
    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader

    Config = PrefetchingParquetDataLoader.Config
    for cls in (ParquetOptions, PackOptions, PrefetchOptions):
        assert issubclass(Config, cls)
    cfg = Config(seed=5, queue_size=3, packing="concat_split", chunk_rows=2)
    assert options(ParquetOptions, cfg) == ParquetOptions(seed=5, chunk_rows=2)
    assert options(PackOptions, cfg) == PackOptions(packing="concat_split")
    assert options(PrefetchOptions, cfg) == PrefetchOptions(queue_size=3)
    # each knob is declared once: in its options class, not again in the Config
    own = set(Config.__dict__.get("__annotations__", {}))
    stage_fields = {
        f.name
        for c in (ParquetOptions, PackOptions, PrefetchOptions)
        for f in dataclasses.fields(c)
    }
    assert not own & stage_fields, own & stage_fields


def test_all_bad_rows_next_to_an_empty_row_group_end_in_a_clear_error(tmp_path, corpus):
    """With a global, reshuffled deal a rank's share changes every epoch: an endless stream
    errors once its streak of epochs without a usable document has visited every row group —
    including an empty one, which yields no chunk at all."""
    from torchtitan_ext.text.errors import NoUsableDocuments
    from torchtitan_ext.text.prefetch import PrefetchingParquetLoader

    schema = pa.schema([("text", pa.string())])
    with pq.ParquetWriter(tmp_path / "bad.parquet", schema) as w:
        w.write_table(pa.table({"text": pa.array([None] * 6, pa.string())}))
        w.write_table(pa.table({"text": pa.array([], pa.string())}))
        w.write_table(pa.table({"text": pa.array([None] * 6, pa.string())}))
    with PrefetchingParquetLoader(
        tmp_path / "bad.parquet",
        corpus[1],
        seq_len=SEQ_LEN,
        batch_size=2,
        val_files="none",
        on_bad_input="skip",
        dp_rank=1,
        dp_world_size=2,
    ) as loader:
        with pytest.raises(NoUsableDocuments, match=r"dp_rank 1 of 2: \d+ whole epoch.*null="):
            next(loader)
