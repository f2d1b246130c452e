"""Videos for Qwen3-VL: decode, sample frames, resize, uint8 patchify; normalise later.

Reproduces transformers 5.23's ``Qwen3VLVideoProcessor`` and the ``Qwen3VLProcessor`` prompt
(``models/qwen3_vl/video_processing_qwen3_vl.py``, ``processing_qwen3_vl.py``) without
torchvision (which does not import beside this project's CPU torch):

| step | function | what HF does, and what we do |
|---|---|---|
| decode | :func:`read_video` | PyAV, every frame ``to_ndarray("rgb24")`` (HF's ``read_video_pyav``); frames that are not sampled are decoded but not converted |
| sample | :func:`sample_indices` | ``n = int(total / video_fps * fps)`` clamped to ``[min_frames, max_frames]`` and to ``total``; ``linspace(0, total - 1, n).round()`` (numpy: halves to even) |
| size | :func:`target_size` | the video ``smart_resize`` over the *sampled* frame count (before padding), factor ``patch_size * merge_size``, budget ``min_pixels..max_pixels`` (optionally qwen-vl-utils' per-frame cap) |
| resize | :func:`resize_frames` | ``torch.nn.functional.interpolate(uint8 NCHW, bicubic, antialias=True, align_corners=False)``: the call torchvision's ``resize`` makes for uint8 on CPU |
| pad | :func:`patchify_video` | repeat the last frame up to a multiple of ``temporal_patch_size`` |
| patchify | :func:`patchify_video` | one numpy reshape/transpose into HF's row order |
| normalise | :func:`normalize_video_patches` | HF's fused torchvision arithmetic, float32 ``(x - mean*255) / (std*255)`` |
| prompt | :func:`frame_timestamps`, :func:`video_placeholder` | ``<{t:.1f} seconds>`` + vision start + pads + vision end per merged frame |

**Row layout.** A patch row is uint8 ``[C * T * P * P]`` = ``3 * 2 * 16 * 16`` = 1536 values in
HF's ``(channel, time, row, column)`` order: both temporal frames are real frames, so unlike an
image row (768 values, the temporal copy added at normalisation) nothing is dropped. Rows are in
HF's order too: merged frame, then merge block (row, column), then the ``merge_size²`` patches of
the block. ``normalize_video_patches(rows)`` equals HF's ``pixel_values_videos`` bit for bit
(tests/test_vl_video.py, against fixtures made by scripts/make_video_fixtures.py). Video rows use
this function, not ``images.normalize_patches``: HF normalises videos with other float32
arithmetic than images (``(x - 127.5) / 127.5`` against ``(x / 255 - 0.5) / 0.5``), which can
differ in the last bit.

**Frame count.** The container's frame count (``stream.frames``, as HF reads it) when it has one,
else the count of the stream's packets (no decoding). A file that then decodes fewer frames than
a sampled index needs is ``truncated_video`` (HF would silently return fewer frames).

Bad input raises :class:`~torchtitan_ext.vl.errors.SampleError` naming the source, with reason
``missing_video``, ``corrupt_video``, ``truncated_video``, ``no_video_stream``, ``empty_video``,
``too_few_frames``
(HF refuses fewer than ``temporal_patch_size`` sampled frames), ``bad_frames``,
``bad_aspect_ratio``, ``variable_frame_rate`` (a sampled frame more than half a sampling interval
from the time the prompt gives it: :func:`check_frame_times`) or ``decode_error``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.vl.errors import SampleError


@dataclass(frozen=True)
class VideoOptions:
    """Everything that changes a video's bytes. Defaults: transformers 5.23's
    ``Qwen3VLVideoProcessor`` class defaults, which is what the offline processor (it has no
    ``video_preprocessor_config.json``) gets; a checkpoint's file: :meth:`from_config`."""

    fps: float = 2.0
    """Frames sampled per second of video."""
    min_frames: int = 4
    """Sample at least this many frames (a video with fewer frames gives all it has)."""
    max_frames: int = 768
    """Sample at most this many frames."""
    min_pixels: int = 128 * 32 * 32
    """``size.shortest_edge``: the sampled frames together get at least this many pixels."""
    max_pixels: int = 32 * 32 * 768
    """``size.longest_edge``: the sampled frames together get at most this many pixels."""
    cap_pixels_per_frame: bool = False
    """qwen-vl-utils' per-frame cap (HF's ``cap_pixels_per_frame``; off in transformers 5.23)."""
    max_video_tokens: int = 768
    """Per-frame token ceiling of the cap."""
    patch_size: int = 16
    """Vision patch side in pixels (the model's)."""
    temporal_patch_size: int = 2
    """Frames per patch (the model's)."""
    merge_size: int = 2
    """Patches merged per side into one LLM token (the model's)."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VideoOptions:
        """From a ``video_preprocessor_config.json`` dict; keys it lacks keep the defaults."""
        if config.get("num_frames") is not None or config.get("do_sample_frames") is False:
            raise ValueError(
                "video_preprocessor_config: only fps-based frame sampling is supported "
                f"(num_frames={config.get('num_frames')}, "
                f"do_sample_frames={config.get('do_sample_frames')})"
            )
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in config.items() if k in names and v is not None}
        size = config.get("size") or {}
        if "shortest_edge" in size:
            kw["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            kw["max_pixels"] = size["longest_edge"]
        return cls(**kw)


# ---------------------------------------------------------------- pure functions


def sample_indices(total_frames: int, video_fps: float, o: VideoOptions) -> np.ndarray:
    """Indices of the frames to keep (int64, increasing): ``Qwen3VLVideoProcessor.sample_frames``."""
    n = int(total_frames / video_fps * o.fps)
    n = min(max(n, o.min_frames), o.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(np.int64)


def frame_timestamps(indices: Sequence[int], video_fps: float, temporal_patch_size: int = 2):
    """Seconds per merged frame: the mean of its first and last frame's time, the index list
    padded with its last index (``Qwen3VLProcessor._calculate_timestamps``)."""
    idx = [int(i) for i in indices]
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    t = [i / video_fps for i in idx]
    step = temporal_patch_size
    return [(t[i] + t[i + step - 1]) / 2 for i in range(0, len(t), step)]


def video_placeholder(
    timestamps: Sequence[float],
    tokens_per_frame: int,
    video_token: str = "<|video_pad|>",
    vision_start: str = "<|vision_start|>",
    vision_end: str = "<|vision_end|>",
) -> str:
    """The text that replaces the chat template's one ``<|video_pad|>`` of a video
    (``Qwen3VLProcessor.replace_video_token``): per merged frame ``<{t:.1f} seconds>``, then
    vision start, ``tokens_per_frame`` video tokens, vision end. The template's own vision
    start/end around the video stay, as in HF."""
    one = video_token * tokens_per_frame
    return "".join(f"<{t:.1f} seconds>{vision_start}{one}{vision_end}" for t in timestamps)


def max_pixels_for(num_frames: int, o: VideoOptions) -> int:
    """The pixel budget of ``num_frames`` sampled frames (HF ``Qwen3VLVideoProcessor.resize``)."""
    if not o.cap_pixels_per_frame:
        return o.max_pixels
    factor = o.patch_size * o.merge_size
    frame_cap = o.max_video_tokens * factor * factor
    per_frame = max(min(frame_cap, o.max_pixels // num_frames), int(o.min_pixels * 1.05))
    return per_frame * num_frames


def target_size(num_frames: int, height: int, width: int, o: VideoOptions) -> tuple[int, int]:
    """(height, width) of the resized frames: the Qwen3-VL video ``smart_resize``."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    if num_frames < o.temporal_patch_size:
        raise SampleError(
            "too_few_frames",
            f"{num_frames} frame(s) sampled, the model needs at least {o.temporal_patch_size}",
        )
    try:
        return smart_resize(
            num_frames,
            height,
            width,
            temporal_factor=o.temporal_patch_size,
            factor=o.patch_size * o.merge_size,
            min_pixels=o.min_pixels,
            max_pixels=max_pixels_for(num_frames, o),
        )
    except ValueError as e:  # aspect ratio > 200
        raise SampleError("bad_aspect_ratio", f"{width}x{height}: {e}") from None


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, 3] -> uint8 [T, height, width, 3], as HF's torchvision backend resizes
    (uint8 bicubic with antialiasing on CPU, NCHW contiguous input); unchanged when same size."""
    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    y = torch.nn.functional.interpolate(
        x, size=[height, width], mode="bicubic", align_corners=False, antialias=True
    )
    return y.permute(0, 2, 3, 1).numpy()


def patchify_video(frames: np.ndarray, o: VideoOptions) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Resized uint8 [T, H, W, C] -> (uint8 [gt*gh*gw, C*tp*ps*ps], grid (gt, gh, gw)).

    The last frame is repeated up to a multiple of ``temporal_patch_size``. Row order and row
    layout are HF's (module docstring). The padding indexes the frames, which keeps their memory
    layout (:func:`resize_frames` returns torch's NCHW memory as an NHWC view): ``np.concatenate``
    with a repeated frame rewrote them as NHWC first (patchify 1.7-2.7 ms instead of 0.3-0.4 ms
    for five 160x224 frames)."""
    if pad := -len(frames) % o.temporal_patch_size:
        frames = frames[np.r_[0 : len(frames), [len(frames) - 1] * pad]]
    t, h, w, c = frames.shape
    ps, m, tp = o.patch_size, o.merge_size, o.temporal_patch_size
    gt, gh, gw = t // tp, h // ps, w // ps
    a = frames.reshape(gt, tp, gh // m, m, ps, gw // m, m, ps, c)
    # -> (gt, gh/m, gw/m, m_h, m_w, C, tp, ps_h, ps_w): HF's permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    a = a.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(a).reshape(gt * gh * gw, c * tp * ps * ps), (gt, gh, gw)


def normalize_video_patches(
    u8: torch.Tensor | np.ndarray,
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    rescale_factor: float = 1 / 255,
) -> torch.Tensor:
    """uint8 video rows [N, C*T*P*P] -> float32 equal to HF's ``pixel_values_videos``.

    HF's torchvision backend fuses rescale into normalise: ``mean * (1 / rescale_factor)`` and
    ``std * (1 / rescale_factor)`` as float32 tensors, then ``(float32(x) - mean) / std``. The
    same torch ops here, so the floats are HF's bit for bit (tested). Runs on the input's device.
    """
    x = torch.as_tensor(u8)
    if x.dtype != torch.uint8 or x.dim() != 2 or x.shape[1] % len(mean):
        raise ValueError(
            f"normalize_video_patches expects uint8 [N, C*T*P*P], got {x.dtype} {tuple(x.shape)}"
        )
    c = len(mean)
    m = (torch.tensor(list(mean), device=x.device) * (1.0 / rescale_factor)).view(1, c, 1)
    s = (torch.tensor(list(std), device=x.device) * (1.0 / rescale_factor)).view(1, c, 1)
    f = x.to(torch.float32).view(x.shape[0], c, -1)
    return ((f - m) / s).view(x.shape)


@dataclass(frozen=True)
class VideoPatches:
    """One processed video."""

    patches: np.ndarray
    """uint8 [gt*gh*gw, C*T*P*P] (normalise with :func:`normalize_video_patches`)."""
    grid_thw: tuple[int, int, int]
    """HF's ``video_grid_thw`` row: merged frames, patch rows, patch columns."""
    frame_indices: tuple[int, ...]
    """The sampled frames' indices in the source (before temporal padding)."""
    timestamps: tuple[float, ...]
    """Seconds per merged frame (``grid_thw[0]`` of them), as the prompt writes them."""
    video_fps: float
    """The source's frame rate."""
    total_frames: int
    """The source's frame count."""
    merge_size: int = 2

    @property
    def tokens_per_frame(self) -> int:
        """LLM tokens per merged frame."""
        return self.grid_thw[1] * self.grid_thw[2] // self.merge_size**2

    def placeholder(self) -> str:
        """The prompt text for this video (:func:`video_placeholder`)."""
        return video_placeholder(self.timestamps, self.tokens_per_frame)


def frames_to_patches(
    frames: np.ndarray, indices: np.ndarray, video_fps: float, total: int, o: VideoOptions
) -> VideoPatches:
    """Sampled uint8 [n, H, W, 3] frames -> :class:`VideoPatches` (resize, pad, patchify)."""
    rh, rw = target_size(len(frames), frames.shape[1], frames.shape[2], o)
    patches, grid = patchify_video(resize_frames(frames, rh, rw), o)
    return VideoPatches(
        patches=patches,
        grid_thw=grid,
        frame_indices=tuple(int(i) for i in indices),
        timestamps=tuple(frame_timestamps(indices, video_fps, o.temporal_patch_size)),
        video_fps=float(video_fps),
        total_frames=int(total),
        merge_size=o.merge_size,
    )


# ---------------------------------------------------------------- decoding (PyAV)

VideoSource = str | os.PathLike | bytes | bytearray | memoryview | dict


def read_video(
    src: VideoSource, o: VideoOptions, root: str | Path | None = None
) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Decode a video file (path, bytes, or ``{"bytes", "path"}`` cell) and keep the sampled
    frames: (uint8 [n, H, W, 3], indices, video fps, total frames). A relative path is read
    relative to ``root``. Every failure is a :class:`SampleError` naming the source."""
    data, name = _source_bytes(src, root)
    with _av_step(name):
        fps, total = _probe(data, name)
        indices = sample_indices(total, fps, o)
        frames, times = _decode_sampled(data, name, indices, total)
    check_frame_times(times, indices, fps, o, name)
    return frames, indices, fps, total


def check_frame_times(
    times: Sequence[float | None], indices: Sequence[int], fps: float, o: VideoOptions, name: str
) -> None:
    """Refuse a video whose sampled frames are not where the prompt says they are.

    The prompt (HF's ``_calculate_timestamps``) dates frame ``i`` at ``i / fps``, ``fps`` being the
    container's average rate: right for a constant frame rate, wrong for a variable one (a
    recording that pauses or changes rate). ``times`` are the sampled frames' presentation times,
    in seconds from the first frame (None: the frame has none). A frame more than half a sampling
    interval (``0.5 / o.fps``: 0.25 s at 2 fps) from its stated time is ``variable_frame_rate``;
    jitter below that (a phone's) passes, and the sample is then HF's, byte for byte."""
    tol = 0.5 / o.fps
    for i, t in zip(indices, times, strict=True):
        if t is not None and abs(t - int(i) / fps) > tol:
            raise SampleError(
                "variable_frame_rate",
                f"{name}: frame {int(i)} is shown at {t:.2f} s but the prompt would date it "
                f"{int(i) / fps:.2f} s (frame count / average rate {fps:.3g}): a variable frame "
                f"rate (tolerance {tol:.2f} s); re-encode at a constant rate",
            )


def _probe(data: bytes, name: str) -> tuple[float, int]:
    """(frame rate, frame count) of the first video stream: the container's count (HF reads
    the same) or, when it has none, the stream's packets counted without decoding."""
    import av

    with av.open(io.BytesIO(data), mode="r") as c:
        if not c.streams.video:
            raise SampleError("no_video_stream", f"{name}: no video stream")
        s = c.streams.video[0]
        rate = s.average_rate or s.guessed_rate
        total = int(s.frames) or sum(1 for p in c.demux(s) if p.size)
    if total == 0:
        raise SampleError("empty_video", f"{name}: no frames")
    if not rate:
        raise SampleError("corrupt_video", f"{name}: no frame rate")
    return float(rate), total


def _decode_sampled(
    data: bytes, name: str, indices: np.ndarray, total: int
) -> tuple[np.ndarray, list[float | None]]:
    """Decode frames 0..indices[-1] in order; convert only the sampled ones to RGB (``rgb24``,
    as HF's ``read_video_pyav``), and note their presentation times (seconds from frame 0).
    Decoding stops at a packet the demuxer flags corrupt (a file cut inside a frame): that is
    ``truncated_video`` when no packet follows, else ``corrupt_video``; a stream that ends
    before the last sampled frame is ``truncated_video``."""
    import av

    wanted = {int(i): k for k, i in enumerate(indices)}
    kept: list[np.ndarray | None] = [None] * len(indices)
    times: list[float | None] = [None] * len(indices)
    last, seen, damaged, t0 = int(indices[-1]), 0, None, None
    with av.open(io.BytesIO(data), mode="r") as c:
        s = c.streams.video[0]
        packets = c.demux(s)
        for packet in packets:
            if packet.is_corrupt:
                rest = sum(1 for p in packets if p.size)
                damaged = "truncated_video" if rest == 0 else "corrupt_video"
                break
            for frame in packet.decode():
                if seen == 0:
                    t0 = frame.time
                if seen in wanted:
                    kept[wanted[seen]] = frame.to_ndarray(format="rgb24")
                    if frame.time is not None and t0 is not None:
                        times[wanted[seen]] = frame.time - t0
                seen += 1
            if seen > last:
                break
    if seen <= last:
        raise SampleError(
            damaged or "truncated_video",
            f"{name}: decoded {seen} of {total} frames, frame {last} needed"
            + (" (the data ends inside a frame)" if damaged == "truncated_video" else "")
            + (" (a damaged packet)" if damaged == "corrupt_video" else ""),
        )
    return np.stack(kept), times


def _source_bytes(src: Any, root: str | Path | None) -> tuple[bytes, str]:
    """(the file's bytes, a name for messages)."""
    if isinstance(src, dict):
        src = src.get("bytes") if src.get("bytes") is not None else src.get("path")
    if isinstance(src, (str, os.PathLike)) and str(src):
        p = Path(src)
        full = p if p.is_absolute() or root is None else Path(root) / p
        try:
            return full.read_bytes(), str(full)
        except OSError as e:
            raise SampleError("missing_video", f"cannot read {full}: {e.strerror or e}") from None
    if isinstance(src, (bytes, bytearray, memoryview)) and len(src):
        return bytes(src), f"<{len(src)} bytes of video>"
    raise SampleError("missing_video", f"no video bytes or path ({type(src).__name__})")


@contextmanager
def _av_step(name: str):
    """PyAV's failures become this video's SampleError: ``corrupt_video`` for FFmpeg's errors
    (invalid or unreadable data), ``decode_error`` with the class for anything else."""
    import av

    try:
        yield
    except SampleError:
        raise
    except av.error.FFmpegError as e:  # InvalidDataError, EOFError, ...
        raise SampleError("corrupt_video", f"{name}: {e.strerror}") from None
    except Exception as e:  # a codec's unforeseen failure is still this video's, not the build's
        msg = " ".join(str(e).split())
        raise SampleError(
            "decode_error", f"{name}: {type(e).__name__}: {msg}", type(e).__name__
        ) from None


def stack_frames(frames: Sequence[Any]) -> np.ndarray:
    """A list of frame images (PIL, any mode; or uint8 [H, W, 3] arrays) or a uint8
    [T, H, W, 3] array -> uint8 [T, H, W, 3]. PIL frames are made RGB as images are."""
    from PIL import Image

    from torchtitan_ext.vl.images import to_rgb

    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        arrs = list(frames)
    else:
        arrs = [np.asarray(to_rgb(f)) if isinstance(f, Image.Image) else f for f in frames]
    if not arrs:
        raise SampleError("empty_video", "frame list: no frames")
    for k, a in enumerate(arrs):
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
            what = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise SampleError("bad_frames", f"frame list: frame {k} is {what}, not uint8 [H, W, 3]")
        if a.shape != arrs[0].shape:
            raise SampleError(
                "bad_frames", f"frame list: frame {k} is {a.shape}, frame 0 is {arrs[0].shape}"
            )
    return np.stack(arrs)


# ---------------------------------------------------------------- the thin class


class VideoProcessor:
    """Videos -> :class:`VideoPatches` with one :class:`VideoOptions`.

    ``processor(path_or_bytes)`` decodes a file; ``processor.from_frames(frames, fps)`` takes
    the frames of a video (all of them, at ``fps`` frames per second): both sample the same way.
    """

    def __init__(self, options: VideoOptions | None = None):
        self.options = options or VideoOptions()

    def __call__(self, src: VideoSource, root: str | Path | None = None) -> VideoPatches:
        frames, indices, fps, total = read_video(src, self.options, root)
        return frames_to_patches(frames, indices, fps, total, self.options)

    def from_frames(self, frames: Sequence[Any] | np.ndarray, fps: float) -> VideoPatches:
        if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
            raise SampleError(
                "bad_frames", f"frame list: fps must be a positive number, got {fps!r}"
            )
        video = stack_frames(frames)
        indices = sample_indices(len(video), float(fps), self.options)
        return frames_to_patches(video[indices], indices, float(fps), len(video), self.options)
