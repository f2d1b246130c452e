"""A conversation -> its chat-template text and the character spans that carry loss.

:meth:`ChatRenderer.render` returns exactly what the processor's chat template renders for the
conversation (``processor.apply_chat_template(messages, tokenize=False)``: the Qwen3-VL template
of the offline processor, or a ``--model-path`` model's own) and, for every assistant turn, the
span from its first character through its end-of-turn token ``<|im_end|>``. Nothing else carries
loss: not the system or user turns, not the images, not the template's ``<|im_start|>assistant\\n``
header, not the newline it writes after ``<|im_end|>``. The processor step turns the spans into
labels (a token is a target when it overlaps a span).

Why not render every row with jinja: rendering costs ~1.5 ms, more than the rest of a small
sample. The text of a turn never changes what the template writes around it for a template that
only inserts texts, so a conversation's text is the template's output for its *structure* (roles,
and the order of image and text parts) with the texts spliced in. Each new structure is rendered
once with a unique sentinel in every text slot; the fixed pieces between the sentinels are kept
and reused by concatenation, but only after a second render with awkward probe texts (spaces at
both ends, newlines, quotes, jinja and HTML syntax) is reproduced exactly by the same splice. A
template that trims, escapes or otherwise rewrites texts fails that proof and takes the slow path:
the whole conversation is rendered, and each assistant turn is located as the difference between
the renders of the conversation up to it (with the generation prompt) and through it, which only
requires the template to render prefixes as prefixes. Texts a template drops (Qwen3-VL's renders
only a leading system message) are dropped here too; a dropped assistant turn is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

END_OF_TURN = "<|im_end|>"
"""The token that ends a turn in Qwen's chat templates; it carries loss in assistant turns."""

LABEL_RULE = "assistant turns: first character through <|im_end|>; tokens overlapping it"
"""What carries loss, in words (part of the cache key: a change of rule changes the key)."""

_PROBE = "  Probe {i}: {{{{x}}}} <b>&amp; 'q' \"x\" {{% y %}}\n\t\\n "
_MAX_PLANS = 4096


def _bad(message: str) -> Exception:
    from torchtitan_ext.vl.processor import SampleError

    return SampleError("bad_conversation", message)


@dataclass(frozen=True)
class ChatText:
    """A rendered conversation."""

    text: str
    spans: tuple[tuple[int, int], ...]
    """[start, end) character spans carrying loss, sorted and disjoint (one per assistant turn
    the template renders)."""
    assistant_texts: tuple[str, ...]
    """The assistant turns' texts (to tell an all-blank target)."""


def _slots(messages: Sequence[dict[str, Any]]) -> list[tuple[int, int | None]]:
    """(message index, part index or None for string content) of every text, in order."""
    out: list[tuple[int, int | None]] = []
    for m, msg in enumerate(messages):
        c = msg["content"]
        if isinstance(c, str):
            out.append((m, None))
        else:
            out += [(m, j) for j, p in enumerate(c) if p["type"] == "text"]
    return out


def _with_texts(messages: Sequence[dict[str, Any]], texts: Sequence[str]) -> list[dict[str, Any]]:
    """A copy of ``messages`` with its text slots replaced by ``texts`` (in slot order)."""
    it = iter(texts)
    out = []
    for msg in messages:
        c = msg["content"]
        if isinstance(c, str):
            out.append({"role": msg["role"], "content": next(it)})
        else:
            parts = [{"type": "text", "text": next(it)} if p["type"] == "text" else p for p in c]
            out.append({"role": msg["role"], "content": parts})
    return out


def _structure(messages: Sequence[dict[str, Any]]) -> tuple:
    return tuple(
        (
            m["role"],
            None if isinstance(m["content"], str) else tuple(p["type"] for p in m["content"]),
        )
        for m in messages
    )


@dataclass(frozen=True)
class _Plan:
    """A structure's fixed template pieces around its rendered text slots."""

    pieces: tuple[str, ...]
    """len(rendered) + 1 pieces: text = pieces[0] + t[0] + pieces[1] + ... + pieces[-1]."""
    rendered: tuple[int, ...]
    """The slots the template renders, in output order."""
    spans: tuple[tuple[int, int, int], ...]
    """Per assistant turn: (first rendered index, last rendered index, characters of the piece
    after the last one that belong to the span: through END_OF_TURN)."""


class ChatRenderer:
    """Renders conversations with one processor's chat template (see the module docstring)."""

    def __init__(self, processor: Any):
        self.processor = processor
        self._plans: dict[tuple, _Plan | None] = {}

    def template(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        from jinja2 import TemplateError

        try:
            out = self.processor.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as e:
            raise _bad(f"the chat template refuses this conversation: {e}") from None
        return out if isinstance(out, str) else out[0]

    def render(self, messages: list[dict[str, Any]]) -> ChatText:
        if not messages:
            raise _bad("no turns")
        key = _structure(messages)
        if key not in self._plans:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[key] = self._plan(messages)
        plan = self._plans[key]
        if plan is None:
            return self._render_slow(messages)
        texts = [self._slot_text(messages, s) for s in _slots(messages)]
        out, starts, ends = [plan.pieces[0]], [], []
        pos = len(plan.pieces[0])
        for k, slot in enumerate(plan.rendered):
            starts.append(pos)
            out.append(texts[slot])
            pos += len(texts[slot])
            ends.append(pos)
            out.append(plan.pieces[k + 1])
            pos += len(plan.pieces[k + 1])
        spans = tuple((starts[a], ends[b] + tail) for a, b, tail in plan.spans)
        return ChatText("".join(out), spans, _assistant_texts(messages))

    @staticmethod
    def _slot_text(messages: Sequence[dict[str, Any]], slot: tuple[int, int | None]) -> str:
        m, j = slot
        c = messages[m]["content"]
        return c if j is None else c[j]["text"]

    def _plan(self, messages: list[dict[str, Any]]) -> _Plan | None:
        """The structure's plan, or None when the splice cannot be proven (slow path)."""
        slots = _slots(messages)
        marks = [f"\x00{k}\x00" for k in range(len(slots))]
        r = self.template(_with_texts(messages, marks))
        found = [(r.find(mk), k) for k, mk in enumerate(marks) if mk in r]
        if any(r.count(marks[k]) != 1 for _, k in found) or found != sorted(found):
            return None
        rendered = tuple(k for _, k in found)
        pieces, at = [], 0
        for p, k in found:
            pieces.append(r[at:p])
            at = p + len(marks[k])
        pieces.append(r[at:])
        probes = [_PROBE.format(i=k) for k in range(len(slots))]
        want = pieces[0] + "".join(probes[k] + pieces[n + 1] for n, k in enumerate(rendered))
        if self.template(_with_texts(messages, probes)) != want:
            return None
        spans = []
        for m, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            mine = [n for n, k in enumerate(rendered) if slots[k][0] == m]
            if not mine:  # no text of this turn in the output: the prefix renders decide
                return None
            after = pieces[mine[-1] + 1]
            end = after.find(END_OF_TURN)
            between = "".join(pieces[n + 1] for n in mine[:-1])
            if end < 0 or END_OF_TURN in between:
                return None  # not a Qwen-style turn end right after the text: slow path decides
            spans.append((mine[0], mine[-1], end + len(END_OF_TURN)))
        return _Plan(tuple(pieces), rendered, tuple(spans))

    def _generation_prompt(self) -> str:
        """What the generation prompt adds (the assistant header), for a conversation that
        starts with an assistant turn (templates cannot render an empty conversation)."""
        probe = [{"role": "user", "content": "x"}]
        with_prompt, without = self.template(probe, True), self.template(probe)
        if not with_prompt.startswith(without):
            raise _bad("the chat template's generation prompt is not a suffix")
        return with_prompt[len(without) :]

    def _render_slow(self, messages: list[dict[str, Any]]) -> ChatText:
        """Render the whole conversation; locate each assistant turn by prefix renders."""
        full = self.template(messages)
        spans = []
        for m, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            before = self.template(messages[:m], True) if m else self._generation_prompt()
            through = self.template(messages[: m + 1])
            if not (full.startswith(through) and through.startswith(before)):
                raise _bad(f"the chat template does not render turn {m} as a prefix of the next")
            end = through.rfind(END_OF_TURN)
            if end < len(before):
                raise _bad(f"the chat template ends assistant turn {m} without {END_OF_TURN}")
            spans.append((len(before), end + len(END_OF_TURN)))
        return ChatText(full, tuple(spans), _assistant_texts(messages))


def _assistant_texts(messages: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    out = []
    for msg in messages:
        if msg["role"] == "assistant":
            c = msg["content"]
            out.append(c if isinstance(c, str) else "".join(p["text"] for p in c if "text" in p))
    return tuple(out)


def renderer(processor: Any) -> ChatRenderer:
    """The processor's renderer (one per processor object, so plans are shared)."""
    r = getattr(processor, "_ttx_chat_renderer", None)
    if r is None:
        r = ChatRenderer(processor)
        processor._ttx_chat_renderer = r
    return r
