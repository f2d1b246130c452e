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

Decoding and frame sampling (:func:`read_video`, :func:`sample_indices`,
:func:`check_frame_times`, :func:`stack_frames`, the frame count) are ``vl/video_decode.py``'s
job; those names are importable from here too.

Bad input raises :class:`~torchtitan_ext.vl.errors.SampleError` naming the source, with reason
``missing_video``, ``corrupt_video``, ``truncated_video``, ``no_video_stream``, ``empty_video``,
``too_few_frames``
(HF refuses fewer than ``temporal_patch_size`` sampled frames), ``bad_frames``,
``bad_aspect_ratio``, ``variable_frame_rate`` (a sampled frame more than half a sampling interval
from the time the prompt gives it: :func:`check_frame_times`) or ``decode_error``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.video_decode import VideoSource, read_video, sample_indices, stack_frames
from torchtitan_ext.vl.video_decode import check_frame_times as check_frame_times


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


class FitFrames:
    """Resize each sampled frame as it is decoded (``read_video``'s ``fit``): the target size is
    the video's (:func:`target_size` of ``num_frames`` and the first frame's size), and torch's
    resize of one frame gives the bytes it gives that frame within the whole stack (it resizes
    each image of a batch alone; tests/test_vl_video.py compares with HF's processor). A frame
    whose size differs from the first one's is ``corrupt_video`` (HF cannot stack it either)."""

    def __init__(self, num_frames: int, o: VideoOptions) -> None:
        self.num_frames, self.o = num_frames, o
        self.source: tuple[int, int] | None = None
        self.size: tuple[int, int] | None = None

    def __call__(self, frame: np.ndarray) -> np.ndarray:
        hw = (int(frame.shape[0]), int(frame.shape[1]))
        if self.size is None:
            self.source, self.size = hw, target_size(self.num_frames, *hw, self.o)
        elif hw != self.source:
            raise SampleError(
                "corrupt_video",
                f"the frame size changes within the video ({self.source[1]}x{self.source[0]} "
                f"then {hw[1]}x{hw[0]})",
            )
        return resize_frames(frame[None], *self.size)[0]


def frames_to_patches(
    frames: np.ndarray,
    indices: np.ndarray,
    video_fps: float,
    total: int,
    o: VideoOptions,
    size: tuple[int, int] | None = None,
) -> VideoPatches:
    """Sampled uint8 [n, H, W, 3] frames -> :class:`VideoPatches` (resize, pad, patchify).
    ``size``: the frames are already resized to it (:class:`FitFrames`)."""
    rh, rw = size or target_size(len(frames), frames.shape[1], frames.shape[2], o)
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


# ---------------------------------------------------------------- the thin class


class VideoProcessor:
    """Videos -> :class:`VideoPatches` with one :class:`VideoOptions`.

    ``processor(path_or_bytes)`` decodes a file; ``processor.from_frames(frames, fps)`` takes
    the frames of a video (all of them, at ``fps`` frames per second): both sample the same way.
    """

    def __init__(self, options: VideoOptions | None = None):
        self.options = options or VideoOptions()

    def __call__(self, src: VideoSource, root: str | Path | None = None) -> VideoPatches:
        o = self.options
        frames, indices, fps, total = read_video(src, o, root, lambda n: FitFrames(n, o))
        # each frame was resized as decoded: the stack is at the target size already
        size = (int(frames.shape[1]), int(frames.shape[2]))
        return frames_to_patches(frames, indices, fps, total, o, size)

    def from_frames(self, frames: Sequence[Any] | np.ndarray, fps: float) -> VideoPatches:
        if not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
            raise SampleError(
                "bad_frames", f"frame list: fps must be a positive number, got {fps!r}"
            )
        video = stack_frames(frames)
        indices = sample_indices(len(video), float(fps), self.options)
        return frames_to_patches(video[indices], indices, float(fps), len(video), self.options)
