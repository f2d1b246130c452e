"""``peek --render`` for text: a font with accented and non-Latin letters, a title naming the
config / loader / rank / batch, and the names ``--show`` prints (``batch i row r``, ``doc k``)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import REPO
from torchtitan_ext.peek_render import FONT_FILE, BatchView, font, render_batch


def _glyph(fnt, ch: str) -> bytes:
    return bytes(fnt.getmask(ch))


@pytest.mark.parametrize("ch", ["é", "ß", "Å", "ñ", "Ж", "λ", "א"])
def test_font_draws_letters_not_boxes(ch):
    """A character the font lacks is drawn as the same 'missing glyph' box as a private-use
    code point; the shipped font draws each of these as its own letter."""
    assert FONT_FILE.is_file()
    fnt = font(15)
    missing = _glyph(fnt, "\ue000")
    assert _glyph(fnt, ch) != missing, ch
    assert fnt.size >= 13  # legible


def test_title_and_labels_use_the_show_names(tmp_path, monkeypatch):
    from PIL import ImageDraw

    drawn: list[str] = []
    original = ImageDraw.ImageDraw.text

    def record(self, xy, text, *args, **kwargs):
        drawn.append(text)
        return original(self, xy, text, *args, **kwargs)

    monkeypatch.setattr(ImageDraw.ImageDraw, "text", record)
    inp = torch.tensor([[0, 5, 6, 1, 0, 7, 1, 2], [0, 3, 4, 5, 6, 7, 8, 9]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    labels = torch.tensor([[5, 6, 1, -100, 7, 1, -100, -100], [3, 4, 5, 6, 7, 8, 9, 10]])
    view = BatchView(bos_id=0, eos_id=1, pad_id=2)
    header = "train_configs/x.toml  [dataloader] loader=parquet_prefetch  dp_rank=1/4"
    render_batch(
        view,
        {"input": inp, "positions": pos, "labels": labels},
        tmp_path / "b.png",
        index=3,
        header=header,
    )
    assert drawn[0] == header and drawn[1].startswith("batch 3: input [2, 8]")
    assert any(t.startswith("batch 3 row 0: 2 docs") for t in drawn)
    assert any(t.startswith("batch 3 row 1: 1 docs") for t in drawn)
    assert any(t.startswith("doc 1") for t in drawn) and not any(t.startswith("d1") for t in drawn)


def test_peek_render_passes_the_config_and_rank(tmp_path, monkeypatch):
    import torchtitan_ext.peek_render as pr
    from torchtitan_ext.peek import main

    seen = {}
    original = pr.render_batch

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(pr, "render_batch", spy)
    cfg = REPO / "tests" / "data" / "configs" / "peek_parquet_prefetch.toml"
    rc = main(["--config-file", str(cfg), "--batches", "1", "--render", str(tmp_path / "r.png")])
    assert rc == 0
    assert str(cfg) in seen["header"] and "loader=parquet_prefetch" in seen["header"]
    assert "dp_rank=0/1" in seen["header"]
