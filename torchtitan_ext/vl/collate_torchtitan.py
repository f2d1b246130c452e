"""Collate cached Qwen3-VL packs into torchtitan 0.3.0's multimodal batch.

``"torchtitan"`` — ``(input_dict, labels)`` equal, key for key, to what torchtitan 0.3.0's
``hf_datasets.multimodal.MultiModalCollator`` (``build_mrope_positions=True``, as its ``qwen3_5``
configs set it) returns for the same samples (tested against the real collator)::

    input [B, L], positions [B, L] (0 on padding),
    pixel_values float32 [n_img, max_patches, 1536] zero-padded per image (max_patches rounded up
    to a multiple of merge_size**2), grid_thw int64 [n_img, 3], pixel_values_videos None,
    grid_thw_videos None, special_tokens {image_id, video_id, vision_start_id, vision_end_id, pad_id},
    mrope_positions [B, L, 3] (only when the batch has an image or a video, as there)
    labels [B, L] already shifted (labels[t] is the target of input[t]; torchtitan's loss does not
    shift), -100 where ignored.

  mRoPE on padding follows the collator, which splits documents where ``positions`` decreases:
  the padding after a pack's last sample is one more text document, numbered 0, 1, 2, ... on all
  three axes (the cache stores 0s there; the model never reads them: padding is its own
  document with label -100). A sample of one token (never in the cache: each is a chat turn)
  is where that rule cannot see a boundary (positions 0, 0): the collator then continues the
  numbering into the next sample, a constant shift that relative RoPE does not see; ours
  restarts, as ``get_rope_index`` does. Every sample's first label is -100 in the cache, so
  after the shift the last token of a sample never learns to predict the next sample's first
  token (the collator itself would train it; with chat samples that first token,
  ``<|im_start|>``, is never a target).
  Video: ``pixel_values_videos`` float32 [n_frames, max_patches, 1536] and ``grid_thw_videos``
  [n_frames, 3] hold each video as one item per merged frame (grid ``[1, h, w]``), the
  collator's own ``_build_mrope_positions`` split. torchtitan 0.3.0's model
  (``get_vision_positions``) needs one unbroken placeholder run per item, and Qwen3-VL's prompt
  puts a timestamp and vision start/end tokens between a video's merged frames: one item per
  video would be refused there as a misalignment. Per frame is also what HF's vision tower
  computes (its attention windows, ``cu_seqlens``, are one merged frame each). The rows are
  normalised with the video formula (``vl/video_batch.py``), HF's ``pixel_values_videos`` bit
  for bit; ``mrope_positions`` is set when the batch has an image or a video.
  Intentional differences: a batch is padded to its longest pack (a bucket) where the collator
  pads every batch to ``seq_len`` (pass ``pad_to=seq_len`` for its shape), and it never has the
  collator's all-padding dummy rows (every rank's batches are full).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl.collate_parts import (
    NormalizeOn,
    PixelNorm,
    batch_length,
    cat_rows,
    normalize,
    pad_stack,
    shift_labels,
)
from torchtitan_ext.vl.pixel_rows import PixelRows, cat_pixel_rows
from torchtitan_ext.vl.video import normalize_video_patches
from torchtitan_ext.vl.video_batch import BATCH_VIDEOS, VIDEO_GRID, VIDEO_ROWS, has_video


def _pad_per_image(
    pixels: torch.Tensor | PixelRows, grid_thw: torch.Tensor, merge_size: int
) -> torch.Tensor:
    """[sum N, D] -> [n_img, max_patches, D], each image's rows first, the rest exactly 0.
    ``pixels`` as a ``PixelRows`` (a planned pack's rows still in the store) is read from there:
    each image's rows are copied once, straight into the output."""
    counts = grid_thw.prod(dim=1).tolist()
    unit = merge_size * merge_size
    max_patches = -(-max(counts) // unit) * unit
    shape = (len(counts), max_patches, pixels.shape[-1])
    in_store = isinstance(pixels, PixelRows)
    out = torch.empty(shape, dtype=torch.uint8) if in_store else pixels.new_empty(shape)
    # One slice copy per image (a boolean-mask scatter measured ~10x slower) and zero only the
    # padding tail. On the CPU through numpy: a plain single-threaded memcpy; torch's parallel
    # copy measured 23 ms instead of 3 ms per 21 MB pack on the loaded 2-core box (its two
    # intra-op threads contend with the rest of the machine).
    if in_store:
        src, dst = pixels, out.numpy()
    else:
        src, dst = (pixels.numpy(), out.numpy()) if pixels.device.type == "cpu" else (pixels, out)
    o = 0
    for i, c in enumerate(counts):
        dst[i, :c] = src[o : o + c]
        dst[i, c:] = 0
        o += c
    if o != pixels.shape[0]:
        raise ValueError(f"grid_thw accounts for {o} patches but pixel rows are {pixels.shape[0]}")
    return out


def zero_padding(values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """Set rows past each image's patch count to exactly 0 (torchtitan's collator pads with 0)."""
    for i, c in enumerate(grid_thw.prod(dim=1).tolist()):
        values[i, c:] = 0
    return values


def collate_torchtitan(
    packs: Sequence[Mapping[str, torch.Tensor]],
    *,
    special_tokens: Mapping[str, int],
    norm: PixelNorm = PixelNorm(),
    normalize_on: NormalizeOn = "collate",
    pad_to: int | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Packs -> ``(input_dict, labels)`` in torchtitan's MultiModalCollator layout."""
    if not packs:
        raise ValueError("collate_torchtitan needs at least one pack")
    tt_tokens = torchtitan_special_tokens(special_tokens)
    length = batch_length(packs, pad_to)
    tokens = pad_stack([p["input_ids"] for p in packs], length, tt_tokens["pad_id"])
    labels = shift_labels(pad_stack([p["labels"] for p in packs], length, IGNORE_INDEX))
    pos = pad_stack([p["position_ids"] for p in packs], length, 0)  # [B, 4, L]
    grid = cat_rows([p["image_grid_thw"] for p in packs])
    input_dict: dict[str, Any] = {
        "input": tokens,
        "positions": pos[:, 0].contiguous(),
        "pixel_values": None,
        "grid_thw": None,
        "pixel_values_videos": None,
        "grid_thw_videos": None,
        "special_tokens": tt_tokens,
    }
    videos = has_video(packs)
    if grid.shape[0] or videos:
        mrope = pos[:, 1:].permute(0, 2, 1).contiguous()  # [B, L, 3]
        _number_padding(mrope, [_real_length(p) for p in packs])
        input_dict["mrope_positions"] = mrope
    if videos:
        _add_video_frames(input_dict, packs, norm, normalize_on)
    if grid.shape[0]:
        pixels = cat_pixel_rows([p["pixel_u8"] for p in packs])  # views stay views
        input_dict["grid_thw"] = grid
        u8 = _pad_per_image(pixels, grid, norm.merge_size)
        if normalize_on == "collate":
            # pad the uint8 rows first, then normalise once: one float pass instead of two
            input_dict["pixel_values"] = zero_padding(normalize(u8, norm), grid)
        elif normalize_on == "device":
            # uint8, zero-padded per image; finish_on_device re-zeroes the pad rows after
            # normalising (AsyncDeviceLoader's plain normalise leaves them at (0-mean)/std; the
            # model never reads them: vision tokens are cut to grid_thw's counts).
            input_dict["pixel_values"] = u8
        else:
            raise ValueError(f"normalize_on must be 'collate' or 'device', got {normalize_on!r}")
    return input_dict, labels


def frame_items(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """Videos [n_vid, 3] -> one row ``[1, h, w]`` per merged frame [sum t, 3], in token order
    (a video's patch rows are frame-major, so each frame's rows are a contiguous slice)."""
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def _add_video_frames(
    input_dict: dict[str, Any],
    packs: Sequence[Mapping[str, torch.Tensor]],
    norm: PixelNorm,
    normalize_on: NormalizeOn,
) -> None:
    """The packs' videos as per-frame items (module docstring), zero-padded per item."""
    with_video = [p for p in packs if VIDEO_GRID in p and int(p[VIDEO_GRID].shape[0]) > 0]
    frames = frame_items(cat_rows([p[VIDEO_GRID] for p in with_video]))
    u8 = _pad_per_image(cat_rows([p[VIDEO_ROWS] for p in with_video]), frames, norm.merge_size)
    if normalize_on == "collate":
        n, k, d = u8.shape
        values = normalize_video_patches(u8.view(n * k, d), norm.mean, norm.std).view(n, k, d)
        u8 = zero_padding(values, frames)
    elif normalize_on != "device":  # "device": uint8 until finish_on_device
        raise ValueError(f"normalize_on must be 'collate' or 'device', got {normalize_on!r}")
    input_dict[BATCH_VIDEOS] = u8
    input_dict["grid_thw_videos"] = frames


def _real_length(pack: Mapping[str, torch.Tensor]) -> int:
    """Tokens of a pack before its padding (``num_tokens``; else the sum of ``seq_lens``)."""
    if "num_tokens" in pack:
        return int(pack["num_tokens"])
    if "seq_lens" in pack:
        return int(pack["seq_lens"].sum())
    return int(pack["input_ids"].shape[-1])


def _number_padding(mrope: torch.Tensor, lengths: Sequence[int]) -> None:
    """Number each row's padding as MultiModalCollator does (in place on ``mrope`` [B, L, 3]):
    it splits a row into documents where ``positions`` decreases, so the padding after the last
    sample is one more text document, 0, 1, 2, ... on all three axes."""
    full = mrope.shape[1]
    for b, n in enumerate(lengths):
        if n < full:
            mrope[b, n:] = torch.arange(full - n, dtype=mrope.dtype).unsqueeze(1)


def torchtitan_special_tokens(special: Mapping[str, int]) -> dict[str, int]:
    """Our ``special_token_ids`` names -> torchtitan's ``MultiModalTokenizer.TOKEN_FIELDS`` names."""
    aliases = {
        "image_id": ("image_id", "image_pad_id"),
        "video_id": ("video_id", "video_pad_id"),
        "vision_start_id": ("vision_start_id",),
        "vision_end_id": ("vision_end_id",),
        "pad_id": ("pad_id",),
    }
    out = {}
    for name, keys in aliases.items():
        for k in keys:
            if k in special:
                out[name] = int(special[k])
                break
        else:
            raise KeyError(
                f"special token {name!r} missing from the cache's special tokens {dict(special)}"
            )
    return out


def check_special_tokens(
    model: Mapping[str, int], special: Mapping[str, int], *, model_from: str, cache_from: str
) -> None:
    """Refuse cache ids that differ from the model tokenizer's (both in torchtitan's names).

    A torchtitan VLM (``qwen3_5``) finds image placeholders through the batch's
    ``special_tokens``, so a foreign cache would still run, silently: its text ids index the
    model's embedding rows as if they came from the model's tokenizer. Differing special-token
    ids are the cheap, certain sign of that. Raises ``ValueError`` (one line, naming each key).
    """
    ours = torchtitan_special_tokens(special)
    bad = [
        f"{k} cache={ours[k]} model={int(v)}"
        for k, v in model.items()
        if k in ours and ours[k] != int(v)
    ]
    if bad:
        raise ValueError(
            f"special-token ids of {cache_from} differ from the model tokenizer's ({model_from}): "
            f"{', '.join(bad)}; build the cache with the model's own processor "
            "(dataloader.model_path = the hf_assets_path directory)"
        )
