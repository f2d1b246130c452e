"""VLReader's step stats: every batch format is counted the same way (tokens, padding, images)."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.vl.reader import ReadStats, batch_arrays

PAD = 0


def _batches() -> dict[str, object]:
    """One batch of 2 packs of 6 tokens (3 pads) and 2 images (4 + 24 patches), in each format."""
    ids = torch.tensor([[5, 6, 7, 8, PAD, PAD], [9, 9, 9, 9, 9, PAD]])
    grid = torch.tensor([[1, 2, 2], [1, 4, 6]])
    return {
        "hf": {"input_ids": ids, "labels": ids, "image_grid_thw": grid},
        "torchtitan": ({"input": ids, "grid_thw": grid}, ids),
        "qwen3_vl": ({"input": ids, "image_grid_thw": grid}, ids),
    }


@pytest.mark.parametrize("fmt", ["hf", "torchtitan", "qwen3_vl"])
def test_stats_count_tokens_pads_and_images_in_every_format(fmt):
    s = ReadStats()
    batch = _batches()[fmt]
    assert s.add(batch, PAD, 0.25) == 2
    assert s.add(batch, PAD, 0.5) == 2
    assert (s.batches, s.packs, s.tokens, s.pad_tokens) == (2, 4, 18, 6)
    assert (s.images, s.patches) == (4, 56)
    assert (s.wait_s, s.last_wait_s) == (0.75, 0.5)


def test_text_only_batch_counts_no_images():
    ids = torch.tensor([[1, 2, PAD]])
    tokens, grid = batch_arrays({"input_ids": ids, "labels": ids})
    assert grid is None and tokens is ids
    s = ReadStats()
    s.add({"input_ids": ids, "labels": ids}, PAD, 0.0)
    assert (s.tokens, s.pad_tokens, s.images, s.patches) == (2, 1, 0, 0)
