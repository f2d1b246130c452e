"""The loaders of the resume matrix (``tests/test_resume_matrix.py``): one builder per loader.

A builder takes a :class:`Variant` (device staging on/off, worker processes) and a scratch
directory for its data, and returns the :class:`~tests.support.resume.LoaderSpec` that builds
that loader at any DP rank / degree; or raises :class:`Unsupported` (one line: why) for a
combination the loader does not have, which the matrix reports as a skip. Adding a loader to the
matrix is adding one function here, decorated with ``@builder("name")``.

Rules for a builder: small data (the whole matrix runs in seconds), a finite pass small enough to
read to its end, ``doc_ids`` naming the documents that *start* in a batch, and ``epoch_docs`` the
documents of one pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.resume import LoaderSpec


@dataclass(frozen=True)
class Variant:
    """One combination of the matrix besides the loader and the degree path."""

    staging: bool
    """Device staging (``device.staging.wrap_for_device``, CPU device, mode "staged") on top."""
    workers: int
    """Worker processes reading the data (0: the loader's own thread only)."""

    def __str__(self) -> str:
        return f"staging-{'on' if self.staging else 'off'}-w{self.workers}"


class Unsupported(Exception):
    """This loader does not have this combination (the message says why; the matrix skips)."""


Builder = Callable[[Variant, Path], LoaderSpec]
BUILDERS: dict[str, Builder] = {}


def builder(name: str) -> Callable[[Builder], Builder]:
    """Register ``fn`` as the matrix's builder of loader ``name``."""

    def register(fn: Builder) -> Builder:
        BUILDERS[name] = fn
        return fn

    return register


def staged(build: Callable[[int, int, bool], Any]) -> Callable[[int, int, bool], Any]:
    """``build`` with device staging (CPU device) on top of every loader it makes;
    :class:`Unsupported` while staging lacks the harness's contract (``rank_state()``), which it
    gains when it moves onto ``Prefetch``."""
    try:
        from torchtitan_ext.device.staging import wrap_for_device
    except ImportError as e:
        raise Unsupported(f"device staging not importable: {e}") from e

    def build_staged(rank: int, world: int, infinite: bool) -> Any:
        loader = build(rank, world, infinite)
        return wrap_for_device(loader, torch.device("cpu"), enabled=True, mode="staged")

    probe = build_staged(0, 1, True)
    try:
        if not callable(getattr(type(probe), "rank_state", None)):
            raise Unsupported(f"device staging ({type(probe).__name__}) has no rank_state() yet")
    finally:
        probe.close()
    return build_staged


def write_jsonl_corpus(root: Path, files: int = 3, docs: int = 37, seed: int = 0) -> list[Path]:
    """``files`` JSONL files of ``docs`` documents of 1-60 words each (deterministic); document
    ``i`` of the epoch is line ``i`` of the files in order."""
    rng, out = np.random.default_rng(seed), []
    for f in range(files):
        p = Path(root) / f"part-{f}.jsonl"
        words = [" ".join(f"w{f}.{d}.{k}" for k in range(rng.integers(1, 60))) for d in range(docs)]
        p.write_text("".join(json.dumps({"text": w}) + "\n" for w in words))
        out.append(p)
    return out


@builder("toy_jsonl")
def toy_jsonl(variant: Variant, root: Path) -> LoaderSpec:
    from tests.support.toy_source import ToyJsonlLoader

    if variant.workers:
        raise Unsupported("thread-only loader (one Prefetch thread, no worker processes)")
    files = write_jsonl_corpus(root)
    ndocs = sum(len(f.read_text().splitlines()) for f in files)

    def build(rank: int, world: int, infinite: bool) -> Any:
        return ToyJsonlLoader(files, rank, world, infinite=infinite)

    return LoaderSpec(
        "toy_jsonl",
        staged(build) if variant.staging else build,
        doc_ids=lambda batch: batch[0]["doc_starts"].tolist(),
        doc_ends=lambda batch: batch[0]["doc_ends"].tolist(),
        epoch_docs=set(range(ndocs)),
    )
