"""What every packer shares: the packed row, its split into a training example, the document
check, the checks of a saved state's numbers (:func:`int_array`, :func:`whole`: refused in one
line, never cast) and the row counters (whose invariant every packer keeps; ``text/packing.py``
documents the packers, ``text/concat_split.py`` the plain one)."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchtitan_ext.constants import IGNORE_INDEX


@dataclass
class PackedRow:
    """One packed row. Unpacks like a tuple: ``tokens, positions = packer.pop_row()``."""

    tokens: np.ndarray
    """int64 ``[seq_len + 1]``; after ``valid`` the row is padding (``pad_id``)."""
    positions: np.ndarray
    """int64 ``[seq_len + 1]``; 0 at every document start and at the row start."""
    valid: int
    """Number of real tokens; ``seq_len + 1`` except for a final partial row of a finite stream."""

    def __iter__(self) -> Iterator[np.ndarray]:
        yield self.tokens
        yield self.positions


def row_to_example(row: PackedRow) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input, labels, positions)``, each ``[seq_len]``: input/positions = row[:-1], labels =
    row[1:] with padding labels set to ``IGNORE_INDEX``."""
    inp = row.tokens[:-1]
    labels = row.tokens[1:].copy()
    if row.valid < len(row.tokens):
        # label j predicts token j+1; token j+1 is padding once j+1 >= valid
        labels[max(row.valid - 1, 0) :] = IGNORE_INDEX
    return inp, labels, row.positions[:-1]


def token_array(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``ids`` as a numpy array: an ``int32`` array as it is (no copy), anything else ``int64``."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32:
        return ids
    return np.asarray(ids, dtype=np.int64)


def as_doc(doc_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """A document as 1-D token ids, or ValueError naming its shape. An ``int32`` array (what
    :class:`~torchtitan_ext.text.tokenize.TextTokenizer` makes) is kept as it is, anything else
    becomes ``int64``: packers buffer ~1000 documents, and a checkpoint copies them (``int32``
    halves both; rows are ``int64`` either way)."""
    arr = token_array(doc_ids)
    if arr.ndim != 1:
        raise ValueError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
    return arr


_I32 = np.iinfo(np.int32)


def fits_int32(ids: np.ndarray) -> bool:
    """Every id of ``ids`` fits ``int32`` (trivially for an ``int32`` array: no pass over it)."""
    return ids.dtype == np.int32 or (
        ids.size == 0 or (int(ids.min()) >= _I32.min and int(ids.max()) <= _I32.max)
    )


def int_array(value: Any, name: str) -> np.ndarray:
    """A packer state's ``value`` (an array or a list) as a 1-D array of integers in its own
    integer dtype, or a one-line ValueError naming ``name``: floats, bools, more dimensions and
    ids past int64 are refused, never cast (a cast would change the ids silently)."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"packer state: {name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"packer state: {name} must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"packer state: {name} holds a value past int64")
    return arr


def whole(state: dict[str, Any], key: str) -> int:
    """A packer state's ``state[key]`` as an int, or a one-line ValueError if it is not a whole
    number (``0.7`` or ``"17"`` is refused, not rounded or parsed)."""
    try:
        return operator.index(state[key])
    except TypeError:
        raise ValueError(f"packer state: {key} must be an integer, got {state[key]!r}") from None


class RowCounters:
    """Shared bookkeeping. Invariant (checked in tests):
    ``tokens_in + bos_inserted + boundary_tokens + tokens_carried ==
    tokens_out + tokens_cropped + buffered_tokens``."""

    _FIELDS = (
        "rows",
        "docs_in",
        "tokens_in",
        "tokens_out",
        "tokens_cropped",
        "docs_cropped",
        "bos_inserted",
        "boundary_tokens",
        "pad_tokens",
        "tokens_carried",
    )

    def __init__(self) -> None:
        for f in self._FIELDS:
            setattr(self, f, 0)

    def state(self) -> dict[str, int]:
        return {f: int(getattr(self, f)) for f in self._FIELDS}

    def load(self, state: dict[str, Any]) -> None:
        for f in self._FIELDS:
            setattr(self, f, int(state[f]))

    def finish_row(
        self, tokens: np.ndarray, positions: np.ndarray, filled: int, R: int, pad_id: int
    ) -> int:
        """Pad the rest of a row of ``R`` (``positions`` 0) and count it; returns ``filled``."""
        if filled < R:
            tokens[filled:] = pad_id
            positions[filled:] = 0
        self.rows += 1
        self.tokens_out += filled
        self.pad_tokens += R - filled
        return filled


def pct(num: int, den: int) -> float:
    """``100 * num / den``, 0 for an empty denominator."""
    return 100.0 * num / den if den else 0.0
