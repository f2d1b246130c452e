"""Offline Qwen3-VL processor, uint8 patchify, on-device normalisation, mRoPE rows without weights.

Algorithm
---------
* ``build_offline_processor`` writes a processor directory built entirely locally: a small byte-level
  BPE (HF ``tokenizers``, trained in ~15 ms on an embedded corpus) with Qwen's special tokens
  registered as *special* tokens (otherwise ``<|image_pad|>`` is byte-split), Qwen3-VL's own chat
  template (``torchtitan_ext/data/qwen3_vl_chat_template.jinja``, the Qwen3-VL Instruct models'
  template byte for byte), and ``Qwen2VLImageProcessorPil`` set to Qwen3-VL's values (patch 16,
  temporal 2, merge 2, mean = std = 0.5, 256²..4096² pixels, bicubic, 1/255).
* Images (the fast path of ``vl/sample.py``): decode -> convert to RGB exactly like
  ``transformers.image_transforms.convert_to_rgb`` (alpha composited onto white) -> one PIL bicubic
  resize to ``smart_resize``'s size (the same call the HF PIL backend makes) -> uint8 patchify by a
  single numpy reshape/transpose into the processor's row layout with the duplicated temporal half
  dropped ([N, 3*16*16] = [N, 768]). The HF path instead rescales and normalises the whole image in
  float64/float32 and broadcasts the temporal copy; doing that later (``normalize_patches``, on the
  device or at collate) reproduces its ``pixel_values`` bit-exactly because the HF PIL backend also
  resizes in uint8 before converting.
* ``mrope_positions`` re-implements ``Qwen3VLModel.get_rope_index`` (transformers 5.23) for one
  sample: text runs advance by their length, an image of llm grid (t, h, w) gets t/h/w meshgrid
  positions offset by the running position, which then advances by ``max(h, w)``. It needs only
  ``spatial_merge_size``, no weights (equality with the real method is tested, several images in
  one sample included).

Speed against the HF processor on 640x480 JPEGs and on the sample set's thumbnails, decode
included on both sides: ``python -m benchmarks vl_preprocess`` (tables in
``benchmarks/RESULTS.md``); on thumbnails the PIL bicubic resize both sides must do is most of
our time. Pixels are identical after ``normalize_patches``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from torchtitan_ext.data.cachedir import build_atomically, cache_root

# Qwen2/3 special tokens in Qwen's order (ids are relative to our small vocab, not 151643...).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's pre-tokenizer split pattern (as in Qwen2/Qwen3 tokenizer.json).
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE_FILE = Path(__file__).resolve().parents[1] / "data" / "qwen3_vl_chat_template.jinja"
"""Qwen3-VL's chat template (the Instruct models' ``chat_template``; see DATA_LICENSES.md)."""


def qwen3_vl_chat_template() -> str:
    return CHAT_TEMPLATE_FILE.read_text()


# Qwen3-VL image-processor values (the transformers class defaults are Qwen2-VL's).
QWEN3_VL_IMAGE_CONFIG: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "resample": 3,  # PIL.Image.BICUBIC
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "do_resize": True,
}

_OFFLINE_VERSION = 2  # 2: Qwen3-VL's own chat template
_VOCAB_SIZE = 1024


def _embedded_corpus() -> list[str]:
    """A small deterministic English corpus for the offline BPE (VQA-flavoured words)."""
    words = (
        "what is the colour of the object in this picture how many are there is it a cat dog "
        "person man woman child car bus bike sky tree grass water building sign text page letter "
        "yes no red green blue yellow black white grey orange purple brown left right top bottom "
        "center image photo show shows describe answer question which where when who why does do "
        "one two three four five six seven eight nine ten zero many few some none all both"
    ).split()
    lines = []
    for i, w in enumerate(words):
        for j in range(1, 6):
            lines.append(
                f"What is the {w}? The {words[(i * j) % len(words)]} is {words[(i + j) % len(words)]}."
            )
            lines.append(f"How many {w}s are in image {i * j}? There are {j} {w}s.\n")
    return lines


def _build_tokenizer_json() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_embedded_corpus(), trainer)
    # Registered as *special* tokens: the added-vocabulary pass splits them out before the BPE.
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    return tok.to_str()


def _processor_class():
    """``Qwen3VLProcessor`` subclass accepting ``video_processor=None`` (facts.md: the base class
    raises without torchvision)."""
    from transformers import Qwen3VLProcessor

    class OfflineQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):  # noqa: D401
            if argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return OfflineQwen3VLProcessor


def build_offline_processor(out_dir: str | Path) -> Path:
    """Write a Qwen3-VL processor directory built locally (no download). Idempotent: a directory
    that still matches its manifest is reused, anything else there is rebuilt
    (:func:`torchtitan_ext.data.cachedir.build_atomically`).

    Files: ``tokenizer.json`` + ``tokenizer_config.json`` (Qwen special tokens registered as
    special, chat template), ``chat_template.jinja``, ``preprocessor_config.json`` (Qwen3-VL values).
    """

    def fill(tmp: Path) -> None:
        from tokenizers import Tokenizer
        from transformers import Qwen2VLImageProcessorPil, TokenizersBackend

        fast = TokenizersBackend(
            tokenizer_object=Tokenizer.from_str(_build_tokenizer_json()),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=qwen3_vl_chat_template(),
            model_max_length=1 << 20,
        )
        fast.save_pretrained(tmp)
        ip = Qwen2VLImageProcessorPil(**QWEN3_VL_IMAGE_CONFIG)
        ip.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(qwen3_vl_chat_template())
        (tmp / "offline_processor.json").write_text(json.dumps({"version": _OFFLINE_VERSION}))

    return build_atomically(Path(out_dir), fill, {"offline_processor_version": _OFFLINE_VERSION})


def default_cache_root() -> Path:
    """Root for locally generated assets (processor dir, sample dataset): the package's one
    cache root, :func:`torchtitan_ext.data.cachedir.cache_root`."""
    return cache_root()


def offline_processor_dir() -> Path:
    return default_cache_root() / f"qwen3vl_offline_processor_v{_OFFLINE_VERSION}"


_PROCESSORS: dict[str, Any] = {}


def load_processor(model_path: str | Path | None = None) -> Any:
    """Load a Qwen3-VL processor: ``None`` -> the offline one (built on first use); a directory
    with ``tokenizer.json``/``tokenizer_config.json`` and ``preprocessor_config.json`` (a real
    Qwen3-VL checkpoint) also works. Never downloads. Cached per path within a process."""
    path = (
        Path(model_path)
        if model_path is not None
        else build_offline_processor(offline_processor_dir())
    )
    key = str(path.resolve())
    if key in _PROCESSORS:
        return _PROCESSORS[key]
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model-path {path}: not a directory (expected a Qwen3-VL processor directory with "
            "tokenizer.json and preprocessor_config.json)"
        )
    if not (path / "preprocessor_config.json").exists():
        raise FileNotFoundError(f"{path}: missing preprocessor_config.json")
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ip = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    template = getattr(tok, "chat_template", None)
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text()
    elif (path / "chat_template.json").exists():
        template = json.loads((path / "chat_template.json").read_text())["chat_template"]
    if not template:
        raise ValueError(
            f"{path}: no chat template (looked for chat_template.jinja, chat_template.json and "
            "tokenizer_config.json's chat_template)"
        )
    proc = _processor_class()(
        image_processor=ip, tokenizer=tok, video_processor=None, chat_template=template
    )
    for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"{path}: token {t} is not a single special token in the tokenizer (got {ids}); "
                "register Qwen's special tokens"
            )
    _PROCESSORS[key] = proc
    return proc


def special_token_ids(processor) -> dict[str, int]:
    """Ids of the Qwen special tokens used by packing/collation."""
    tok = processor.tokenizer

    def one(t: str) -> int:
        i = tok.convert_tokens_to_ids(t)
        if i is None or (tok.unk_token_id is not None and i == tok.unk_token_id):
            raise ValueError(f"tokenizer has no special token {t}")
        return int(i)

    return {
        "image_pad_id": one("<|image_pad|>"),
        "video_pad_id": one("<|video_pad|>"),
        "vision_start_id": one("<|vision_start|>"),
        "vision_end_id": one("<|vision_end|>"),
        "pad_id": one("<|endoftext|>"),
        "im_start_id": one("<|im_start|>"),
        "im_end_id": one("<|im_end|>"),
    }


# ----------------------------------------------------------------------------------------------
# Pixels


def normalize_patches(
    u8: torch.Tensor | np.ndarray,
    mean: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
    std: tuple[float, ...] | list[float] = (0.5, 0.5, 0.5),
    temporal_patch_size: int = 2,
    rescale_factor: float = 1 / 255,
) -> torch.Tensor:
    """uint8 patches [N, C*p*p] -> float32 [N, C*T*p*p] equal to the HF processor's pixel_values.

    Mirrors the HF PIL backend's arithmetic exactly: ``float32(float64(x) * rescale_factor)``, then
    ``(x - mean) / std`` in float32 per channel, then the temporal copy (the row layout is
    (C, T, ph, pw)). Runs on the input's device. On CPU it is bit-exact (tested). On CUDA,
    IEEE float64 multiply and float32 subtract/divide are correctly rounded too, so it should be
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
    # float64 product then one rounding to float32: bit-identical to np_rescale.
    f = (x.to(torch.float64) * rescale_factor).to(torch.float32).view(n, c, d // c)
    m = torch.tensor(mean, dtype=torch.float32, device=f.device).view(1, c, 1)
    s = torch.tensor(std, dtype=torch.float32, device=f.device).view(1, c, 1)
    f = (f - m) / s
    return f.unsqueeze(2).expand(n, c, temporal_patch_size, d // c).reshape(n, -1)


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


class SampleError(ValueError):
    """A bad sample: ``reason`` is a short code counted in packing_stats.json; ``error_type``
    names the exception behind a ``decode_error`` / ``processor_error``."""

    def __init__(self, reason: str, message: str, error_type: str | None = None):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.error_type = error_type

    @classmethod
    def from_exception(cls, reason: str, e: BaseException) -> SampleError:
        return cls(reason, f"{type(e).__name__}: {e}", type(e).__name__)

    def at_image(self, i: int, n: int) -> SampleError:
        """The same error, naming the image's index in the row's list of ``n`` images."""
        return SampleError(self.reason, f"images[{i}] of {n}: {self.message}", self.error_type)


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

    Grey ("L") images are resized as one band and the band is broadcast to R, G, B during the
    patch copy: HF converts L -> RGB (pure replication) before its bicubic resize, and Pillow
    resamples every band with the same integer kernel, so the bytes are identical (tested) at a
    third of the resize cost.
    """
    grey = img.mode == "L" and img.info.get("transparency") is None
    src = img if grey else to_rgb(img)
    w, h = src.size
    rh, rw = p.target_size(h, w)
    if (rh, rw) != (h, w):
        src = src.resize((rw, rh), resample=p.resample)
    ps, m = p.patch_size, p.merge_size
    gh, gw = rh // ps, rw // ps
    if grey:
        a = np.asarray(src).reshape(gh // m, m, ps, gw // m, m, ps, 1)
        a = np.broadcast_to(a, (*a.shape[:6], 3))
    else:
        a = np.asarray(src).reshape(gh // m, m, ps, gw // m, m, ps, 3)  # (H, W, C) uint8
    # (gh/m, m, ps, gw/m, m, ps, C) -> (gh/m, gw/m, m_h, m_w, C, ps_h, ps_w): the HF row order.
    a = a.transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(a).reshape(gh * gw, 3 * ps * ps), (1, gh, gw)


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


# ----------------------------------------------------------------------------------------------
# mRoPE positions


def mrope_positions(
    input_ids: np.ndarray, grid_thw: np.ndarray, image_pad_id: int, spatial_merge_size: int
) -> np.ndarray:
    """3 mRoPE rows [3, L] of one unpacked sample, as ``Qwen3VLModel.get_rope_index`` computes them.

    Text runs: positions continue from the running position on all 3 rows. Image run with grid
    (t, h, w) -> llm grid (t, h/m, w/m): rows = (start + t_idx, start + h_idx, start + w_idx) over a
    meshgrid in (t, h, w) order; afterwards the running position advances by ``max(h, w) / m``.
    """
    ids = np.asarray(input_ids)
    n = ids.shape[0]
    out = np.empty((3, n), dtype=np.int64)
    is_img = ids == image_pad_id
    if not is_img.any():
        out[:] = np.arange(n, dtype=np.int64)
        return out
    # run starts/ends of image tokens
    d = np.diff(np.concatenate(([0], is_img.view(np.int8), [0])))
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    if len(starts) != len(grid_thw):
        raise SampleError(
            "placeholder_mismatch", f"{len(starts)} image token runs but {len(grid_thw)} images"
        )
    pos, prev = 0, 0
    ms = spatial_merge_size
    for (s, e), (t, h, w) in zip(
        zip(starts, ends, strict=True), np.asarray(grid_thw).tolist(), strict=True
    ):
        tl = s - prev
        out[:, prev:s] = np.arange(pos, pos + tl, dtype=np.int64)
        pos += tl
        lt, lh, lw = t, h // ms, w // ms
        if e - s != lt * lh * lw:
            raise SampleError(
                "placeholder_mismatch",
                f"image run of {e - s} tokens, grid {t}x{h}x{w} needs {lt * lh * lw}",
            )
        out[0, s:e] = np.repeat(np.arange(lt, dtype=np.int64), lh * lw) + pos
        out[1, s:e] = np.tile(np.repeat(np.arange(lh, dtype=np.int64), lw), lt) + pos
        out[2, s:e] = np.tile(np.arange(lw, dtype=np.int64), lt * lh) + pos
        pos += max(h, w) // ms
        prev = e
    out[:, prev:] = np.arange(pos, pos + n - prev, dtype=np.int64)
    return out


def position_rows(
    input_ids: np.ndarray, grid_thw: np.ndarray, image_pad_id: int, spatial_merge_size: int
) -> np.ndarray:
    """The 4 position rows [4, L]: row 0 = arange(L), rows 1..3 = ``mrope_positions``."""
    ids = np.asarray(input_ids)
    out = np.empty((4, ids.shape[0]), dtype=np.int64)
    out[0] = np.arange(ids.shape[0])
    out[1:] = mrope_positions(ids, grid_thw, image_pad_id, spatial_merge_size)
    return out


def processor_fingerprint(processor) -> dict[str, Any]:
    """Everything about a processor that changes the cache bytes (for the cache key)."""
    tok = processor.tokenizer
    backend = getattr(tok, "backend_tokenizer", None) or tok._tokenizer
    vocab_hash = hashlib.sha256(backend.to_str().encode()).hexdigest()
    p = ImageParams.from_processor(processor)
    template = (
        processor.chat_template
        if isinstance(processor.chat_template, str)
        else json.dumps(processor.chat_template, sort_keys=True)
    )
    return {
        "tokenizer_sha256": vocab_hash,
        "chat_template_sha256": hashlib.sha256((template or "").encode()).hexdigest(),
        "image": {
            "patch_size": p.patch_size,
            "temporal_patch_size": p.temporal_patch_size,
            "merge_size": p.merge_size,
            "min_pixels": p.min_pixels,
            "max_pixels": p.max_pixels,
            "resample": p.resample,
            "mean": list(p.mean),
            "std": list(p.std),
            "rescale_factor": p.rescale_factor,
        },
    }
