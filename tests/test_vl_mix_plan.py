"""A weighted plan over several VL sample stores (stretch): weights in samples, per-source epochs,
deterministic given the seed, and packs equal to their samples read one by one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchtitan_ext.vl.build import build_cache
from torchtitan_ext.vl.mix_plan import MixedStores, plan_mixture, split_by_weight
from torchtitan_ext.vl.plan import PlanOptions

OPTS = PlanOptions.make(1000, 4, [512])


def test_split_by_weight_adds_up():
    assert split_by_weight(10, [1, 1, 1]) == [4, 3, 3]
    assert split_by_weight(7, [3, 1]) == [5, 2]
    assert split_by_weight(5, [0, 2]) == [0, 5]
    with pytest.raises(ValueError, match="weights"):
        split_by_weight(5, [0, 0])


def test_mixture_counts_epochs_and_determinism():
    rng = np.random.default_rng(1)
    small, big = rng.integers(10, 400, 20), rng.integers(10, 400, 200)
    plan = plan_mixture([small, big], [3, 1], OPTS, seed=5)
    assert plan.per_source == (165, 55)  # 220 samples split 3:1, in samples
    assert np.bincount(plan.source, minlength=2).tolist() == [165, 55]
    drawn = np.bincount(plan.sample[plan.source == 0], minlength=20)
    assert drawn.min() >= 8 and drawn.max() <= 9, "165 = 8 full epochs of 20 and 5 more"
    assert len(set(plan.sample[plan.source == 1].tolist())) == 55, "less than an epoch: distinct"
    head = plan.source[: plan.offsets[10]]
    assert 0.6 <= float((head == 0).mean()) <= 0.9, "the sources are interleaved 3:1 throughout"
    again = plan_mixture([small, big], [3, 1], OPTS, seed=5)
    assert np.array_equal(again.sample, plan.sample) and np.array_equal(again.source, plan.source)
    other = plan_mixture([small, big], [3, 1], OPTS, seed=6)
    assert not np.array_equal(other.sample, plan.sample)
    tokens = [int(sum(([small, big][j][s] for j, s in zip(
        plan.source[a:b].tolist(), plan.sample[a:b].tolist(), strict=True)), 0))
        for a, b in zip(plan.offsets[:-1], plan.offsets[1:], strict=True)]  # fmt: skip
    assert max(tokens) <= 1000
    assert all(pl == (512 if t <= 512 else 1000) for t, pl in zip(tokens, plan.pack_len,
                                                                   strict=True))  # fmt: skip


def test_mixed_packs_are_their_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path / "home"))
    from torchtitan_ext.vl.sample_chat import chat_sample_path
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    a = build_cache(sample_dataset_path(n=10, root=tmp_path / "d"), "train", tmp_path / "c", 1024,
                    8, max_samples=10, show_progress=False, store=True)  # fmt: skip
    b = build_cache(chat_sample_path(), "train", tmp_path / "c", 1024, 8, max_samples=8,
                    show_progress=False, store=True)  # fmt: skip
    mixed = MixedStores.open([a, b], [1, 2], PlanOptions.make(1024, 4, None), seed=0)
    assert len(mixed) > 1
    for i in range(len(mixed)):
        p = mixed.pack(i)
        m = slice(mixed.plan.offsets[i], mixed.plan.offsets[i + 1])
        ids = []
        for j, g in zip(mixed.plan.source[m].tolist(), mixed.plan.sample[m].tolist(), strict=True):
            ids += mixed.stores[j].pack(g)["input_ids"].tolist()
        n = int(p["num_tokens"])
        assert p["input_ids"][:n].tolist() == ids and n == len(ids)
        assert torch.all(p["input_ids"][n:] == mixed.special_tokens["pad_id"])
