"""The user-facing documentation holds together: every relative link in README.md, docs/*.md and
DATA_LICENSES.md names a file that exists and, with ``#anchor``, a heading of that file; links into
benchmarks/RESULTS.md point at a generated case section, never at the hand-written history; every
``docs/<name>.md`` that code, configs or the Makefile mention exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", REPO / "DATA_LICENSES.md", *sorted((REPO / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with inline code removed (1-based line numbers)."""
    out, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> list[str]:
    """Every heading anchor of a markdown file, in order (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.append(base if n == 0 else f"{base}-{n}")
    return out


def results_case_anchors() -> set[str]:
    """The anchors of RESULTS.md's generated case sections (the ``## <case>`` headings before
    ``## History``)."""
    cases = set()
    for line in (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").splitlines():
        if line.strip() == "## History":
            break
        if line.startswith("## "):
            cases.add(slug(line[3:]))
    return cases


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for i, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append((i, target))
    return links


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path):
    problems = []
    for line, target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        where = f"{doc.relative_to(REPO)}:{line}: ({target})"
        if not dest.exists():
            problems.append(f"{where} names a file that does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
        if dest == REPO / "benchmarks" / "RESULTS.md" and anchor:
            if anchor not in results_case_anchors():
                problems.append(
                    f"{where}: link a generated case section of RESULTS.md "
                    f"({sorted(results_case_anchors())}), not the hand-written history"
                )
    assert not problems, "\n".join(problems)


def test_docs_named_in_code_configs_and_docs_exist():
    """``docs/<name>.md`` (and ``tests/test_<name>.py``) in a docstring, --help text, TOML
    comment, the Makefile or a doc's prose."""
    mention = re.compile(r"\bdocs/([\w.-]+\.md)\b")
    sources = [
        *REPO.glob("torchtitan_ext/**/*.py"),
        *REPO.glob("tests/**/*.py"),
        *REPO.glob("scripts/*.py"),
        *REPO.glob("benchmarks/*.py"),
        *REPO.glob("train_configs/*.toml"),
        REPO / "Makefile",
        REPO / "benchmarks" / "RESULTS.md",
        REPO / "benchmarks" / "results_history.md",
        *DOCS,
    ]
    test_file = re.compile(r"\btests/(test_\w+\.py)\b")
    problems = []
    for f in sources:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for name in mention.findall(line):
                if not (REPO / "docs" / name).is_file():
                    problems.append(f"{f.relative_to(REPO)}:{i}: docs/{name} does not exist")
            for name in test_file.findall(line):
                if not (REPO / "tests" / name).is_file():
                    problems.append(f"{f.relative_to(REPO)}:{i}: tests/{name} does not exist")
    assert not problems, "\n".join(problems)


def test_the_anchor_rule_matches_github():
    assert slug("Row checks (counted skips)") == "row-checks-counted-skips"
    assert slug("`inspect-cache --verify`") == "inspect-cache---verify"
    assert slug("vl_dataset") == "vl_dataset"
    assert slug("EXIF orientation: applied by default") == "exif-orientation-applied-by-default"
