"""Which files a piece of code opens, as the kernel reports it (Linux inotify): every open of a
file in a watched directory, whatever call makes it (``open``, ``np.memmap``, ``torch.from_file``,
``mmap``), so a test of "reads only the index" cannot be bypassed by another read path."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

needs_inotify = pytest.mark.skipif(
    sys.platform != "linux", reason="watches file opens with Linux's inotify"
)


@contextlib.contextmanager
def watch_opens(dirs: Sequence[Path]) -> Iterator[Callable[[], set[tuple[str, str]]]]:
    """Watch ``dirs``; yields ``opened()``: the (directory name, file name) pairs opened since
    the previous call. A directory's own listing (an event without a file name) is left out."""
    from inotify_simple import INotify, flags

    with INotify() as ino:
        names = {ino.add_watch(str(d), flags.OPEN): Path(d).name for d in dirs}

        def opened() -> set[tuple[str, str]]:
            return {(names[e.wd], e.name) for e in ino.read(timeout=0) if e.name}

        yield opened
