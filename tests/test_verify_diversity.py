"""scripts/verify_data_diversity.py and torchtitan_ext.text.diversity: 0 % duplicates and 100 %
coverage over 3 epochs with persistent workers for the streaming loader; the seed's take()-style
dataset is flagged."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import REPO, torchrun
from tests.test_streaming import corpus, make_docs, tokenizer, write_parquet  # noqa: F401
from torchtitan_ext.loaders.streaming import StreamingTextDataLoader
from torchtitan_ext.text.diversity import BuggyTakeDataset, DiversityMeter, run_check

SCRIPT = REPO / "scripts" / "verify_data_diversity.py"


def _script():
    spec = importlib.util.spec_from_file_location("verify_data_diversity", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_streaming_loader_three_epochs_no_duplicates_full_coverage(corpus, tokenizer):  # noqa: F811
    src, docs = corpus
    cfg = StreamingTextDataLoader.Config(
        dataset_path=src,
        tokenizer_path=tokenizer.source,
        shuffle_buffer=16,
        emit_doc_ids=True,
        num_workers=2,
        persistent_workers=True,
        batches_per_iter=25,  # DataLoader "epochs" end and restart: persistent workers re-iter
    )

    def make(rank):
        return cfg.build(dp_rank=rank, dp_world_size=2, seq_len=16, local_batch_size=4)

    meter = run_check(make, ranks=2, workers=2, epochs=3, num_documents=len(docs))
    rep = meter.report()
    assert rep.complete_epochs == [0, 1, 2]
    assert rep.window_duplicates == 0 and rep.doc_duplicates == 0
    assert all(rep.coverage[e] == 1.0 for e in (0, 1, 2))
    assert rep.failures() == []


def test_buggy_take_dataset_is_flagged(corpus, tokenizer):  # noqa: F811
    src, _ = corpus
    files = sorted(str(p) for p in Path(src).parent.glob("*.parquet"))

    def make(rank):
        ds = BuggyTakeDataset(files, tokenizer, 16, take=30, buffer_size=10)
        return DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)

    meter = run_check(make, ranks=1, workers=2, batches=60, num_documents=30)
    rep = meter.report()
    assert rep.doc_duplicates > 0 and rep.first_duplicate is not None
    assert rep.failures(), "the take() replay must fail the check"
    assert max(i for _, i in meter._starts) < 30, "it only ever sees the first 30 documents"


def test_meter_counts_duplicates_and_merges_ranks():
    def batch(ids, offs, epoch=0, seed=0):
        g = torch.Generator().manual_seed(seed)
        n = len(ids)
        x = {
            "input": torch.randint(0, 100, (1, n), generator=g),
            "doc_ids": torch.tensor([ids]),
            "doc_epochs": torch.full((1, n), epoch),
            "doc_offsets": torch.tensor([offs]),
        }
        return x, torch.randint(0, 100, (1, n), generator=g)

    a = DiversityMeter(num_documents=3)
    a.add_batch(batch([0, 0, 1, 1], [0, 1, 0, 1]))
    b = DiversityMeter(num_documents=3)
    b.add_batch(batch([1, 2, 2, 2], [3, 0, 1, 2], seed=1), rank=1)  # doc 1 continues: no start
    b.add_batch(batch([2, 2, 0, 0], [5, 6, 0, 1], seed=2), rank=1)  # doc 0 again: duplicate
    merged = DiversityMeter.merged([json.loads(json.dumps(m.state())) for m in (a, b)], 3).report()
    assert merged.doc_duplicates == 1 and merged.coverage[0] == 1.0
    # a document that began on the previous row's label-only token starts at offset 1
    c = DiversityMeter(num_documents=3)
    c.add_batch(batch([2, 2], [1, 2]))
    assert c.report().doc_starts == 1


def test_cli_passes_for_streaming_and_fails_for_buggy_demo(corpus, tokenizer, tmp_path, capsys):  # noqa: F811
    src, _ = corpus
    main = _script().main
    common = [
        "--dataset",
        src,
        "--tokenizer",
        tokenizer.source,
        "--seq-len",
        "16",
        "--batch-size",
        "4",
    ]
    out = tmp_path / "r.json"
    rc = main(
        [
            *common,
            "--ranks",
            "2",
            "--workers",
            "0",
            "--epochs",
            "2",
            "--json",
            str(out),
            "--set",
            "shuffle_buffer=8",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    rep = json.loads(out.read_text())
    assert rep["doc_dup_rate"] == 0 and rep["coverage"]["0"] == 1.0 and rep["coverage"]["1"] == 1.0
    rc = main([*common, "--buggy-take-demo", "--take", "20", "--workers", "0", "--batches", "40"])
    text = capsys.readouterr().out
    assert rc == 1 and "FAIL" in text and "first duplicate: {" in text
    with pytest.raises(SystemExit):
        main([*common, "--set", "no_such_field=1"])


@pytest.mark.integration
@pytest.mark.slow
def test_under_torchrun(corpus, tokenizer, tmp_path):  # noqa: F811
    src, _ = corpus
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = torchrun(
        2,
        str(SCRIPT),
        "--dataset",
        src,
        "--tokenizer",
        tokenizer.source,
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--workers",
        "0",
        "--epochs",
        "1",
        "--json",
        str(tmp_path / "r.json"),
    )
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["doc_dup_rate"] == 0 and rep["coverage"]["0"] == 1.0
    assert "2 rank(s)" in p.stdout


class _EpochLoader:
    """Two epochs of the same four rows (no document ids), reporting its epoch as the
    Parquet loader does (``get_stats()['epoch']``, as of the last batch returned)."""

    def __init__(self, report_epoch: bool) -> None:
        self.report_epoch, self.epoch, self.k = report_epoch, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.k == 4:
            raise StopIteration
        self.epoch, i = divmod(self.k, 2)
        self.k += 1
        tokens = torch.arange(9).reshape(1, 9) + 100 * i
        return {"input": tokens[:, :-1]}, tokens[:, 1:]

    def get_stats(self) -> dict:
        return {"epoch": self.epoch} if self.report_epoch else {}


def test_a_loader_without_document_ids_is_judged_per_reported_epoch():
    m = run_check(lambda r: _EpochLoader(report_epoch=True), 1, 0, batches=4)
    assert m.r.window_duplicates == 0 and m.r.window_repeats_across_epochs == 2
    # without an epoch the replay is indistinguishable from the take(N) bug: duplicates
    m = run_check(lambda r: _EpochLoader(report_epoch=False), 1, 0, batches=4)
    assert m.r.window_duplicates == 2
