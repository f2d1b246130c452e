"""Lines of code of the data side at one or more git revisions (before/after a refactor).

    python scripts/count_data_lines.py 0e944ef HEAD          # one total per revision
    python scripts/count_data_lines.py --files HEAD          # and per file
    python scripts/count_data_lines.py --worktree            # the working tree, uncommitted

A *line of code* is a line holding a Python token: blank lines, comment-only lines and docstrings
(module, class and function) are not counted, so the figure does not reward deleting
explanations. Files are read with ``git show REV:path``, so any revision can be counted from any
checkout.

The data side (one definition, :data:`GROUPS`, so before and after count the same thing): what
turns stored data into batches at training time —

* ``pipeline/``, ``device/``, ``loaders/``, ``threads.py``: all of it;
* ``text/``: all but the tokenizer (``tokenize.py``, ``fast_bpe.py``, also used outside the
  loaders) and the offline diversity check (``diversity.py``);
* ``vl/``: all but the offline cache *building* side (build, write, preprocess, the processor,
  samples, images, chat templates, layouts, row sources, rendering, inspection, locks): files
  added later count unless listed here.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import io
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = "torchtitan_ext"

# group -> (include globs, exclude globs), relative to the repository root
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "pipeline": ([f"{PKG}/pipeline/*.py"], []),
    "device": ([f"{PKG}/device/*.py"], []),
    "loaders": ([f"{PKG}/loaders/*.py"], []),
    "threads": ([f"{PKG}/threads.py"], []),
    "text": (
        [f"{PKG}/text/*.py"],
        [f"{PKG}/text/{n}.py" for n in ("tokenize", "fast_bpe", "diversity")],
    ),
    "vl (reading)": (
        [f"{PKG}/vl/*.py"],
        [
            f"{PKG}/vl/{n}.py"
            for n in (
                "build",
                "build_config",
                "write",
                "manifest",
                "preprocess",
                "processor",
                "offline_processor",
                "sample",
                "sample_chat",
                "sample_data",
                "images",
                "chat",
                "layouts",
                "conversation",
                "sources",
                "row_work",
                "render",
                "inspect",
                "locks",
                "positions",
                "format",
                "errors",
            )
        ],  # fmt: skip
    ),
}


def code_lines(text: str) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    doc_lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            v = body[0].value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                doc_lines.update(range(v.lineno, (v.end_lineno or v.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}  # fmt: skip
    code: set[int] = set()
    for t in tokenize.generate_tokens(io.StringIO(text).readline):
        if t.type not in skip:
            code.update(range(t.start[0], t.end[0] + 1))
    return len(code - doc_lines)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def group_of(path: str) -> str | None:
    for name, (inc, exc) in GROUPS.items():
        if any(fnmatch.fnmatch(path, g) for g in inc) and not any(
            fnmatch.fnmatch(path, g) for g in exc
        ):
            return name
    return None


def count(rev: str | None) -> dict[str, dict[str, int]]:
    """group -> {path: lines of code} at ``rev`` (``None``: the working tree)."""
    if rev is None:
        paths = [str(p.relative_to(REPO)) for p in (REPO / PKG).rglob("*.py")]
    else:
        paths = _git("ls-tree", "-r", "--name-only", rev, PKG).split()
    out: dict[str, dict[str, int]] = {g: {} for g in GROUPS}
    for p in sorted(paths):
        g = group_of(p)
        if g is not None:
            text = (REPO / p).read_text() if rev is None else _git("show", f"{rev}:{p}")
            out[g][p] = code_lines(text)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("revs", nargs="*", help="git revisions (default: HEAD)")
    ap.add_argument("--worktree", action="store_true", help="also count the working tree")
    ap.add_argument("--files", action="store_true", help="per-file counts too")
    a = ap.parse_args(argv)
    revs: list[str | None] = list(a.revs or ([] if a.worktree else ["HEAD"]))
    revs += [None] if a.worktree else []
    for rev in revs:
        label = (
            "working tree"
            if rev is None
            else f"{rev} ({_git('rev-parse', '--short', rev).strip()})"
        )
        by_group = count(rev)
        total = sum(sum(f.values()) for f in by_group.values())
        print(f"{label}: {total} lines of code")
        for g, files in by_group.items():
            print(f"  {g:<14} {sum(files.values()):>6}  ({len(files)} files)")
            if a.files:
                for p, n in files.items():
                    print(f"      {n:>6}  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
