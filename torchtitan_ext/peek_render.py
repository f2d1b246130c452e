"""Decode (``peek --show``) and draw (``peek --render``) the batches of any loader.

Works on the flattened batch (:func:`torchtitan_ext.peek.flatten_batch`), so it does not care which
loader made it:

* tokens: ``input`` (torchtitan) or ``input_ids`` (Hugging Face kwargs); labels: ``labels``;
  document starts: ``positions`` [B, L] (or row 0 of ``position_ids`` [4, B, L], the Qwen3-VL text
  row) restarting at 0, else BOS tokens.
* token classes: BOS / EOS / pad from the loader's own tokenizer (the one it encodes with), image
  and vision start/end tokens from a VL loader's ``special_tokens``. A token is shown as *masked*
  when the label at its position is -100 (no loss there).
* per-row numbers: documents, fill (non-pad tokens / row length), masked positions; per batch, the
  change of the loader's crop / skip counters since the previous batch (``get_stats()``): cropping is
  counted per batch by the loaders, so that is as fine as the stats allow.
* a mixture (``[[dataloader.sources]]``): :func:`mix_summary`, the per-source counts and shares
  after the last batch, one line (``peek`` prints it in every mode).

``--render``: text batches as one coloured strip per row (a colour per document, masked positions
paler, BOS black / EOS red ticks, pad grey), with document names and a decoded snippet; VL batches
from a cache are drawn with the pack picture of ``inspect-cache`` (``vl/render.py``), one per pack,
stacked (videos as frame strips, ``vl/video_render.py``); without a cache the strip picture is
used with image tokens orange and video tokens red-pink (``--show`` marks them «IMG» / «VID»).
Names match ``--show`` (``batch i row r``, ``doc k``); the title names the config, loader, rank
and batch. Text is drawn in the shipped DejaVu Sans (accents, Greek, Cyrillic ... render as letters, not boxes).
Drawing is PIL only (~10-50 ms per batch).
"""

from __future__ import annotations

import colorsys
import functools
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_ext.constants import IGNORE_INDEX

# token classes
TEXT, BOS, EOS, PAD, IMAGE, VISION = "text", "bos", "eos", "pad", "image", "vision"
VIDEO = "video"
MARK = {BOS: "«BOS»", EOS: "«EOS»", PAD: "«PAD»", IMAGE: "«IMG»", VIDEO: "«VID»", VISION: "«V»"}


def _inner_objects(loader: Any, depth: int = 3) -> list[Any]:
    """The loader and the objects it wraps (staging wrapper -> loader -> dataset)."""
    out, frontier = [loader], [loader]
    for _ in range(depth):
        nxt = []
        for o in frontier:
            for name in ("loader", "inner", "_loader", "dataset", "streaming_dataset"):
                x = getattr(o, name, None) if not isinstance(o, (str, bytes, int)) else None
                if x is not None and all(x is not y for y in out):
                    out.append(x)
                    nxt.append(x)
        frontier = nxt
    return out


@dataclass
class BatchView:
    """What peek needs to interpret a loader's batches."""

    decoder: Any = None
    """Anything with ``decode(list[int], skip_special_tokens=...)``; None: ids are shown raw."""
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    image_ids: set[int] = field(default_factory=set)
    """Image and video pad tokens (non-empty: a VL loader)."""
    video_ids: set[int] = field(default_factory=set)
    """Video pad tokens (shown as video, not image)."""
    vision_ids: set[int] = field(default_factory=set)
    loader: Any = None

    @classmethod
    def for_loader(cls, loader: Any, trainer_tokenizer: Any = None) -> BatchView:
        objs = _inner_objects(loader)
        view = cls(loader=loader)
        special = next(
            (
                o.special_tokens
                for o in objs
                if isinstance(getattr(o, "special_tokens", None), Mapping)
            ),
            None,
        )
        if special is not None:  # a VL loader: its processor's tokenizer decodes the packs
            view.pad_id = special.get("pad_id")
            view.image_ids = {
                int(special[k]) for k in ("image_pad_id", "video_pad_id") if k in special
            }
            view.video_ids = {int(special["video_pad_id"])} if "video_pad_id" in special else set()
            view.vision_ids = {
                int(special[k]) for k in ("vision_start_id", "vision_end_id") if k in special
            }
            cfg = next((o.config for o in objs if hasattr(o, "config")), None)
            try:
                from torchtitan_ext.vl.processor import load_processor

                view.decoder = load_processor(getattr(cfg, "model_path", None)).tokenizer
            except (OSError, ValueError, ImportError):
                view.decoder = None  # shown as ids: the processor is not available here
            return view
        tok = next(
            (o.tokenizer for o in objs if hasattr(getattr(o, "tokenizer", None), "decode")),
            trainer_tokenizer,
        )
        view.decoder = tok
        if tok is not None:
            view.bos_id = getattr(tok, "bos_id", None)
            view.eos_id = getattr(tok, "eos_id", None)
            view.pad_id = getattr(tok, "pad_id", None)
        return view

    # ------------------------------------------------------------------ batch geometry
    @staticmethod
    def tokens(flat: Mapping[str, Any]) -> np.ndarray:
        for k in ("input", "input_ids", "tokens"):
            if k in flat:
                return _np(flat[k])
        raise KeyError(f"batch has no token tensor (input / input_ids); keys: {sorted(flat)}")

    @staticmethod
    def labels(flat: Mapping[str, Any]) -> np.ndarray | None:
        return _np(flat["labels"]) if "labels" in flat else None

    @staticmethod
    def positions(flat: Mapping[str, Any]) -> np.ndarray | None:
        if "positions" in flat and flat["positions"] is not None:
            p = _np(flat["positions"])
            if p.ndim == 2:
                return p
        if "position_ids" in flat:
            p = _np(flat["position_ids"])
            if p.ndim == 3 and p.shape[0] == 4:
                return p[0]  # Qwen3-VL: row 0 is the per-sample text position
            if p.ndim == 2:
                return p
        return None

    def kinds(self, row: np.ndarray, n_valid: int | None = None) -> np.ndarray:
        k = np.full(row.shape, TEXT, dtype=object)
        if self.image_ids:
            k[np.isin(row, list(self.image_ids))] = IMAGE
        if self.video_ids:
            k[np.isin(row, list(self.video_ids))] = VIDEO
        if self.vision_ids:
            k[np.isin(row, list(self.vision_ids))] = VISION
        if self.bos_id is not None:
            k[row == self.bos_id] = BOS
        if self.eos_id is not None:
            k[row == self.eos_id] = EOS
        if n_valid is not None:
            k[n_valid:] = PAD
        return k

    def valid_length(self, row: np.ndarray, labels: np.ndarray | None) -> int:
        """Tokens before the trailing padding: a tail of pad ids whose labels are all -100 (a pad
        id that is also EOS/BOS inside the text is not padding)."""
        if self.pad_id is None:
            return len(row)
        n = len(row)
        while (
            n > 0
            and row[n - 1] == self.pad_id
            and (labels is None or labels[n - 1] == IGNORE_INDEX)
        ):
            n -= 1
        return n

    def doc_starts(self, row: np.ndarray, pos_row: np.ndarray | None, n_valid: int) -> list[int]:
        if pos_row is not None:
            starts = [int(i) for i in np.flatnonzero(pos_row[:n_valid] == 0)]
        elif self.bos_id is not None:
            starts = [int(i) for i in np.flatnonzero(row[:n_valid] == self.bos_id)]
        else:
            starts = []
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        return starts

    def decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self.decoder is None:
            return " ".join(str(i) for i in ids)
        try:
            return self.decoder.decode(ids, skip_special_tokens=False)
        except TypeError:
            return self.decoder.decode(ids)


def _np(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach().cpu().numpy()
    return np.asarray(v)


@dataclass
class RowInfo:
    row: int
    length: int
    valid: int
    starts: list[int]
    masked: int
    kinds: np.ndarray
    masked_mask: np.ndarray

    @property
    def fill_pct(self) -> float:
        return 100.0 * self.valid / max(self.length, 1)


def row_infos(view: BatchView, flat: Mapping[str, Any]) -> list[RowInfo]:
    toks = view.tokens(flat)
    labels = view.labels(flat)
    pos = view.positions(flat)
    if toks.ndim == 1:
        toks = toks[None]
        labels = None if labels is None else labels.reshape(1, -1)
        pos = None if pos is None else pos.reshape(1, -1)
    out = []
    for r in range(toks.shape[0]):
        row = toks[r]
        lab = labels[r] if labels is not None and labels.shape == toks.shape else None
        valid = view.valid_length(row, lab)
        masked = (lab == IGNORE_INDEX) if lab is not None else np.zeros(row.shape, dtype=bool)
        out.append(
            RowInfo(
                row=r,
                length=len(row),
                valid=valid,
                starts=view.doc_starts(row, pos[r] if pos is not None else None, valid),
                masked=int(masked[:valid].sum()),
                kinds=view.kinds(row, valid),
                masked_mask=masked,
            )
        )
    return out


# ====================================================================== --show
_COUNTER_WORDS = ("crop", "skip")


def stats_delta(cur: Mapping[str, float], prev: Mapping[str, float]) -> dict[str, float]:
    """Change of the crop / skip counters since the previous batch."""
    out = {}
    for k, v in cur.items():
        if any(w in k for w in _COUNTER_WORDS) and not k.endswith(("pct", "%")):
            out[k] = v - prev.get(k, 0.0)
    return out


def mix_summary(sources: Mapping[str, Mapping[str, float]]) -> str | None:
    """One line of a mixture's per-source counts (``LoaderStats.sources``): items handed over,
    realised share and target, and tokens where the source counts them; None without one."""
    if not sources:
        return None
    parts = []
    for name, st in sources.items():
        tokens = next((st[k] for k in ("tokens", "tokens_read") if k in st), None)
        tok = f", {tokens:g} tokens" if tokens is not None else ""
        ended = ", ended" if st.get("ended") else ""
        parts.append(
            f"{name} {st.get('items', 0):g} items{tok} {100 * st.get('share', 0.0):.1f}% "
            f"(target {100 * st.get('target', 0.0):.1f}%{ended})"
        )
    return "mixture: " + "; ".join(parts)


class Shower:
    """Prints batches decoded: one line per document, masked runs in ⟦ ⟧ (dim with colour)."""

    def __init__(self, view: BatchView, color: bool = False, max_chars: int = 400) -> None:
        self.view, self.color, self.max_chars = view, color, max_chars

    def _style(self, s: str, code: str) -> str:
        return f"\033[{code}m{s}\033[0m" if self.color else s

    def segment_text(self, row: np.ndarray, info: RowInfo, a: int, b: int) -> str:
        """Decode tokens [a, b) of a row: text runs decoded, special tokens as «MARKS», runs of
        masked positions in ⟦ ⟧."""
        parts: list[str] = []
        i = a
        while i < b:
            masked = bool(info.masked_mask[i])
            j = i
            while j < b and bool(info.masked_mask[j]) == masked:
                j += 1
            run: list[str] = []
            k = i
            while k < j:  # within a masked / unmasked run: text decoded, specials as marks
                kind = info.kinds[k]
                m = k
                while m < j and info.kinds[m] == kind:
                    m += 1
                if kind == TEXT:
                    run.append(self.view.decode([int(t) for t in row[k:m]]))
                else:
                    mark = MARK[kind] if m - k == 1 else f"{MARK[kind][:-1]}×{m - k}»"
                    run.append(self._style(mark, "36"))
                k = m
            s = "".join(run)
            parts.append(self._style(f"⟦{s}⟧", "2") if masked else s)
            i = j
        text = "".join(parts).replace("\n", "⏎")
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + f"… (+{len(text) - self.max_chars} chars)"
        return text

    def render_batch(
        self, i: int, flat: Mapping[str, Any], stats: Mapping[str, float], prev: Mapping[str, float]
    ) -> str:
        lines = []
        shapes = "  ".join(
            f"{k} {list(_np(v).shape)}" for k, v in flat.items() if hasattr(v, "shape")
        )
        delta = stats_delta(stats, prev)
        dtxt = ", ".join(f"{k} +{v:g}" for k, v in delta.items())
        lines.append(self._style(f"── batch {i} ── {shapes}", "1"))
        if dtxt:
            lines.append(f"   this batch: {dtxt}")
        toks = self.view.tokens(flat)
        toks = toks if toks.ndim == 2 else toks[None]
        for info in row_infos(self.view, flat):
            row = toks[info.row]
            pad = info.length - info.valid
            lines.append(
                f" row {info.row}: {len(info.starts)} docs · fill {info.fill_pct:.1f}% "
                f"({info.valid}/{info.length}, pad {pad}) · masked {info.masked}"
            )
            bounds = [*info.starts, info.valid]
            for d, (a, b) in enumerate(pairwise(bounds)):
                if b <= a:
                    continue
                cont = ""
                bos = self.view.bos_id
                if d == 0 and bos is not None and row[0] != bos and bool((row == bos).any()):
                    cont = " (continued)"  # a BOS-using loader whose row starts mid-document
                head = self._style(f"  ┃doc {d}{cont} [{a}:{b}] {b - a} tok┃", "33")
                lines.append(f"{head} {self.segment_text(row, info, a, b)}")
            if pad:
                lines.append(self._style(f"  ┃pad [{info.valid}:{info.length}]┃ «PAD×{pad}»", "2"))
        return "\n".join(lines)

    def show(
        self, i: int, flat: Mapping[str, Any], stats: Mapping[str, float], prev: Mapping[str, float]
    ) -> None:
        print(self.render_batch(i, flat, stats, prev), flush=True)


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
    objs = _inner_objects(loader)
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
        f"{k} {list(_np(v).shape)}"
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
