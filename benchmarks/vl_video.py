"""Qwen3-VL video: frames/s of decode + process (VideoProcessor) vs PyAV decode alone (the floor) and vs HF's Qwen3VLVideoProcessor; where the time goes.

Clips: the six fixture videos (tests/fixtures/video, 64x48 to 160x120, 7 to 75 frames), timed
as one set, and one larger clip generated here with PyAV (640x360, 10 s at 30 fps, libx264;
``--quick``: 320x180, 2 s), written to a temporary directory: nothing is downloaded. The unit is
*source* frames per second (a clip's frame count over the time to turn it into patches): decoding
must run through every frame up to the last sampled one, so that is the work that scales.

Paths, interleaved per round (one intra-op thread, as in a cache-build worker):

* **ours**: ``VideoProcessor(VideoOptions())(path)``: read, probe, decode, sample, resize,
  patchify to uint8 rows (what the cache stores; normalisation happens later, on the device).
* **decode floor**: a bare PyAV loop over the same file, converting to RGB exactly the frames the
  sampler keeps (``rgb24``). No program that decodes with PyAV can turn the clip into patches
  faster than this.
* **HF**: transformers' ``load_video(backend="pyav")`` with ``Qwen3VLVideoProcessor.sample_frames``,
  then ``Qwen3VLVideoProcessor`` (torchvision backend) to float32 ``pixel_values_videos``; its
  output is checked equal to ours normalised (``normalize_video_patches``), and the row *ours ->
  float32* adds that normalisation to ours so the two are like for like. HF's video processor
  needs torchvision; where it does not import the row says why (n/a).

Each path is reported twice: frames per second of wall time, and per CPU-second of this process
(steadier on a shared host, where the wall time also counts waiting for a core).

**Where the time goes** (each clip set, interleaved, CPU time): probe (container open, frame
count), decode (the sampled frames, RGB), resize (torch bicubic antialiased, uint8), patchify
(numpy reshape/transpose), each timed alone on the previous step's output. Decoding is most of it
on the large clip; on the small fixture clips (upscaled to the pixel budget's minimum) resize
counts too. (This profile found patchify rewriting a video with an odd sampled frame count into
the other memory layout while padding it: 2.7 ms of ~13 ms for such a fixture clip;
``vl.video.patchify_video`` now pads by indexing, which keeps the layout: 0.4 ms.)

Options (``--set key=value``): ``seconds`` (length of the generated clip, default 10; quick 2),
``fps`` (its frame rate, default 30).

    python -m benchmarks vl_video [--repeats 5] [--quick] [--set seconds=10]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import REPO, BenchArgs, Row, compare, interleave, row_from

FIXTURES = REPO / "tests" / "fixtures" / "video"


def synth_clip(path: Path, width: int, height: int, fps: int, seconds: float) -> Path:
    """A moving gradient with a square and light noise, encoded with PyAV's libx264 (the kind of
    content tests/fixtures/video holds, at a realistic size)."""
    import av

    n = int(round(fps * seconds))
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    with av.open(str(path), "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=Fraction(fps))
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = {"crf": "28", "preset": "veryfast", "threads": "1"}
        for t in range(n):
            r = 127 + 120 * np.sin((x + 3 * t) / width * 6.28)
            g = 127 + 120 * np.cos((y - 2 * t) / height * 6.28)
            b = (x + y + 5 * t) % 256
            f = np.stack([r, g, b], -1) + rng.normal(0, 1.5, (height, width, 3))
            q = (4 * t) % (width - 40)
            f[height // 3 : height // 3 + 40, q : q + 40] = (250, 240, 30)
            frame = av.VideoFrame.from_ndarray(np.clip(f, 0, 255).astype(np.uint8), "rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def decode_floor(path: Path, options: Any) -> int:
    """Bare PyAV: decode up to the last sampled frame, convert the sampled ones to rgb24.
    Returns the frames kept."""
    import av

    from torchtitan_ext.vl.video import sample_indices

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        wanted = set(sample_indices(int(s.frames), float(s.average_rate), options).tolist())
        last, kept = max(wanted), 0
        for i, frame in enumerate(c.decode(s)):
            if i in wanted:
                frame.to_ndarray(format="rgb24")
                kept += 1
            if i >= last:
                break
    return kept


def hf_video_processor() -> tuple[Any, str | None]:
    """(HF Qwen3VLVideoProcessor, None), or (None, why it cannot run here)."""
    try:
        import torchvision  # noqa: F401
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLVideoProcessor(cap_pixels_per_frame=False), None  # 5.23's default
    except Exception as e:  # not installed, or installed but not importable beside this torch
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None, (
            f"n/a: HF's Qwen3VLVideoProcessor needs torchvision, which does not import here "
            f"({why}). PyPI's torchvision build for torch 2.13.0 links libtorch_cuda.so, so it "
            "does not import beside the CPU-only torch wheel; run this case where torchvision "
            "imports to get the row"
        )


def hf_process(vp: Any, path: Path) -> dict[str, Any]:
    """HF's path from a file: its PyAV reader with its sampler, then its video processor."""
    from transformers.video_utils import load_video

    video, md = load_video(str(path), backend="pyav", sample_indices_fn=vp.sample_frames)
    return vp(videos=[video], video_metadata=[md], do_sample_frames=False, return_tensors="pt")


def _clip_rows(label: str, paths: list[Path], args: BenchArgs, vp, why_not) -> list[Row]:
    from torchtitan_ext.vl.video import VideoOptions, VideoProcessor, normalize_video_patches

    o = VideoOptions()
    proc = VideoProcessor(o)
    outs = [proc(p) for p in paths]
    frames = sum(v.total_frames for v in outs)
    sampled = sum(len(v.frame_indices) for v in outs)
    equal = None
    if vp is not None:  # like for like first: HF's float32 equals ours normalised
        equal = all(
            torch.equal(
                hf_process(vp, p)["pixel_values_videos"], normalize_video_patches(v.patches)
            )
            for p, v in zip(paths, outs, strict=True)
        )
    fns = {
        "ours": cpu_timed(lambda: [proc(p) for p in paths]),
        "floor": cpu_timed(lambda: [decode_floor(p, o) for p in paths]),
        "ours_f32": cpu_timed(lambda: [normalize_video_patches(proc(p).patches) for p in paths]),
    }
    if vp is not None:
        fns["hf"] = cpu_timed(lambda: [hf_process(vp, p) for p in paths])
    t = interleave(fns, args.repeats, args.warmup, args.guard())
    info = {
        "clips": len(paths),
        "source_frames": frames,
        "sampled_frames": sampled,
        "grids": [list(v.grid_thw) for v in outs],
    }

    def fps_row(case: str, key: str, cpu: bool, **kw) -> Row:
        s = t[key]
        secs = s.values("cpu") if cpu else s.samples
        xs = [frames / x for x in secs]
        r = row_from(case, s, "frames/s", group=label, higher_is_better=True, info=info, **kw)
        r.samples, r.value = xs, float(np.median(xs))
        return r

    rows: list[Row] = []
    for cpu in (False, True):
        tag = f"{label}, per CPU-second" if cpu else label
        ours = fps_row(f"ours: decode + process to uint8 [{tag}]", "ours", cpu)
        floor = fps_row(
            f"decode floor: PyAV decode of the sampled frames [{tag}]",
            "floor",
            cpu,
            note="decode only: no resize, no patches",
        )
        f32 = fps_row(f"ours -> float32 [{tag}]", "ours_f32", cpu)
        hf_case = f"HF Qwen3VLVideoProcessor (PyAV reader), float32 [{tag}]"
        rows += [ours, floor, f32]
        compare(rows, ours.case, floor.case)
        if vp is not None:
            ok = (
                "output equal to ours -> float32"
                if equal
                else "OUTPUT DIFFERS from ours -> float32"
            )
            rows.append(fps_row(hf_case, "hf", cpu, note=ok))
            compare(rows, f32.case, hf_case)
            f32.info = {**info, "equal_to_hf": equal}
        else:
            rows.append(Row(hf_case, float("nan"), "frames/s", note=why_not))
    return rows


def cpu_timed(fn: Callable[[], Any]) -> Callable[[], dict[str, float]]:
    """``fn`` for :func:`interleave`, returning its process CPU seconds (the sample stays the
    wall time): on a shared host the CPU time is the steadier figure."""

    def go() -> dict[str, float]:
        c0 = time.process_time()
        fn()
        return {"cpu": time.process_time() - c0}

    return go


@dataclass
class _Clip:
    """One clip's inputs to each step of VideoProcessor (each step's output feeds the next)."""

    data: bytes
    name: str
    indices: np.ndarray
    total: int
    frames: np.ndarray
    size: tuple[int, int]
    resized: np.ndarray


def _clip_inputs(path: Path, o: Any) -> _Clip:
    from torchtitan_ext.vl import video as V
    from torchtitan_ext.vl import video_decode as D

    data = path.read_bytes()
    fps, total = D._probe(data, path.name)
    idx = V.sample_indices(total, fps, o)
    frames, _ = D._decode_sampled(data, path.name, idx, total)
    size = V.target_size(len(frames), frames.shape[1], frames.shape[2], o)
    return _Clip(data, path.name, idx, total, frames, size, V.resize_frames(frames, *size))


def _profile_rows(label: str, paths: list[Path], args: BenchArgs) -> list[Row]:
    """Each step of VideoProcessor over the clips, timed alone on its input (CPU time)."""
    from torchtitan_ext.vl import video as V
    from torchtitan_ext.vl import video_decode as D

    o = V.VideoOptions()
    clips = [_clip_inputs(p, o) for p in paths]
    steps = {
        "probe (open, frame count)": lambda: [D._probe(c.data, c.name) for c in clips],
        "decode (sampled frames, rgb24)": lambda: [
            D._decode_sampled(c.data, c.name, c.indices, c.total) for c in clips
        ],
        "resize (torch bicubic antialias, uint8)": lambda: [
            V.resize_frames(c.frames, *c.size) for c in clips
        ],
        "patchify (numpy transpose)": lambda: [V.patchify_video(c.resized, o) for c in clips],
    }
    t = interleave({k: cpu_timed(f) for k, f in steps.items()}, args.repeats, args.warmup,
                   args.guard())  # fmt: skip
    med = {k: float(np.median(s.values("cpu"))) for k, s in t.items()}
    whole = sum(med.values())
    info = {
        "clips": [
            f"{len(c.frames)} of {c.total} frames sampled, {c.frames.shape[2]}x"
            f"{c.frames.shape[1]} -> {c.size[1]}x{c.size[0]}"
            for c in clips
        ]
    }
    return [
        row_from(
            f"step: {k} [{label}]",
            t[k],
            "ms CPU",
            1e3,
            key="cpu",
            group=f"steps {label}",
            info=info,
            note=f"{100 * med[k] / whole:.0f}% of the steps' sum",
        )
        for k in steps
    ]


def run(args: BenchArgs) -> list[Row]:
    tmp = Path(tempfile.mkdtemp(prefix="bench_vl_video_"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a cache-build worker (vl.build sets it)
    try:
        w, h = (320, 180) if args.quick else (640, 360)
        seconds = float(args.extra.get("seconds", 2 if args.quick else 10))
        fps = int(args.extra.get("fps", 30))
        big = synth_clip(tmp / f"synth_{w}x{h}_{fps}fps.mp4", w, h, fps, seconds)
        vp, why_not = hf_video_processor()
        fixtures = sorted(FIXTURES.glob("*.mp4"))
        rows = _clip_rows("fixture clips", fixtures, args, vp, why_not)
        big_label = f"{w}x{h} {seconds:g} s {fps} fps"
        rows += _clip_rows(big_label, [big], args, vp, why_not)
        rows += _profile_rows("fixture clips", fixtures, args)
        rows += _profile_rows(big_label, [big], args)
        return rows
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
