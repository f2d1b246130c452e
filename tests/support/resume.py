"""The one resume harness: every loader, through the one checkpoint format, at the same or another
DP degree. Loader-level resume is checked here, not with a save/load/compare loop of a test's own.

A loader under test is described by a :class:`LoaderSpec`; what the harness asks of a loader is
what torchtitan asks of it, plus ``rank_state()``:

* ``iter(loader)`` / ``next(loader)`` — batches;
* ``loader.rank_state()`` — this DP rank's state (no collective); torchtitan's ``state_dict()`` is
  ``checkpoint.envelope(name, gather(rank_state()))``, which the harness builds by hand from
  every in-process rank (one process cannot run a real multi-rank ``gather``);
* ``loader.load_state_dict(envelope)`` — resume, at any DP degree the envelope allows;
* ``loader.close()`` (where the loader has one).

A spec with ``state`` takes the checkpoint value its own way instead (e.g. a text-level loader's
or a dataset's ``state_dict()``, through a JSON round trip): then ``rank_state()`` is not needed.

:func:`assert_resume_exact` checks:

* **Same degree** — ``steps`` batches, save, a fresh loader resumes from the saved value,
  ``steps`` more: bitwise equal to ``2 * steps`` uninterrupted batches, on every rank. With
  ``cuts=(a, b, c, ...)`` instead: a *chain* of restarts — ``a`` batches, save, a fresh loader
  resumes and reads ``b``, save, another fresh loader ``c``, ...; the concatenation is bitwise
  equal to one uninterrupted run of ``a + b + c + ...`` batches. A cut of ``None`` reads to the
  end of a finite pass (``infinite=False``), so ``(k, None)`` is "resume at k, read the rest" and
  ``(None, None)`` "a state taken after the end resumes to nothing more". Several independent
  cut points are several calls. Segments may cross epoch boundaries (an infinite loader wraps).
  ``running=n``: every resumed loader first reads ``n`` batches of its own (its threads /
  workers running from the start), then ``load_state_dict`` — a load on a running loader.
  Returns the batches of the chained run, per rank (equal to the uninterrupted ones), for checks
  of their contents.
* **Other degrees** (``dp_to`` a sequence, e.g. ``(3, 1)``) — a finite pass read ``steps``
  batches per rank at ``dp_from``, then at each degree of ``dp_to`` (the last one to the end):
  every document of the epoch is emitted exactly once (``spec.doc_ids``), none lost, none twice;
  with ``spec.doc_ends`` also every document's *end* exactly once (a lost tail of a document
  split across batches is invisible to the starts alone). Returns None.

``check(loader, event)``, optional, is called on every loader the harness drives (the
uninterrupted reference too) with ``event`` one of: ``"batch"`` after every batch it returns,
``"save"`` just before its state is taken, ``"load"`` just after ``load_state_dict``, ``"end"``
after its last segment (before ``close``). A check asserts what must hold there, e.g. that
counters reconcile at every batch and right after a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtitan_ext.pipeline import checkpoint

Check = Callable[[Any, str], None]
"""``check(loader, event)``: event ``"batch"``, ``"save"``, ``"load"`` or ``"end"``."""


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
    state: Callable[[Sequence[Any]], Any] | None = None
    """``state(loaders)``: the value to save from the ranks' loaders and hand to each resumed
    loader's ``load_state_dict`` (None: :func:`save`, the envelope of every ``rank_state()``)."""


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


def take(loader: Any, n: int | None, check: Check | None = None) -> list[Any]:
    """Up to ``n`` batches (all remaining ones with ``None``); ``check(loader, "batch")`` after
    each."""
    out: list[Any] = []
    it = iter(loader)
    while n is None or len(out) < n:
        try:
            out.append(next(it))
        except StopIteration:
            break
        if check is not None:
            check(loader, "batch")
    return out


def save(spec: LoaderSpec, loaders: Sequence[Any]) -> dict[str, Any]:
    """The checkpoint value torchtitan would save for these ranks (as one ``gather`` makes it)."""
    return checkpoint.envelope(spec.name, [ld.rank_state() for ld in loaders], "any")


def _state(spec: LoaderSpec, loaders: Sequence[Any], check: Check | None) -> Any:
    if check is not None:
        for ld in loaders:
            check(ld, "save")
    return spec.state(loaders) if spec.state is not None else save(spec, loaders)


def _build_all(spec: LoaderSpec, world: int, infinite: bool) -> list[Any]:
    return [spec.build(r, world, infinite) for r in range(world)]


def _close_all(loaders: Sequence[Any], check: Check | None = None) -> None:
    for ld in loaders:
        if check is not None:
            check(ld, "end")
        close = getattr(ld, "close", None)
        if close is not None:
            close()


def assert_same_degree(
    spec: LoaderSpec,
    steps: int,
    world: int,
    infinite: bool = True,
    *,
    cuts: Sequence[int | None] | None = None,
    running: int = 0,
    check: Check | None = None,
) -> list[list[Any]]:
    cuts = list(cuts) if cuts is not None else [steps, steps]
    assert len(cuts) >= 2, "a resume needs at least two segments"
    total = None if None in cuts else sum(cuts)  # type: ignore[arg-type]
    ref = _build_all(spec, world, infinite)
    expected = [take(ld, total, check) for ld in ref]
    _close_all(ref, check)
    got: list[list[Any]] = [[] for _ in range(world)]
    saved: Any = None
    for i, n in enumerate(cuts):
        loaders = _build_all(spec, world, infinite)
        if i:
            for ld in loaders:
                if running:
                    take(ld, running)
                ld.load_state_dict(saved)
                if check is not None:
                    check(ld, "load")
        for r, ld in enumerate(loaders):
            got[r] += take(ld, n, check)
        if i < len(cuts) - 1:
            saved = _state(spec, loaders, check)
            _close_all(loaders)
        else:
            _close_all(loaders, check)
    where = f"{spec.name} (cuts {cuts}{f', running {running}' if running else ''})"
    for r in range(world):
        assert len(got[r]) == len(expected[r]), (
            f"{where}: rank {r}: {len(got[r])} batches, {len(expected[r])} uninterrupted"
        )
        for i, (x, y) in enumerate(zip(got[r], expected[r], strict=True)):
            assert same(x, y), f"{where}: rank {r} batch {i} differs after the resume"
    return got


def assert_elastic(
    spec: LoaderSpec,
    steps: int,
    dp_from: int,
    dp_to: Sequence[int],
    *,
    check: Check | None = None,
) -> None:
    assert spec.doc_ids is not None and spec.epoch_docs, "elastic checks need doc_ids"
    seen: list[int] = []
    ended: list[int] = []
    loaders = _build_all(spec, dp_from, False)
    degrees = [dp_from, *dp_to]
    for i, world in enumerate(degrees):
        if i:
            saved = _state(spec, loaders, check)
            _close_all(loaders)
            loaders = _build_all(spec, world, False)
            for ld in loaders:
                ld.load_state_dict(saved)
                if check is not None:
                    check(ld, "load")
        last = i == len(degrees) - 1
        for ld in loaders:
            for batch in take(ld, None if last else steps, check):
                seen += spec.doc_ids(batch)
                ended += spec.doc_ends(batch) if spec.doc_ends is not None else []
    _close_all(loaders, check)
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
    spec: LoaderSpec,
    steps: int | None = None,
    dp_from: int = 1,
    dp_to: int | Sequence[int] | None = None,
    *,
    cuts: Sequence[int | None] | None = None,
    infinite: bool = True,
    running: int = 0,
    check: Check | None = None,
) -> list[list[Any]] | None:
    """Same degree (``dp_to`` None or ``dp_from``): bitwise resume, over ``(steps, steps)`` or
    the chain ``cuts``; returns the resumed run's batches per rank. Other degrees (a chain, e.g.
    ``(3, 1)``): every document of the epoch exactly once. See the module docstring."""
    chain = [dp_from] if dp_to is None else [dp_to] if isinstance(dp_to, int) else list(dp_to)
    if chain == [dp_from]:
        assert steps is not None or cuts is not None, "give steps or cuts"
        return assert_same_degree(
            spec, steps or 0, dp_from, infinite, cuts=cuts, running=running, check=check
        )
    assert steps is not None and cuts is None and running == 0, "elastic paths take steps only"
    assert_elastic(spec, steps, dp_from, chain, check=check)
    return None
