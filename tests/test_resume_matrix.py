"""The resume matrix: every registered loader x staging on/off x workers 0/2 x DP degree path,
through the one harness (``tests/support/resume.py``).

Loaders come from ``tests/support/loader_specs.py`` (one builder function each); a combination a
loader does not have is an explicit skip naming why. Paths: the same degree (bitwise resume) and
chains of other degrees (every document of the epoch exactly once).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.loader_specs import BUILDERS, CONTEXTS, Unsupported, Variant
from tests.support.resume import LoaderSpec, assert_resume_exact

VARIANTS = [Variant(staging=s, workers=w) for s in (False, True) for w in (0, 2)]
# (dp_from, dp_to): same degree at 1 and 2 ranks; 2 -> 3 -> 1 (grow then shrink in one epoch)
PATHS = [(1, 1), (2, 2), (2, (3, 1))]
STEPS = 6

_specs: dict[tuple[str, Variant], LoaderSpec | Unsupported] = {}


@pytest.fixture(scope="module")
def spec_of(tmp_path_factory: pytest.TempPathFactory):
    """One spec (or the reason it is unsupported) per loader and variant, built once."""

    def get(name: str, variant: Variant) -> LoaderSpec:
        key = (name, variant)
        if key not in _specs:
            root: Path = tmp_path_factory.mktemp(f"{name}-{variant}")
            try:
                _specs[key] = BUILDERS[name](variant, root)
            except Unsupported as e:
                _specs[key] = e
        got = _specs[key]
        if isinstance(got, Unsupported):
            pytest.skip(f"{name} {variant}: {got}")
        return got

    yield get
    CONTEXTS.close()  # data a builder keeps open (the VL sample cache's environment)


def _path_id(p: tuple) -> str:
    frm, to = p
    return "dp" + "-".join(map(str, [frm, *([to] if isinstance(to, int) else to)]))


@pytest.mark.parametrize("path", PATHS, ids=_path_id)
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
@pytest.mark.parametrize("loader", sorted(BUILDERS))
def test_resume(spec_of, loader: str, variant: Variant, path: tuple) -> None:
    dp_from, dp_to = path
    spec = spec_of(loader, variant)
    assert_resume_exact(spec, spec.steps or STEPS, dp_from, dp_to)


def test_every_builder_names_its_loader(tmp_path: Path) -> None:
    """A builder's spec carries its registry name (the envelope's loader name must match)."""
    for name, build in BUILDERS.items():
        try:
            (tmp_path / name).mkdir()
            spec = build(Variant(staging=False, workers=0), tmp_path / name)
        except Unsupported:
            continue
        assert spec.name == name and spec.doc_ids is not None and spec.epoch_docs
