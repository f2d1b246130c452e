"""A small VQA-style sample dataset, derived deterministically from a few shipped images.

``make_sample_dataset(out_dir, n=300)`` takes the source images in ``torchtitan_ext/data/vl_src`` (small
re-encodings of scikit-image's sample photos, credited in DATA_LICENSES.md) and makes
``n`` variants with a seeded RNG: random crops, resizes (longest side 24-320 px), flips and colour
modes (RGB/L JPEG, RGBA/P/P-with-transparency PNG, CMYK JPEG), each with a question and an answer
that describe the variant (what it shows, its size, whether it was flipped, its mode). The result is
one Parquet file loadable by ``datasets.load_dataset("parquet", data_files=...)`` with columns
``image`` (HF ``Image`` feature: {bytes, path}), ``question``, ``answer``.

``bad_rows=True`` appends the hard cases the preprocessing must count or reject: corrupt and
truncated bytes, a missing image (a path to no file), a 1x1 image (valid: upscaled to 256x256),
a very large and an extreme-aspect image, empty and overlong text, a placeholder mismatch (a special token in the text).
Generation of 300 rows takes ~1 s; ``sample_dataset_path()`` caches the result on disk (with a
manifest of sizes and digests: a damaged or different directory is rebuilt).
"""

from __future__ import annotations

import io
import random
from pathlib import Path

from PIL import Image, ImageOps

from torchtitan_ext.data.cachedir import build_atomically, cache_root

SAMPLE_VERSION = 2  # 2: the missing image is a path to no file

# Expected skip reasons of the bad rows (row name -> reason; the 1x1 image is valid).
BAD_ROW_REASONS: dict[str, str | None] = {
    "corrupt": "corrupt_image",
    "truncated": "corrupt_image",
    "missing": "missing_image",
    "one_pixel": None,
    "very_large": "too_long",
    "extreme_aspect": "bad_aspect_ratio",
    "empty_answer": "empty_text",
    "overlong_text": "too_long",
    "placeholder": "placeholder_mismatch",
}


def source_dir() -> Path:
    """The shipped source images (package data: torchtitan_ext/data/vl_src)."""
    d = Path(__file__).resolve().parents[1] / "data" / "vl_src"
    if not d.is_dir():
        raise FileNotFoundError(f"sample source images not found at {d} (package data missing)")
    return d


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def _variant(rng: random.Random, src: Image.Image, name: str, i: int) -> tuple[bytes, str, str]:
    im = src.convert("RGB") if src.mode not in ("RGB", "L") else src
    w, h = im.size
    # crop
    fw, fh = rng.uniform(0.5, 1.0), rng.uniform(0.5, 1.0)
    cw, ch = max(1, int(w * fw)), max(1, int(h * fh))
    x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
    im = im.crop((x0, y0, x0 + cw, y0 + ch))
    # resize: longest side 24..320
    longest = rng.randint(24, 320)
    s = longest / max(cw, ch)
    im = im.resize((max(1, round(cw * s)), max(1, round(ch * s))), Image.BILINEAR)
    flipped = rng.random() < 0.5
    if flipped:
        im = ImageOps.mirror(im)
    kind = i % 7
    if kind in (0, 1, 2):
        mode, data = "RGB", _encode(im.convert("RGB"), "JPEG", quality=rng.randint(70, 95))
    elif kind == 3:
        mode, data = "L", _encode(im.convert("L"), "JPEG", quality=85)
    elif kind == 4:
        rgba = im.convert("RGBA")
        alpha = Image.linear_gradient("L").resize(rgba.size)
        rgba.putalpha(alpha)
        mode, data = "RGBA", _encode(rgba, "PNG")
    elif kind == 5:
        p = im.convert("RGB").quantize(colors=rng.choice([16, 64, 256]))
        if rng.random() < 0.5:
            p.info["transparency"] = 0
            mode, data = "P", _encode(p, "PNG", transparency=0)
        else:
            mode, data = "P", _encode(p, "PNG")
    else:
        mode, data = "CMYK", _encode(im.convert("CMYK"), "JPEG", quality=85)
    what = name.replace("_", " ")
    q_kind = rng.randrange(4)
    if q_kind == 0:
        q, a = "What is shown in this picture?", f"It shows a {what}."
    elif q_kind == 1:
        q, a = "What are the dimensions of the image?", f"{im.width} by {im.height} pixels."
    elif q_kind == 2:
        q, a = "Is this image mirrored?", "yes" if flipped else "no"
    else:
        q = "Describe the image in detail, including its colour mode and size."
        a = f"A {mode} image of a {what}, {im.width} pixels wide and {im.height} pixels high."
    return data, q, a


def _bad_rows(rng: random.Random, good: bytes) -> list[dict]:
    one = _encode(Image.new("RGB", (1, 1), (200, 30, 30)), "PNG")
    large = _encode(Image.new("RGB", (4600, 4000), (10, 120, 200)), "PNG")
    thin = _encode(Image.new("L", (1, 300), 128), "PNG")
    rows = [
        ("corrupt", bytes(rng.getrandbits(8) for _ in range(512)), "What is this?", "Noise."),
        ("truncated", good[: len(good) // 3], "What is this?", "Half."),
        ("missing", None, "What is this?", "Nothing."),
        ("one_pixel", one, "What colour is the image?", "Red."),
        ("very_large", large, "What colour is the image?", "Blue."),
        ("extreme_aspect", thin, "What is this?", "A line."),
        ("empty_answer", good, "What is this?", ""),
        ("overlong_text", good, "Why? " * 3000, "Because."),
        ("placeholder", good, "Compare <|image_pad|> with this image.", "Same."),
    ]
    return [
        {
            # no bytes and a path that does not exist (a null image is a valid text-only row)
            "image": {"bytes": b, "path": None if b is not None else "no_such_image.jpg"},
            "question": q,
            "answer": a,
            "kind": k,
        }
        for k, b, q, a in rows
    ]


def write_vl_parquet(rows: list[dict], file: Path, batch_size: int | None = None) -> Path:
    """Write image/question/answer rows as one Parquet file in HF ``datasets``' layout (the image
    column an ``Image`` feature of ``{"bytes", "path"}``; any other column a string), the layout
    every VL source here reads. ``batch_size``: rows per row group (``datasets``' default if
    None)."""
    import datasets
    from datasets.utils import logging as ds_logging

    cols = {"image": datasets.Image(), "question": datasets.Value("string")}
    cols["answer"] = datasets.Value("string")
    for k in rows[0] if rows else ():
        cols.setdefault(k, datasets.Value("string"))
    ds = datasets.Dataset.from_list(rows, features=datasets.Features(cols))
    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()  # a 1-batch "Creating parquet" bar is noise here
    try:
        kw = {} if batch_size is None else {"batch_size": batch_size}
        ds.to_parquet(str(file), **kw)
    finally:
        if bars:
            ds_logging.enable_progress_bar()
    return file


def make_sample_dataset(
    out_dir: str | Path, n: int = 300, bad_rows: bool = False, seed: int = 0
) -> Path:
    """Write ``out_dir/train-00000-of-00001.parquet`` (n variants [+ bad rows]); returns out_dir.

    ``out_dir`` is reused only while its manifest matches its files and these arguments
    (:func:`torchtitan_ext.data.cachedir.build_atomically`); anything else there is rebuilt."""

    def fill(tmp: Path) -> None:
        write_vl_parquet(
            _sample_rows(n, bad_rows, seed), tmp / "train-00000-of-00001.parquet", batch_size=64
        )

    meta = {"sample_version": SAMPLE_VERSION, "n": n, "bad_rows": bad_rows, "seed": seed}
    return build_atomically(Path(out_dir), fill, meta)


def _sample_rows(n: int, bad_rows: bool, seed: int) -> list[dict]:
    src = source_dir()
    files = sorted(p for p in src.iterdir() if p.suffix.lower() in (".jpg", ".png"))
    sources = []
    for p in files:
        with Image.open(p) as im:
            im.load()
            sources.append((p.stem, im.copy()))
    rng = random.Random(seed)
    rows: list[dict] = []
    for i in range(n):
        name, im = sources[i % len(sources)]
        data, q, a = _variant(rng, im, name, i)
        rows.append(
            {"image": {"bytes": data, "path": None}, "question": q, "answer": a, "kind": "ok"}
        )
    if bad_rows:
        good = rows[0]["image"]["bytes"] if rows else _encode(sources[0][1].convert("RGB"), "JPEG")
        bad = _bad_rows(rng, good)
        # spread the bad rows through the data (deterministic positions)
        for j, r in enumerate(bad):
            rows.insert(min(len(rows), 3 + j * max(1, len(rows) // len(bad))), r)
    return rows


def sample_dataset_path(
    n: int = 300, bad_rows: bool = False, root: str | Path | None = None
) -> Path:
    """Local HF-datasets-loadable Parquet dir of the sample dataset, generated on first use.

    ``root`` defaults to :func:`torchtitan_ext.data.cachedir.cache_root`.
    """
    base = Path(root) if root is not None else cache_root()
    out = base / f"vl_sample_v{SAMPLE_VERSION}_n{n}{'_bad' if bad_rows else ''}"
    return make_sample_dataset(out, n=n, bad_rows=bad_rows)
