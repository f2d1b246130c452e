"""Where derived data lives, and how a derived directory is built once and trusted only while it
still holds what was built.

Derived directories (the embedded corpus and tokenizer, the VL sample dataset, the offline
Qwen3-VL processor, benchmark corpora) are cached under :func:`cache_root` and reused across
runs. A directory found there may be partial (a build killed half-way by a tool that does not
rename atomically), edited by hand, or left by another checkout whose builder wrote different
bytes under the same name. So every build ends with a manifest, ``.manifest.json``: the size and
SHA-256 of each file and the build parameters (``meta``). :func:`build_atomically` reuses a
directory only when the manifest matches the files on disk and the parameters asked for;
otherwise it logs the reason and rebuilds. A directory without a manifest that holds files the
build does not write is somebody's data (an ``--out-dir`` pointed at the wrong place): it is never
deleted, the build fails naming those files. Checking costs a hash of the directory (~6 ms for the
2.8 MB embedded corpus); the directories are small by design.

Concurrent builders (torchrun ranks starting together) take a lock file beside the directory
(``.{name}.lock``, ``fcntl.flock``): one builds, the others wait and then find it valid. The
build itself writes into a temporary sibling that is renamed into place, so a reader never sees
a half-written directory under the final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = ".manifest.json"
"""The manifest's file name inside a built directory (hidden: never matched by a data glob)."""
_MANIFEST_FORMAT = 1


def cache_root() -> Path:
    """Where derived data is written: ``$TORCHTITAN_EXT_CACHE``, else
    ``$XDG_CACHE_HOME/torchtitan_ext``, else ``~/.cache/torchtitan_ext``."""
    env = os.environ.get("TORCHTITAN_EXT_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "torchtitan_ext"


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(d: Path) -> list[str]:
    """Every regular file under ``d`` (relative POSIX paths, sorted), the manifest excluded."""
    out = [p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() or p.is_symlink()]
    return sorted(f for f in out if f != MANIFEST)


def write_manifest(d: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the size and SHA-256 of every file under ``d`` (and ``meta``) in ``d/.manifest.json``."""
    files = {f: {"size": (d / f).stat().st_size, "sha256": sha256_file(d / f)} for f in _files(d)}
    manifest = {"format": _MANIFEST_FORMAT, "meta": meta or {}, "files": files}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def verify_manifest(d: Path, meta: dict[str, Any] | None = None) -> str | None:
    """``None`` when ``d`` holds exactly the files of its manifest (sizes and digests) and was
    built with ``meta``; else the first reason it does not, in words."""
    if not d.is_dir():
        return "missing"
    if not (d / MANIFEST).is_file():
        return f"no {MANIFEST} (a partial directory, or one written by an older version)"
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        files = manifest["files"]
        fmt, built_meta = manifest["format"], manifest["meta"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__}: {e})"
    if fmt != _MANIFEST_FORMAT:
        return f"{MANIFEST} format {fmt!r} != {_MANIFEST_FORMAT}"
    want_meta = json.loads(json.dumps(meta or {}))  # compare as stored (tuples -> lists)
    if built_meta != want_meta:
        return f"built with {built_meta}, asked for {want_meta}"
    on_disk = _files(d)
    if on_disk != sorted(files):
        missing = sorted(set(files) - set(on_disk))
        extra = sorted(set(on_disk) - set(files))
        return f"files differ from the manifest (missing {missing[:3]}, unexpected {extra[:3]})"
    for name, rec in files.items():
        p = d / name
        if p.stat().st_size != rec["size"]:
            return f"{name}: {p.stat().st_size} bytes, manifest says {rec['size']}"
        if sha256_file(p) != rec["sha256"]:
            return f"{name}: content differs from the manifest (sha256)"
    return None


@contextlib.contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock; the atomic rename still holds
        yield
        return
    with open(final.parent / f".{final.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_atomically(
    final: Path, fill: Callable[[Path], None], meta: dict[str, Any] | None = None
) -> Path:
    """Return directory ``final``, (re)building it with ``fill(tmp)`` unless it already holds
    what a build with ``meta`` wrote (checked against its manifest: see the module docstring).

    ``fill`` writes into an empty temporary sibling; the manifest is added and the directory
    renamed into place. A directory that fails the check is logged and replaced when it is one
    of ours (it has a manifest), empty, or holds only files the build writes (a partial build,
    or one by an older version); a directory holding anything else is somebody's data: it is
    left alone and ``FileExistsError`` names what it holds."""
    final = Path(final)
    if verify_manifest(final, meta) is None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final):
        problem = verify_manifest(final, meta)
        if problem is None:  # another process built it while we waited for the lock
            return final
        _remove_leftovers(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            fill(tmp)
            write_manifest(tmp, meta)
            if final.exists() or final.is_symlink():
                _check_replaceable(final, tmp)
                logger.warning("%s: %s; rebuilding it", final, problem)
                stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=final.parent))
                os.replace(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _remove_leftovers(final: Path) -> None:
    """Remove the temporary siblings of ``final`` that killed builds left behind. Called with the
    build lock held: every builder takes it before creating its temporary directory, so any that
    exists now belongs to a process that died mid-build."""
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.stale-*"):
        for left in final.parent.glob(pattern):
            logger.info("%s: removing %s left by a killed build", final, left.name)
            shutil.rmtree(left, ignore_errors=True)


_LEGACY_MARKERS = {"DONE"}  # the completion marker of builds before manifests


def _check_replaceable(final: Path, built: Path) -> None:
    if final.is_dir() and not final.is_symlink():
        if (final / MANIFEST).exists():
            return  # ours, damaged or built with other parameters
        foreign = sorted(set(_files(final)) - set(_files(built)) - _LEGACY_MARKERS)
        if not foreign:
            return  # empty, or a partial / older build of the same files
    else:
        foreign = [final.name]
    raise FileExistsError(
        f"{final}: exists and holds data this build does not write ({', '.join(foreign[:3])}"
        f"{', ...' if len(foreign) > 3 else ''}); not replacing it: remove it or choose another "
        "directory"
    )
