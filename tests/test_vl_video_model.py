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

from .support.video_packs import mixed_samples, pack_of

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


# --------------------------------------------------------------------------------- real samples
@pytest.fixture(scope="module")
def samples(proc):
    return mixed_samples(proc)


def test_video_sample_positions_equal_get_rope_index(samples, special):
    from tests.support.tiny_qwen3vl import tiny_model

    model = tiny_model(special, vocab=640).model
    for s in samples:
        t = s["input_ids"][None]
        kinds = (t == special["image_pad_id"]).int() + 2 * (t == special["video_pad_id"]).int()
        g, vg = s["image_grid_thw"], s.get("video_grid_thw")
        ref, _ = model.get_rope_index(t, kinds, g if len(g) else None, vg)
        assert torch.equal(s["position_ids"][1:], ref[:, 0])


# ------------------------------------------------------------------------------------- collate
def test_collate_passes_videos_normalised_here_or_on_the_device(samples, special):
    from torchtitan_ext.vl.collate import PackCollator, finish_on_device
    from torchtitan_ext.vl.video import normalize_video_patches

    packs = [pack_of(samples[:3], special), pack_of(samples[3:], special)]
    want_rows = torch.cat([packs[0]["video_u8"], packs[1]["video_u8"]])
    want_grid = torch.cat([packs[0]["video_grid_thw"], packs[1]["video_grid_thw"]])
    for fmt in ("hf", "qwen3_vl"):
        here = PackCollator(fmt, special, normalize_on="collate")(packs)
        dev = PackCollator(fmt, special, normalize_on="device")(packs)
        h = here if fmt == "hf" else here[0]
        d = dev if fmt == "hf" else dev[0]
        assert h["pixel_values_videos"].dtype == torch.float32
        assert torch.equal(h["pixel_values_videos"], normalize_video_patches(want_rows))
        assert torch.equal(h["video_grid_thw"], want_grid)
        assert d["pixel_values_videos"].dtype == torch.uint8
        assert torch.equal(d["pixel_values_videos"], want_rows)
        done = finish_on_device(dev)
        done = done if fmt == "hf" else done[0]
        for k in ("pixel_values_videos", "pixel_values"):
            assert torch.equal(done[k], h[k]), k  # bitwise: the same formula either way


def test_a_video_only_batch_has_no_image_keys(samples, special):
    from torchtitan_ext.vl.collate import collate_qwen3_vl

    inp, _ = collate_qwen3_vl([pack_of(samples[:1], special)], pad_id=special["pad_id"])
    assert "pixel_values" not in inp and "image_grid_thw" not in inp
    assert inp["video_grid_thw"].tolist() == [[2, 10, 14]]


def test_packs_without_video_keep_their_batches(samples, special):
    """No ``video_*`` keys, or zero videos: the batch has exactly the image-only keys."""
    from torchtitan_ext.vl.collate import PackCollator

    plain = pack_of(samples[1:3], special)
    empty = {
        **plain,
        "video_u8": torch.zeros((0, 1536), dtype=torch.uint8),
        "video_grid_thw": torch.zeros((0, 3), dtype=torch.int64),
    }
    for fmt in ("hf", "qwen3_vl", "torchtitan"):
        for on in ("collate", "device"):
            a, b = (PackCollator(fmt, special, normalize_on=on)([p]) for p in (plain, empty))
            a, b = (a, b) if fmt == "hf" else (a[0], b[0])
            assert set(a) == set(b) and not any("video" in k and a[k] is not None for k in a)
            for k in a:
                if isinstance(a[k], torch.Tensor):
                    assert torch.equal(a[k], b[k]), (fmt, on, k)


# --------------------------------------------------------------------------------------- model
@pytest.fixture(scope="module")
def models():
    """The debugmodel flavor through our wrapper, and transformers' own model with its weights."""
    from torchtitan_ext.models.qwen3_vl import flavors as fl
    from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel, build_hf_model

    torch.manual_seed(0)
    ours = Qwen3VLModel(Qwen3VLModel.Config(hf_config=fl.flavor_config("debugmodel"))).eval()
    hf = build_hf_model(fl.flavor_config("debugmodel")).eval()
    hf.load_state_dict(ours.state_dict())
    return ours, hf


def run_ours(model, packs, special) -> torch.Tensor:
    from torchtitan_ext.vl.collate import collate_qwen3_vl

    inp, _ = collate_qwen3_vl(packs, pad_id=special["pad_id"])
    with torch.no_grad():
        return model(inp.pop("input"), **inp)


def run_hf(model, s: dict, special) -> torch.Tensor:
    """One sample as transformers runs it: float pixels, grids, ``mm_token_type_ids``; the model
    computes its own positions (``get_rope_index``)."""
    from torchtitan_ext.vl.collate import normalize
    from torchtitan_ext.vl.video import normalize_video_patches

    t = s["input_ids"][None]
    kw: dict = {
        "mm_token_type_ids": (t == special["image_pad_id"]).int()
        + 2 * (t == special["video_pad_id"]).int()
    }
    if len(s["image_grid_thw"]):
        kw |= {
            "pixel_values": normalize(s["pixel_u8"], _norm()),
            "image_grid_thw": s["image_grid_thw"],
        }
    if "video_grid_thw" in s:
        kw |= {
            "pixel_values_videos": normalize_video_patches(s["video_u8"]),
            "video_grid_thw": s["video_grid_thw"],
        }
    with torch.no_grad():
        return model(input_ids=t, use_cache=False, **kw).logits


def _norm():
    from torchtitan_ext.vl.collate import PixelNorm

    return PixelNorm()


def test_a_pack_with_video_is_its_samples_alone_and_hf(models, samples, special):
    ours, hf = models
    mixed = samples[:3]  # video, image, text
    packed = run_ours(ours, [pack_of(mixed, special)], special)[0]
    o = 0
    for s in mixed:
        n = len(s["input_ids"])
        alone = run_ours(ours, [pack_of([s], special)], special)[0]
        ref = run_hf(hf, s, special)[0]
        assert (packed[o : o + n] - alone).abs().max() <= 1e-5
        assert (alone - ref).abs().max() <= 1e-5
        o += n
    assert o == packed.shape[0]


def test_two_videos_and_an_image_in_one_pack(models, samples, special):
    """Videos of 2 and 3 merged frames, image and video deepstack features in one pack."""
    ours, hf = models
    mixed = [samples[3], samples[1], samples[0]]
    packed = run_ours(ours, [pack_of(mixed, special)], special)[0]
    o = 0
    for s in mixed:
        n = len(s["input_ids"])
        assert (packed[o : o + n] - run_hf(hf, s, special)[0]).abs().max() <= 1e-5
        o += n


def test_model_wants_video_rows_and_grid_together(models):
    ours, _ = models
    with pytest.raises(ValueError, match="pixel_values_videos and video_grid_thw"):
        ours(
            torch.zeros(1, 4, dtype=torch.long),
            position_ids=torch.zeros(4, 1, 4, dtype=torch.long),
            video_grid_thw=torch.tensor([[2, 2, 2]]),
        )


def test_model_refuses_pixels_still_uint8(models, samples, special):
    """A ``normalize_on="device"`` batch that skipped ``finish_on_device``: transformers would
    cast the bytes to float silently."""
    from torchtitan_ext.vl.collate import collate_qwen3_vl

    ours, _ = models
    inp, _ = collate_qwen3_vl(
        [pack_of(samples[:1], special)], pad_id=special["pad_id"], normalize_on="device"
    )
    with pytest.raises(ValueError, match="uint8 pixel_values_videos.*finish_on_device"):
        ours(inp.pop("input"), **inp)
