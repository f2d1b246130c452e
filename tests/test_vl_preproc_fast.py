"""The fast pixel paths of ``vl/images.py`` change no byte.

* ``image_to_patches`` (band by band, ``ps``-byte patch rows, Arrow export) equals the plain
  reference -- HF's order of operations: ``convert_to_rgb`` (grey too), bicubic resize, one numpy
  transpose -- on odd inputs: every PIL mode a dataset brings, 1x1, very wide / tall, a
  downscale, patch size 14, and an image Pillow keeps in several memory blocks (no Arrow export).
* ``normalize_patches`` (float32 formula in row blocks, or the 256 reference values) equals the
  HF arithmetic done step by step, bit for bit, for every uint8 value, across block edges, for
  other means/stds/factors/temporal sizes, and on the fallback path.
* End to end: ``process_sample`` + ``normalize_patches`` equals ``Qwen3VLProcessor`` on the odd
  inputs the transparency tests (``test_vl_images.py``) do not cover.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image

from torchtitan_ext.vl import images as I
from torchtitan_ext.vl import processor as P
from torchtitan_ext.vl import sample as VS


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHTITAN_EXT_CACHE", str(tmp_path_factory.mktemp("vl_preproc_fast")))
    yield P.load_processor(None)
    mp.undo()


def _reference_patches(img: Image.Image, p: I.ImageParams) -> tuple[np.ndarray, tuple]:
    """HF's order: RGB first (L included), resize, then one transpose of the [H, W, 3] array."""
    src = I.to_rgb(img)
    rh, rw = p.target_size(src.height, src.width)
    if (rh, rw) != (src.height, src.width):
        src = src.resize((rw, rh), resample=p.resample)
    ps, m = p.patch_size, p.merge_size
    gh, gw = rh // ps, rw // ps
    a = np.asarray(src).reshape(gh // m, m, ps, gw // m, m, ps, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(a).reshape(gh * gw, 3 * ps * ps), (1, gh, gw)


def _rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _reopen(img: Image.Image, fmt: str, **kw) -> Image.Image:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    out = Image.open(io.BytesIO(b.getvalue()))
    out.load()
    return out


@functools.cache
def _odd_images() -> dict[str, Image.Image]:
    """Built once; nothing here modifies them (the HF path gets a copy)."""
    a = _rgb(37, 53)
    rgb = Image.fromarray(a)
    grey = Image.fromarray(a[..., 0])
    alpha = np.arange(37 * 53, dtype=np.uint8).reshape(37, 53)
    return {
        "RGB": rgb,
        "L (grey, one-band resize)": grey,
        "LA": Image.fromarray(np.dstack([a[..., 0], alpha]), "LA"),
        "RGBA": Image.fromarray(np.dstack([a, alpha])),
        "P": rgb.quantize(16),
        "P + transparency": _reopen(rgb.quantize(16), "PNG", transparency=3),
        "L + transparency key": _reopen(grey, "PNG", transparency=int(a[0, 0, 0])),
        "CMYK JPEG": _reopen(rgb.convert("CMYK"), "JPEG", quality=90),
        "16-bit PNG (I;16)": _reopen(Image.fromarray(a[..., 0].astype(np.uint16) * 257), "PNG"),
        "1-bit": grey.convert("1"),
        "1x1": Image.fromarray(_rgb(1, 1)),
        "1x1 grey": Image.fromarray(_rgb(1, 1)[..., 0]),
        "very wide 2000x12": Image.fromarray(_rgb(12, 2000, 1)),
        "very tall 12x2000": Image.fromarray(_rgb(2000, 12, 2)),
        "640x480 JPEG (no resize)": _reopen(Image.fromarray(_rgb(480, 640, 3)), "JPEG"),
    }


PARAMS = {
    "qwen3-vl": I.ImageParams(),
    "patch 14 (qwen2-vl)": I.ImageParams(patch_size=14, min_pixels=56 * 56, max_pixels=1003520),
    "downscale": I.ImageParams(max_pixels=64 * 64),
}


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("name", list(_odd_images()))
def test_patches_equal_reference_on_odd_inputs(name, params):
    img, p = _odd_images()[name], PARAMS[params]
    got, grid = I.image_to_patches(img, p)
    ref, ref_grid = _reference_patches(img, p)
    assert grid == ref_grid
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    np.testing.assert_array_equal(got, ref, err_msg=f"{name} / {params}")


def test_patches_of_an_image_in_several_memory_blocks():
    """Pillow splits large images over memory blocks; those have no Arrow export and are read
    through ``np.asarray`` instead (forced here with a tiny block size)."""
    import pyarrow as pa

    old = Image.core.get_block_size()
    Image.core.set_block_size(4096)
    try:
        img = Image.fromarray(_rgb(480, 640, 4))
        img.load()
        with pytest.raises(ValueError):  # really not exportable: the fallback runs
            pa.array(img.getchannel(0))
        got, grid = I.image_to_patches(img, I.ImageParams())
    finally:
        Image.core.set_block_size(old)
    ref, ref_grid = _reference_patches(img, I.ImageParams())
    assert grid == ref_grid
    np.testing.assert_array_equal(got, ref)


# ------------------------------------------------------------------------- normalisation


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32).numpy()


CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


@pytest.mark.parametrize(
    ("mean", "std", "factor", "t"),
    [
        ((0.5,) * 3, (0.5,) * 3, 1 / 255, 2),
        (*CLIP, 1 / 255, 2),
        ((0.5,) * 3, (0.5,) * 3, 1 / 127, 1),
        ((0.1, 0.2, 0.3), (0.7, 0.8, 0.9), 1 / 255, 3),
        ((0.1, 0.2, 0.3), (0.25, 0.5, 1.0), 1 / 255, 2),
        ((0.5,) * 3, (0.5,) * 3, 0.003, 2),  # no float32 formula is exact: 256-value table
    ],
)
def test_normalize_every_value_bit_exact(mean, std, factor, t):
    """Each channel sees all 256 values, so this is every input the function can get."""
    rows = torch.arange(256, dtype=torch.uint8).repeat(3 * 4).view(4, 768)
    rows[1:] = rows[1:].roll(37, dims=1)  # values at other positions too
    got = I.normalize_patches(rows, mean, std, t, factor)
    ref = I._normalize_reference(rows, mean, std, t, factor)
    assert got.shape == (4, 768 * t) and got.dtype == torch.float32 and got.is_contiguous()
    np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_normalize_picks_the_first_exact_formula():
    """Qwen's std 0.5 folds into the divisor (two operations); CLIP's std does not (three);
    a factor that is not 1/integer gets the 256 reference values."""
    qwen = I._cpu_norm((0.5,) * 3, (0.5,) * 3, 1 / 255)
    assert qwen.lut is None and qwen.std is None
    clip = I._cpu_norm(*CLIP, 1 / 255)
    assert clip.lut is None and clip.std is not None
    assert I._cpu_norm((0.5,) * 3, (0.5,) * 3, 0.003).lut is not None


@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 700])
def test_normalize_across_row_blocks(n):
    """Row counts around the block size, and no rows at all (an image-less sample)."""
    u8 = torch.from_numpy(np.random.default_rng(n).integers(0, 256, (n, 768), dtype=np.uint8))
    got = I.normalize_patches(u8)
    assert got.shape == (n, 1536)
    if n:
        ref = I._normalize_reference(u8, (0.5,) * 3, (0.5,) * 3, 2, 1 / 255)
        np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_normalize_accepts_numpy_and_strided_rows():
    u8 = np.random.default_rng(5).integers(0, 256, (40, 2 * 768), dtype=np.uint8)[:, ::2]
    ref = I._normalize_reference(torch.from_numpy(u8.copy()), (0.5,) * 3, (0.5,) * 3, 2, 1 / 255)
    np.testing.assert_array_equal(_bits(I.normalize_patches(u8)), _bits(ref))
    np.testing.assert_array_equal(_bits(I.normalize_patches(torch.from_numpy(u8))), _bits(ref))


# ------------------------------------------------------------------------ end to end vs HF

HF_CASES = [
    "CMYK JPEG",
    "16-bit PNG (I;16)",
    "1-bit",
    "1x1",
    "1x1 grey",
    "very wide 2000x12",
    "640x480 JPEG (no resize)",
]


@pytest.mark.parametrize("name", HF_CASES)
def test_odd_inputs_equal_hf_processor(proc, name):
    img = _odd_images()[name]
    ref = VS.hf_process(proc, [img.copy()], "q", "a")
    ours = VS.process_sample(proc, P.decode_image(img), "q", "a")
    assert torch.equal(ours.input_ids, ref["input_ids"][0])
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    np.testing.assert_array_equal(
        _bits(P.normalize_patches(ours.pixel_u8)), _bits(ref["pixel_values"])
    )
