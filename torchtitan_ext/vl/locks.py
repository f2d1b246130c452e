"""The VL cache writers' locks (all beside the key directory, in the cache root, never inside it).

* ``.<key dir>.lock`` — **one lock per cache key**, whatever the rank layout. Every writer holds
  it shared for its whole build and records its ``WORLD_SIZE`` in it; a writer with another
  ``WORLD_SIZE`` on the same key while one is active gets :class:`CacheLockedError` (two layouts
  would assign the same shards to different ranks). The writer that finds no other writer active
  takes it exclusively first and removes what killed runs left: ``shards/.tmp-*`` directories and
  temporary JSON files.
* ``.<key dir>.rank<r>of<W>.lock`` — one writer per rank of a layout (a second gets
  CacheLockedError).
* ``.<key dir>.manifest.lock`` — one finaliser at a time. A finaliser removes only temporary JSON
  files, which only finalisers write; it never touches another writer's shard directories.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from torchtitan_ext.vl.format import SHARDS
from torchtitan_ext.vl.write import JSON_TMP_PREFIX


class CacheLockedError(RuntimeError):
    """Another process holds a writer lock for this cache key (same rank, or another layout)."""


def _locked(path: Path, what: str) -> CacheLockedError:
    return CacheLockedError(
        f"{what}: another process is writing this cache (lock {path} is held); "
        "wait for it or use another --cache-dir"
    )


@contextlib.contextmanager
def flock(path: Path, blocking: bool, what: str) -> Iterator[None]:
    """Hold ``path`` exclusively (``blocking``: wait for it; else :class:`CacheLockedError`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _locked(path, what) from None
            raise
        yield
    finally:
        os.close(fd)  # closing releases the flock


def lock_path(kdir: Path, what: str) -> Path:
    """The lock file ``.<key dir>.<what>.lock`` (``what`` empty: the per-key lock)."""
    return kdir.parent / f".{kdir.name}.{what}.lock" if what else kdir.parent / f".{kdir.name}.lock"


def remove_strays(kdir: Path) -> None:
    """What killed writers left: shard temp directories and temporary JSON files. Called only
    with exclusive locks that prove no writer that could own them is alive."""
    for t in (kdir / SHARDS).glob(".tmp-*"):
        shutil.rmtree(t, ignore_errors=True)
    for t in kdir.glob(f"{JSON_TMP_PREFIX}*"):
        t.unlink(missing_ok=True)


@contextlib.contextmanager
def key_lock(kdir: Path, world: int) -> Iterator[None]:
    """The per-key writer lock (module docstring): shared among writers of one layout."""
    path = lock_path(kdir, "")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            alone = False
        if alone:  # no other writer of this key is alive: record this layout, clean up
            if (kdir / SHARDS).is_dir():
                remove_strays(kdir)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(world).encode(), 0)
        fcntl.flock(fd, fcntl.LOCK_SH)
        layout = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if layout != str(world):
            raise CacheLockedError(
                f"{kdir}: a writer with WORLD_SIZE={layout} is building this cache (lock {path}); "
                f"this one has WORLD_SIZE={world}: wait for it to finish, then rerun"
            )
        yield
    finally:
        os.close(fd)
