"""Chat data through the tools: preprocess-cached flags, the cached_vl loader's layout keys,
inspect-cache --render and peek --show / --render on multi-image, multi-turn samples."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from torchtitan_ext.vl import preprocess as PP

from .support.vl_chat import image_bytes

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "data" / "configs"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from torchtitan_ext.vl.sample_chat import chat_sample_path

    root = tmp_path_factory.mktemp("chattools")
    return {"root": root, "chat": chat_sample_path(n=24, root=root / "data")}


def _llava_dir(d: Path) -> Path:
    """A LLaVA-style file with its own column names (``pic``, ``conv``)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "a.jpg").write_bytes(image_bytes(0, (200, 150)))
    conv = [[{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A thing."}],
            [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]]  # fmt: skip
    pq.write_table(pa.table({"pic": ["a.jpg", None], "conv": conv}), d / "train.parquet")
    return d


def test_preprocess_cli_layout_flags(env, tmp_path, capsys):
    d = _llava_dir(tmp_path / "ll")
    base = ["--dataset", str(d), "--cache-dir", str(tmp_path / "c"), "--seq-len", "1024",
            "--num-workers", "0", "--quiet"]  # fmt: skip
    assert PP.main(base) == 2  # nothing to detect from 'pic' / 'conv'
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "['pic', 'conv']" in err and "--conversations-column" in err
    )
    assert PP.main([*base, "--conversations-column", "conv", "--image-column", "pic"]) == 0
    out = capsys.readouterr()
    assert "row layout llava (detected) from columns conversations='conv', image='pic'" in out.out
    (kdir,) = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
    meta = json.loads((kdir / "metadata.json").read_text())
    assert meta["layout"] == {
        "layout": "llava",
        "columns": {"conversations": "conv", "image": "pic"},
    }
    assert meta["config"]["format"] == "auto" and meta["config"]["conversations_column"] == "conv"
    st = json.loads((kdir / "packing_stats.json").read_text())
    assert st["samples_packed"] == 2 and st["images"] == 1  # the text-only row is a sample
    assert PP.main([*base, "--format", "cauldron"]) == 2
    assert "no texts column for the cauldron layout" in capsys.readouterr().err


def test_loader_config_has_every_build_option():
    """Every BuildConfig option is a cached_vl key of the same name and default, so a layout
    flag reaches the cache key from a TOML file by name."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.build import OPTION_NAMES, BuildConfig

    loader = {f.name: f.default for f in fields(CachedVLDataLoader.Config)}
    build = {f.name: f.default for f in fields(BuildConfig)}
    for name in OPTION_NAMES:
        if name in ("seq_len", "rows_per_shard", "max_image_pixels"):
            continue  # pack_seq_len (the trainer's seq_len); builder-only knobs
        assert name in loader, name
        assert loader[name] == build[name], name


def test_loader_reads_a_chat_layout_by_name(env, tmp_path):
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    d = _llava_dir(tmp_path / "ll")
    cfg = CachedVLDataLoader.Config(dataset=str(d), cache_dir=str(tmp_path / "c"),
                                    build_if_missing=True, batch_format="hf", format="llava",
                                    conversations_column="conv", image_column="pic",
                                    shuffle=False)  # fmt: skip
    dl = cfg.build(dp_rank=0, dp_world_size=1, seq_len=512, local_batch_size=1)
    batch = next(iter(dl))
    assert batch["image_grid_thw"].shape == (1, 3) and batch["labels"].ne(-100).any()
    (kdir,) = [p for p in (tmp_path / "c").iterdir() if p.is_dir()]
    assert json.loads((kdir / "metadata.json").read_text())["layout"]["layout"] == "llava"


def test_render_shows_images_turns_and_loss(env, tmp_path, capsys):
    from torchtitan_ext.vl import inspect as I
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.processor import load_processor
    from torchtitan_ext.vl.render import COLORS, TURN_TICK, sample_turns

    k = build_cache(env["chat"], "train", tmp_path / "c", 1024, 8, show_progress=False)
    cache = VLCache.open(k)
    sp = cache.special_tokens
    tok = load_processor(None).tokenizer
    # the sample with a system prompt and three images (row 2 of the chat sample)
    i = next(i for i in range(len(cache)) if 2 in cache.pack_rows(i))
    p = cache.pack(i)
    at = sum(p["seq_lens"][: cache.pack_rows(i).index(2)].tolist())
    n = int(p["seq_lens"][cache.pack_rows(i).index(2)])
    turns = sample_turns(p["input_ids"][at : at + n].numpy(), p["labels"][at : at + n].numpy(), sp,
                         lambda t: tok.decode(t, skip_special_tokens=False))  # fmt: skip
    assert [t.role for t in turns] == ["system", "user", "assistant"]
    assert [t.images for t in turns] == [0, 3, 0]
    assert turns[0].loss_tokens == turns[1].loss_tokens == 0 < turns[2].loss_tokens
    out = tmp_path / "p.png"
    assert I.main(["--cache-dir", str(k)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("row layout"))
    assert line.endswith("messages (image=images, messages=messages)")
    assert I.main(["--cache-dir", str(k), "--render", str(i), str(out)]) == 0
    px = np.asarray(Image.open(out).convert("RGB")).reshape(-1, 3)
    colours = {tuple(c) for c in np.unique(px, axis=0)}
    assert {COLORS["target"], COLORS["masked"], COLORS["image"], TURN_TICK} <= colours


def test_peek_show_and_render_chat(env, tmp_path, capsys):
    from torchtitan_ext.peek import main

    args = ["--config-file", str(CONFIGS / "peek_cached_vl.toml"),
            "--dataloader.cache_dir", str(tmp_path / "c"), "--dataloader.dataset", "sample_chat",
            "--dataloader.format", "messages", "--dataloader.max_samples", "24",
            "--batches", "1", "--show", "--color", "never",
            "--render", str(tmp_path / "b.png")]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>assistant" in out and "<|im_start|>user" in out
    # a loss span: an assistant's text outside the ⟦masked⟧ brackets, ending at its <|im_end|>
    assert "⟧" in out and "<|im_end|>⟦" in out
    assert max(line.count("«IMG×") for line in out.splitlines()) >= 2  # a multi-image sample
    assert Image.open(tmp_path / "b.png").height > 300


def test_chat_train_config_feeds_the_loader(env, tmp_path):
    """train_configs/qwen3_vl_chat_tiny_cpu.toml: every [dataloader] key is a cached_vl key, and
    the loader it describes serves chat packs (batch format "hf" here: the qwen3_vl format is
    the model module's)."""
    import tomllib

    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    table = tomllib.loads((REPO / "train_configs" / "qwen3_vl_chat_tiny_cpu.toml").read_text())
    assert (table["model"]["module"], table["model"]["flavor"]) == ("qwen3_vl", "debugmodel")
    dl = dict(table["dataloader"])
    assert dl.pop("name") == "cached_vl" and dl["dataset"] == "sample_chat"
    dl.update(cache_dir=str(tmp_path / "c"), batch_format="hf", max_samples=24)
    loader = CachedVLDataLoader.Config(**dl).build(
        dp_rank=0, dp_world_size=1, seq_len=table["training"]["seq_len"],
        local_batch_size=table["training"]["local_batch_size"],
    )  # fmt: skip
    batch = next(iter(loader))
    assert batch["input_ids"].shape[1] in [*dl["buckets"], table["training"]["seq_len"]]
    assert batch["image_grid_thw"].shape[0] >= 2 and batch["labels"].ne(-100).any()


@pytest.mark.slow
def test_chat_benchmark_quick_smoke(env):
    from benchmarks.common import BenchArgs
    from benchmarks.vl_chat import run

    rows = run(BenchArgs(quick=True, repeats=1, extra={"images": "6"}))
    assert [r.info["images"] for r in rows] == [6] * 4 and rows[1].ratio > 0 and rows[3].ratio > 0
    assert rows[0].info["chat_rows"] == 3 and rows[0].info["vqa_rows"] == 6


def test_render_strip_ticks_turn_starts_and_numbers_images():
    """The strip marks each <|im_start|> with a tick of its own colour and nowhere else."""
    from PIL import ImageDraw

    from torchtitan_ext.vl.render import COLORS, TURN_TICK, _strip

    sp = {"im_start_id": 1, "image_pad_id": 7}
    ids = np.array([1, 5, 5, 7, 7, 5, 1, 5, 5, 5])
    kind = np.array(["masked"] * 3 + ["image"] * 2 + ["masked", "masked"] + ["target"] * 3,
                    dtype=object)  # fmt: skip
    img = Image.new("RGB", (200, 60), "white")
    y_end = _strip(ImageDraw.Draw(img), kind, ids, sp, 10, 20, 8, 20)
    px = img.load()
    ticks = [j for j in range(len(ids)) if px[10 + 8 * j, 19] == TURN_TICK]
    assert ticks == [0, 6] and y_end > 20
    assert px[10 + 8 * 8 + 4, 22] == COLORS["target"] and px[10 + 8 * 3 + 4, 22] == COLORS["image"]


def test_online_fallback_reads_chat_layouts_like_the_builder(env, tmp_path):
    """The online fallback uses the builder's layout, column flags and dataset directory: its
    packs equal the cache's, pixels of relative-path images included."""
    import torch

    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.online import OnlineVLDataset

    d = _llava_dir(tmp_path / "ll")
    opts = {"conversations_column": "conv", "image_column": "pic", "buckets": [256, 512]}
    cache = VLCache.open(build_cache(d, "train", tmp_path / "c", 1024, 4, show_progress=False,
                                     **opts))  # fmt: skip
    online = list(OnlineVLDataset(d, "train", seq_len=1024, buffer_size=4, shuffle=False,
                                  infinite=False, **opts))  # fmt: skip
    assert len(online) == len(cache) >= 1
    for i, p in enumerate(online):
        c = cache.pack(i)
        for k in ("input_ids", "labels", "position_ids", "pixel_u8", "image_grid_thw"):
            assert torch.equal(p[k], c[k]), k
