"""Stand-ins that watch an in-process trainer: the log lines it emits and the metrics it sends to
its backends (the trainer-glue tests of plain and mixture loaders share them)."""

from __future__ import annotations

import logging
from typing import Any


class LogRecords(logging.Handler):
    """A logging handler that keeps the message (``getMessage()``) of each INFO-or-above record."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class MetricBackend:
    """A metric backend (TensorBoard / W&B stand-in) that keeps what it is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, dict[str, Any]]] = []

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.sent.append((step, dict(metrics)))

    def close(self) -> None:
        pass
