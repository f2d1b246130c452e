"""The small sample-set VL cache several test modules build (one set-up, one place)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest


@contextlib.contextmanager
def sample_cache(
    tmp_path_factory: Any,
    name: str,
    *,
    n: int = 24,
    seq_len: int = 1024,
    buffer_size: int = 8,
    buckets: Sequence[int] | None = (512, 768),
    store: bool = False,
) -> Iterator[dict[str, Any]]:
    """Build a cache of ``n`` sample rows under a fresh temporary root, with
    ``TORCHTITAN_EXT_CACHE`` (offline processor, sample data) pointed inside it while open.
    ``store``: a sample store (``vl/plan.py``) instead of a packed cache.
    Yields ``{"root", "data", "cache_dir", "path"}``."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp(name)
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    try:
        from torchtitan_ext.vl.build import build_cache
        from torchtitan_ext.vl.sample_data import sample_dataset_path

        data = sample_dataset_path(n=n, root=root / "data")
        cache_dir = root / "cache"
        path = build_cache(
            data,
            "train",
            cache_dir,
            seq_len=seq_len,
            buffer_size=buffer_size,
            buckets=list(buckets) if buckets else None,
            show_progress=False,
            store=store,
        )
        yield {"root": root, "data": data, "cache_dir": cache_dir, "path": path}
    finally:
        mp.undo()


@contextlib.contextmanager
def bad_rows_dataset(tmp_path_factory: Any, name: str, *, n: int) -> Iterator[dict[str, Any]]:
    """A sample dataset of ``n`` rows with every kind of bad row (``make_sample_dataset``) under a
    fresh temporary root, with ``TORCHTITAN_EXT_CACHE`` (offline processor assets) pointed
    inside it while open. Yields ``{"root", "ds"}``."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp(name)
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "assets"))
    try:
        from torchtitan_ext.vl.sample_data import make_sample_dataset

        yield {"root": root, "ds": make_sample_dataset(root / "ds", n=n, bad_rows=True)}
    finally:
        mp.undo()
