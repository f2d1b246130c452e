"""pack_position_rows: a whole pack's position rows in one pass equal each sample's own
position_rows (itself checked against transformers' get_rope_index in test_vl_processor.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.positions import pack_position_rows, position_rows

IMG, MS = 7, 2

piece = st.one_of(
    st.integers(1, 6).map(lambda k: ("text", k)),
    st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3)).map(
        lambda g: ("image", (g[0], 2 * g[1], 2 * g[2]))
    ),
)


def sample(pieces):
    ids, grids = [], []
    for kind, v in pieces:
        if kind == "text":
            ids += [1] * v
        else:
            t, h, w = v  # <|vision_start|> pads <|vision_end|>, as the chat template writes
            ids += [2] + [IMG] * (t * (h // MS) * (w // MS)) + [3]
            grids.append(v)
    return np.array(ids, dtype=np.int64), np.array(grids, dtype=np.int64).reshape(-1, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(piece, min_size=0, max_size=5), min_size=1, max_size=6))
def test_a_pack_is_its_samples_each_alone(samples):
    """Samples that begin or end with an image (two image runs meet at a sample boundary),
    several images in a row, text-only and empty samples."""
    built = [sample(p) for p in samples]
    ids = np.concatenate([b[0] for b in built])
    grid = np.concatenate([b[1] for b in built])
    lens = np.array([len(b[0]) for b in built])
    want = [position_rows(i, g, IMG, MS) for i, g in built]
    got = pack_position_rows(ids, lens, grid, IMG, MS)
    assert np.array_equal(got, np.concatenate(want, axis=1) if want else got)


def test_image_runs_that_meet_at_a_sample_boundary_stay_two_images():
    a, ga = np.array([1, 1, IMG, IMG]), np.array([[1, 2, 4]])  # ends inside an image run
    b, gb = np.array([IMG, IMG, 1]), np.array([[1, 4, 2]])  # starts with one
    got = pack_position_rows(np.concatenate([a, b]), np.array([len(a), len(b)]),
                             np.concatenate([ga, gb]), IMG, MS)  # fmt: skip
    assert got[1:, len(a)].tolist() == [0, 0, 0]  # the second sample's image starts at 0


def test_a_run_that_does_not_match_its_grid_is_named():
    ids = np.array([1, 2] + [IMG] * 4 + [3])
    with pytest.raises(SampleError, match="image run of 4 tokens, grid 1x4x2 needs 2"):
        pack_position_rows(ids, np.array([len(ids)]), np.array([[1, 4, 2]]), IMG, MS)
    with pytest.raises(SampleError, match="1 image token runs but 2 images"):
        pack_position_rows(ids, np.array([len(ids)]), np.array([[1, 4, 4]] * 2), IMG, MS)
