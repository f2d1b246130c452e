"""The pieces of a conversation every row layout (``vl/layouts.py``) shares: :class:`ChatSample`
(what a layout produces), role names, LLaVA markers, and the parsing of turn, content and media
cells. A cell this cannot read is the row's counted skip ``bad_conversation``.

Roles: ``system``, ``user``, ``assistant`` (ShareGPT's ``human``/``gpt`` and a few other common
names map onto them). A ``messages`` / ``conversations`` / ``texts`` cell may also be a JSON string.
Image cells: an HF ``Image`` struct (``{"bytes", "path"}``), a path (relative paths are resolved
against the dataset directory when the image is read), raw bytes, a PIL image, or a list of any
of these; a null cell or an empty list means a text-only row (in the chat layouts).
Video cells: a video file as a path (relative: to the dataset directory), bytes or a
``{"bytes", "path"}`` struct, or one video given as its frames (a list of image cells, taken at
HF's assumed 24 frames per second); a cell that is a list holds several videos, so a video given
as frames is a list inside that list (``videos: [[frame0, frame1, ...]]``).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LLAVA_IMAGE = "<image>"
"""The image marker inside LLaVA / ShareGPT turn values."""
LLAVA_VIDEO = "<video>"
"""The video marker inside LLaVA-Video turn values."""
_LLAVA_MARKS = re.compile(f"({re.escape(LLAVA_IMAGE)}|{re.escape(LLAVA_VIDEO)})")

ROLE_NAMES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}
"""Turn roles as datasets write them -> the chat template's roles."""


@dataclass
class ChatSample:
    """One row as a conversation: what every layout produces."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """HF chat format: ``{"role", "content"}``, content a string or a list of ``{"type": "image"}``
    / ``{"type": "video"}`` / ``{"type": "text", "text": str}`` parts (normalised: no other
    keys)."""
    images: list[Any] = field(default_factory=list)
    """Image cells as stored, one per image part, in order; decoded by the processing step."""
    videos: list[Any] = field(default_factory=list)
    """Video cells as stored (a file, or a list of frame cells), one per video part, in order."""


def _bad(message: str) -> Exception:
    from torchtitan_ext.vl.processor import SampleError

    return SampleError("bad_conversation", message)


def image_cells(cell: Any) -> list[Any]:
    """A row's image cell as a list: None -> [] (a text-only row); a list -> its items (a None
    item stays, and is that image's ``missing_image``); anything else -> [cell]."""
    if cell is None:
        return []
    if isinstance(cell, (list, tuple)):
        return list(cell)
    return [cell]


video_cells = image_cells
"""A row's video cell as a list, by :func:`image_cells`' rule (a list holds several videos; a
video given as frames is a list inside it)."""


def _json_cell(cell: Any, what: str) -> Any:
    """A conversation cell stored as a JSON string is parsed; anything else is returned."""
    if isinstance(cell, str):
        try:
            return json.loads(cell)
        except ValueError as e:
            raise _bad(f"{what} is a string but not JSON ({e})") from None
    return cell


def _turns(cell: Any, what: str) -> list[Mapping[str, Any]]:
    cell = _json_cell(cell, what)
    if cell is None:
        raise _bad(f"{what} is null")
    if not isinstance(cell, (list, tuple)) or not all(isinstance(t, Mapping) for t in cell):
        raise _bad(f"{what} is not a list of turns ({type(cell).__name__})")
    return list(cell)


def _role(turn: Mapping[str, Any], k: int) -> str:
    raw = turn.get("role", turn.get("from"))
    role = ROLE_NAMES.get(str(raw).lower()) if isinstance(raw, str) else None
    if role is None:
        raise _bad(f"turn {k}: unknown role {raw!r} (expected one of {sorted(ROLE_NAMES)})")
    return role


def _text(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _bad(f"{where}: text is {type(v).__name__}, not a string")
    return v


def _parts(content: Any, k: int) -> str | list[dict[str, Any]]:
    """A messages-layout turn's content, normalised (see ChatSample.messages)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, (list, tuple)):
        raise _bad(f"turn {k}: content is {type(content).__name__}")
    out: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        if isinstance(p, str):
            out.append({"type": "text", "text": p})
            continue
        if not isinstance(p, Mapping):
            raise _bad(f"turn {k} part {j}: {type(p).__name__}, not a content part")
        kind = p.get("type") or ("text" if p.get("text") is not None else None)
        if kind in ("image", "image_url"):
            out.append({"type": "image"})
        elif kind in ("video", "video_url"):
            out.append({"type": "video"})
        elif kind == "text":
            out.append({"type": "text", "text": _text(p.get("text"), f"turn {k} part {j}")})
        else:
            raise _bad(f"turn {k} part {j}: unsupported content type {kind!r}")
    return out


def _n_image_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(
        1
        for m in messages
        if not isinstance(m["content"], str)
        for p in m["content"]
        if p["type"] == "image"
    )


def vqa_messages(
    n_images: int, question: Any, answer: Any, n_videos: int = 0
) -> list[dict[str, Any]]:
    """The conversation of a VQA row: the images, the videos, the question; then the answer."""
    user: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    user += [{"type": "video"} for _ in range(n_videos)]
    user.append({"type": "text", "text": "" if question is None else str(question)})
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": "" if answer is None else str(answer)},
    ]


def _most_frequent(answers: Sequence[Any]) -> Any:
    vals = [a.get("answer") if isinstance(a, Mapping) else a for a in answers]
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    counts = Counter(vals)
    best = max(counts.values())
    return next(v for v in vals if counts[v] == best)
