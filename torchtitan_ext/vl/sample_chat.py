"""A small chat sample dataset (the ``messages`` layout), made deterministically from the shipped
images: what ``dataset = "sample_chat"`` and ``preprocess-cached --dataset sample_chat`` read.

Rows are written the way HF ``datasets`` writes chat data: a ``messages`` column of
``{role, content: [{type, text}]}`` turns and an ``images`` column that is a ``Sequence(Image())``
(``{bytes, path}`` structs), saved with ``Dataset.to_parquet``. Six kinds of rows, in turn:

* one image, one turn (a VQA row written as chat);
* two images in two user turns (the second image in the second turn, after its text);
* a system prompt, three images in one turn, one answer naming all three;
* a text-only conversation of three turns with a system prompt;
* a text-only single turn;
* two images compared in one turn, then a text-only follow-up turn.

Questions and answers describe the images (what they show, their sizes) and are true of them,
so a model can learn them. ``bad_rows=True`` appends the row checks' cases
(:data:`CHAT_BAD_ROW_REASONS`). 120 rows take ~0.5 s; :func:`chat_sample_path` caches them.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from PIL import Image

from torchtitan_ext.data.cachedir import build_atomically, cache_root
from torchtitan_ext.vl.sample_data import _variant, source_dir

CHAT_SAMPLE_VERSION = 1

CHAT_BAD_ROW_REASONS: dict[str, str] = {
    "placeholder_mismatch": "placeholder_mismatch",
    "corrupt_in_list": "corrupt_image",
    "unknown_role": "bad_conversation",
    "empty_assistant": "empty_text",
    "overlong": "too_long",
}
"""Bad row kind -> its skip reason (``overlong`` fits with ``truncate``: its first turn is short)."""

WHAT = {
    "astronaut": "an astronaut", "camera": "a man with a camera", "chelsea": "a cat",
    "chessboard_RGB": "a chessboard", "coffee": "a cup of coffee",
    "hubble_deep_field": "a field of galaxies", "logo": "a logo", "motorcycle_left": "a motorcycle",
    "page": "a page of text", "retina": "a retina", "rocket": "a rocket",
}  # fmt: skip
"""What each shipped source image shows, with its article."""

SYSTEM_PROMPTS = (
    "You are a careful assistant. Answer in one short sentence.",
    "You describe pictures for people who cannot see them.",
    "Answer briefly and precisely.",
)


def _img(cell: bytes) -> dict[str, Any]:
    return {"bytes": cell, "path": None}


def _user(*parts: Any) -> dict[str, Any]:
    """A user turn: str parts are texts, None parts are images."""
    return {
        "role": "user",
        "content": [
            {"type": "image", "text": None} if p is None else {"type": "text", "text": p}
            for p in parts
        ],
    }


def _say(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


def _size(data: bytes) -> tuple[int, int]:
    import io

    with Image.open(io.BytesIO(data)) as im:
        return im.size


class _Maker:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        files = sorted(p for p in source_dir().iterdir() if p.suffix.lower() in (".jpg", ".png"))
        self.sources = []
        for p in files:
            with Image.open(p) as im:
                im.load()
                self.sources.append((p.stem, im.copy()))
        self.k = 0

    def image(self) -> tuple[bytes, str, str, str]:
        """(bytes, what it shows, a question about it, its answer)."""
        name, src = self.sources[self.k % len(self.sources)]
        data, q, a = _variant(self.rng, src, name, self.k)
        self.k += 1
        return data, WHAT.get(name, name.replace("_", " ")), q, a

    def row(self, i: int) -> dict[str, Any]:
        kind = i % 6
        rng = self.rng
        if kind == 0:
            d, _, q, a = self.image()
            return {"messages": [_user(None, q), _say("assistant", a)], "images": [_img(d)]}
        if kind == 1:
            (d1, w1, q1, a1), (d2, w2, _, _) = self.image(), self.image()
            msgs = [
                _user(None, q1),
                _say("assistant", a1),
                _user("And what does this one show?", None),
                _say("assistant", f"It shows {w2}."),
            ]
            return {"messages": msgs, "images": [_img(d1), _img(d2)]}
        if kind == 2:
            imgs = [self.image() for _ in range(3)]
            msgs = [
                _say("system", rng.choice(SYSTEM_PROMPTS)),
                _user(None, None, None, "How many pictures are there, and what do they show?"),
                _say("assistant", "Three: {}, {} and {}.".format(*(x[1] for x in imgs))),
            ]
            return {"messages": msgs, "images": [_img(x[0]) for x in imgs]}
        if kind == 3:
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            msgs = [
                _say("system", rng.choice(SYSTEM_PROMPTS)),
                _say("user", f"What is {a} plus {b}?"),
                _say("assistant", f"{a} plus {b} is {a + b}."),
                _say("user", f"And {a} times {b}?"),
                _say("assistant", f"{a} times {b} is {a * b}."),
                _say("user", "Is that number even?"),
                _say("assistant", "Yes." if (a * b) % 2 == 0 else "No, it is odd."),
            ]
            return {"messages": msgs, "images": []}
        if kind == 4:
            n = rng.randint(2, 12)
            msgs = [_say("user", f"Count from one to {n} in digits."),
                    _say("assistant", " ".join(str(j) for j in range(1, n + 1)))]  # fmt: skip
            return {"messages": msgs, "images": []}
        (d1, _, _, _), (d2, _, _, _) = self.image(), self.image()
        (w1, _), (w2, h2) = _size(d1), _size(d2)
        wider = "first" if w1 > w2 else "second" if w2 > w1 else "neither"
        msgs = [
            _user(None, None, "Which picture is wider?"),
            _say("assistant", f"The {wider} one: {w1} against {w2} pixels."),
            _user("How tall is the second one?"),
            _say("assistant", f"{h2} pixels."),
        ]
        return {"messages": msgs, "images": [_img(d1), _img(d2)]}

    def bad_rows(self) -> list[dict[str, Any]]:
        d, _, q, a = self.image()
        long_turns = []
        for j in range(40):
            long_turns += [_say("user", f"Tell me fact number {j} about the picture, at length."),
                           _say("assistant", "It is a picture with many colours. " * 6)]  # fmt: skip
        rows = {
            "placeholder_mismatch": ([_user(None, None, q), _say("assistant", a)], [_img(d)]),
            "corrupt_in_list": (
                [_user(None, None, None, q), _say("assistant", a)],
                [_img(d), _img(b"\x89PNG\r\n\x1a\n" + bytes(64)), _img(d)],
            ),
            "unknown_role": ([_say("narrator", "Once upon a time"), _say("assistant", a)], []),
            "empty_assistant": ([_user(None, q), _say("assistant", "  ")], [_img(d)]),
            "overlong": ([_user(None, q), _say("assistant", a), *long_turns], [_img(d)]),
        }
        return [{"messages": m, "images": im, "kind": k} for k, (m, im) in rows.items()]


def write_chat_parquet(rows: list[dict[str, Any]], file: Path) -> Path:
    """Rows of ``messages`` + ``images`` (+ ``kind``) as HF ``datasets`` writes them: the
    images a ``Sequence(Image())`` feature, saved with ``to_parquet``."""
    import datasets
    from datasets.utils import logging as ds_logging

    text = datasets.Value("string")
    features = datasets.Features(
        {
            "messages": datasets.List(
                {"role": text, "content": datasets.List({"type": text, "text": text})}
            ),
            "images": datasets.Sequence(datasets.Image()),
            "kind": text,
        }
    )
    rows = [{"kind": "ok", **r} for r in rows]
    ds = datasets.Dataset.from_list(rows, features=features)
    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        ds.to_parquet(str(file), batch_size=64)
    finally:
        if bars:
            ds_logging.enable_progress_bar()
    return file


def make_chat_sample(
    out_dir: str | Path, n: int = 120, bad_rows: bool = False, seed: int = 0
) -> Path:
    """Write ``out_dir/train-00000-of-00001.parquet`` (n rows [+ bad rows]); returns out_dir.
    Reused while its manifest matches (:func:`torchtitan_ext.data.cachedir.build_atomically`)."""

    def fill(tmp: Path) -> None:
        mk = _Maker(seed)
        rows = [mk.row(i) for i in range(n)]
        if bad_rows:
            for j, r in enumerate(mk.bad_rows()):
                rows.insert(min(len(rows), 2 + j * max(1, len(rows) // 5)), r)
        write_chat_parquet(rows, tmp / "train-00000-of-00001.parquet")

    meta = {"chat_sample_version": CHAT_SAMPLE_VERSION, "n": n, "bad_rows": bad_rows, "seed": seed}
    return build_atomically(Path(out_dir), fill, meta)


def chat_sample_path(n: int = 120, bad_rows: bool = False, root: str | Path | None = None) -> Path:
    """The chat sample's Parquet directory, generated on first use under ``root`` (default:
    :func:`torchtitan_ext.data.cachedir.cache_root`)."""
    base = Path(root) if root is not None else cache_root()
    out = base / f"vl_chat_sample_v{CHAT_SAMPLE_VERSION}_n{n}{'_bad' if bad_rows else ''}"
    return make_chat_sample(out, n=n, bad_rows=bad_rows)
