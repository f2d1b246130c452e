"""Videos for Qwen3-VL, in: decode a file (PyAV) or take a list of frames, and sample the frames
to keep, as transformers 5.23's ``Qwen3VLVideoProcessor`` does (``vl/video.py`` resizes, patchifies
and normalises them, and has the step table).

**Frame count.** The container's frame count (``stream.frames``, as HF reads it) when it has one,
else the count of the stream's packets (no decoding); packets that end well before the duration the
container states are ``truncated_video`` (a cut WebM would otherwise be sampled as a shorter
video). A file that then decodes fewer frames than a sampled index needs is ``truncated_video``
(HF would silently return fewer frames).

Every failure is a :class:`~torchtitan_ext.vl.errors.SampleError` naming the source (reasons:
``vl/video.py``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from torchtitan_ext.vl.errors import SampleError

if TYPE_CHECKING:
    from torchtitan_ext.vl.video import VideoOptions


def sample_indices(total_frames: int, video_fps: float, o: VideoOptions) -> np.ndarray:
    """Indices of the frames to keep (int64, increasing): ``Qwen3VLVideoProcessor.sample_frames``."""
    n = int(total_frames / video_fps * o.fps)
    n = min(max(n, o.min_frames), o.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(np.int64)


# ---------------------------------------------------------------- decoding (PyAV)

VideoSource = str | os.PathLike | bytes | bytearray | memoryview | dict


FrameFit = Callable[[np.ndarray], np.ndarray]
"""What happens to each sampled frame (uint8 [H, W, 3]) as soon as it is decoded."""


def read_video(
    src: VideoSource,
    o: VideoOptions,
    root: str | Path | None = None,
    fit: Callable[[int], FrameFit] | None = None,
) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Decode a video file (path, bytes, or ``{"bytes", "path"}`` cell) and keep the sampled
    frames: (uint8 [n, H, W, 3], indices, video fps, total frames). A relative path is read
    relative to ``root``. Every failure is a :class:`SampleError` naming the source.

    ``fit(n)`` (``n`` sampled frames) gives the function applied to each sampled frame as it is
    decoded, e.g. the resize (``vl/video.py``): then only the fitted frames are kept, never all
    ``n`` at full resolution (a 10-minute 1080p clip samples 768 frames: 4.8 GB at full size)."""
    data, name = _source_bytes(src, root)
    with _av_step(name):
        fps, total = _probe(data, name)
        indices = sample_indices(total, fps, o)
        shrink = fit(len(indices)) if fit is not None else None
        frames, times = _decode_sampled(data, name, indices, total, shrink)
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
    the same) or, when it has none, the stream's packets counted without decoding
    (:func:`_count_packets`, which refuses a cut file)."""
    import av

    with av.open(io.BytesIO(data), mode="r") as c:
        if not c.streams.video:
            raise SampleError("no_video_stream", f"{name}: no video stream")
        s = c.streams.video[0]
        rate = s.average_rate or s.guessed_rate
        total = int(s.frames) or _count_packets(c, s, name, float(rate or 0))
    if total == 0:
        raise SampleError("empty_video", f"{name}: no frames")
    if not rate:
        raise SampleError("corrupt_video", f"{name}: no frame rate")
    return float(rate), total


def _declared_seconds(container: Any, stream: Any) -> float | None:
    """How long the container says the video stream lasts, where it says so reliably: the
    stream's own duration, else its Matroska/WebM ``DURATION`` tag (``HH:MM:SS.nnnnnnnnn``),
    else the container's duration when the video is its only stream (with audio, the container
    may rightly outlast the video). None: not stated."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    tag = stream.metadata.get("DURATION") or stream.metadata.get("duration")
    if tag:
        try:
            h, m, sec = str(tag).split(":")
            return int(h) * 3600 + int(m) * 60 + float(sec)
        except ValueError:
            pass
    if container.duration and len(container.streams) == 1:
        return container.duration / 1_000_000
    return None


def _count_packets(container: Any, stream: Any, name: str, rate: float) -> int:
    """The frame count of a container that states none (Matroska, WebM, MPEG-TS): the stream's
    packets. A file cut short has fewer packets than its frames, and would be sampled as a
    shorter video with nothing said; so where the container states the stream's duration
    (:func:`_declared_seconds`), packets that end more than a frame and a half before it are
    ``truncated_video``."""
    declared = _declared_seconds(container, stream)
    n, first, end = 0, None, None
    for p in container.demux(stream):
        if not p.size:
            continue
        n += 1
        pts = p.pts if p.pts is not None else p.dts
        if pts is not None and p.time_base:
            t0, t1 = float(pts * p.time_base), float((pts + (p.duration or 0)) * p.time_base)
            first = t0 if first is None else min(first, t0)
            end = t1 if end is None else max(end, t1)
    if declared is None or not rate:
        return n
    shown = 0.0 if end is None else end - (first or 0.0)
    if declared - shown > 1.5 / rate:
        raise SampleError(
            "truncated_video",
            f"{name}: its {n} packets end at {shown:.2f} s but the container says the video "
            f"lasts {declared:.2f} s (the file is cut short)",
        )
    return n


def _decode_sampled(
    data: bytes, name: str, indices: np.ndarray, total: int, shrink: FrameFit | None = None
) -> tuple[np.ndarray, list[float | None]]:
    """Decode frames 0..indices[-1] in order; convert only the sampled ones to RGB (``rgb24``,
    as HF's ``read_video_pyav``), pass each through ``shrink`` when given, and note their
    presentation times (seconds from frame 0).
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
                    rgb = frame.to_ndarray(format="rgb24")
                    kept[wanted[seen]] = rgb if shrink is None else shrink(rgb)
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
