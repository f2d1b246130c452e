"""Decode the batches of any loader (``peek --show``), and the view of a batch that drawing uses.

Works on the flattened batch (:func:`torchtitan_ext.peek_files.flatten_batch`), so it does not care which
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

Drawing (``peek --render``) is :mod:`torchtitan_ext.peek_render`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from torchtitan_ext.constants import IGNORE_INDEX

# token classes
TEXT, BOS, EOS, PAD, IMAGE, VISION = "text", "bos", "eos", "pad", "image", "vision"
VIDEO = "video"
MARK = {BOS: "«BOS»", EOS: "«EOS»", PAD: "«PAD»", IMAGE: "«IMG»", VIDEO: "«VID»", VISION: "«V»"}


def inner_objects(loader: Any, depth: int = 3) -> list[Any]:
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
        objs = inner_objects(loader)
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
                return as_array(flat[k])
        raise KeyError(f"batch has no token tensor (input / input_ids); keys: {sorted(flat)}")

    @staticmethod
    def labels(flat: Mapping[str, Any]) -> np.ndarray | None:
        return as_array(flat["labels"]) if "labels" in flat else None

    @staticmethod
    def positions(flat: Mapping[str, Any]) -> np.ndarray | None:
        if "positions" in flat and flat["positions"] is not None:
            p = as_array(flat["positions"])
            if p.ndim == 2:
                return p
        if "position_ids" in flat:
            p = as_array(flat["position_ids"])
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


def as_array(v: Any) -> np.ndarray:
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
            f"{k} {list(as_array(v).shape)}" for k, v in flat.items() if hasattr(v, "shape")
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
