"""Rules the test suite keeps about itself (docs/testing.md, "Rules for tests")."""

from __future__ import annotations

import ast
import re
import tomllib
from importlib.metadata import packages_distributions

from tests.conftest import REPO


def _pinned_distributions() -> set[str]:
    """The normalised names of ``[project].dependencies`` in pyproject.toml."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


def _importorskips() -> list[tuple[str, int, str]]:
    """Every ``importorskip("module")`` call under tests/: (file, line, top-level module)."""
    out = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                module = str(node.args[0].value).split(".")[0]
                out.append((str(path.relative_to(REPO)), node.lineno, module))
    return out


def test_pinned_dependencies_are_imported_not_skipped():
    """A missing pinned dependency is a broken install and must fail loudly; ``importorskip``
    would turn it into green skips. Only optional extras may be skipped."""
    pinned = _pinned_distributions()
    assert {"torchtitan", "tiktoken", "pillow"} <= pinned  # the parse sees the pins
    dists = packages_distributions()  # import name -> distributions providing it
    offenders = [
        f"{f}:{line} importorskip({m!r})"
        for f, line, m in _importorskips()
        if {d.lower().replace("_", "-") for d in dists.get(m, [m])} & pinned
    ]
    assert not offenders, "pinned dependencies skipped instead of imported: " + ", ".join(offenders)
