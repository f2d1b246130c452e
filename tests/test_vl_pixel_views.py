"""Packs whose pixels the collate copies anyway read them as views of the cache's mapping (one
20 MB copy fewer per 8k-token pack); the batches stay bitwise those of private copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.vl_sample import sample_cache
from tests.test_vl_loader import BUCKETS, SEQ, make, same
from torchtitan_ext.vl.collate import PackCollator
from torchtitan_ext.vl.dataset import CachedVLDataset


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with sample_cache(tmp_path_factory, "vl_views", n=24, seq_len=SEQ, buckets=BUCKETS) as env:
        yield env


@pytest.mark.parametrize(
    "fmt, on, copies",
    [("torchtitan", "device", True), ("torchtitan", "collate", True),
     ("hf", "collate", True), ("qwen3_vl", "collate", True),
     ("hf", "device", False), ("qwen3_vl", "device", False)],
)  # fmt: skip
def test_which_collates_copy_the_pixels(fmt, on, copies):
    """hf / qwen3_vl batches normalised on the device hand the pack's own tensor to the staging
    copy: only there must the pack own its pixels."""
    special = {"pad_id": 0, "image_pad_id": 1, "video_pad_id": 2, "vision_start_id": 3,
               "vision_end_id": 4}  # fmt: skip
    assert PackCollator(fmt, special, normalize_on=on).copies_pixels is copies


def _mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies inside one of the cache's mapped pixel arrays."""
    return any(np.shares_memory(t.numpy(), m) for m in MAPS)


@pytest.mark.parametrize("fmt, on", [("torchtitan", "device"), ("hf", "collate")])
def test_the_loader_reads_views_and_gives_the_same_batches(env, fmt, on):
    a = make(env, batch_format=fmt, normalize_on=on)
    assert a.reader.dataset.copy_pixels is False
    b = make(env, batch_format=fmt, normalize_on=on)
    b.reader.dataset.copy_pixels = True  # as before: a private copy per pack
    got, want = iter(a), iter(b)
    for _ in range(6):
        assert same(next(got), next(want))
    a.close(), b.close()


MAPS: list[np.ndarray] = []


def test_a_view_is_a_view_and_hf_device_batches_keep_their_copy(env):
    ds = CachedVLDataset(env["path"], copy_pixels=False, shuffle=False)
    MAPS[:] = [ds.cache._arrays(s)["pixels"] for s in range(len(ds.cache.metadata["shards"]))]
    assert _mapped(next(iter(ds))["pixel_u8"])
    assert not _mapped(next(iter(CachedVLDataset(env["path"], shuffle=False)))["pixel_u8"])
    dl = make(env, batch_format="hf", normalize_on="device")
    assert dl.reader.dataset.copy_pixels is True
    dl.close()
