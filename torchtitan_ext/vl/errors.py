"""The one error a bad sample raises anywhere in VL preprocessing (image, conversation, positions)."""

from __future__ import annotations


class SampleError(ValueError):
    """A bad sample: ``reason`` is a short code counted in packing_stats.json; ``error_type``
    names the exception behind a ``decode_error`` / ``processor_error``."""

    def __init__(self, reason: str, message: str, error_type: str | None = None):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.error_type = error_type

    @classmethod
    def from_exception(cls, reason: str, e: BaseException) -> SampleError:
        return cls(reason, f"{type(e).__name__}: {e}", type(e).__name__)

    def at_image(self, i: int, n: int) -> SampleError:
        """The same error, naming the image's index in the row's list of ``n`` images."""
        return SampleError(self.reason, f"images[{i}] of {n}: {self.message}", self.error_type)

    def at_video(self, i: int, n: int) -> SampleError:
        """The same error, naming the video's index in the row's list of ``n`` videos."""
        return SampleError(self.reason, f"videos[{i}] of {n}: {self.message}", self.error_type)
