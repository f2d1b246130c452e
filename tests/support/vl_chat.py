"""Helpers for the chat-layout tests: the Hugging Face reference for a conversation, assistant
labels found in token ids without the code under test, and a cache's samples by source row."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image


def hf_reference(proc: Any, messages: list[dict], images: list[Image.Image]) -> dict[str, Any]:
    """transformers' path: ``apply_chat_template`` then ``Qwen3VLProcessor(text, images)``;
    labels from :func:`assistant_labels`. ``inputs``: the processor's whole output (model
    kwargs, batch of one)."""
    text = proc.apply_chat_template(messages, tokenize=False)
    out = proc(text=[text], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0]
    return {
        "inputs": dict(out),
        "text": text,
        "input_ids": ids,
        "labels": assistant_labels(proc, ids),
        "image_grid_thw": out.get("image_grid_thw", torch.zeros((0, 3), dtype=torch.int64)),
        "pixel_values": out.get("pixel_values"),
    }


def vqa_reference(
    proc: Any, images: list[Image.Image], question: str, answer: str
) -> dict[str, Any]:
    """:func:`hf_reference` of a VQA row, its conversation written here by hand: the images,
    then the question, in the user turn; the answer in the assistant turn."""
    user = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return hf_reference(proc, messages, images)


def chat_reference(proc: Any, row: dict[str, Any]) -> dict[str, Any]:
    """:func:`hf_reference` of a ``messages`` + ``images`` row as ``datasets`` writes it (content
    parts ``{type, text}``, images ``{bytes, path}``), turned into HF chat messages here."""
    messages = [
        {
            "role": m["role"],
            "content": [
                {"type": "image"} if c["type"] == "image" else {"type": "text", "text": c["text"]}
                for c in m["content"]
            ],
        }
        for m in row["messages"]
    ]
    return hf_reference(proc, messages, [pil(im["bytes"]) for im in row["images"]])


def assistant_labels(proc: Any, ids: torch.Tensor) -> torch.Tensor:
    """Labels located in the token ids alone: after every ``<|im_start|>assistant\\n`` header,
    every token through the next ``<|im_end|>``; -100 elsewhere."""
    tok = proc.tokenizer
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    seq = ids.tolist()
    labels = torch.full_like(ids, -100)
    i = 0
    while i < len(seq):
        if seq[i : i + len(header)] == header:
            j = i + len(header)
            while seq[j] != end:
                j += 1
            labels[i + len(header) : j + 1] = ids[i + len(header) : j + 1]
            i = j + 1
        else:
            i += 1
    return labels


def cached_samples(cache: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Every sample of a VLCache by its source row: ids, labels, positions, grids, uint8 pixels."""
    pad = cache.special_tokens["image_pad_id"]
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(len(cache)):
        p = cache.pack(i)
        rows = cache.pack_rows(i)
        at = gi = pi = 0
        for row, n in zip(rows, p["seq_lens"].tolist(), strict=True):
            ids = p["input_ids"][at : at + n]
            is_img = (ids == pad).to(torch.int8)
            n_img = int((torch.diff(is_img, prepend=torch.zeros(1, dtype=torch.int8)) == 1).sum())
            grid = p["image_grid_thw"][gi : gi + n_img]
            n_pix = int(grid.prod(dim=1).sum()) if n_img else 0
            out[int(row)] = {
                "input_ids": ids,
                "labels": p["labels"][at : at + n],
                "position_ids": p["position_ids"][:, at : at + n],
                "image_grid_thw": grid,
                "pixel_u8": p["pixel_u8"][pi : pi + n_pix],
            }
            at, gi, pi = at + n, gi + n_img, pi + n_pix
    return out


def image_bytes(k: int, size: tuple[int, int], mode: str = "RGB", fmt: str = "JPEG") -> bytes:
    """A bundled source image, cropped/resized to ``size``, in ``mode``, encoded as ``fmt``."""
    from torchtitan_ext.vl.sample_data import source_dir

    files = sorted(p for p in source_dir().iterdir() if p.suffix in (".jpg", ".png"))
    with Image.open(files[k % len(files)]) as im:
        img = im.convert("RGB").resize(size, Image.BILINEAR)
    if mode == "RGBA":
        img = img.convert("RGBA")
        img.putalpha(Image.linear_gradient("L").resize(size))
    elif mode == "P":
        img = img.quantize(32)
    else:
        img = img.convert(mode)
    b = io.BytesIO()
    img.save(b, fmt)
    return b.getvalue()


def pil(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def rope_reference(model: Any, ids: torch.Tensor, grid: torch.Tensor, pad: int) -> np.ndarray:
    """transformers' ``Qwen3VLModel.get_rope_index`` rows [3, L] for one sample."""
    t = ids[None]
    pos, _ = model.get_rope_index(t, (t == pad).int(), image_grid_thw=grid if len(grid) else None)
    return pos[:, 0].numpy()


def positions_reference(
    model: Any, ids: torch.Tensor, grid: torch.Tensor, pad: int
) -> torch.Tensor:
    """A sample's four position rows [4, L] as the cache serves them: row 0 counts the tokens,
    rows 1-3 are :func:`rope_reference`."""
    rope = torch.from_numpy(rope_reference(model, ids, grid, pad))
    return torch.cat([torch.arange(len(ids))[None], rope.to(torch.int64)])
