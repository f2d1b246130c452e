"""No text we ship carries double-encoded UTF-8 ("mojibake"): the demos train on it, users read it.

A UTF-8 multi-byte sequence read back as cp1252 / Latin-1 turns "é" into "Ã©" and "Shinshín"
into "ShinshÃ\\xadn": a lead character U+00C2..U+00F4 followed by 1-3 characters standing for
the bytes 0x80..0xBF, as many as that lead byte needs. The Gutenberg War and Peace carried ~10,600 of them until the repaired
copy was shipped. Scanned: every text file of the package (gzip sources decompressed), the README,
the docs and the train configs. Not scanned: byte-level BPE vocabularies (``benchmarks/data``,
``tests/data``), whose byte-to-unicode alphabet legitimately contains "Ã" and "Ä".
"""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_CP1252_HIGH = "€‚ƒ„…†‡ˆ‰Š‹ŒŽ‘’“”•–—˜™š›œžŸ"
_CONT = f"[\u0080-\u00bf{_CP1252_HIGH}]"  # a character standing for a byte 0x80..0xBF
# a lead byte and exactly the continuation bytes it needs (2-, 3-, 4-byte sequences): "né’s"
# (é = 0xE9 needs two) and "nó—yes" are genuine text
MOJIBAKE = re.compile(
    f"[\u00c2-\u00df]{_CONT}|[\u00e0-\u00ef]{_CONT}{{2}}|[\u00f0-\u00f4]{_CONT}{{3}}"
)
TEXT_SUFFIXES = {".py", ".txt", ".md", ".toml", ".jinja", ".json", ".gz"}


def _shipped() -> list[Path]:
    files = [p for p in (REPO / "torchtitan_ext").rglob("*") if p.suffix in TEXT_SUFFIXES]
    files += [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    files += list((REPO / "train_configs").glob("*.toml"))
    return sorted(p for p in files if p.is_file() and "__pycache__" not in p.parts)


def _text(p: Path) -> str:
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return raw.decode("utf-8")


def test_the_pattern_finds_double_encoding_and_leaves_good_text():
    for bad in ("ShinshÃ\xadn", "cafÃ©", "Ã‰cole", "itâ€™s"):
        assert MOJIBAKE.search(bad), bad
    assert not MOJIBAKE.search("Shinshín café École it’s — 東京 Война naïve «quoted» né’s nó—yes")


@pytest.mark.parametrize("path", _shipped(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_shipped_text_is_double_encoded(path: Path):
    text = _text(path)
    found = MOJIBAKE.findall(text)
    assert not found, (
        f"{path.relative_to(REPO)}: {len(found)} double-encoded sequences, e.g. {found[:5]}"
    )


def test_war_and_peace_reads_correctly():
    text = _text(REPO / "torchtitan_ext" / "data" / "war_and_peace.txt.gz")
    assert "Shinshín" in text and "Emperor Alexander Pávlovich" in text
