"""Pixel normalisation for uint8 Qwen2/3-VL patches: ``(x / 255 - mean) / std`` + temporal expansion.

A VL cache stores ``pixel_values`` as uint8 patch rows (4x fewer bytes on disk, in pinned memory
and over PCIe than float32) and normalises them late: on the device right after the H2D copy
(``AsyncDeviceLoader``) or on the CPU in a collate function. Both call :func:`normalize_pixels`,
so the two paths produce the same bits.

Layout. The processor's patchify emits one row per patch in channel-major order
``[C, T, P, P]`` (``C=3`` channels, ``T=temporal_patch_size`` frames, ``P=patch_size``). A still
image repeats its single frame ``T`` times *inside each channel*, so a uint8 row stored with one
frame, ``[C, 1, P, P]`` (768 values for P=16), expands to ``[C, T, P, P]`` (1536) per channel
(reshape ``[N, C, 1, P*P]`` -> expand ``[N, C, T, P*P]`` -> flatten). It is *not* two copies of
the 768-value row back to back.

Bit-exactness. transformers' ``Qwen2VLImageProcessorPil`` computes
``float32(float64(x) * (1/255))`` then ``(x - mean_f32) / std_f32`` in float32. For all 256 uint8
values ``float32(x) / 255.0`` (a correctly rounded float32 division) gives the same bits, while
``float32(x) * float32(1/255)`` differs in 126 of 256 values (checked exhaustively in the tests).
PyTorch's CUDA kernel turns division by a *CPU scalar* into multiplication by its reciprocal, so
every constant here is a tensor on the input's device, which keeps a true division everywhere.

Cost (``python -m benchmarks staging``): on a GPU a handful of elementwise kernels over
``N x 1536`` floats, negligible next to a training step. On the 2-core CPU box, 4096 x 768 uint8
rows take ~1 ms into a pre-allocated ``out`` on an idle core and ~10-20 ms into a fresh tensor
(page faults of the 24 MiB output); with the box saturated by other jobs we measured up to 130 ms.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "QWEN3_VL_MEAN",
    "QWEN3_VL_STD",
    "PixelNormalize",
    "normalize_pixels",
    "normalized_shape",
]

QWEN3_VL_MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
"""Qwen3-VL's image mean (its processor config); Qwen2-VL used the CLIP mean instead."""
QWEN3_VL_STD: tuple[float, float, float] = (0.5, 0.5, 0.5)
"""Qwen3-VL's image std."""


def normalized_shape(
    shape: Sequence[int], num_channels: int, temporal_patch_size: int, input_temporal: int = 1
) -> tuple[int, ...]:
    """Shape of :func:`normalize_pixels`' output for an input of ``shape``.

    Raises ``ValueError`` if the last dimension is not ``num_channels * input_temporal * k``.
    """
    if not shape:
        raise ValueError("pixel tensor must have at least one dimension (the patch row)")
    d = int(shape[-1])
    per = num_channels * input_temporal
    if d % per:
        raise ValueError(
            f"pixel rows have {d} values, not a multiple of channels({num_channels}) x "
            f"input_temporal({input_temporal})"
        )
    return (*[int(s) for s in shape[:-1]], d // input_temporal * temporal_patch_size)


@functools.lru_cache(maxsize=32)
def _constants(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mean, std, 255 as float32 tensors on ``device``, created once per device.

    Device tensors rather than Python scalars: CUDA's division by a *CPU scalar* is a multiply by
    its reciprocal, which is not bit-exact (module docstring). Cached because creating them is a
    synchronous pageable H2D copy that would stall the copy stream's host thread on every batch.
    """
    c = len(mean)
    m = torch.tensor(mean, dtype=torch.float32).to(device).view(1, c, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).to(device).view(1, c, 1, 1)
    return m, s, torch.tensor(255.0, dtype=torch.float32).to(device)


def normalize_pixels(
    pixels: torch.Tensor,
    mean: Sequence[float] = QWEN3_VL_MEAN,
    std: Sequence[float] = QWEN3_VL_STD,
    temporal_patch_size: int = 2,
    *,
    input_temporal: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise uint8 patch rows to float32 exactly like the HF Qwen2-VL PIL image processor.

    Args:
        pixels: uint8 tensor ``[..., C * input_temporal * P * P]``; each row in channel-major
            ``[C, input_temporal, P, P]`` order (the processor's patchify of the uint8 image).
        mean, std: per-channel constants (``len(mean) == C``).
        temporal_patch_size: frames per output row ``T``. Rows with ``input_temporal == 1`` are
            repeated ``T`` times inside each channel; ``input_temporal == T`` means no expansion.
        input_temporal: frames per stored row (1 for still images stored compactly).
        out: optional float32 tensor of the output shape to write into (pre-allocated buffers).

    Returns:
        float32 tensor ``[..., C * T * P * P]`` on ``pixels.device``.
    """
    if pixels.dtype != torch.uint8:
        raise TypeError(f"normalize_pixels expects uint8 pixels, got {pixels.dtype}")
    if len(mean) != len(std):
        raise ValueError(f"mean has {len(mean)} channels but std has {len(std)}")
    if input_temporal not in (1, temporal_patch_size):
        raise ValueError(
            f"input_temporal must be 1 or temporal_patch_size ({temporal_patch_size}), "
            f"got {input_temporal}"
        )
    c = len(mean)
    oshape = normalized_shape(pixels.shape, c, temporal_patch_size, input_temporal)
    dev = pixels.device
    m, s, d255 = _constants(tuple(float(v) for v in mean), tuple(float(v) for v in std), dev)
    k = pixels.shape[-1] // (c * input_temporal)
    x = pixels.reshape(-1, c, input_temporal, k)
    t = temporal_patch_size
    if out is None:
        out = torch.empty(oshape, dtype=torch.float32, device=dev)
    elif tuple(out.shape) != oshape or out.dtype != torch.float32 or out.device != dev:
        raise ValueError(
            f"out must be float32 {oshape} on {dev}, got {out.dtype} {tuple(out.shape)} "
            f"on {out.device}"
        )
    # Computed in place inside `out` (no float temporary: on CPU, page-faulting a fresh temporary
    # cost more than the arithmetic), then the first frame is replicated per channel.
    o = out.view(-1, c, t, k)
    first = o[:, :, :input_temporal, :]
    first.copy_(x)  # uint8 -> float32 is exact
    first.div_(d255).sub_(m).div_(s)
    if t > input_temporal:
        o[:, :, input_temporal:, :].copy_(first.expand(-1, c, t - input_temporal, k))
    return out


@dataclass(frozen=True)
class PixelNormalize:
    """Which uint8 tensors to normalise right after the copy, and how."""

    keys: tuple[str, ...] = ("pixel_values",)
    """Dict keys (at any nesting depth) whose uint8 tensors are normalised; other dtypes pass
    through unchanged (counted in stats as ``staging/normalize_passthrough``)."""
    mean: tuple[float, ...] = QWEN3_VL_MEAN
    """Per-channel mean (Qwen3-VL: 0.5)."""
    std: tuple[float, ...] = QWEN3_VL_STD
    """Per-channel std (Qwen3-VL: 0.5)."""
    temporal_patch_size: int = 2
    """Frames per output row; stored rows with ``input_temporal=1`` are expanded per channel."""
    input_temporal: int = 1
    """Frames per stored uint8 row (1: [N, 768] for P=16; equal to temporal_patch_size: none)."""

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return normalize_pixels(
            x,
            self.mean,
            self.std,
            self.temporal_patch_size,
            input_temporal=self.input_temporal,
            out=out,
        )

    def out_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return normalized_shape(
            shape, len(self.mean), self.temporal_patch_size, self.input_temporal
        )
