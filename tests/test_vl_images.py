"""Pixels equal transformers' own for every transparency form PIL can express (RGB/L/I;16/1
colour keys, palette tRNS, LA, RGBA, PA, GIF, WebP, TIFF), and the EXIF-orientation option:
upright like ``datasets`` decoding by default, stored order when disabled, part of the key."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from torchtitan_ext.vl import processor as P
from torchtitan_ext.vl import sample as VS


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path_factory.mktemp("vl_images")))
    yield P.load_processor(None)
    mp.undo()


def _enc(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def _arr(h=37, w=53, seed=0) -> np.ndarray:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[: h // 2, : w // 2] = (200, 10, 90)  # a block of the colour used as key below
    return a


def _transparency_forms() -> dict[str, bytes | Image.Image]:
    a = _arr()
    g = a[..., 0]
    pal = Image.fromarray(a).quantize(16)
    i16 = Image.fromarray(g.astype(np.uint16) * 257)
    rgba = Image.fromarray(np.dstack([a, np.arange(a.size // 3, dtype=np.uint8).reshape(g.shape)]))
    la = Image.fromarray(np.dstack([g, a[..., 1]]), "LA")
    return {
        "RGB + tRNS colour key": _enc(Image.fromarray(a), transparency=(200, 10, 90)),
        "L + tRNS grey key": _enc(Image.fromarray(g), transparency=int(g[0, 0])),
        "I;16 + tRNS key": _enc(i16, transparency=int(g[0, 0]) * 257),
        "1-bit + tRNS key": _enc(Image.fromarray(g > 128).convert("1"), transparency=1),
        "P + tRNS alpha table": _enc(pal, transparency=bytes(range(0, 256, 16))),
        "P + tRNS index": _enc(pal, transparency=3),
        "LA": _enc(la),
        "RGBA": _enc(rgba),
        "GIF P + transparency index": _enc(pal, "GIF", transparency=2),
        "WebP RGBA": _enc(rgba, "WEBP", lossless=True),
        "TIFF LA": _enc(la, "TIFF"),
        "TIFF RGBA": _enc(rgba, "TIFF"),
        "PA (in memory)": rgba.convert("PA"),
        "RGBa premultiplied (in memory)": rgba.convert("RGBa"),
    }


def _hf_pixels(proc, img: Image.Image) -> torch.Tensor:
    """transformers' own path: Qwen2VLImageProcessorPil (convert_to_rgb, resize, rescale,
    normalise) on the image as given."""
    return VS.hf_process(proc, [img], "q", "a")["pixel_values"]


@pytest.mark.parametrize("name", list(_transparency_forms()))
def test_every_transparency_form_bit_exact_to_hf(proc, name):
    data = _transparency_forms()[name]

    def opened():
        return Image.open(io.BytesIO(data)) if isinstance(data, bytes) else data.copy()

    ref = _hf_pixels(proc, opened())
    src = {"bytes": data, "path": None} if isinstance(data, bytes) else data
    ours = VS.process_sample(proc, P.decode_image(src), "q", "a")
    assert torch.equal(P.normalize_patches(ours.pixel_u8), ref), name


def test_colour_key_matters(proc):
    """The keyed pixels really are composited (white), not returned as stored: the case the
    plain-RGB shortcut got wrong."""
    data = _transparency_forms()["RGB + tRNS colour key"]
    keyed = P.to_rgb(Image.open(io.BytesIO(data)))
    plain = Image.open(io.BytesIO(data)).convert("RGB")
    assert np.asarray(keyed)[0, 0].tolist() == [255, 255, 255]
    assert np.asarray(plain)[0, 0].tolist() == [200, 10, 90]


# ---------------------------------------------------------------------------------- EXIF


def _exif(orientation: int) -> bytes:
    e = Image.Exif()
    e[Image.ExifTags.Base.Orientation] = orientation
    return e.tobytes()


def _png_with_late_exif(img: Image.Image, orientation: int) -> bytes:
    """A PNG whose eXIf chunk follows the pixel data (PIL reads it only when decoding)."""
    raw = _enc(img)
    iend = raw.rindex(b"IEND") - 4
    body = _exif(orientation)
    if body.startswith(b"Exif\x00\x00"):
        body = body[6:]
    chunk = struct.pack(">I", len(body)) + b"eXIf" + body
    chunk += struct.pack(">I", zlib.crc32(b"eXIf" + body) & 0xFFFFFFFF)
    return raw[:iend] + chunk + raw[iend:]


@pytest.mark.parametrize(
    ("fmt", "orientation"),
    [("JPEG", 6), ("JPEG", 8), ("JPEG", 3), ("JPEG", 2), ("PNG", 6), ("PNG", 5), ("WEBP", 7)],
)
def test_exif_orientation_upright_like_datasets(proc, fmt, orientation):
    import datasets

    img = Image.fromarray(_arr(48, 80, seed=1))
    data = _enc(img, fmt, exif=_exif(orientation), **({"quality": 90} if fmt == "JPEG" else {}))
    upright = datasets.Image().decode_example({"bytes": data, "path": None})
    raw = Image.open(io.BytesIO(data))
    ours = VS.process_sample(proc, P.decode_image(data), "q", "a")
    assert torch.equal(P.normalize_patches(ours.pixel_u8), _hf_pixels(proc, upright))
    off = VS.process_sample(proc, P.decode_image(data, exif_transpose=False), "q", "a")
    assert torch.equal(P.normalize_patches(off.pixel_u8), _hf_pixels(proc, raw))
    if orientation >= 5:  # a quarter turn: the grids are transposed
        assert ours.image_grid_thw[0, 1:].tolist() == off.image_grid_thw[0, 1:].flip(0).tolist()


def test_png_exif_after_the_pixels(proc):
    img = Image.fromarray(_arr(48, 80, seed=2))
    flipped = _png_with_late_exif(img, 3)  # half turn: same size
    assert "exif" not in Image.open(io.BytesIO(flipped)).info  # really only seen on decoding
    ours = VS.process_sample(proc, P.decode_image(flipped), "q", "a")
    ref = _hf_pixels(proc, img.rotate(180))
    assert torch.equal(P.normalize_patches(ours.pixel_u8), ref)
    # a quarter turn found only after decoding changes the token count chosen from the header:
    # a counted skip, never wrong pixels
    with pytest.raises(P.SampleError, match="decode_error"):
        VS.process_sample(proc, P.decode_image(_png_with_late_exif(img, 6)), "q", "a")


def test_exif_option_is_part_of_the_cache_key(tmp_path, monkeypatch):
    from torchtitan_ext.vl.build import build_cache, find_cache
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.sample_data import write_vl_parquet

    monkeypatch.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path / "home"))
    img = Image.fromarray(_arr(48, 96, seed=3))
    rows = [
        {"image": {"bytes": _enc(img, "JPEG", exif=_exif(6)), "path": None},
         "question": "Which way is up?", "answer": "The sky."},
    ]  # fmt: skip
    (tmp_path / "ds").mkdir()
    write_vl_parquet(rows, tmp_path / "ds" / "train-0.parquet")
    kw = dict(buckets=None, show_progress=False)
    on = build_cache(tmp_path / "ds", "train", tmp_path / "c", 1024, 4, **kw)
    assert (
        find_cache(tmp_path / "ds", "train", tmp_path / "c", 1024, 4, exif_transpose=False) is None
    )
    off = build_cache(tmp_path / "ds", "train", tmp_path / "c", 1024, 4, exif_transpose=False, **kw)
    assert on != off
    g_on = VLCache.open(on).pack(0)["image_grid_thw"][0].tolist()
    g_off = VLCache.open(off).pack(0)["image_grid_thw"][0].tolist()
    assert g_on == [1, g_off[2], g_off[1]] and g_on != g_off
    assert VLCache.open(on).metadata["config"]["exif_transpose"] is True
