"""Collate cached Qwen3-VL packs into the two batch formats a trainer consumes.

Input: a list of pack dicts as yielded by ``CachedVLDataset`` (``input_ids`` [L], ``labels`` [L],
``position_ids`` [4, L], ``pixel_u8`` uint8 [N, 768], ``image_grid_thw`` [n_img, 3], ...). Packs
are already padded to a bucket length; a batch is padded to its longest pack (with
``local_batch_size = 1``, the usual choice for 8k packs, nothing is padded and the text tensors are
views). Pixels travel as uint8 (half the bytes of one float32 temporal half, an eighth of the
processor's float32 [N, 1536]); normalisation ``(x/255 - mean)/std`` plus the temporal duplication
happens either here (``normalize_on="collate"``, CPU) or after the host-to-device copy
(``normalize_on="device"``: ``pixel_values`` stays **uint8** [.., 768] and is normalised where it
lands — ``AsyncDeviceLoader`` normalises uint8 ``pixel_values`` right after its copy (its
``PixelNormalize`` default key), or call ``finish_on_device`` yourself). The dtype is the marker:
a float ``pixel_values`` is final, a uint8 one still needs normalising.

Formats
-------
``"hf"`` — keyword arguments of ``transformers.Qwen3VLForConditionalGeneration.forward``::

    input_ids [B, L], labels [B, L] (unshifted: HF shifts inside the loss), position_ids [4, B, L]
    (row 0 = text position restarting at 0 per sample; rows 1..3 = mRoPE t/h/w),
    pixel_values float32 [sum N, 1536], image_grid_thw [n_img, 3], use_cache=False,
    pixel_values_videos float32 [sum N_vid, 1536], video_grid_thw [n_vid, 3] (only when a pack
    holds video: ``vl/video_batch.py``)

  ``attention_mask`` is deliberately absent (None): with no mask, no KV cache and position ids
  that restart per sample, transformers builds a block-causal mask from the position ids (its
  packed-sequence detection), so each sample attends only to itself. ``use_cache=False`` is part of
  the batch because with the cache on the detection is skipped (facts.md: Δlogit 0.49).

``"torchtitan"`` — ``(input_dict, labels)`` equal, key for key, to what torchtitan 0.3.0's
``hf_datasets.multimodal.MultiModalCollator`` (``build_mrope_positions=True``, as its ``qwen3_5``
configs set it) returns for the same samples (tested against the real collator)::

    input [B, L], positions [B, L] (0 on padding),
    pixel_values float32 [n_img, max_patches, 1536] zero-padded per image (max_patches rounded up
    to a multiple of merge_size**2), grid_thw int64 [n_img, 3], pixel_values_videos None,
    grid_thw_videos None, special_tokens {image_id, video_id, vision_start_id, vision_end_id, pad_id},
    mrope_positions [B, L, 3] (only when the batch has an image, as there)
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
  Images only: a pack holding video is refused with one error naming the format.
  Intentional differences: a batch is padded to its longest pack (a bucket) where the collator
  pads every batch to ``seq_len`` (pass ``pad_to=seq_len`` for its shape), and it never has the
  collator's all-padding dummy rows (every rank's batches are full).

``"qwen3_vl"`` — ``(input_dict, labels)`` for torchtitan's trainer and the ``qwen3_vl`` model
(``torchtitan_ext.models.qwen3_vl``, transformers' Qwen3-VL inside): the ``"hf"`` tensors under
torchtitan's names, so the trainer's ``model(input_dict["input"], **rest)`` is the model call::

    input [B, L], position_ids [4, B, L], pixel_values [sum N, 1536] (uint8 [sum N, 768] with
    normalize_on="device"), image_grid_thw [n_img, 3] (both absent in a text-only batch),
    pixel_values_videos, video_grid_thw as in "hf" (absent without video);
    labels [B, L] shifted as in "torchtitan" (torchtitan's loss does not shift)

Cost (``python -m benchmarks vl_dataset``, 2-core box, 8113 tokens / 23 images / 27.6k patches):
fetch + collate 1.7 ms in the HF format with uint8 pixels (B=1: no pixel copy), 2.8 ms in the
torchtitan format (the per-image padding copies ~21 MB of uint8, through numpy: torch's 2-thread
copy measured 23 ms on the loaded box); CPU normalisation (``normalize_on="collate"``) writes
~170 MB of float32 and costs ~70 ms here (up to ~400 ms under load) — the reason pixels travel as
uint8 and are normalised on the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl.video_batch import add_videos, finish_videos, has_video

BatchFormat = Literal["hf", "torchtitan", "qwen3_vl"]
BATCH_FORMATS: tuple[str, ...] = ("hf", "torchtitan", "qwen3_vl")
NormalizeOn = Literal["collate", "device"]


@dataclass(frozen=True)
class PixelNorm:
    """How uint8 patches [N, 3*16*16] become the processor's float patches [N, 3*T*16*16]."""

    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    temporal_patch_size: int = 2
    merge_size: int = 2

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> PixelNorm:
        """Read the values from a cache's ``metadata.json`` (any nesting level, e.g. the
        processor fingerprint's ``image`` table), falling back to Qwen3-VL's for absent keys."""
        found: dict[str, Any] = {}

        def walk(d: Mapping[str, Any]) -> None:
            for k, v in d.items():
                if isinstance(v, Mapping):
                    walk(v)
                elif k not in found:
                    found[k] = v

        walk(metadata)
        d = cls()
        mean = found.get("image_mean", found.get("mean", d.mean))
        std = found.get("image_std", found.get("std", d.std))
        return cls(
            mean=tuple(float(x) for x in mean),  # type: ignore[arg-type]
            std=tuple(float(x) for x in std),  # type: ignore[arg-type]
            temporal_patch_size=int(found.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(found.get("merge_size", found.get("spatial_merge_size", d.merge_size))),
        )


def normalize(pixel_u8: torch.Tensor, norm: PixelNorm) -> torch.Tensor:
    """uint8 [..., 768] -> float32 [..., 768 * T] exactly as the HF processor (on any device).

    Delegates to ``device.normalize.normalize_pixels`` (the AsyncDeviceLoader's) when present (one implementation for
    collate and device), else to ``vl.processor.normalize_patches``.
    """
    fn = _normalizer()
    lead = pixel_u8.shape[:-1]
    flat = pixel_u8.reshape(-1, pixel_u8.shape[-1])
    out = fn(flat, mean=norm.mean, std=norm.std, temporal_patch_size=norm.temporal_patch_size)
    return out.reshape(*lead, out.shape[-1])


_NORMALIZER = None


def _normalizer():
    global _NORMALIZER
    if _NORMALIZER is None:
        try:
            from torchtitan_ext.device.normalize import normalize_pixels as fn
        except ImportError:  # staging helper's module absent: the processor has the same op
            from torchtitan_ext.vl.processor import normalize_patches as fn
        _NORMALIZER = fn
    return _NORMALIZER


def _pad_stack(tensors: Sequence[torch.Tensor], length: int, value: int) -> torch.Tensor:
    """Stack 1-D (or [..., L]) tensors along a new dim 0, right-padding the last dim."""
    if len(tensors) == 1 and tensors[0].shape[-1] == length:
        return tensors[0].unsqueeze(0)
    out = torch.full((len(tensors), *tensors[0].shape[:-1], length), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, ..., : t.shape[-1]] = t
    return out


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors), dim=0)


def batch_length(packs: Sequence[Mapping[str, torch.Tensor]], pad_to: int | None = None) -> int:
    """Padded length of a batch: the longest pack (a bucket length), or ``pad_to`` if larger."""
    longest = max(int(p["input_ids"].shape[-1]) for p in packs)
    return max(longest, pad_to or 0)


def collate_hf(
    packs: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int,
    norm: PixelNorm = PixelNorm(),
    normalize_on: NormalizeOn = "collate",
    pad_to: int | None = None,
) -> dict[str, Any]:
    """Packs -> Qwen3-VL forward kwargs (see the module docstring)."""
    if not packs:
        raise ValueError("collate_hf needs at least one pack")
    length = batch_length(packs, pad_to)
    pos = _pad_stack([p["position_ids"] for p in packs], length, 0)  # [B, 4, L]
    batch: dict[str, Any] = {
        "input_ids": _pad_stack([p["input_ids"] for p in packs], length, pad_id),
        "labels": _pad_stack([p["labels"] for p in packs], length, IGNORE_INDEX),
        "position_ids": pos.transpose(0, 1),  # [4, B, L]
        "image_grid_thw": _cat([p["image_grid_thw"] for p in packs]),
        "use_cache": False,
    }
    pixels = _cat([p["pixel_u8"] for p in packs])
    if normalize_on == "collate":
        batch["pixel_values"] = normalize(pixels, norm)
    elif normalize_on == "device":
        batch["pixel_values"] = pixels  # uint8: normalised after the device copy
    else:
        raise ValueError(f"normalize_on must be 'collate' or 'device', got {normalize_on!r}")
    if batch["image_grid_thw"].shape[0] == 0:
        # No image: the model must not see empty image inputs.
        batch.pop("pixel_values")
        batch.pop("image_grid_thw")
    add_videos(batch, packs, mean=norm.mean, std=norm.std, normalize_on=normalize_on)
    return batch


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF's unshifted labels [B, L] -> torchtitan's: ``out[:, t]`` is the target of token ``t``
    (``labels[:, t + 1]``), -100 at the end. torchtitan's loss compares position ``t`` of the
    logits with position ``t`` of the labels; transformers shifts inside its loss instead."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    return out


def collate_qwen3_vl(
    packs: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int,
    norm: PixelNorm = PixelNorm(),
    normalize_on: NormalizeOn = "collate",
    pad_to: int | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Packs -> ``(input_dict, labels)`` for the ``qwen3_vl`` model (see the module docstring)."""
    batch = collate_hf(packs, pad_id=pad_id, norm=norm, normalize_on=normalize_on, pad_to=pad_to)
    del batch["use_cache"]  # the model never uses a KV cache
    labels = shift_labels(batch.pop("labels"))
    return {"input": batch.pop("input_ids"), **batch}, labels


def _pad_per_image(pixels: torch.Tensor, grid_thw: torch.Tensor, merge_size: int) -> torch.Tensor:
    """[sum N, D] -> [n_img, max_patches, D], each image's rows first, the rest exactly 0."""
    counts = grid_thw.prod(dim=1).tolist()
    unit = merge_size * merge_size
    max_patches = -(-max(counts) // unit) * unit
    out = pixels.new_empty((len(counts), max_patches, pixels.shape[-1]))
    # One slice copy per image (a boolean-mask scatter measured ~10x slower) and zero only the
    # padding tail. On the CPU through numpy: a plain single-threaded memcpy; torch's parallel
    # copy measured 23 ms instead of 3 ms per 21 MB pack on the loaded 2-core box (its two
    # intra-op threads contend with the rest of the machine).
    src, dst = (pixels.numpy(), out.numpy()) if pixels.device.type == "cpu" else (pixels, out)
    o = 0
    for i, c in enumerate(counts):
        dst[i, :c] = src[o : o + c]
        dst[i, c:] = 0
        o += c
    if o != pixels.shape[0]:
        raise ValueError(f"grid_thw accounts for {o} patches but pixel rows are {pixels.shape[0]}")
    return out


def _zero_padding(values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
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
    if has_video(packs):
        raise ValueError(
            "batch_format 'torchtitan' carries images only and this pack holds video "
            "(video_grid_thw); use batch_format 'qwen3_vl' or 'hf'"
        )
    tt_tokens = torchtitan_special_tokens(special_tokens)
    length = batch_length(packs, pad_to)
    tokens = _pad_stack([p["input_ids"] for p in packs], length, tt_tokens["pad_id"])
    labels = shift_labels(_pad_stack([p["labels"] for p in packs], length, IGNORE_INDEX))
    pos = _pad_stack([p["position_ids"] for p in packs], length, 0)  # [B, 4, L]
    grid = _cat([p["image_grid_thw"] for p in packs])
    input_dict: dict[str, Any] = {
        "input": tokens,
        "positions": pos[:, 0].contiguous(),
        "pixel_values": None,
        "grid_thw": None,
        "pixel_values_videos": None,
        "grid_thw_videos": None,
        "special_tokens": tt_tokens,
    }
    if grid.shape[0]:
        pixels = _cat([p["pixel_u8"] for p in packs])
        input_dict["grid_thw"] = grid
        mrope = pos[:, 1:].permute(0, 2, 1).contiguous()  # [B, L, 3]
        _number_padding(mrope, [_real_length(p) for p in packs])
        input_dict["mrope_positions"] = mrope
        u8 = _pad_per_image(pixels, grid, norm.merge_size)
        if normalize_on == "collate":
            # pad the uint8 rows first, then normalise once: one float pass instead of two
            input_dict["pixel_values"] = _zero_padding(normalize(u8, norm), grid)
        elif normalize_on == "device":
            # uint8, zero-padded per image; finish_on_device re-zeroes the pad rows after
            # normalising (AsyncDeviceLoader's plain normalise leaves them at (0-mean)/std; the
            # model never reads them: vision tokens are cut to grid_thw's counts).
            input_dict["pixel_values"] = u8
        else:
            raise ValueError(f"normalize_on must be 'collate' or 'device', got {normalize_on!r}")
    return input_dict, labels


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


def finish_on_device(batch: Any, norm: PixelNorm = PixelNorm()) -> Any:
    """Turn a ``normalize_on="device"`` batch into the final one, on whatever device it lives.

    Accepts either format: an HF kwargs dict with uint8 ``pixel_values`` [N, 768] or a torchtitan
    ``(input_dict, labels)`` with uint8 ``pixel_values`` [n_img, max_patches, 768] (pad rows are
    set back to exactly 0 like torchtitan's collator, using ``grid_thw``). A uint8
    ``pixel_values_videos`` is normalised with the video formula (``vl/video_batch.py``).
    Tensors already float (or absent) pass through unchanged.
    """
    if isinstance(batch, tuple):
        input_dict, labels = batch
        return finish_on_device(input_dict, norm), labels
    if not isinstance(batch, dict):
        return batch
    finish_videos(batch, mean=norm.mean, std=norm.std)
    u8 = batch.get("pixel_values")
    if not isinstance(u8, torch.Tensor) or u8.dtype != torch.uint8:
        return batch
    values = normalize(u8, norm)
    if u8.dim() == 3:  # torchtitan layout: zero the padding rows again
        values = _zero_padding(values, batch["grid_thw"])
    batch["pixel_values"] = values
    return batch


class PackCollator:
    """Picklable collate_fn (DataLoader workers) for either format."""

    def __init__(
        self,
        batch_format: BatchFormat,
        special_tokens: Mapping[str, int],
        norm: PixelNorm = PixelNorm(),
        normalize_on: NormalizeOn = "collate",
        pad_to: int | None = None,
    ) -> None:
        if batch_format not in BATCH_FORMATS:
            raise ValueError(f"batch_format must be one of {BATCH_FORMATS}, got {batch_format!r}")
        if normalize_on not in ("collate", "device"):
            raise ValueError(f"normalize_on must be 'collate' or 'device', got {normalize_on!r}")
        self.batch_format, self.normalize_on, self.norm, self.pad_to = (
            batch_format,
            normalize_on,
            norm,
            pad_to,
        )
        self.special_tokens = dict(special_tokens)
        self.pad_id = torchtitan_special_tokens(special_tokens)["pad_id"]

    @property
    def copies_pixels(self) -> bool:
        """True when no batch holds a pack's own ``pixel_u8`` tensor: the torchtitan layout
        copies it into per-image padding, and ``normalize_on="collate"`` makes new float pixels.
        Then the packs may view the cache's mapping (``CachedVLDataset(copy_pixels=False)``); an
        ``"hf"`` / ``"qwen3_vl"`` batch normalised on the device hands the pack's tensor itself
        to the staging copy, so there the pack keeps its private copy."""
        return self.batch_format == "torchtitan" or self.normalize_on == "collate"

    def __call__(self, packs: Sequence[Mapping[str, torch.Tensor]]) -> Any:
        if self.batch_format == "qwen3_vl":
            return collate_qwen3_vl(
                packs,
                pad_id=self.pad_id,
                norm=self.norm,
                normalize_on=self.normalize_on,
                pad_to=self.pad_to,
            )
        if self.batch_format == "hf":
            return collate_hf(
                packs,
                pad_id=self.pad_id,
                norm=self.norm,
                normalize_on=self.normalize_on,
                pad_to=self.pad_to,
            )
        return collate_torchtitan(
            packs,
            special_tokens=self.special_tokens,
            norm=self.norm,
            normalize_on=self.normalize_on,
            pad_to=self.pad_to,
        )
