"""Sampled video frames are resized as they are decoded: the bytes are those of resizing the whole
stack (so HF's, tests/test_vl_video.py), and the full-resolution frames are never all held."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.video import FitFrames, VideoOptions, VideoProcessor, frames_to_patches
from torchtitan_ext.vl.video_decode import read_video

FIXTURES = Path(__file__).parent / "fixtures" / "video"


def whole_stack(src, o: VideoOptions):
    """The former path: every sampled frame at full size, then one resize of the stack."""
    frames, indices, fps, total = read_video(src, o)
    return frames_to_patches(frames, indices, fps, total, o)


@pytest.mark.parametrize("clip", sorted(p.name for p in FIXTURES.glob("*.mp4")))
def test_frame_by_frame_equals_the_whole_stack(clip):
    o = VideoOptions()
    ours, ref = VideoProcessor(o)(FIXTURES / clip), whole_stack(FIXTURES / clip, o)
    assert ours.grid_thw == ref.grid_thw and np.array_equal(ours.patches, ref.patches)


@pytest.fixture(scope="module")
def big_clip(tmp_path_factory) -> Path:
    """48 frames of 640x480 noise at 24 fps (noise: the resize has real work per frame)."""
    import av

    path = tmp_path_factory.mktemp("clip") / "noise.mp4"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt = 640, 480, "yuv420p"
        s.options = {"preset": "ultrafast"}
        for _ in range(48):
            img = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
            for packet in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


def test_full_size_frames_are_not_all_held(big_clip):
    o = VideoOptions(fps=24.0)  # every one of the 48 frames is sampled
    full = 48 * 480 * 640 * 3
    tracemalloc.start()
    try:
        v = VideoProcessor(o)(big_clip)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert v.grid_thw[0] == 24 and np.array_equal(v.patches, whole_stack(big_clip, o).patches)
    held = peak - big_clip.stat().st_size  # the file's bytes are read into memory whole
    assert held < full / 8, (
        f"{held / 1e6:.1f} MB held beyond the file's bytes; the full stack is {full / 1e6:.1f} MB"
    )


def test_a_frame_size_change_is_corrupt_video():
    fit = FitFrames(4, VideoOptions())
    assert fit(np.zeros((48, 64, 3), np.uint8)).shape[2] == 3
    with pytest.raises(
        SampleError, match=r"frame size changes within the video \(64x48 then 32x48\)"
    ):
        fit(np.zeros((48, 32, 3), np.uint8))
