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
from torchtitan_ext.vl.layouts import ChatSample
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
        return process_chat(processor, sample.messages, pil, max_len=sample_max_len(config),
                            positions=positions, truncate=config.truncate)  # fmt: skip
    except SampleError:
        raise
    except Exception as e:  # one row's failure is that row's counted skip, whatever it is
        raise SampleError.from_exception("processor_error", e) from e


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
    )
