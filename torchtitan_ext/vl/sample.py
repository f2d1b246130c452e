"""One conversation + its images and videos -> one processed sample (token ids, labels, uint8
patches, grids).

:func:`process_chat` is the per-row step of every layout (``vl/layouts.py`` makes the
conversation, ``vl/build.py`` decodes the image headers):

1. the texts are checked for Qwen's special-token strings (``placeholder_mismatch``);
2. each image's grid comes from ``smart_resize`` on its header size (no pixels decoded yet);
3. the conversation is rendered with the processor's chat template and the assistant spans are
   located (``vl/chat.py``), tokenised once with offsets; a token overlapping a span is a target;
4. the ``<|image_pad|>`` count must equal the image count, and no two may touch
   (``placeholder_mismatch``); a conversation whose assistant turns are all blank is
   ``empty_text``; a sample longer than ``max_len`` is ``too_long`` -- or, with ``truncate``, loses
   whole trailing turns (and their images) until it fits, cut after an assistant turn so the loss
   mask stays whole (``extra["turns_dropped"]``);
5. each ``<|image_pad|>`` is expanded to ``t*h*w/merge²`` copies -- the ids the HF processor
   produces -- and the images are resized and patchified (``processor.image_to_patches``); an
   image that fails names its index in the row's list;
6. each ``<|video_pad|>`` (one per video part, in order) is replaced by the ids of the video's
   prompt text, ``VideoPatches.placeholder()``: per merged frame ``<{t:.1f} seconds>``, vision
   start, ``h*w/merge²`` video pads, vision end -- what ``Qwen3VLProcessor`` puts there. The
   videos arrive decoded (``VideoPatches``, ``vl/video.py``): their frame count decides the
   token count. The ids are spliced, not re-tokenised: the timestamp text sits between special
   tokens, which the tokenizer splits on, so its tokens do not depend on what surrounds it.

The result equals ``Qwen3VLProcessor(text=apply_chat_template(messages), images=...,
videos=...)`` in ids, ``image_grid_thw`` and ``video_grid_thw``, and in ``pixel_values`` after
``normalize_patches`` / ``pixel_values_videos`` after ``normalize_video_patches`` (tested per
layout; videos: tests/test_vl_video_cache.py against HF's answers in tests/fixtures/video).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch
from PIL import Image

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl.chat import ChatText, renderer
from torchtitan_ext.vl.conversation import vqa_messages
from torchtitan_ext.vl.processor import (
    QWEN_SPECIAL_TOKENS,
    ImageParams,
    SampleError,
    image_to_patches,
    load_image,
    position_rows,
    special_token_ids,
)
from torchtitan_ext.vl.video import VideoPatches

VIDEO_PATCH_DIM = 3 * 2 * 16 * 16
"""Width of an empty sample's video rows (a video row: C * temporal_patch * patch²)."""


@dataclass
class VLSample:
    """One processed sample (no padding). ``pixel_u8`` rows are in the processor's layout."""

    input_ids: torch.Tensor  # int64 [L]
    labels: torch.Tensor  # int64 [L], -100 except assistant tokens
    pixel_u8: torch.Tensor  # uint8 [N, 768]
    image_grid_thw: torch.Tensor  # int64 [n_img, 3]
    position_ids: torch.Tensor  # int64 [4, L] (row 0 text, rows 1..3 mRoPE)
    extra: dict[str, Any] = field(default_factory=dict)
    video_u8: torch.Tensor = field(
        default_factory=lambda: torch.zeros((0, VIDEO_PATCH_DIM), dtype=torch.uint8)
    )  # uint8 [N_vid, 1536], videos in token order (vl/video.py's rows)
    video_grid_thw: torch.Tensor = field(
        default_factory=lambda: torch.zeros((0, 3), dtype=torch.int64)
    )  # int64 [n_vid, 3]

    def __getitem__(self, k: str):  # dict-style access for convenience
        return getattr(self, k)


class _Pipeline:
    """Per-processor constants (computed once per processor)."""

    def __init__(self, processor):
        self.params = ImageParams.from_processor(processor)
        self.ids = special_token_ids(processor)
        tok = processor.tokenizer
        self.backend = getattr(tok, "backend_tokenizer", None) or tok._tokenizer
        self.specials = [t for t in QWEN_SPECIAL_TOKENS if t in tok.get_vocab()]
        self.chat = renderer(processor)
        self._stamps: dict[str, list[int]] = {}

    def video_ids(self, v: VideoPatches) -> np.ndarray:
        """The ids of ``v.placeholder()`` (module docstring, step 6), timestamps tokenised once."""
        vs, ve, pad = (self.ids[k] for k in ("vision_start_id", "vision_end_id", "video_pad_id"))
        frame = [vs] + [pad] * v.tokens_per_frame + [ve]
        out: list[int] = []
        for t in v.timestamps:
            text = f"<{t:.1f} seconds>"
            if text not in self._stamps:
                self._stamps[text] = self.backend.encode(text, add_special_tokens=False).ids
            out += self._stamps[text] + frame
        return np.asarray(out, dtype=np.int64)


def _pipeline(processor) -> _Pipeline:
    pl = getattr(processor, "_ttx_pipeline", None)
    if pl is None:
        pl = _Pipeline(processor)
        processor._ttx_pipeline = pl
    return pl


@dataclass
class _Encoded:
    chat: ChatText
    ids: np.ndarray
    """int64 token ids, one ``<|image_pad|>`` per image."""
    target: np.ndarray
    """bool per token: overlaps an assistant span."""
    pads: np.ndarray
    """positions of the ``<|image_pad|>`` tokens."""
    vpads: np.ndarray
    """positions of the ``<|video_pad|>`` tokens (one per video part before expansion)."""


def _encode(pl: _Pipeline, messages: list[dict[str, Any]]) -> _Encoded:
    chat = pl.chat.render(messages)
    enc = pl.backend.encode(chat.text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    # fromiter over the flat pairs: half the cost of np.asarray on a list of tuples
    off = np.fromiter(chain.from_iterable(enc.offsets), np.int64, 2 * len(ids)).reshape(-1, 2)
    target = np.zeros(len(ids), dtype=bool)
    if chat.spans and len(ids):
        s = np.asarray(chat.spans, dtype=np.int64)
        k = np.searchsorted(s[:, 1], off[:, 0], side="right")  # first span ending after start
        inside = k < len(s)
        target[inside] = s[k[inside], 0] < off[inside, 1]
    return _Encoded(
        chat,
        ids,
        target,
        np.flatnonzero(ids == pl.ids["image_pad_id"]),
        np.flatnonzero(ids == pl.ids["video_pad_id"]),
    )


def _check_texts(pl: _Pipeline, messages: Sequence[dict[str, Any]]) -> None:
    for m in messages:
        c = m["content"]
        for text in [c] if isinstance(c, str) else [p["text"] for p in c if "text" in p]:
            for t in pl.specials:
                if t in text:
                    raise SampleError(
                        "placeholder_mismatch", f"{m['role']} text contains the special token {t}"
                    )


def _header_grids(p: ImageParams, images: Sequence[Image.Image]) -> list[tuple[int, int, int]]:
    grids = []
    for i, im in enumerate(images):
        try:
            rh, rw = p.target_size(im.height, im.width)
        except SampleError as e:
            raise e.at_image(i, len(images)) from None
        grids.append((1, rh // p.patch_size, rw // p.patch_size))
    return grids


def _n_tokens(e: _Encoded, image_tokens: Sequence[int], video_tokens: Sequence[int] = ()) -> int:
    n, nv = len(e.pads), len(e.vpads)
    return len(e.ids) - n - nv + int(sum(image_tokens[:n])) + int(sum(video_tokens[:nv]))


def _truncated(
    pl: _Pipeline,
    messages: list[dict[str, Any]],
    image_tokens: Sequence[int],
    max_len: int,
    video_tokens: Sequence[int] = (),
) -> tuple[_Encoded, int]:
    """The longest prefix of whole turns ending with an assistant turn that fits ``max_len``
    (its encoding, and the number of turns dropped), or ``too_long``."""
    for k in range(len(messages) - 1, 0, -1):
        if messages[k - 1]["role"] != "assistant":
            continue
        e = _encode(pl, messages[:k])
        if not any(t.strip() for t in e.chat.assistant_texts):
            break
        if _n_tokens(e, image_tokens, video_tokens) <= max_len:
            return e, len(messages) - k
    raise SampleError("too_long", f"no prefix of whole turns fits seq_len {max_len}")


def process_chat(
    processor,
    messages: list[dict[str, Any]],
    images: Sequence[Image.Image],
    max_len: int | None = None,
    positions: bool = True,
    truncate: bool = False,
    videos: Sequence[VideoPatches] = (),
) -> VLSample:
    """A conversation (HF chat format, see ``vl/layouts.py``), its images (PIL, opened lazily)
    and its videos (decoded: ``VideoPatches``) -> VLSample via the fast path (module docstring).
    Raises SampleError (``reason``). ``positions=False`` leaves ``position_ids`` empty (the cache
    recomputes them at read)."""
    pl = _pipeline(processor)
    p = pl.params
    images, videos = list(images), list(videos)
    _check_texts(pl, messages)
    grids = _header_grids(p, images)
    m2 = p.merge_size**2
    image_tokens = [t * h * w // m2 for t, h, w in grids]
    video_ids = [pl.video_ids(v) for v in videos]
    video_tokens = [len(v) for v in video_ids]
    vision = sum(image_tokens) + sum(video_tokens)
    if max_len is not None and not truncate and vision > max_len:
        what = "video and image" if videos else "image"
        raise SampleError("too_long", f"{vision} {what} tokens > seq_len {max_len}")
    e = _encode(pl, messages)
    if len(e.pads) != len(images):
        raise SampleError(
            "placeholder_mismatch",
            f"{len(e.pads)} image placeholders rendered for {len(images)} images",
        )
    if len(e.vpads) != len(videos):
        raise SampleError(
            "placeholder_mismatch",
            f"{len(e.vpads)} video placeholders rendered for {len(videos)} videos",
        )
    if len(e.pads) > 1 and (np.diff(e.pads) == 1).any():
        raise SampleError("placeholder_mismatch", "two image placeholders touch (one run)")
    if not any(t.strip() for t in e.chat.assistant_texts):
        raise SampleError("empty_text", "no assistant text (no training target)")
    dropped = 0
    total = _n_tokens(e, image_tokens, video_tokens)
    if max_len is not None and total > max_len:
        if not truncate:
            raise SampleError("too_long", f"{total} tokens > seq_len {max_len}")
        e, dropped = _truncated(pl, messages, image_tokens, max_len, video_tokens)
        images, grids = images[: len(e.pads)], grids[: len(e.pads)]
        videos, video_ids = videos[: len(e.vpads)], video_ids[: len(e.vpads)]
    ids, target = _expand(e, image_tokens, video_ids)
    labels = np.where(target, ids, IGNORE_INDEX)
    patches = _image_patches(images, grids, p)
    grid = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    vgrid = np.asarray([v.grid_thw for v in videos], dtype=np.int64).reshape(-1, 3)
    video_kw = {"video_grid_thw": vgrid, "video_pad_id": pl.ids["video_pad_id"]} if videos else {}
    pos = (
        position_rows(ids, grid, pl.ids["image_pad_id"], p.merge_size, **video_kw)
        if positions
        else np.zeros((4, 0), np.int64)
    )
    patch_dim = 3 * p.patch_size**2
    out = VLSample(
        input_ids=torch.from_numpy(ids),
        labels=torch.from_numpy(labels),
        pixel_u8=torch.from_numpy(_concat(patches, patch_dim)),
        image_grid_thw=torch.from_numpy(grid),
        position_ids=torch.from_numpy(pos),
        extra={"turns_dropped": dropped} if dropped else {},
    )
    if videos:
        out.video_u8 = torch.from_numpy(np.concatenate([v.patches for v in videos]))
        out.video_grid_thw = torch.from_numpy(vgrid)
    return out


def _image_patches(
    images: Sequence[Image.Image], grids: Sequence[tuple[int, int, int]], p: ImageParams
) -> list[np.ndarray]:
    """Each image resized and patchified; a grid other than its header's is ``decode_error``."""
    patches = []
    for i, (im, g) in enumerate(zip(images, grids, strict=True)):
        try:
            u8, g2 = image_to_patches(load_image(im), p)
            if g2 != g:  # a lying header, or a PNG's late EXIF orientation turned it by 90 degrees
                raise SampleError(
                    "decode_error", f"decoded grid {g2} differs from the header's {g}"
                )
        except SampleError as err:
            raise err.at_image(i, len(images)) from None
        patches.append(u8)
    return patches


def _expand(
    e: _Encoded, image_tokens: Sequence[int], video_ids: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target flags) with each image pad repeated ``image_tokens[i]`` times and each video
    pad replaced by its video's ids; an expanded token carries its pad's target flag."""
    reps = np.ones(len(e.ids), dtype=np.int64)
    reps[e.pads] = image_tokens[: len(e.pads)]
    ids, target = np.repeat(e.ids, reps), np.repeat(e.target, reps)
    if not len(e.vpads):
        return ids, target
    at = (np.cumsum(reps)[e.vpads] - 1).tolist()  # the video pads' places after the images
    pieces, flags, prev = [], [], 0
    for a, vid in zip(at, video_ids, strict=True):
        pieces += [ids[prev:a], vid]
        flags += [target[prev:a], np.full(len(vid), target[a])]
        prev = a + 1
    pieces.append(ids[prev:])
    flags.append(target[prev:])
    return np.concatenate(pieces), np.concatenate(flags)


def _concat(patches: list[np.ndarray], patch_dim: int) -> np.ndarray:
    """The images' patch rows in one array (one image's array as it is: no copy)."""
    if len(patches) == 1:
        return patches[0]
    return np.concatenate(patches) if patches else np.zeros((0, patch_dim), np.uint8)


def process_sample(
    processor,
    image: Image.Image | list[Image.Image] | None,
    question: str | None,
    answer: str | None,
    max_len: int | None = None,
    positions: bool = True,
) -> VLSample:
    """One VQA sample (images, question, answer) -> VLSample (:func:`process_chat`)."""
    images = [] if image is None else (list(image) if isinstance(image, (list, tuple)) else [image])
    return process_chat(
        processor, vqa_messages(len(images), question, answer), images, max_len, positions
    )


def hf_process(processor, images: list[Image.Image], question: str, answer: str) -> dict:
    """The reference HF path for a VQA sample: ``apply_chat_template`` then ``processor(...)``."""
    text = processor.apply_chat_template(
        vqa_messages(len(images), question, answer), tokenize=False
    )
    out = processor(text=[text], images=images or None, return_tensors="pt")
    return dict(out)
