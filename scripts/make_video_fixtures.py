#!/usr/bin/env python
"""Write tests/fixtures/video/: tiny generated videos and transformers' Qwen3-VL output for them.

Run in an environment with transformers 5.23, torchvision and av (HF's video processor needs
torchvision, which does not import beside this project's CPU torch):

    PYTHONPATH=/tmp/site312 /tmp/py312/bin/python scripts/make_video_fixtures.py [OUT_DIR]

For each case it encodes a small synthetic clip with PyAV (H.264 in MP4; the pictures are
generated here, no third-party content), decodes every frame with PyAV (``rgb24``, as
transformers' own ``read_video_pyav`` does, which is cross-checked), and runs the HF
``Qwen3VLProcessor`` (the offline processor's tokenizer and chat template + a
``Qwen3VLVideoProcessor``) on a one-video chat message with frame sampling on. Saved per case,
``<case>.npz``:

- ``pixel_values_sha256``: sha256 of HF's float32 ``pixel_values_videos`` bytes (C order);
- ``patches_u8_sha256`` and ``patches_u8_rows`` (every ``ROW_STRIDE``-th row, to locate a
  difference): HF's ``pixel_values_videos`` mapped back to uint8. The map is checked to be exact
  (``(u8 - 127.5) / 127.5`` in float32 gives HF's floats bit for bit); only hashes and a sample
  of rows are stored so that the fixtures stay small;
- ``grid_thw``, ``frame_indices``, ``timestamps`` (per merged frame), ``video_fps``,
  ``total_frames``, ``text`` (the rendered prompt), ``input_ids``;
- ``options``: JSON of the video-processor values that were not the defaults.

This script never imports torchtitan_ext's video code: the fixtures are HF's answers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

REPO = Path(__file__).resolve().parents[1]
ROW_STRIDE = 16

# name: (width, height, fps, n_frames, faststart, non-default video-processor options)
CASES: dict[str, tuple[int, int, Fraction, int, bool, dict]] = {
    # 20 frames at 10 fps: 4 frames sampled; small frames upscaled to the pixel budget's minimum
    "small_10fps": (64, 48, Fraction(10), 20, False, {}),
    # 72 frames at 24 fps: 6 sampled; moov atom first (the truncation tests cut this one)
    "qvga_24fps": (160, 120, Fraction(24), 72, True, {}),
    # 75 frames at 30 fps: 5 sampled -> one padding frame (temporal patch 2)
    "odd_30fps": (96, 64, Fraction(30), 75, False, {}),
    # 7 frames at 2.5 fps: 5 sampled, linspace(0, 6, 5) = 0 1.5 3 4.5 6 rounds half to even
    "halfround_2.5fps": (64, 64, Fraction(5, 2), 7, False, {}),
    # a smaller pixel budget: frames are downscaled (smart_resize's max branch)
    "budget_24fps": (
        160,
        120,
        Fraction(24),
        72,
        True,
        {"size": {"shortest_edge": 4096, "longest_edge": 32768}},
    ),
    # qwen-vl-utils' per-frame cap, fps 4 and min_frames 6
    "capped_30fps": (
        96,
        64,
        Fraction(30),
        75,
        False,
        {"cap_pixels_per_frame": True, "fps": 4, "min_frames": 6},
    ),
}


def synth_frames(w: int, h: int, n: int, seed: int) -> np.ndarray:
    """n RGB frames: a moving colour gradient, a bright square and low noise (uint8 [n, h, w, 3])."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.empty((n, h, w, 3), np.uint8)
    for t in range(n):
        r = 127 + 120 * np.sin((x + 3 * t) / max(w, 1) * 6.28)
        g = 127 + 120 * np.cos((y - 2 * t) / max(h, 1) * 6.28)
        b = (x + y + 5 * t) % 256
        f = np.stack([r, g, b], -1) + rng.normal(0, 1, (h, w, 3))
        s = (4 * t) % max(w - 12, 1)
        f[h // 3 : h // 3 + 12, s : s + 12] = (250, 240, 30)
        out[t] = np.clip(f, 0, 255).astype(np.uint8)
    return out


def encode(path: Path, frames: np.ndarray, fps: Fraction, faststart: bool) -> None:
    opts = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", format="mp4", options=opts) as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = {"crf": "28", "preset": "veryfast", "bframes": "0", "threads": "1"}
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def decode_all(path: Path) -> tuple[np.ndarray, float, int]:
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        fps, n = float(s.average_rate), int(s.frames)
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    assert len(frames) == n, (path, len(frames), n)
    return frames, fps, n


def build_processor(tmp: Path, options: dict):
    sys.path.insert(0, str(REPO))
    from torchtitan_ext.vl.offline_processor import build_offline_processor  # no video code

    pdir = build_offline_processor(tmp / "processor")
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tok = AutoTokenizer.from_pretrained(pdir, local_files_only=True)
    ip = Qwen2VLImageProcessorPil.from_pretrained(pdir, local_files_only=True)
    vp = Qwen3VLVideoProcessor(**options)
    template = (pdir / "chat_template.jinja").read_text()
    return Qwen3VLProcessor(
        image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=template
    )


def check_hf_pyav(path: Path, proc, frames: np.ndarray, indices: np.ndarray) -> None:
    """transformers' own PyAV reader, with the processor's sampler, picks the same frames."""
    from transformers.video_utils import read_video_pyav

    video, md = read_video_pyav(str(path), sample_indices_fn=proc.video_processor.sample_frames)
    assert list(md.frames_indices) == list(indices), (md.frames_indices, indices)
    assert np.array_equal(video, frames[indices])


def run_case(name: str, spec, out: Path, tmp: Path) -> None:
    import torch

    w, h, fps, n, faststart, options = spec
    path = out / f"{name}.mp4"
    encode(path, synth_frames(w, h, n, seed=len(name)), fps, faststart)
    frames, video_fps, total = decode_all(path)
    proc = build_processor(tmp, {"cap_pixels_per_frame": False, **options})
    messages = [
        {
            "role": "user",
            "content": [{"type": "video"}, {"type": "text", "text": "What is in the video?"}],
        }
    ]
    prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    md = {"fps": video_fps, "total_num_frames": total, "width": w, "height": h}
    enc = proc(
        text=[prompt],
        videos=[frames],
        video_metadata=[md],
        do_sample_frames=True,
        return_tensors="pt",
    )
    pv = enc["pixel_values_videos"]
    assert pv.dtype == torch.float32
    indices = np.asarray(proc.video_processor.sample_frames(_metadata(md), fps=None))
    check_hf_pyav(path, proc, frames, indices)
    u8 = torch.round(pv.double() * 127.5 + 127.5).clamp(0, 255).to(torch.uint8)
    assert torch.equal((u8.float() - 127.5) / 127.5, pv), "uint8 map is not exact"
    grid = enc["video_grid_thw"][0].tolist()
    ts = proc._calculate_timestamps(
        list(indices), video_fps, proc.video_processor.temporal_patch_size
    )
    text = proc.tokenizer.decode(enc["input_ids"][0])
    np.savez_compressed(
        out / f"{name}.npz",
        patches_u8_sha256=np.array(hashlib.sha256(u8.numpy().tobytes()).hexdigest()),
        patches_u8_rows=u8.numpy()[::ROW_STRIDE],
        pixel_values_sha256=np.array(hashlib.sha256(pv.numpy().tobytes()).hexdigest()),
        grid_thw=np.array(grid, np.int64),
        frame_indices=indices.astype(np.int64),
        timestamps=np.array(ts, np.float64),
        video_fps=np.array(video_fps),
        total_frames=np.array(total),
        text=np.array(text),
        input_ids=enc["input_ids"][0].numpy().astype(np.int64),
        options=np.array(json.dumps(options, sort_keys=True)),
    )
    print(
        f"{name}: {w}x{h} {float(fps)} fps {total} frames -> indices {indices.tolist()} grid {grid}, "
        f"{path.stat().st_size} B video"
    )


def _metadata(md: dict):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=md["total_num_frames"], fps=md["fps"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=str(REPO / "tests" / "fixtures" / "video"))
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in CASES.items():
            run_case(name, spec, out, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
