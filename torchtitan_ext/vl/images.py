"""Images for the Qwen3-VL cache: decode, upright, RGB, resize, uint8 patchify; normalise later.

The fast path of ``vl/sample.py``: decode -> convert to RGB exactly like
``transformers.image_transforms.convert_to_rgb`` (alpha composited onto white) -> one PIL bicubic
resize to ``smart_resize``'s size (the same call the HF PIL backend makes) -> uint8 patchify,
band by band in whole patch rows, into the processor's row layout with the duplicated temporal
half dropped ([N, 3*16*16] = [N, 768]). The HF path instead rescales and normalises the whole image in
float64/float32 and broadcasts the temporal copy; doing that later (``normalize_patches``, on the
device or at collate) reproduces its ``pixel_values`` bit-exactly because the HF PIL backend also
resizes in uint8 before converting.

Speed against the HF processor on 640x480 JPEGs and on the sample set's thumbnails, decode
included on both sides: ``python -m benchmarks vl_preprocess`` (tables in
``benchmarks/RESULTS.md``; its "floor" rows time the PIL work alone). Pixels are identical
after ``normalize_patches``.
"""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from torchtitan_ext.vl.errors import SampleError


def normalize_patches(
    u8: torch.Tensor | np.ndarray,
    mean: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
    temporal_patch_size: int = 2,
    rescale_factor: float = 1 / 255,
) -> torch.Tensor:
    """uint8 patches [N, C*p*p] -> float32 [N, C*T*p*p] equal to the HF processor's pixel_values.

    The HF PIL backend computes ``float32(float64(x) * rescale_factor)``, then ``(x - mean) / std``
    in float32 per channel, then the temporal copy (the row layout is (C, T, ph, pw)).

    On the CPU the result is one float32 value per (channel, uint8 value), so a float32 formula
    that gives the reference's bits for all 256 values of every channel gives them for every
    input: ``_cpu_norm`` (once per mean/std/factor) picks the first such formula -- for Qwen's
    constants ``x / 127.5 - 1``, two operations -- or, where none is exact, the 256 reference
    values. Each operation is a correctly rounded IEEE one, the same bits whether numpy takes
    a SIMD or a scalar loop. It runs in blocks of rows into one small temporary, broadcast once
    into the [N, C, T, p*p] output: no float64 pass, no full-size temporaries. On any other
    device the reference torch arithmetic runs there (``_normalize_reference``); IEEE float64
    multiply and float32 subtract/divide are correctly rounded on CUDA too, so it should be
    identical; that is tested by a ``cuda``-marked test but was not run here (no GPU).
    """
    x = torch.as_tensor(u8)
    if x.dtype != torch.uint8 or x.dim() != 2:
        raise ValueError(
            f"normalize_patches expects uint8 [N, C*p*p], got {x.dtype} {tuple(x.shape)}"
        )
    c = len(mean)
    n, d = x.shape
    if d % c:
        raise ValueError(f"row width {d} not divisible by {c} channels")
    if x.device.type != "cpu":
        return _normalize_reference(x, mean, std, temporal_patch_size, rescale_factor)
    norm = _cpu_norm(tuple(map(float, mean)), tuple(map(float, std)), float(rescale_factor))
    k = d // c
    src = x.numpy().reshape(n, c, 1, k)
    out = np.empty((n, c, temporal_patch_size, k), np.float32)
    if norm.lut is None:
        # in blocks of rows, so that the float32 temporary stays in the CPU cache and memory
        # sees one write of the output (the arithmetic is elementwise: blocks change no bit)
        step = max(1, _NORM_BLOCK_BYTES // (4 * d))
        tmp = np.empty((min(n, step), c, 1, k), np.float32)
        for i in range(0, n, step):
            f = tmp[: min(step, n - i)]
            norm.apply(src[i : i + step], f)
            out[i : i + step] = f  # the temporal copy: one broadcast write
    else:
        for ch in range(c):
            out[:, ch] = norm.lut[ch][src[:, ch]]
    return torch.from_numpy(out.reshape(n, c * temporal_patch_size * k))


_NORM_BLOCK_BYTES = 768 * 1024
"""Size of ``normalize_patches``' float32 temporary (256 rows of 768 values), small enough to
stay in the CPU cache, so memory sees the output written once rather than several passes over
a full-size temporary. On the 2-core EPYC box 128-512 rows per block were within noise of each
other and of one whole-array temporary when the box was otherwise idle."""


def _normalize_reference(
    x: torch.Tensor,
    mean: tuple[float, ...] | list[float],
    std: tuple[float, ...] | list[float],
    temporal_patch_size: int,
    rescale_factor: float,
) -> torch.Tensor:
    """The HF PIL backend's arithmetic step by step in torch, on ``x``'s device."""
    c = len(mean)
    n, d = x.shape
    # float64 product then one rounding to float32: bit-identical to np_rescale.
    f = (x.to(torch.float64) * rescale_factor).to(torch.float32).view(n, c, d // c)
    m = torch.tensor(mean, dtype=torch.float32, device=f.device).view(1, c, 1)
    s = torch.tensor(std, dtype=torch.float32, device=f.device).view(1, c, 1)
    f = (f - m) / s
    return (
        f.unsqueeze(2).expand(n, c, temporal_patch_size, d // c).reshape(n, temporal_patch_size * d)
    )


@dataclass(frozen=True)
class _CpuNorm:
    """How the CPU path of ``normalize_patches`` computes one (mean, std, factor): a float32
    formula ``x / divisor - mean`` (then ``/ std`` unless folded in), constants [1, C, 1, 1],
    or, where no formula gave the reference's bits, the 256 reference values per channel."""

    divisor: np.ndarray
    mean: np.ndarray
    std: np.ndarray | None
    """None: folded into ``divisor`` and ``mean``."""
    lut: np.ndarray | None = None
    """float32 [C, 256]: the reference values, used instead of the formula when set."""

    def apply(self, src: np.ndarray, out: np.ndarray) -> None:
        """uint8 [n, C, 1, k] -> float32 ``out`` of the same shape (formula only)."""
        np.divide(src, self.divisor, out=out, dtype=np.float32)
        np.subtract(out, self.mean, out=out)
        if self.std is not None:
            np.divide(out, self.std, out=out)


@functools.lru_cache(maxsize=32)
def _cpu_norm(mean: tuple[float, ...], std: tuple[float, ...], rescale_factor: float) -> _CpuNorm:
    """The first float32 formula that gives the reference's bits for every uint8 value of every
    channel -- the output depends on nothing else, so that proves it for all inputs -- else the
    reference values. Candidates: ``x / (255 * std) - mean / std`` (two operations; exact when
    every std is a power of two, as Qwen's 0.5: scaling by 2^k commutes with rounding), then
    ``(x / 255 - mean) / std`` (``float32(x) / 255`` equals ``float32(float64(x) / 255)`` for
    all 256 values)."""
    c = len(mean)
    values = torch.arange(256, dtype=torch.uint8).repeat(c).view(1, c * 256)
    ref = _normalize_reference(values, mean, std, 1, rescale_factor).numpy().reshape(c, 256)
    inv = 1.0 / rescale_factor
    div = float(round(inv)) if abs(inv - round(inv)) < 1e-6 else inv
    m, sd = np.asarray(mean, np.float64), np.asarray(std, np.float64)

    def col(v) -> np.ndarray:
        return np.asarray(v, np.float32).reshape(1, c, 1, 1)

    three = _CpuNorm(col([div] * c), col(m), col(sd))
    for cand in (_CpuNorm(col(div * sd), col(m / sd), None), three):
        got = np.empty((1, c, 1, 256), np.float32)
        cand.apply(values.numpy().reshape(1, c, 1, 256), got)
        if np.array_equal(got.reshape(c, 256).view(np.int32), ref.view(np.int32)):
            return cand
    return _CpuNorm(three.divisor, three.mean, three.std, lut=np.ascontiguousarray(ref))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' ``smart_resize`` (qwen2_vl), re-exported for cheap size checks."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as sr

    return sr(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def to_rgb(img: Image.Image) -> Image.Image:
    """Same result as ``transformers.image_transforms.convert_to_rgb`` (transformers 5.23, the
    PIL branch): any transparency -- an alpha band ("A": RGBA, LA, PA) or a ``transparency``
    entry (a palette's tRNS, the colour key of an RGB / L / I;16 PNG) -- is composited onto
    white; else a plain ``convert("RGB")``. Only an RGB image without a colour key is returned
    as it is."""
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if img.mode == "RGB" and not has_alpha:
        return img
    if has_alpha:
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return img.convert("RGB")


@dataclass
class ImageParams:
    """The image-processor values the fast path needs (defaults: Qwen3-VL's)."""

    patch_size: int = 16
    """Vision patch side in pixels."""
    temporal_patch_size: int = 2
    """Frames per patch; still images repeat the frame (dropped in storage, re-added on load)."""
    merge_size: int = 2
    """Patches merged per side into one LLM token (merge_size² patches per token)."""
    min_pixels: int = 65536
    """``size.shortest_edge``: smaller images are upscaled to at least this many pixels."""
    max_pixels: int = 16777216
    """``size.longest_edge``: larger images are downscaled to at most this many pixels."""
    resample: int = 3
    """PIL resampling filter (3 = bicubic)."""
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    """Per-channel mean applied by ``normalize_patches``."""
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    """Per-channel std applied by ``normalize_patches``."""
    rescale_factor: float = 1 / 255
    """uint8 -> [0, 1] factor (applied in float64, as transformers does)."""

    @classmethod
    def from_processor(cls, processor) -> ImageParams:
        ip = processor.image_processor
        size = ip.size
        get = (lambda k: size[k]) if isinstance(size, dict) else (lambda k: getattr(size, k))
        resample = ip.resample
        return cls(
            patch_size=int(ip.patch_size),
            temporal_patch_size=int(ip.temporal_patch_size),
            merge_size=int(ip.merge_size),
            min_pixels=int(get("shortest_edge")),
            max_pixels=int(get("longest_edge")),
            resample=int(getattr(resample, "value", resample)),
            mean=tuple(float(v) for v in ip.image_mean),
            std=tuple(float(v) for v in ip.image_std),
            rescale_factor=float(ip.rescale_factor),
        )

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        try:
            return smart_resize(
                height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
            )
        except ValueError as e:  # aspect ratio > 200
            raise SampleError("bad_aspect_ratio", f"{width}x{height}: {e}") from None


def image_to_patches(img: Image.Image, p: ImageParams) -> tuple[np.ndarray, tuple[int, int, int]]:
    """PIL image -> (uint8 [gh*gw, 3*ps*ps] in the processor's row order, grid (1, gh, gw)).

    Grey ("L") images are resized as one band and the band is copied to R, G, B during the
    patch copy: HF converts L -> RGB (pure replication) before its bicubic resize, and Pillow
    resamples every band with the same integer kernel, so the bytes are identical (tested) at a
    third of the resize cost.

    The copy runs band by band (Pillow's ``split`` makes the planar bands in C) and moves whole
    patch rows: a row of ``ps`` pixels of one band is ``ps`` contiguous bytes in the source and
    in the output, so viewing both as one ``ps``-byte item turns a gather of single bytes into a
    copy of ``ps``-byte items (about 4-8x fewer, longer numpy inner loops).
    """
    grey = img.mode == "L" and img.info.get("transparency") is None
    src = img if grey else to_rgb(img)
    w, h = src.size
    rh, rw = p.target_size(h, w)
    if (rh, rw) != (h, w):
        src = src.resize((rw, rh), resample=p.resample)
    ps, m = p.patch_size, p.merge_size
    gh, gw = rh // ps, rw // ps
    row = np.dtype((np.void, ps))  # one patch row of one band
    out = np.empty((gh // m, gw // m, m, m, 3, ps, ps), np.uint8)
    dst = out.view(row)[..., 0]  # (gh/m, gw/m, m_h, m_w, C, ps_h) rows
    for c, band in enumerate([src] if grey else src.split()):
        a = _band_array(band).view(row).reshape(gh // m, m, ps, gw // m, m)
        # (gh/m, m_h, ps_h, gw/m, m_w) -> (gh/m, gw/m, m_h, m_w, ps_h): the HF row order.
        dst[:, :, :, :, c] = a.transpose(0, 3, 1, 4, 2)
    if grey:
        dst[:, :, :, :, 1] = dst[:, :, :, :, 0]
        dst[:, :, :, :, 2] = dst[:, :, :, :, 0]
    return out.reshape(gh * gw, 3 * ps * ps), (1, gh, gw)


def _band_array(band: Image.Image) -> np.ndarray:
    """A one-band uint8 image's pixels [H, W], without a copy where Pillow can export them
    (Arrow C data interface; a large image split over several memory blocks cannot: copied)."""
    import pyarrow as pa

    try:
        buf = pa.array(band).buffers()[-1]
    except ValueError:  # "Image rows are not contiguous in memory"
        return np.asarray(band)
    return np.frombuffer(buf, np.uint8, band.width * band.height).reshape(band.height, band.width)


_PIL_DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
"""What PIL raises for truncated or corrupt data (SyntaxError for some broken headers)."""


def decode_image(
    data: Any,
    max_image_pixels: int | None = None,
    exif_transpose: bool = True,
    root: str | Path | None = None,
) -> Image.Image:
    """An image cell -> a PIL image, or SampleError.

    Cells: raw bytes, an HF ``Image`` struct ``{"bytes", "path"}`` (the bytes when present, else
    the file at ``path``), a path string, or a PIL image. A relative path is read relative to
    ``root`` (the dataset directory) when given.

    The image is opened lazily (header only) and its pixel count checked before any decoding.
    ``exif_transpose``: an image carrying an orientation tag is decoded and turned upright here,
    exactly as ``datasets``' ``Image`` feature does (``ImageOps.exif_transpose`` whenever the tag
    is present); other images stay lazy until ``load_image`` (a PNG's tag is looked for there).
    No bytes or an unreadable file is ``missing_image``, corrupt data ``corrupt_image``; any other
    exception while reading is ``decode_error`` (with its class).
    """
    if data is None:
        raise SampleError("missing_image", "image is None")
    if isinstance(data, Image.Image):
        img = data
    else:
        if isinstance(data, dict):
            data = data.get("bytes") if data.get("bytes") is not None else data.get("path")
        if isinstance(data, (str, os.PathLike)) and str(data):
            data = _read_path(Path(data), root)
        if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) == 0:
            raise SampleError("missing_image", f"no image bytes ({type(data).__name__})")
        img = _decoding(lambda: Image.open(io.BytesIO(data)))
    if max_image_pixels is not None and img.width * img.height > max_image_pixels:
        raise SampleError(
            "image_too_large", f"{img.width}x{img.height} > {max_image_pixels} pixels"
        )
    if exif_transpose:
        if img.format == "PNG" and "exif" not in img.info:
            # PIL reads a PNG's eXIf chunk only with the pixels when it follows them: look
            # after decoding (load_image), so that a PNG stays lazy here.
            img._ttx_exif_after_load = True  # type: ignore[attr-defined]
        else:
            img = _upright(img)
    return img


def _read_path(path: Path, root: str | Path | None) -> bytes:
    full = path if path.is_absolute() or root is None else Path(root) / path
    try:
        return full.read_bytes()
    except OSError as e:
        raise SampleError("missing_image", f"cannot read {full}: {e.strerror or e}") from None


def _upright(img: Image.Image) -> Image.Image:
    """``ImageOps.exif_transpose`` when the image has an orientation tag (EXIF or XMP), as
    ``datasets`` decodes (it decodes the pixels); else the image unchanged."""
    from PIL import ImageOps

    if _decoding(lambda: img.getexif().get(Image.ExifTags.Base.Orientation)) is None:
        return img
    return _decoding(lambda: ImageOps.exif_transpose(img))


def _decoding(fn):
    """Run one PIL step; its failures become the row's SampleError."""
    try:
        return fn()
    except SampleError:
        raise
    except _PIL_DECODE_ERRORS as e:
        raise SampleError("corrupt_image", f"{type(e).__name__}: {e}") from None
    except Exception as e:  # a plugin's unforeseen failure is still this row's, not the build's
        raise SampleError.from_exception("decode_error", e) from None


def load_image(img: Image.Image) -> Image.Image:
    """Decode a lazily opened image; corrupt/truncated data -> SampleError("corrupt_image"),
    anything else -> SampleError("decode_error"). A PNG whose EXIF orientation could only be
    read with its pixels (``decode_image``) is turned upright here."""
    _decoding(img.load)
    if getattr(img, "_ttx_exif_after_load", False):
        return _upright(img)
    return img
