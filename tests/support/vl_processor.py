"""The offline Qwen3-VL processor and its special-token ids as module-scope fixtures, one home for
the test modules that need them. ``tests/conftest.py`` registers this module (``pytest_plugins``),
so a test module asks for ``proc`` / ``special`` by name; a module that needs another processor
(a fresh cache directory, a built one) defines its own ``proc``, which wins inside it."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def proc() -> Any:
    """The offline processor (``load_processor(None)``: built on first use, cached per process)."""
    from torchtitan_ext.vl.processor import load_processor

    return load_processor()


@pytest.fixture(scope="module")
def special(proc: Any) -> dict[str, int]:
    """The special-token ids packing and collation use (``special_token_ids``)."""
    from torchtitan_ext.vl.processor import special_token_ids

    return special_token_ids(proc)
