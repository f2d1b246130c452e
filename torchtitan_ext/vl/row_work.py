"""One row of a VL cache build: parse, decode, preprocess and tokenise it, or say why it is skipped.

Runs in the build's pool workers (:func:`worker_init` sets each one up, :func:`process_row` is the
task) and in process; the online fallback calls :func:`process_parsed` directly. Every failure of
a row is that row's :class:`~torchtitan_ext.vl.processor.SampleError` with a short reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl.build_config import BuildConfig, sample_max_len
from torchtitan_ext.vl.conversation import ChatSample
from torchtitan_ext.vl.write import ProcessedRow, Skip


def process_parsed(
    processor, sample: ChatSample, config: BuildConfig, positions: bool, root: Path | None = None
):
    """A parsed row -> ``VLSample``; every failure is a ``SampleError`` with its reason
    (unforeseen exceptions become ``processor_error`` naming the exception's class). ``root``:
    the dataset directory (relative image paths)."""
    from torchtitan_ext.vl.processor import SampleError, decode_image
    from torchtitan_ext.vl.sample import process_chat

    try:
        n = len(sample.images)
        pil = []
        for i, cell in enumerate(sample.images):
            try:
                pil.append(decode_image(cell, config.max_image_pixels, config.exif_transpose, root))
            except SampleError as e:
                raise e.at_image(i, n) from None
        videos = decode_videos(processor, sample.videos, config, root)
        return process_chat(processor, sample.messages, pil, max_len=sample_max_len(config),
                            positions=positions, truncate=config.truncate,
                            videos=videos)  # fmt: skip
    except SampleError:
        raise
    except Exception as e:  # one row's failure is that row's counted skip, whatever it is
        raise SampleError.from_exception("processor_error", e) from e


FRAME_LIST_FPS = 24.0
"""The frame rate of a video given as a list of frames: transformers' assumption when a video
has no metadata (``Qwen3VLVideoProcessor.sample_frames`` "Defaulting to fps=24")."""


def decode_videos(processor, cells: list[Any], config: BuildConfig, root: Path | None) -> list:
    """A row's video cells -> ``VideoPatches`` (``vl/video.py``), with the build's video options.
    A cell that is a list is one video given as its frames (each an image cell, decoded as the
    row's images are); anything else is a video file. A failure names the video's index."""
    from torchtitan_ext.vl.build_config import video_options
    from torchtitan_ext.vl.processor import ImageParams, SampleError, decode_image
    from torchtitan_ext.vl.video import VideoProcessor

    if not cells:
        return []
    vp = VideoProcessor(video_options(config, ImageParams.from_processor(processor)))
    out = []
    for i, cell in enumerate(cells):
        try:
            if isinstance(cell, (list, tuple)):
                frames = [decode_image(f, config.max_image_pixels, config.exif_transpose, root)
                          for f in cell]  # fmt: skip
                out.append(vp.from_frames(frames, FRAME_LIST_FPS))
            else:
                out.append(vp(cell, root))
        except SampleError as e:
            raise e.at_video(i, len(cells)) from None
    return out


_W: dict[str, Any] = {}
"""The worker's processor, config, row parser and dataset root (set by :func:`worker_init`)."""


def worker_init(config: BuildConfig, layout: Any, root: Path | None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    from torchtitan_ext.vl.processor import load_processor

    _W["proc"] = load_processor(config.model_path)
    _W["config"] = config
    _W["parse"] = layout.parse
    _W["root"] = root


def process_row(item: tuple[int, dict[str, Any]]) -> ProcessedRow | Skip:
    """(row index, raw row) -> its processed arrays, or the reason it is skipped."""
    from torchtitan_ext.vl.processor import SampleError

    row, raw = item
    try:
        try:
            sample = _W["parse"](raw)
        except SampleError:
            raise
        except Exception as e:  # a malformed cell the layout cannot read
            raise SampleError.from_exception("processor_error", e) from e
        s = process_parsed(_W["proc"], sample, _W["config"], positions=False, root=_W["root"])
    except SampleError as e:
        return Skip(row, e.reason, str(e), e.error_type)
    mask = (s.labels.numpy() != IGNORE_INDEX).astype(np.uint8)
    mask[0] = 0  # first token of each sample never a target (packing contract)
    return ProcessedRow(
        row=row,
        tokens=s.input_ids.numpy().astype(np.int32),
        label_mask=mask,
        pixels=s.pixel_u8.numpy(),
        grid_thw=s.image_grid_thw.numpy().astype(np.int32),
        turns_dropped=int(s.extra.get("turns_dropped", 0)),
        video_pixels=s.video_u8.numpy() if len(s.video_grid_thw) else None,
        video_grid_thw=s.video_grid_thw.numpy().astype(np.int32) if len(s.video_grid_thw) else None,
    )
