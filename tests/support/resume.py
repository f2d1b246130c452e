"""The one resume harness: every loader, through the one checkpoint format, at the same or another
DP degree.

A loader under test is described by a :class:`LoaderSpec`; what the harness asks of a loader is
what torchtitan asks of it, plus ``rank_state()``:

* ``iter(loader)`` / ``next(loader)`` — batches;
* ``loader.rank_state()`` — this DP rank's state (no collective); torchtitan's ``state_dict()`` is
  ``checkpoint.envelope(name, gather(rank_state()))``, which the harness builds by hand from
  every in-process rank (one process cannot run a real multi-rank ``gather``);
* ``loader.load_state_dict(envelope)`` — resume, at any DP degree the envelope allows;
* ``loader.close()``.

:func:`assert_resume_exact` checks:

* **Same degree** — ``steps`` batches, save, a fresh loader resumes from the saved envelope,
  ``steps`` more: bitwise equal to ``2 * steps`` uninterrupted batches, on every rank.
* **Other degrees** (``dp_to`` a sequence, e.g. ``(3, 1)``) — a finite pass read ``steps``
  batches per rank at ``dp_from``, then at each degree of ``dp_to`` (the last one to the end):
  every document of the epoch is emitted exactly once (``spec.doc_ids``), none lost, none twice;
  with ``spec.doc_ends`` also every document's *end* exactly once (a lost tail of a document
  split across batches is invisible to the starts alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_ext.pipeline import checkpoint


@dataclass
class LoaderSpec:
    """How to build one loader and read its batches.

    ``build(dp_rank, dp_world_size, infinite)`` returns a fresh loader (its workers / staging
    decided by the spec); ``doc_ids(batch)`` the documents *starting* in a batch (each document
    is counted where it starts, so a document split across batches is counted once);
    ``epoch_docs`` every document of one pass; optional ``doc_ends(batch)`` the documents
    *ending* in a batch (checked like the starts where given).
    """

    name: str
    build: Callable[[int, int, bool], Any]
    doc_ids: Callable[[Any], list[int]] | None = None
    epoch_docs: set[int] = field(default_factory=set)
    steps: int | None = None
    """Batches per rank per phase a matrix run should read (None: its default); a loader whose
    test data holds few batches per epoch says fewer, so every phase stays inside the epoch."""
    doc_ends: Callable[[Any], list[int]] | None = None


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two batches (nested dicts / lists / tuples of tensors and values)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def take(loader: Any, n: int | None) -> list[Any]:
    """Up to ``n`` batches (all remaining ones with ``None``)."""
    out: list[Any] = []
    it = iter(loader)
    while n is None or len(out) < n:
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def save(spec: LoaderSpec, loaders: Sequence[Any]) -> dict[str, Any]:
    """The checkpoint value torchtitan would save for these ranks (as one ``gather`` makes it)."""
    return checkpoint.envelope(spec.name, [ld.rank_state() for ld in loaders], "any")


def _build_all(spec: LoaderSpec, world: int, infinite: bool) -> list[Any]:
    return [spec.build(r, world, infinite) for r in range(world)]


def _close_all(loaders: Sequence[Any]) -> None:
    for ld in loaders:
        ld.close()


def assert_same_degree(spec: LoaderSpec, steps: int, world: int, infinite: bool = True) -> None:
    ref = _build_all(spec, world, infinite)
    expected = [take(ld, 2 * steps) for ld in ref]
    _close_all(ref)
    first = _build_all(spec, world, infinite)
    head = [take(ld, steps) for ld in first]
    saved = save(spec, first)
    _close_all(first)
    again = _build_all(spec, world, infinite)
    for ld in again:
        ld.load_state_dict(saved)
    tail = [take(ld, steps) for ld in again]
    _close_all(again)
    for r in range(world):
        got = head[r] + tail[r]
        assert len(got) == len(expected[r]), f"rank {r}: {len(got)} batches, {len(expected[r])}"
        for i, (x, y) in enumerate(zip(got, expected[r], strict=True)):
            assert same(x, y), f"{spec.name}: rank {r} batch {i} differs after the resume"


def assert_elastic(spec: LoaderSpec, steps: int, dp_from: int, dp_to: Sequence[int]) -> None:
    assert spec.doc_ids is not None and spec.epoch_docs, "elastic checks need doc_ids"
    seen: list[int] = []
    ended: list[int] = []
    loaders = _build_all(spec, dp_from, False)
    degrees = [dp_from, *dp_to]
    for i, world in enumerate(degrees):
        if i:
            saved = save(spec, loaders)
            _close_all(loaders)
            loaders = _build_all(spec, world, False)
            for ld in loaders:
                ld.load_state_dict(saved)
        last = i == len(degrees) - 1
        for ld in loaders:
            for batch in take(ld, None if last else steps):
                seen += spec.doc_ids(batch)
                ended += spec.doc_ends(batch) if spec.doc_ends is not None else []
    _close_all(loaders)
    path = " -> ".join(map(str, degrees))
    _assert_once(spec, seen, f"{spec.name} DP {path}: documents")
    if spec.doc_ends is not None:
        _assert_once(spec, ended, f"{spec.name} DP {path}: document ends")


def _assert_once(spec: LoaderSpec, seen: list[int], what: str) -> None:
    counts: dict[int, int] = {}
    for d in seen:
        counts[d] = counts.get(d, 0) + 1
    twice = sorted(d for d, c in counts.items() if c > 1)
    lost = sorted(spec.epoch_docs - counts.keys())
    extra = sorted(counts.keys() - spec.epoch_docs)
    assert not twice, f"{what} emitted twice: {twice[:10]}"
    assert not lost, f"{what} lost: {lost[:10]} ({len(lost)})"
    assert not extra, f"{what} unknown: {extra[:10]}"


def assert_resume_exact(
    spec: LoaderSpec, steps: int, dp_from: int, dp_to: int | Sequence[int]
) -> None:
    """Same degree: bitwise resume. Other degrees (a chain, e.g. ``(3, 1)``): every document of
    the epoch exactly once."""
    chain = [dp_to] if isinstance(dp_to, int) else list(dp_to)
    if chain == [dp_from]:
        assert_same_degree(spec, steps, dp_from)
    else:
        assert_elastic(spec, steps, dp_from, chain)
