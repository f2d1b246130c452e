"""Bad-input reporting shared by the text loaders: one error type and one skip ledger.

Convention (``on_bad_input``): every text loader takes ``on_bad_input: "error" | "skip"``.

* ``"error"`` (the default): the first bad record raises :class:`BadInputError`, whose message
  names *where* (file, row group, row, key) and *what* (the reason). Raised in a background thread,
  it is re-raised from the consumer's ``__next__`` with the original traceback chained.
* ``"skip"``: the record is dropped and counted in a :class:`SkipLog` under a short reason
  (``"null"``, ``"not_string"``, ``"empty"``, ``"invalid_utf8"``, ``"unreadable_row_group"`` ...),
  keeping the first few locations per reason as examples. Nothing is dropped silently, and the
  counts reconcile: ``rows read == documents used + skip_log.total``.

Why not ``warnings``/logging only: a log line cannot be checked, checkpointed or reconciled; a
counter can, and it travels in the loader's ``state_dict`` so resumed runs keep their totals.
"""

from __future__ import annotations

from typing import Any, Literal

OnBadInput = Literal["error", "skip"]
ON_BAD_INPUT_CHOICES: tuple[str, ...] = ("error", "skip")


def check_on_bad_input(value: str) -> OnBadInput:
    """Validate an ``on_bad_input`` setting (config typos should fail at construction)."""
    if value not in ON_BAD_INPUT_CHOICES:
        raise ValueError(f"on_bad_input must be one of {ON_BAD_INPUT_CHOICES}, got {value!r}")
    return value  # type: ignore[return-value]


def where(
    file: str | None = None,
    row_group: int | None = None,
    row: int | None = None,
    key: str | None = None,
) -> str:
    """A compact location string, e.g. ``"shard.parquet row_group=3 row=17 key='text'"``."""
    parts = [str(file) if file is not None else "<unknown file>"]
    if row_group is not None:
        parts.append(f"row_group={row_group}")
    if row is not None:
        parts.append(f"row={row}")
    if key is not None:
        parts.append(f"key={key!r}")
    return " ".join(parts)


class BadInputError(ValueError):
    """A record (or a whole file / row group) the loader cannot use.

    The message always starts with the location so that a user can open the file and look::

        BadInputError: data/train-00001.parquet row_group=3 row=17 key='text': NULL value
            (set on_bad_input="skip" to count and skip such rows)
    """

    def __init__(
        self,
        reason: str,
        *,
        file: str | None = None,
        row_group: int | None = None,
        row: int | None = None,
        key: str | None = None,
        hint: bool = True,
    ) -> None:
        self.reason = reason
        self.file = file
        self.row_group = row_group
        self.row = row
        self.key = key
        msg = f"{where(file, row_group, row, key)}: {reason}"
        if hint:
            msg += ' (set on_bad_input="skip" to count and skip such records)'
        super().__init__(msg)

    @property
    def location(self) -> str:
        return where(self.file, self.row_group, self.row, self.key)


class NoUsableDocuments(ValueError):
    """A whole pass over a stream's data yielded no usable document (every record skipped, or
    nothing to read): an endless stream would spin through empty epochs forever, so it stops with
    this error, which names the files and the skip counts."""


class SkipLog:
    """Counts skipped records per reason and keeps the first ``max_examples`` locations of each.

    ``state_dict()`` is pickle-free (a dict of ints and lists of str) so it can ride in a
    checkpoint; examples are informational and are restored too.
    """

    def __init__(self, max_examples: int = 5) -> None:
        self.max_examples = max_examples
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}

    def skip(self, reason: str, where: str, n: int = 1) -> None:
        """Record ``n`` skipped records for ``reason`` at location ``where``."""
        if n <= 0:
            return
        self.counts[reason] = self.counts.get(reason, 0) + n
        ex = self.examples.setdefault(reason, [])
        if len(ex) < self.max_examples:
            ex.append(where)

    def merge(self, other: SkipLog) -> None:
        """Add ``other``'s counts (and examples, up to the cap) into this log."""
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            ex = self.examples.setdefault(reason, [])
            for w in other.examples.get(reason, []):
                if len(ex) < self.max_examples:
                    ex.append(w)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        """Counts per reason (a copy)."""
        return dict(self.counts)

    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "examples": {k: list(v) for k, v in self.examples.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {str(k): int(v) for k, v in state.get("counts", {}).items()}
        self.examples = {str(k): [str(x) for x in v] for k, v in state.get("examples", {}).items()}

    def __repr__(self) -> str:
        return f"SkipLog(total={self.total}, counts={self.counts})"
