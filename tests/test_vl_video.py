"""vl/video.py: Qwen3-VL video processing equals transformers 5.23's, bit for bit, without torchvision.

The references in tests/fixtures/video/ are HF's answers for tiny generated videos
(scripts/make_video_fixtures.py, run in an environment with torchvision): the sampled frame
indices, ``video_grid_thw``, the per-merged-frame timestamps, the prompt and its token ids, and
sha256 hashes of ``pixel_values_videos`` (HF's float32) and of its exact uint8 preimage, plus every
16th uint8 row to locate a difference. HF's own sampler, timestamp and token-count functions are
also called directly (they import without torchvision) over grids of inputs.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import av
import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO
from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.video import (
    VideoOptions,
    VideoProcessor,
    frame_timestamps,
    normalize_video_patches,
    sample_indices,
    target_size,
)

FIXTURES = REPO / "tests" / "fixtures" / "video"
CASES = sorted(p.stem for p in FIXTURES.glob("*.npz"))
ROW_STRIDE = 16  # scripts/make_video_fixtures.py


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def results():
    """case -> (reference npz, our VideoPatches from the .mp4)."""
    out = {}
    for case in CASES:
        ref = np.load(FIXTURES / f"{case}.npz")
        opts = VideoOptions.from_config(json.loads(str(ref["options"])))
        out[case] = (ref, opts, VideoProcessor(opts)(FIXTURES / f"{case}.mp4"))
    return out


def test_fixtures_cover_the_edge_cases():
    assert len(CASES) == 6, CASES
    refs = {c: np.load(FIXTURES / f"{c}.npz") for c in CASES}
    # an odd number of sampled frames (temporal padding), and a linspace with exact halves
    assert any(len(r["frame_indices"]) % 2 for r in refs.values())
    assert list(refs["halfround_2.5fps"]["frame_indices"]) == [0, 2, 3, 4, 6]
    assert sum(f.stat().st_size for f in FIXTURES.iterdir()) < 400_000


@pytest.mark.parametrize("case", CASES)
def test_sampling_grid_and_timestamps_equal_hf(results, case):
    ref, _, v = results[case]
    assert list(v.frame_indices) == ref["frame_indices"].tolist()
    assert v.total_frames == int(ref["total_frames"]) and v.video_fps == float(ref["video_fps"])
    assert list(v.grid_thw) == ref["grid_thw"].tolist()
    assert list(v.timestamps) == ref["timestamps"].tolist()  # exact floats


@pytest.mark.parametrize("case", CASES)
def test_patches_equal_hf_bit_for_bit(results, case):
    """uint8 rows equal HF's (hash + sampled rows), and normalised they are HF's float32
    ``pixel_values_videos`` bit for bit (hash of the bytes)."""
    ref, _, v = results[case]
    assert v.patches.dtype == np.uint8 and v.patches.shape[1] == 3 * 2 * 16 * 16
    assert v.patches.shape[0] == int(np.prod(ref["grid_thw"]))
    sampled = v.patches[::ROW_STRIDE]
    bad = np.nonzero((sampled != ref["patches_u8_rows"]).any(1))[0]
    assert bad.size == 0, f"rows {(bad * ROW_STRIDE).tolist()[:10]} differ from HF"
    assert _sha(v.patches) == str(ref["patches_u8_sha256"])
    f = normalize_video_patches(v.patches)
    assert f.dtype.is_floating_point and f.element_size() == 4
    assert _sha(f.numpy()) == str(ref["pixel_values_sha256"])


@pytest.fixture(scope="module")
def processor():
    from torchtitan_ext.vl.processor import load_processor

    return load_processor()


@pytest.mark.parametrize("case", CASES)
def test_prompt_and_token_ids_equal_hf(results, processor, case):
    """The chat template's one <|video_pad|> replaced by our placeholder gives HF's prompt and ids."""
    ref, _, v = results[case]
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "What is in the video?"}],
        }
    ]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.count("<|video_pad|>") == 1
    text = prompt.replace("<|video_pad|>", v.placeholder())
    assert text == str(ref["text"])
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == ref["input_ids"].tolist()


def _all_frames(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def test_frame_list_equals_the_file(results):
    """All frames as PIL images at the file's fps: the same sampling and bytes as the file."""
    ref, opts, v = results["odd_30fps"]
    frames = [Image.fromarray(a) for a in _all_frames(FIXTURES / "odd_30fps.mp4")]
    w = VideoProcessor(opts).from_frames(frames, fps=30)
    assert w.frame_indices == v.frame_indices and w.grid_thw == v.grid_thw
    assert w.timestamps == v.timestamps and np.array_equal(w.patches, v.patches)
    arr = np.stack(_all_frames(FIXTURES / "odd_30fps.mp4"))
    assert np.array_equal(VideoProcessor(opts).from_frames(arr, fps=30.0).patches, v.patches)


def _hf_sampler(o: VideoOptions):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    self = SimpleNamespace(fps=o.fps, min_frames=o.min_frames, max_frames=o.max_frames)

    def run(total: int, fps: float):
        md = VideoMetadata(total_num_frames=total, fps=fps)
        return Qwen3VLVideoProcessor.sample_frames(self, md).tolist()

    return run


@pytest.mark.parametrize(
    "o",
    [VideoOptions(), VideoOptions(fps=1.0, min_frames=2, max_frames=9), VideoOptions(fps=4.5)],
)
def test_sample_indices_and_timestamps_equal_hf_functions(o):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    hf = _hf_sampler(o)
    for total in [1, 2, 3, 5, 7, 8, 13, 24, 75, 299, 1001]:
        for fps in [1.0, 2.5, 7.0, 23.976, 24.0, 29.97, 30.0, 60.0]:
            got = sample_indices(total, fps, o).tolist()
            assert got == hf(total, fps), (total, fps)
            want = Qwen3VLProcessor._calculate_timestamps(None, list(got), fps, 2)
            assert frame_timestamps(got, fps, 2) == want, (total, fps)


@pytest.mark.parametrize("cap", [False, True])
def test_token_count_equals_hf_over_sizes(cap):
    """HF's own count (its smart_resize and per-frame cap) over a grid of frame counts and sizes."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    o = VideoOptions(cap_pixels_per_frame=cap)
    self = SimpleNamespace(
        size={"shortest_edge": o.min_pixels, "longest_edge": o.max_pixels},
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        cap_pixels_per_frame=cap,
        max_video_tokens=o.max_video_tokens,
    )
    for n in [2, 3, 4, 7, 16, 64, 300]:
        for h, w in [(20, 30), (48, 64), (120, 160), (480, 640), (720, 1280), (1080, 1920)]:
            rh, rw = target_size(n, h, w, o)
            ours = (n + n % 2) // 2 * (rh // 16) * (rw // 16)
            assert ours == Qwen3VLVideoProcessor.get_num_of_video_patches(self, n, h, w), (n, h, w)


def test_normalize_video_rows_layout():
    """Channel-major rows: value k of a row belongs to channel k // (T*P*P)."""
    u8 = np.zeros((2, 1536), np.uint8)
    u8[:, 512:1024] = 255
    f = normalize_video_patches(u8)
    assert f[0, :512].eq(-1).all() and f[0, 512:1024].eq(1).all() and f[0, 1024:].eq(-1).all()
    with pytest.raises(ValueError, match="uint8"):
        normalize_video_patches(u8.astype(np.float32))


def test_options_from_a_checkpoint_config():
    cfg = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2, "max_frames": 32}
    o = VideoOptions.from_config(cfg)
    assert (o.min_pixels, o.max_pixels, o.max_frames, o.min_frames) == (4096, 25165824, 32, 4)
    with pytest.raises(ValueError, match="num_frames"):
        VideoOptions.from_config({"num_frames": 8})


# ---------------------------------------------------------------- bad input


def _encode(frames: int, fmt: str = "mp4", codec: str = "libx264") -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        c.start_encoding()
        for k in range(frames):
            img = np.full((48, 64, 3), 40 * k, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _error(src) -> SampleError:
    with pytest.raises(SampleError) as e:
        VideoProcessor()(src)
    assert "\n" not in str(e.value)
    return e.value


def test_missing_path_names_the_file(tmp_path):
    e = _error(tmp_path / "nope.mp4")
    assert e.reason == "missing_video" and str(tmp_path / "nope.mp4") in e.message
    assert _error(None).reason == "missing_video"
    assert _error(b"").reason == "missing_video"


def test_relative_path_is_read_under_root():
    v = VideoProcessor()("small_10fps.mp4", root=FIXTURES)
    assert v.grid_thw == (2, 10, 14)


def test_undecodable_bytes(tmp_path):
    e = _error(b"this is not a video file" * 40)
    assert e.reason == "corrupt_video" and "<960 bytes of video>" in e.message
    assert "Invalid data" in e.message
    p = tmp_path / "junk.mp4"
    p.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\xff" * 500)
    e = _error(p)
    assert e.reason == "corrupt_video" and str(p) in e.message


def test_truncated_file(tmp_path):
    """Cut inside the frames of a file whose index comes first: ``truncated_video``, naming the
    file and how far decoding got. Cut before its index (index at the end): ``corrupt_video``."""
    data = (FIXTURES / "qvga_24fps.mp4").read_bytes()  # moov first (faststart)
    p = tmp_path / "cut.mp4"
    p.write_bytes(data[: int(len(data) * 0.6)])
    e = _error(p)
    assert e.reason == "truncated_video" and str(p) in e.message and "of 72 frames" in e.message
    late = (FIXTURES / "small_10fps.mp4").read_bytes()  # moov last
    assert _error(late[: len(late) // 2]).reason == "corrupt_video"


def test_zero_frames():
    e = _error(_encode(0, fmt="avi", codec="mpeg4"))  # a video stream with no frames
    assert e.reason == "empty_video" and "no frames" in e.message
    assert _error(_encode(0)).reason == "no_video_stream"  # an mp4 without one
    with pytest.raises(SampleError) as ei:
        VideoProcessor().from_frames([], fps=24)
    assert ei.value.reason == "empty_video"


def test_one_frame_is_refused_as_hf_does():
    """HF's video smart_resize raises for fewer sampled frames than the temporal patch size."""
    assert _error(_encode(1)).reason == "too_few_frames"
    assert VideoProcessor()(_encode(2)).grid_thw[0] == 1


def test_bad_frame_lists():
    ok = np.zeros((48, 64, 3), np.uint8)
    for frames, fps in [
        ([ok, np.zeros((48, 63, 3), np.uint8)], 24),
        ([ok, ok.astype(np.float32)], 24),
        ([ok, ok], 0),
    ]:
        with pytest.raises(SampleError) as e:
            VideoProcessor().from_frames(frames, fps=fps)
        assert e.value.reason == "bad_frames" and "frame list" in e.value.message


def test_container_without_frame_count_counts_packets(results):
    """Matroska stores no frame count (``stream.frames == 0``; HF's PyAV reader then samples
    nothing): the packets are counted, so the clip samples as its MP4 twin does."""
    _, opts, v = results["odd_30fps"]
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        for a in _all_frames(FIXTURES / "odd_30fps.mp4"):
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    with av.open(io.BytesIO(buf.getvalue())) as c:
        assert c.streams.video[0].frames == 0
    w = VideoProcessor(opts)(buf.getvalue())
    assert (w.total_frames, w.frame_indices, w.grid_thw) == (75, v.frame_indices, v.grid_thw)
    assert w.timestamps == v.timestamps


def test_an_unforeseen_decoder_failure_is_this_videos_error(monkeypatch):
    import torchtitan_ext.vl.video_decode as video_decode

    def boom(data, name):
        raise RuntimeError("codec\nexploded")

    monkeypatch.setattr(video_decode, "_probe", boom)
    e = _error(FIXTURES / "small_10fps.mp4")
    assert e.reason == "decode_error" and e.error_type == "RuntimeError"
    assert "small_10fps.mp4: RuntimeError: codec exploded" in e.message
