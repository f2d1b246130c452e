"""Row layouts: which columns of a dataset hold what, and how a raw row becomes a conversation.

Every layout turns a raw row (``vl/sources.py``: a dict of the row's columns as pyarrow or
``datasets`` return them) into one :class:`ChatSample`: a conversation in Hugging Face's chat
format plus the row's image cells and video cells, each kind in placeholder order. The rest of the pipeline (chat template,
loss mask, images, packing) is the same for every layout.

| layout | columns (first found; ``--<role>-column`` names another) | conversation |
|---|---|---|
| ``vqa`` | ``image``/``images``/``img`` and ``video``/``videos`` (optional), ``question``/``prompt``/``query``, ``answer``/``multiple_choice_answer``/``answers``/``response`` | user: the images, then the videos, then the question; assistant: the answer. A list of answers (VQAv2's ``answers``: strings or ``{"answer": ...}`` dicts) gives its most frequent answer (ties: the first). With a media column, a row whose media cells are all null or empty is the counted skip ``missing_image`` (``missing_video`` when the layout has only a video column), never a text-only sample. |
| ``messages`` | ``messages``, ``images``/``image`` and ``videos``/``video`` (optional) | HF / OpenAI chat: ``{role, content}`` turns, content a string or a list of ``{"type": "image"}`` / ``{"type": "video"}`` / ``{"type": "text", "text": ...}`` parts; the images column's images fill the image parts in order, the videos column's videos the video parts. |
| ``llava`` | ``conversations``, ``image``/``images`` and ``video``/``videos`` (optional) | LLaVA / ShareGPT (LLaVA-Video): ``{"from": "human"/"gpt"/"system", "value": "...<image>...<video>..."}``; each ``<image>`` marker is an image part, each ``<video>`` a video part (the text around them is kept as it is, newlines included). |
| ``cauldron`` | ``texts``, ``images`` (optional) | the_cauldron: ``[{"user", "assistant"}, ...]``; the images go first in the first user turn (as HF's Idefics2 fine-tuning does). |

Roles, and the image and video cells a layout accepts: ``vl/conversation.py``.

Choosing (:func:`choose_layout`): ``format="auto"`` picks the first layout whose columns the schema
has, in the order ``messages``, ``llava``, ``cauldron``, ``vqa`` (a column override such as
``messages_column`` points at its layout), and says what it picked from which columns. A named
format must find its columns or it is an error naming them; a schema matching nothing is an
error listing the columns found and the flags to use. A row a layout cannot read (an unknown
role, a content part of another type, text that is not a string) is the row's counted skip
``bad_conversation``; nothing here decodes an image.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from torchtitan_ext.vl.conversation import (
    _LLAVA_MARKS,
    LLAVA_IMAGE,
    LLAVA_VIDEO,
    ChatSample,
    _bad,
    _most_frequent,
    _parts,
    _role,
    _text,
    _turns,
    image_cells,
    video_cells,
    vqa_messages,
)

logger = logging.getLogger(__name__)

Format = Literal["auto", "vqa", "messages", "llava", "cauldron"]
FORMATS: tuple[str, ...] = ("auto", "vqa", "messages", "llava", "cauldron")

COLUMN_ROLES: tuple[str, ...] = (
    "image",
    "video",
    "question",
    "answer",
    "messages",
    "conversations",
    "texts",
)
"""The column roles a user can name: BuildConfig field ``<role>_column``, flag ``--<role>-column``."""

# ----------------------------------------------------------------------------------------------
# layouts


class Layout:
    """What every layout has: its role fields (dataclass fields named after ``COLUMN_ROLES``),
    ``detect``/``match`` from a schema, ``columns``, ``describe()`` (part of the cache key) and
    ``parse(raw) -> ChatSample``."""

    name: ClassVar[str]
    ROLES: ClassVar[dict[str, tuple[str, ...]]]
    """Role -> the column names looked for, in order."""
    OPTIONAL: ClassVar[tuple[str, ...]] = ("image", "video")

    @classmethod
    def match(cls, columns: Sequence[str], overrides: Mapping[str, str], where: str):
        """This layout's columns in ``columns`` (an override must exist), or the first required
        role that has none (a str)."""
        chosen: dict[str, str | None] = {}
        for role, options in cls.ROLES.items():
            if role in overrides:
                col = overrides[role]
                if col not in columns:
                    raise ValueError(
                        f"{where}: --{role}-column {col!r} is not a column (have {list(columns)})"
                    )
            else:
                col = next((o for o in options if o in columns), None)
            if col is None and role not in cls.OPTIONAL:
                return role
            chosen[role] = col
        return cls(**chosen)

    @classmethod
    def detect(cls, columns: Sequence[str], where: str, overrides: Mapping[str, str] = {}):
        """This layout's columns, or a ValueError naming the role that has none."""
        got = cls.match(columns, overrides, where)
        if isinstance(got, str):
            raise ValueError(
                f"{where}: no {got} column for the {cls.name} layout (looked for "
                f"{list(cls.ROLES[got])}; have {list(columns)}); name it with --{got}-column"
            )
        return got

    def mapping(self) -> dict[str, str | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns a source reads for this layout."""
        return tuple(c for c in self.mapping().values() if c is not None)

    def describe(self) -> dict[str, Any]:
        """The layout and its column mapping (part of the cache key). A layout without a video
        column describes itself as it did before videos (no ``video`` entry)."""
        cols = self.mapping()
        if cols.get("video", "") is None:
            del cols["video"]
        return {"layout": self.name, "columns": cols}

    def parse(self, raw: dict[str, Any]) -> ChatSample:
        raise NotImplementedError


@dataclass(frozen=True)
class VQALayout(Layout):
    """Single-turn visual QA: images + question -> answer (see the module table)."""

    image: str | None
    question: str
    answer: str
    video: str | None = None
    name: ClassVar[str] = "vqa"
    ROLES: ClassVar[dict[str, tuple[str, ...]]] = {
        "image": ("image", "images", "img"),
        "video": ("video", "videos"),
        "question": ("question", "prompt", "query"),
        "answer": ("answer", "multiple_choice_answer", "answers", "response"),
    }

    def parse(self, raw: dict[str, Any]) -> ChatSample:
        """A VQA row is about its media: with a media column, a row without any is a counted
        skip (a question about a missing picture is not a text-only sample); with none (a
        text-only QA set) every row is text."""
        images = image_cells(raw.get(self.image)) if self.image else []
        videos = video_cells(raw.get(self.video)) if self.video else []
        if (self.image or self.video) and not images and not videos:
            from torchtitan_ext.vl.errors import SampleError

            cols = " / ".join(repr(c) for c in (self.image, self.video) if c)
            reason = "missing_image" if self.image else "missing_video"
            raise SampleError(reason, f"column {cols} is null or empty in this row")
        ans = raw.get(self.answer)
        if isinstance(ans, (list, tuple)):
            ans = _most_frequent(ans)
        msgs = vqa_messages(len(images), raw.get(self.question), ans, len(videos))
        return ChatSample(msgs, images, videos)


@dataclass(frozen=True)
class MessagesLayout(Layout):
    """HF / OpenAI chat ``messages`` + an images column (see the module table)."""

    messages: str
    image: str | None
    video: str | None = None
    name: ClassVar[str] = "messages"
    ROLES: ClassVar[dict[str, tuple[str, ...]]] = {
        "messages": ("messages",),
        "image": ("images", "image"),
        "video": ("videos", "video"),
    }

    def parse(self, raw: dict[str, Any]) -> ChatSample:
        turns = _turns(raw.get(self.messages), f"column {self.messages!r}")
        msgs = []
        for k, t in enumerate(turns):
            content = t.get("content", t.get("value"))
            msgs.append({"role": _role(t, k), "content": _parts(content, k)})
        images = image_cells(raw.get(self.image)) if self.image else []
        videos = video_cells(raw.get(self.video)) if self.video else []
        return ChatSample(messages=msgs, images=images, videos=videos)


@dataclass(frozen=True)
class LlavaLayout(Layout):
    """LLaVA / ShareGPT ``conversations`` with ``<image>`` markers (see the module table)."""

    conversations: str
    image: str | None
    video: str | None = None
    name: ClassVar[str] = "llava"
    ROLES: ClassVar[dict[str, tuple[str, ...]]] = {
        "conversations": ("conversations",),
        "image": ("image", "images"),
        "video": ("video", "videos"),
    }

    def parse(self, raw: dict[str, Any]) -> ChatSample:
        turns = _turns(raw.get(self.conversations), f"column {self.conversations!r}")
        msgs = []
        for k, t in enumerate(turns):
            value = _text(t.get("value", t.get("content")), f"turn {k}")
            role = _role(t, k)
            if LLAVA_IMAGE not in value and LLAVA_VIDEO not in value:
                msgs.append({"role": role, "content": value})
                continue
            parts: list[dict[str, Any]] = []
            for piece in _LLAVA_MARKS.split(value):  # text, marker, text, marker, ..., text
                if piece == LLAVA_IMAGE:
                    parts.append({"type": "image"})
                elif piece == LLAVA_VIDEO:
                    parts.append({"type": "video"})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            msgs.append({"role": role, "content": parts})
        images = image_cells(raw.get(self.image)) if self.image else []
        videos = video_cells(raw.get(self.video)) if self.video else []
        return ChatSample(messages=msgs, images=images, videos=videos)


@dataclass(frozen=True)
class CauldronLayout(Layout):
    """the_cauldron: ``images`` + ``texts = [{"user", "assistant"}, ...]`` (see the module
    table)."""

    texts: str
    image: str | None
    name: ClassVar[str] = "cauldron"
    ROLES: ClassVar[dict[str, tuple[str, ...]]] = {
        "texts": ("texts",),
        "image": ("images", "image"),
    }

    def parse(self, raw: dict[str, Any]) -> ChatSample:
        turns = _turns(raw.get(self.texts), f"column {self.texts!r}")
        if not turns:
            raise _bad(f"column {self.texts!r} holds no turn")
        images = image_cells(raw.get(self.image)) if self.image else []
        msgs: list[dict[str, Any]] = []
        for k, t in enumerate(turns):
            user = _text(t.get("user"), f"turn {k} user")
            content: list[dict[str, Any]] = [{"type": "image"} for _ in images] if k == 0 else []
            content.append({"type": "text", "text": user})
            msgs.append({"role": "user", "content": content})
            msgs.append({"role": "assistant", "content": _text(t.get("assistant"), f"turn {k}")})
        return ChatSample(messages=msgs, images=images)


LAYOUTS: dict[str, type[Layout]] = {
    "messages": MessagesLayout,
    "llava": LlavaLayout,
    "cauldron": CauldronLayout,
    "vqa": VQALayout,
}
"""In auto-detection order: the conversation layouts first (their column names are specific)."""

_OWNER = {"messages": "messages", "conversations": "llava", "texts": "cauldron",
          "question": "vqa", "answer": "vqa"}  # fmt: skip


def _flags() -> str:
    return " / ".join(f"--{r}-column" for r in COLUMN_ROLES)


def column_overrides(config: Any) -> dict[str, str]:
    """The ``<role>_column`` attributes of a config (a BuildConfig, a loader Config) that are
    set."""
    out = {}
    for role in COLUMN_ROLES:
        v = getattr(config, f"{role}_column", None)
        if v:
            out[role] = str(v)
    return out


def choose_layout(
    columns: Sequence[str], where: str, format: str = "auto", overrides: Mapping[str, str] = {}
) -> Layout:
    """The layout of a schema (see the module docstring); logs the choice."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    owners = {_OWNER[r] for r in overrides if r in _OWNER}
    if format == "auto" and len(owners) == 1:
        format = owners.pop()
    if format != "auto":
        cls = LAYOUTS[format]
        extra = sorted(set(overrides) - set(cls.ROLES))
        if extra:
            raise ValueError(
                f"{where}: the {format} layout has no {extra[0]} column (its columns: "
                f"{', '.join(cls.ROLES)}); drop --{extra[0]}-column"
            )
        layout = cls.detect(columns, where, overrides)
        how = "as asked"
    else:
        found = [cls.match(columns, overrides, where) for cls in LAYOUTS.values()]
        layout = next((x for x in found if isinstance(x, Layout)), None)  # type: ignore[assignment]
        if layout is None:
            raise ValueError(
                f"{where}: cannot tell the row layout from the columns {list(columns)}: expected "
                "'messages' (--format messages), 'conversations' (llava), 'texts' (cauldron) or "
                "question + answer columns (vqa); name yours with --format and "
                f"{_flags()}"
            )
        how = "detected"
    cols = ", ".join(f"{r}={c!r}" for r, c in layout.mapping().items() if c is not None)
    logger.info("%s: row layout %s (%s) from columns %s", where, layout.name, how, cols)
    return layout
