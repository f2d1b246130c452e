"""Draw the batches of any loader (``peek --render``), from the decoded view of
:mod:`torchtitan_ext.peek_view`.

``--render``: text batches as one coloured strip per row (a colour per document, masked positions
paler, BOS black / EOS red ticks, pad grey), with document names and a decoded snippet; VL batches
from a cache are drawn with the pack picture of ``inspect-cache`` (``vl/render.py``), one per pack,
stacked (videos as frame strips, ``vl/video_render.py``); without a cache the strip picture is
used with image tokens orange and video tokens red-pink (``--show`` marks them «IMG» / «VID»).
Names match ``--show`` (``batch i row r``, ``doc k``); the title names the config, loader, rank
and batch. Text is drawn in the shipped DejaVu Sans (accents, Greek, Cyrillic ... render as
letters, not boxes).
Drawing is PIL only (~10-50 ms per batch).
"""

from __future__ import annotations

import colorsys
import functools
import tempfile
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_ext.peek_view import (
    BOS,
    EOS,
    IMAGE,
    PAD,
    TEXT,
    VIDEO,
    VISION,
    BatchView,
    as_array,
    inner_objects,
    row_infos,
)


# ====================================================================== --render
def _doc_colors(n: int) -> list[tuple[int, int, int]]:
    out = []
    for d in range(max(n, 1)):
        h = (0.58 + d * 0.618034) % 1.0  # golden-ratio hues from blue: neighbours differ
        r, g, b = colorsys.hls_to_rgb(h, 0.5, 0.65)
        out.append((int(r * 255), int(g * 255), int(b * 255)))
    return out


def _pale(c: tuple[int, int, int], f: float = 0.62) -> tuple[int, int, int]:
    return tuple(int(x + (255 - x) * f) for x in c)  # type: ignore[return-value]


STRIP_COLORS = {
    PAD: (215, 215, 215),
    IMAGE: (240, 140, 30),
    VIDEO: (215, 60, 110),  # vl/video_render.py's VIDEO_COLOR
    VISION: (150, 70, 200),
}


FONT_FILE = Path(__file__).parent / "data" / "fonts" / "DejaVuSans.ttf"


@functools.cache
def font(size: int) -> Any:
    """DejaVu Sans at ``size`` px (shipped: Latin-1 and beyond, Greek, Cyrillic, Hebrew, Arabic
    ...), or PIL's own scalable font where FreeType is missing."""
    from PIL import ImageFont

    try:
        return ImageFont.truetype(str(FONT_FILE), size)
    except (OSError, ImportError):  # no FreeType in this PIL build
        return ImageFont.load_default(size)


def _fit(text: str, fnt: Any, room: float) -> str:
    """``text`` cut to fit ``room`` pixels in ``fnt`` (an ellipsis marks the cut)."""
    if fnt.getlength(text) <= room:
        return text
    lo, hi = 0, len(text)
    while lo < hi:  # longest prefix that fits with the ellipsis
        mid = (lo + hi + 1) // 2
        if fnt.getlength(text[:mid] + "…") <= room:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + "…" if lo else ""


def render_strips(
    view: BatchView,
    flat: Mapping[str, Any],
    out: str | Path,
    title: str = "",
    width: int = 1400,
    index: int = 0,
) -> Path:
    """Rows as coloured strips: a colour per document (pale where the label is -100), BOS black
    tick, EOS red tick, pad grey, image tokens orange; under each document its name as ``--show``
    prints it (``doc k``) and a decoded snippet. ``title``: lines above the picture."""
    from PIL import Image, ImageDraw

    f_title, f_row, f_label = font(17), font(15), font(13)
    infos = row_infos(view, flat)
    toks = view.tokens(flat)
    toks = toks if toks.ndim == 2 else toks[None]
    margin, strip_h = 14, 18
    line_h = strip_h + 24  # a strip and the labels under it
    L = max(i.length for i in infos)
    cell = max(2, min(24, (width - 2 * margin) // max(L, 1)))
    per_line = max(1, (width - 2 * margin) // cell)
    lines_per_row = -(-L // per_line)
    row_block = 24 + lines_per_row * line_h + 12
    title_lines = [t for t in title.splitlines() if t]
    top = 14 + 24 * len(title_lines) + 8
    height = top + len(infos) * row_block + 40
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    for k, line in enumerate(title_lines):
        d.text((margin, 12 + 24 * k), _fit(line, f_title, width - 2 * margin), "black", f_title)
    y = top
    for info in infos:
        row = toks[info.row]
        colors = _doc_colors(len(info.starts))
        doc_of = np.zeros(info.length, dtype=np.int64)
        for k, st in enumerate(info.starts):
            doc_of[st:] = k
        pad = info.length - info.valid
        d.text(
            (margin, y),
            f"batch {index} row {info.row}: {len(info.starts)} docs · fill {info.fill_pct:.1f}% "
            f"({info.valid}/{info.length}, pad {pad}) · masked {info.masked}",
            fill="black",
            font=f_row,
        )
        y += 24
        for j in range(info.length):
            r, c = divmod(j, per_line)
            x0, y0 = margin + c * cell, y + r * line_h
            kind = info.kinds[j]
            if kind in STRIP_COLORS:
                col = STRIP_COLORS[kind]
            else:
                col = colors[doc_of[j] % len(colors)]
            if info.masked_mask[j] and kind != PAD:
                col = _pale(col)
            d.rectangle([x0, y0, x0 + cell - 1 - (cell > 3), y0 + strip_h], fill=col)
            if kind == BOS:
                d.rectangle([x0, y0 - 3, x0 + max(1, cell // 3), y0 + strip_h + 3], fill=(0, 0, 0))
            elif kind == EOS:
                x1 = x0 + cell - 1 - (cell > 3)
                d.rectangle(
                    [x1 - max(1, cell // 3), y0 - 3, x1, y0 + strip_h + 3], fill=(220, 0, 0)
                )
        # document labels: "doc k" + a decoded snippet where the strip is wide enough
        bounds = [*info.starts, info.valid]
        for k, (a, b) in enumerate(pairwise(bounds)):
            r, c = divmod(a, per_line)
            x0 = margin + c * cell
            y0 = y + r * line_h + strip_h + 3
            room = min(b - a, per_line - c) * cell - 4
            label = f"doc {k}"
            if room < f_label.getlength(label):
                continue
            ids = [int(t) for t, kd in zip(row[a:b], info.kinds[a:b], strict=True) if kd == TEXT]
            snippet = " ".join(view.decode(ids[:48]).split())
            label = _fit(f"{label}  {snippet}" if snippet else label, f_label, room)
            d.text((x0 + 1, y0), label, fill=(50, 50, 50), font=f_label)
        y += lines_per_row * line_h + 12
    # legend
    x = margin
    legend = [
        ("doc (colour per document)", _doc_colors(1)[0]),
        ("label -100 (pale)", _pale(_doc_colors(1)[0])),
        ("BOS", (0, 0, 0)),
        ("EOS", (220, 0, 0)),
        ("pad", STRIP_COLORS[PAD]),
    ]
    if view.image_ids:
        legend += [("image", STRIP_COLORS[IMAGE]), ("vision start/end", STRIP_COLORS[VISION])]
    if any((i.kinds == VIDEO).any() for i in infos):
        legend.insert(-1, ("video", STRIP_COLORS[VIDEO]))
    for name, col in legend:
        d.rectangle([x, y + 2, x + 14, y + 14], fill=col)
        d.text((x + 19, y), name, fill="black", font=f_label)
        x += 36 + int(f_label.getlength(name))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)
    return out


def vl_pack_indices(loader: Any, state_before: Any, n_packs: int) -> tuple[Any, list[int]] | None:
    """(cache, cache pack indices) of the batch read right after ``state_before``, for a cached
    VL loader (its checkpoint envelope's position: epoch / cursor); None when that cannot be
    worked out."""
    if not isinstance(state_before, Mapping) or "global" not in state_before:
        return None
    objs = inner_objects(loader)
    ds = next((o for o in objs if hasattr(o, "cache") and hasattr(o, "pack_index_of")), None)
    if ds is None:
        return None
    from torchtitan_ext.pipeline import checkpoint
    from torchtitan_ext.vl.dataset import epoch_permutation, locate

    g = state_before["global"]
    if g.get("format") == checkpoint.FORMAT:  # the one envelope: every VL rank's position is one
        g = checkpoint.open_envelope(state_before, g["loader"], int(g["dp_world_size"]))[0]
    if int(g.get("source", 0)) != 0:
        return None
    rank = int(getattr(ds, "dp_rank", 0))
    remainder = "wrap" if int(g.get("remainder_wrap", 0)) else "drop"
    idx = []
    for k in range(n_packs):
        epoch, pos = locate(
            int(g["num_packs"]),
            int(g["world_size"]),
            rank,
            int(g["epoch"]),
            int(g["cursor"]),
            k,
            remainder,
        )
        perm = epoch_permutation(int(g["num_packs"]), int(g["seed"]), epoch, bool(g["shuffle"]))
        idx.append(int(perm[pos]))
    return ds.cache, idx


def render_batch(
    view: BatchView,
    flat: Mapping[str, Any],
    out: str | Path,
    index: int = 0,
    state_before: Any = None,
    header: str = "",
) -> Path:
    """Draw batch ``index``: VL packs from a cache with inspect-cache's pack picture (stacked,
    each headed ``batch i row r``), everything else as strips. ``header`` (the config, loader and
    rank, as ``peek --show`` prints them) heads the picture."""
    shapes = "  ".join(
        f"{k} {list(as_array(v).shape)}"
        for k, v in flat.items()
        if hasattr(v, "shape") and "pixel" not in k
    )
    title = f"{header}\nbatch {index}: {shapes}" if header else f"batch {index}: {shapes}"
    toks = view.tokens(flat)
    n_rows = toks.shape[0] if toks.ndim == 2 else 1
    found = vl_pack_indices(view.loader, state_before, n_rows) if view.image_ids else None
    if found is None:
        return render_strips(view, flat, out, title=title, index=index)
    from PIL import Image, ImageDraw

    from torchtitan_ext.vl.render import render_pack

    cache, indices = found
    f_title, f_row = font(17), font(15)
    with tempfile.TemporaryDirectory() as tmp:
        parts = [
            Image.open(render_pack(cache, i, Path(tmp) / f"{n}.png")).convert("RGB")
            for n, i in enumerate(indices)
        ]
    lines = title.splitlines()
    w = max(p.width for p in parts)
    top = 12 + 24 * len(lines)
    canvas = Image.new("RGB", (w, top + sum(p.height + 30 for p in parts)), "white")
    d = ImageDraw.Draw(canvas)
    for k, line in enumerate(lines):
        d.text((12, 10 + 24 * k), _fit(line, f_title, w - 24), "black", f_title)
    y = top
    for row, (p, pack) in enumerate(zip(parts, indices, strict=True)):
        d.text((12, y + 4), f"batch {index} row {row} (cache pack {pack})", "black", f_row)
        canvas.paste(p, (0, y + 26))
        y += p.height + 30
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(out)
    return out
