"""Render one pack of a VL cache as a PNG: image thumbnails + a coloured token strip per sample.

Images are rebuilt from the stored uint8 patches (the inverse of ``image_to_patches``' transpose),
so the picture shows exactly what the model will see. Token colours: green = text with a label
(assistant), blue-grey = text masked with -100, orange = image tokens, purple = vision start/end,
light grey = padding. Measured: ~0.1 s for a 1024-token pack of 8 samples (PIL drawing).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

COLORS = {
    "target": (46, 160, 67),
    "masked": (120, 140, 170),
    "image": (240, 140, 30),
    "vision": (150, 70, 200),
    "pad": (225, 225, 225),
}


def unpatchify(u8: np.ndarray, grid: tuple[int, int, int], patch: int = 16, merge: int = 2):
    """uint8 [gh*gw, 3*p*p] (processor row order) -> (gh*p, gw*p, 3) image array."""
    _, gh, gw = grid
    a = u8.reshape(gh // merge, gw // merge, merge, merge, 3, patch, patch)
    a = a.transpose(0, 2, 5, 1, 3, 6, 4)  # (gh/m, m, p, gw/m, m, p, C)
    return np.ascontiguousarray(a).reshape(gh * patch, gw * patch, 3)


def render_pack(cache, index: int, out: str | Path, width: int = 1200, decode: bool = True) -> Path:
    """Write a PNG of pack ``index`` of ``cache`` (a VLCache) to ``out``."""
    p = cache.pack(index)
    sp = cache.special_tokens
    ip = cache.image_params
    ids = p["input_ids"].numpy()
    labels = p["labels"].numpy()
    lens = p["seq_lens"].numpy().tolist()
    grid = p["image_grid_thw"].numpy()
    pix = p["pixel_u8"].numpy()
    L = len(ids)
    kind = np.full(L, "masked", dtype=object)
    kind[labels != -100] = "target"
    kind[ids == sp["image_pad_id"]] = "image"
    kind[(ids == sp["vision_start_id"]) | (ids == sp["vision_end_id"])] = "vision"
    n_content = int(sum(lens))
    kind[n_content:] = "pad"

    tok = None
    if decode:
        try:
            from torchtitan_ext.vl.processor import load_processor

            tok = load_processor(cache.metadata["config"].get("model_path")).tokenizer
        except (OSError, ValueError):
            tok = None  # no processor available here: render without text snippets

    # thumbnails
    thumbs, off = [], 0
    for g in grid:
        n = int(g[0] * g[1] * g[2])
        img = Image.fromarray(
            unpatchify(
                pix[off : off + n],
                tuple(int(x) for x in g),
                int(ip["patch_size"]),
                int(ip["merge_size"]),
            )
        )
        off += n
        img.thumbnail((120, 120))
        thumbs.append(img)
    margin = 10
    longest = max([*lens, L - n_content, 1])
    cell = int(min(8, max(2, (width - 20) // longest)))  # wide cells for short packs
    per_line = (width - 20) // cell
    lines_per_sample = [max(1, -(-n // per_line)) for n in lens]
    pad_lines = max(0, -(-(L - n_content) // per_line))
    thumb_rows = max(1, -(-len(thumbs) // max(1, (width - 20) // 128)))
    h = (
        30
        + thumb_rows * 140
        + sum(34 + 8 * k for k in lines_per_sample)
        + (30 + 8 * pad_lines if pad_lines else 0)
        + 40
    )
    canvas = Image.new("RGB", (width, h), "white")
    d = ImageDraw.Draw(canvas)
    d.text(
        (margin, 8),
        f"pack {index}: L={L}, {len(lens)} samples, {n_content} tokens "
        f"({100 * n_content / max(L, 1):.1f}% fill), {len(grid)} images, {len(pix)} patches",
        fill="black",
    )
    x, y = margin, 30
    for k, t in enumerate(thumbs):
        if x + 128 > width:
            x, y = margin, y + 140
        canvas.paste(t, (x, y))
        d.text((x, y + t.height + 2), f"img {k} {grid[k][1]}x{grid[k][2]}", fill="black")
        x += 128
    y += 140
    a = 0
    for s, n in enumerate(lens):
        seg_ids = ids[a : a + n]
        desc = (
            f"sample {s}: {n} tokens, {int((kind[a : a + n] == 'image').sum())} image, "
            f"{int((kind[a : a + n] == 'target').sum())} target"
        )
        if tok is not None:
            text = tok.decode(
                [int(t) for t in seg_ids if t != sp["image_pad_id"]], skip_special_tokens=True
            )
            desc += "  |  " + " ".join(text.split())[:110]
        d.text((margin, y), desc, fill="black")
        y += 14
        for j in range(n):
            r, c = divmod(j, per_line)
            x0, y0 = margin + c * cell, y + r * 8
            d.rectangle([x0, y0, x0 + cell - 1, y0 + 5], fill=COLORS[kind[a + j]])
        y += 8 * lines_per_sample[s] + 20
        a += n
    if pad_lines:
        d.text((margin, y), f"padding: {L - n_content} tokens", fill="black")
        y += 14
        for j in range(L - n_content):
            r, c = divmod(j, per_line)
            x0, y0 = margin + c * cell, y + r * 8
            d.rectangle([x0, y0, x0 + cell - 1, y0 + 5], fill=COLORS["pad"])
        y += 8 * pad_lines + 16
    x = margin
    for name, col in COLORS.items():
        d.rectangle([x, y, x + 12, y + 10], fill=col)
        d.text((x + 16, y), name, fill="black")
        x += 110
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(out)
    return out
