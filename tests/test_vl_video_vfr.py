"""Variable frame rate: the prompt dates frame ``i`` at ``i / average_rate`` (HF's timestamps), so a
video whose frames are elsewhere is a counted ``variable_frame_rate`` skip, while a constant rate
and small jitter are processed exactly as before (``vl/video.py`` ``check_frame_times``)."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest

from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.video import VideoOptions, VideoProcessor, check_frame_times


def _frames(n: int, w: int = 64, h: int = 48) -> np.ndarray:
    rng = np.random.default_rng(n)
    return rng.integers(0, 255, size=(n, h, w, 3), dtype=np.uint8)


def _encode(frames: np.ndarray, times_s: list[float]) -> bytes:
    """MP4 (mpeg4) of ``frames`` shown at ``times_s`` (a millisecond time base)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=30)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.codec_context.time_base = Fraction(1, 1000)
        for f, t in zip(frames, times_s, strict=True):
            vf = av.VideoFrame.from_ndarray(f, format="rgb24")
            vf.pts, vf.time_base = round(t * 1000), Fraction(1, 1000)
            for p in s.encode(vf):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def test_a_recording_that_pauses_is_a_variable_frame_rate_skip() -> None:
    # 20 frames at 10 fps, a 3 s pause, 20 more at 10 fps: the average rate dates the last
    # frames seconds away from where they are shown
    times = [i / 10 for i in range(20)] + [5.0 + i / 10 for i in range(20)]
    data = _encode(_frames(40), times)
    with pytest.raises(SampleError) as e:
        VideoProcessor(VideoOptions())(data)
    assert e.value.reason == "variable_frame_rate"
    assert "re-encode at a constant rate" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("jitter_ms", [0, 15])
def test_a_constant_rate_or_small_jitter_is_processed(jitter_ms: int) -> None:
    rng = np.random.default_rng(1)
    times = [
        i / 10 + (rng.integers(-jitter_ms, jitter_ms + 1) / 1000 if i else 0) for i in range(40)
    ]
    v = VideoProcessor(VideoOptions())(_encode(_frames(40), times))
    assert v.grid_thw[0] >= 2 and len(v.timestamps) == v.grid_thw[0]


def test_the_tolerance_is_half_a_sampling_interval() -> None:
    o = VideoOptions(fps=2.0)
    check_frame_times([0.0, 1.24], [0, 10], 10.0, o, "x")  # 0.24 s off: within 0.25 s
    with pytest.raises(SampleError, match="frame 10 is shown at 1.26 s"):
        check_frame_times([0.0, 1.26], [0, 10], 10.0, o, "x")
    check_frame_times([None, None], [0, 10], 10.0, o, "x")  # no presentation times: no check
