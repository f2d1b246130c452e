"""What counts as a text column and a text value: one definition for both text loaders.

A text column is any Arrow string or binary type, plain, ``large_``, ``_view`` or
dictionary-encoded over one of those (a pandas categorical written to Parquet is
``dictionary<int32, string>``). Binary values are UTF-8, decoded strictly per value, so that one
bad value is one counted ``invalid_utf8`` skip (or an error naming its row), never a whole batch
lost. Values are taken with ``to_pylist()``, which decodes dictionaries and views itself; the
loaders never need to know which layout a file used, and files of one dataset may differ.

Per value (:func:`as_text`): a non-empty ``str`` (or valid UTF-8 ``bytes``) is a document;
``None`` is ``"null"``, ``""`` is ``"empty"``, bad bytes are ``"invalid_utf8"``, anything else
``"not_string"``. What a loader then does with a reason (raise, or count and skip) is its
``on_bad_input`` policy (:mod:`torchtitan_ext.text.errors`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pyarrow as pa

TextKind = Literal["str", "bytes"]


def text_kind(typ: pa.DataType) -> TextKind | None:
    """``"str"`` / ``"bytes"`` for a text column type (see the module docstring), else None."""
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ):
        return "str"
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_binary_view(typ):
        return "bytes"
    return None


@dataclass(frozen=True)
class Rejected:
    """Why a value is not a document: a short ``reason`` (the skip counter's key) and a message."""

    reason: str
    message: str


NULL = Rejected("null", "NULL value")
EMPTY = Rejected("empty", "empty document")


def as_text(value: object) -> str | Rejected:
    """The document text of one value, or why it is not one."""
    if type(value) is str:
        return value if value else EMPTY
    if value is None:
        return NULL
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            return Rejected("invalid_utf8", f"invalid UTF-8 ({e})")
        return value if value else EMPTY
    if isinstance(value, str):
        return str(value) if value else EMPTY
    return Rejected("not_string", f"value is {type(value).__name__}, not text")
