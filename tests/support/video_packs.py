"""Real Qwen3-VL samples with videos, images or text only, as the cache hands them over, and a
pack of them: the inputs of the video collate / model tests (``tests/test_vl_video_model.py``,
``tests/test_vl_video_torchtitan.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.vl.positions import pack_position_rows, position_rows

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "video"
MERGE = 2


def video_sample(proc, name: str, question: str, answer: str) -> dict:
    """A chat sample with one video, built as HF's processor lays it out: the chat template's
    ``<|video_pad|>`` replaced by ``VideoPatches.placeholder()`` (tests/test_vl_video.py checks
    that against HF), labels on the assistant turn's tokens only (as the cache writes them)."""
    from torchtitan_ext.constants import IGNORE_INDEX
    from torchtitan_ext.vl.processor import special_token_ids
    from torchtitan_ext.vl.video import VideoProcessor

    v = VideoProcessor()(FIXTURES / name)
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer},
    ]
    prompt = proc.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    full = proc.apply_chat_template(messages, tokenize=False)
    assert full.startswith(prompt) and prompt.count("<|video_pad|>") == 1
    tok = proc.tokenizer
    head = tok(prompt.replace("<|video_pad|>", v.placeholder()), add_special_tokens=False)
    tail = tok(full[len(prompt) :], add_special_tokens=False)
    ids = torch.tensor(head["input_ids"] + tail["input_ids"], dtype=torch.int64)
    labels = ids.clone()
    labels[: len(head["input_ids"])] = IGNORE_INDEX
    sp = special_token_ids(proc)
    grid = np.asarray([v.grid_thw], dtype=np.int64)
    pos = position_rows(
        ids.numpy(), np.zeros((0, 3), np.int64), sp["image_pad_id"], v.merge_size,
        video_grid_thw=grid, video_pad_id=sp["video_pad_id"],
    )  # fmt: skip
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.from_numpy(pos),
        "pixel_u8": torch.zeros((0, 768), dtype=torch.uint8),
        "image_grid_thw": torch.zeros((0, 3), dtype=torch.int64),
        "video_u8": torch.from_numpy(v.patches),
        "video_grid_thw": torch.from_numpy(grid),
    }


def image_sample(proc, image, question: str, answer: str) -> dict:
    from torchtitan_ext.vl import sample as VSM

    s = VSM.process_sample(proc, [image] if image is not None else None, question, answer)
    return {k: getattr(s, k) for k in ("input_ids", "labels", "position_ids", "pixel_u8",
                                        "image_grid_thw")}  # fmt: skip


def pack_of(samples: list[dict], special: dict[str, int]) -> dict:
    """Samples laid end to end, positions from ``pack_position_rows`` (a pack as the loader
    would hand it over; the cache does not store video yet)."""
    ids = torch.cat([s["input_ids"] for s in samples])
    lens = np.array([len(s["input_ids"]) for s in samples])
    grid = torch.cat([s["image_grid_thw"] for s in samples])
    vids = [s for s in samples if "video_grid_thw" in s]
    vgrid = (
        torch.cat([s["video_grid_thw"] for s in vids])
        if vids
        else torch.zeros((0, 3), dtype=torch.int64)
    )
    pos = pack_position_rows(
        ids.numpy(), lens, grid.numpy(), special["image_pad_id"], MERGE,
        video_grid_thw=vgrid.numpy(), video_pad_id=special["video_pad_id"],
    )  # fmt: skip
    pack = {
        "input_ids": ids,
        "labels": torch.cat([s["labels"] for s in samples]),
        "position_ids": torch.from_numpy(pos),
        "pixel_u8": torch.cat([s["pixel_u8"] for s in samples]),
        "image_grid_thw": grid,
        "seq_lens": torch.from_numpy(lens),
    }
    if vids:
        pack["video_u8"] = torch.cat([s["video_u8"] for s in vids])
        pack["video_grid_thw"] = vgrid
    return pack


def mixed_samples(proc) -> list[dict]:
    """A video (2 merged frames), an image, a text-only turn and a second video (3 frames)."""
    from PIL import Image

    gradient = Image.fromarray(np.tile(np.arange(96, dtype=np.uint8), (64, 1))).convert("RGB")
    return [
        video_sample(proc, "small_10fps.mp4", "What moves?", "A square."),
        image_sample(proc, gradient, "Which way is it lighter?", "To the right."),
        image_sample(proc, None, "Say hi.", "Hi."),
        video_sample(proc, "budget_24fps.mp4", "And here?", "A gradient."),
    ]
