"""Video through positions, collate and the qwen3_vl model: mRoPE rows equal transformers'
``get_rope_index`` on samples mixing text, images and videos; a pack's position rows are its
samples' own; the collate passes ``pixel_values_videos`` / ``video_grid_thw``; a pack holding a
video, an image and text gives each sample's logits alone and HF's own forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.positions import mrope_positions, pack_position_rows, position_rows

# rope_model's ids: image pad 1, video pad 2, vision start 3, vision end 4; text is 5+
IMG, VID, VS, VE, MS = 1, 2, 3, 4, 2


@pytest.fixture(scope="module")
def rope_model():
    from tests.support.tiny_qwen3vl import rope_model

    return rope_model()


def hf_rope(model, ids: np.ndarray, grid: np.ndarray, vgrid: np.ndarray) -> np.ndarray:
    """transformers' own rows [3, L] (``mm_token_type_ids``: 1 image, 2 video)."""
    t = torch.from_numpy(ids)[None]
    kinds = (t == IMG).int() + 2 * (t == VID).int()
    pos, _ = model.get_rope_index(
        t,
        kinds,
        image_grid_thw=torch.from_numpy(grid) if len(grid) else None,
        video_grid_thw=torch.from_numpy(vgrid) if len(vgrid) else None,
    )
    return pos[:, 0].numpy()


piece = st.one_of(
    st.integers(1, 5).map(lambda k: ("text", (k,))),
    st.tuples(st.integers(1, 3), st.integers(1, 3)).map(
        lambda g: ("image", (1, 2 * g[0], 2 * g[1]))
    ),
    st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)).map(
        lambda g: ("video", (g[0], 2 * g[1], 2 * g[2]))
    ),
)


def build(pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids, image grids, video grids of one sample as the processor lays it out: an image is
    vision start + pads + vision end; a video is, per merged frame, a timestamp (text), vision
    start, that frame's pads, vision end (``VideoPatches.placeholder``)."""
    ids: list[int] = []
    grids, vgrids = [], []
    for kind, v in pieces:
        if kind == "text":
            ids += [5] * v[0]
        elif kind == "image":
            ids += [VS] + [IMG] * (v[1] // MS * v[2] // MS) + [VE]
            grids.append(v)
        else:
            t, h, w = v
            for _ in range(t):
                ids += [6, 7, VS] + [VID] * (h // MS * w // MS) + [VE]
            vgrids.append(v)
    return (
        np.asarray(ids, dtype=np.int64),
        np.asarray(grids, dtype=np.int64).reshape(-1, 3),
        np.asarray(vgrids, dtype=np.int64).reshape(-1, 3),
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(piece, min_size=1, max_size=5))
def test_mrope_with_videos_equals_get_rope_index(rope_model, pieces):
    ids, g, vg = build(pieces)
    ours = mrope_positions(ids, g, IMG, MS, video_grid_thw=vg, video_pad_id=VID)
    assert np.array_equal(ours, hf_rope(rope_model, ids, g, vg))


def test_a_video_is_placed_frame_by_frame():
    """Two merged frames of 2x2 llm tokens after 3 text tokens: each frame restarts t at its
    own start (t=1 per frame), not t = 0, 1 over one run."""
    ids, g, vg = build([("text", (3,)), ("video", (2, 4, 4))])
    rows = mrope_positions(ids, g, IMG, MS, video_grid_thw=vg, video_pad_id=VID)
    first = np.flatnonzero(ids == VID)[:4]
    second = np.flatnonzero(ids == VID)[4:]
    assert rows[:, first].tolist() == [[6] * 4, [6, 6, 7, 7], [6, 7, 6, 7]]
    # after frame 1: +2 (max h, w), then vision end, 2 timestamp tokens, vision start
    assert rows[:, second].tolist() == [[12] * 4, [12, 12, 13, 13], [12, 13, 12, 13]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(piece, min_size=0, max_size=4), min_size=1, max_size=5))
def test_a_pack_with_videos_is_its_samples_each_alone(samples):
    built = [build(p) for p in samples]
    ids = np.concatenate([b[0] for b in built])
    lens = np.array([len(b[0]) for b in built])
    grid = np.concatenate([b[1] for b in built])
    vgrid = np.concatenate([b[2] for b in built])
    want = np.concatenate(
        [position_rows(i, g, IMG, MS, video_grid_thw=v, video_pad_id=VID) for i, g, v in built],
        axis=1,
    )
    got = pack_position_rows(ids, lens, grid, IMG, MS, video_grid_thw=vgrid, video_pad_id=VID)
    assert np.array_equal(got, want)


def test_video_and_image_runs_that_touch_stay_two_runs():
    ids = np.array([5] + [IMG] * 2 + [VID] * 2 + [5])
    g, vg = np.array([[1, 2, 4]]), np.array([[1, 4, 2]])
    got = pack_position_rows(ids, np.array([len(ids)]), g, IMG, MS, video_grid_thw=vg,
                             video_pad_id=VID)  # fmt: skip
    assert np.array_equal(
        got[1:], mrope_positions(ids, g, IMG, MS, video_grid_thw=vg, video_pad_id=VID)
    )
    assert got[1:, 3].tolist() == [3, 3, 3]  # the video starts after the image's +2


def test_video_count_mismatches_are_named():
    ids, g, vg = build([("video", (2, 4, 4))])
    lens = np.array([len(ids)])
    with pytest.raises(SampleError, match="2 video token runs but 3 video frames"):
        pack_position_rows(ids, lens, g, IMG, MS, video_grid_thw=np.array([[3, 4, 4]]),
                           video_pad_id=VID)  # fmt: skip
    with pytest.raises(SampleError, match="video run of 4 tokens, grid 1x4x8 needs 8"):
        mrope_positions(ids, g, IMG, MS, video_grid_thw=np.array([[2, 4, 8]]), video_pad_id=VID)
