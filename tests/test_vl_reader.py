"""The VL chain's step counters: every batch format is counted the same way (tokens, padding,
images), and the counts travel in the state (``CountBatches.stats`` is a function of it)."""

from __future__ import annotations

import pytest
import torch

from torchtitan_ext.pipeline.stage import Stage
from torchtitan_ext.vl.stages import CountBatches, batch_arrays, batch_counts

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


class _Repeat(Stage):
    """A source handing out one batch forever; its position is the number handed out."""

    def __init__(self, batch: object) -> None:
        self.batch, self.n = batch, 0

    def next(self) -> object:
        self.n += 1
        return self.batch

    def state(self) -> dict:
        return {"n": self.n}

    def reset(self, state: dict | None = None) -> None:
        self.n = 0 if state is None else state["n"]


@pytest.mark.parametrize("fmt", ["hf", "torchtitan", "qwen3_vl"])
def test_stats_count_tokens_pads_and_images_in_every_format(fmt):
    assert batch_counts(_batches()[fmt], PAD) == (2, 9, 3, 2, 28, 0, 0)
    c = CountBatches(_Repeat(_batches()[fmt]), PAD)
    c.next()
    after_one = c.state()
    c.next()
    s = c.stats(c.state())
    assert (s["batches"], s["packs"], s["tokens"], s["pad_tokens"]) == (2, 4, 18, 6)
    assert (s["images"], s["patches"]) == (4, 56) and s["pad_pct"] == 25.0
    assert c.stats(after_one)["batches"] == 1, "stats are a function of the state passed"
    c.reset(after_one)
    assert c.stats(c.state())["packs"] == 2 and c.upstream.n == 1


def test_text_only_batch_counts_no_images():
    ids = torch.tensor([[1, 2, PAD]])
    tokens, grid = batch_arrays({"input_ids": ids, "labels": ids})
    assert grid is None and tokens is ids
    assert batch_counts({"input_ids": ids, "labels": ids}, PAD) == (1, 2, 1, 0, 0, 0, 0)


def test_video_counts_are_merged_frames_in_every_format():
    """Two videos of 2 and 3 merged frames (4 + 2 patches per frame): the ``hf`` / ``qwen3_vl``
    grids are per video, the ``torchtitan`` ones per merged frame; the counts agree."""
    ids = torch.tensor([[5, 6, PAD]])
    whole = torch.tensor([[2, 2, 2], [3, 1, 2]])
    frames = torch.tensor([[1, 2, 2]] * 2 + [[1, 1, 2]] * 3)
    batches = {
        "hf": {"input_ids": ids, "labels": ids, "video_grid_thw": whole},
        "torchtitan": ({"input": ids, "grid_thw": None, "grid_thw_videos": frames}, ids),
        "qwen3_vl": ({"input": ids, "video_grid_thw": whole}, ids),
    }
    for fmt, batch in batches.items():
        assert batch_counts(batch, PAD) == (1, 2, 1, 0, 0, 5, 14), fmt


def test_video_counters_reach_the_line_once_seen():
    from torchtitan_ext.metrics import data_step

    stats = {"images": 4.0, "video_frames": 0.0, "video_patches": 0.0}
    metrics, line = data_step(stats, [0.001], {}, 1)
    assert (
        line == "data_wait: 1.00ms  images/step: 4" and metrics["data/video_frames_per_step"] == 0
    )
    stats |= {"video_frames": 6.0, "video_patches": 24.0}
    _, line = data_step(stats, [0.001, 0.001], {"images": 2.0}, 1)
    assert line == "data_wait: 1.00ms  images/step: 1  frames/step: 3  video_patches/step: 12"
