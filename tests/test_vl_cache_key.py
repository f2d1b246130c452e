"""The cache key (docs/vl-cache.md, "The cache key and the source fingerprint"): each input the
docs name changes it, and what does not change the cache's bytes leaves it alone.

Keys are computed with ``resolve`` (no build). Every ``BuildConfig`` field must have a case
below, so a new build option cannot enter the builder without a test that it enters the key.
One small build checks that the builder's and the loader's own knobs (workers, progress, rank
layout, where the cache lives, the training order and batch format) find the same directory.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from torchtitan_ext.vl import build as B
from torchtitan_ext.vl.sample_data import make_sample_dataset

SEQ, BUF = 1024, 8


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("vlkey")
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def ds(root):
    return make_sample_dataset(root / "ds", n=6)


def key(dataset, split: str = "train", seq_len: int = SEQ, buffer_size: int = BUF, **options):
    cfg = B.config_from(dataset, split, seq_len, buffer_size, **options)
    return B.resolve(cfg, "unused-cache-dir").key


# BuildConfig field -> a value other than its default (each must give another key). The layout
# fields, model_path and dataset are covered by their own tests (here and in test_vl_layouts).
CHANGES = {
    "split": "validation",
    "seq_len": 2048,
    "buffer_size": 4,
    "buckets": [512],
    "max_samples": 3,
    "rows_per_shard": 4,
    "max_image_pixels": 1_000_000,
    "exif_transpose": False,
    "fingerprint": "quick",
    "truncate": True,
    "store": True,
    "video_fps": 1.0,
    "video_min_frames": 2,
    "video_max_frames": 64,
    "video_min_pixels": 4096,
    "video_max_pixels": 1_000_000,
    "video_cap_pixels_per_frame": True,
    "video_max_tokens": 128,
}
COVERED_ELSEWHERE = {"dataset", "model_path", *B.LAYOUT_OPTIONS}


def test_every_build_option_has_a_case():
    names = {f.name for f in dataclasses.fields(B.BuildConfig)}
    assert names - COVERED_ELSEWHERE == set(CHANGES)


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_each_build_option_changes_the_key(root, ds, name):
    if name == "split":
        # a second split of the same rows, in files of their own
        d = root / "two_splits"
        if not d.exists():
            d.mkdir()
            (f,) = ds.glob("*.parquet")
            shutil.copy(f, d / "train-00000-of-00001.parquet")
            shutil.copy(f, d / "validation-00000-of-00001.parquet")
        assert key(d, split="validation") != key(d)
        # one file read as either split: the same files, so only the split tells them apart
        (f,) = ds.glob("*.parquet")
        assert key(f, split="validation") != key(f)
        return
    args = {"seq_len": SEQ, "buffer_size": BUF}
    if name in args:
        args[name] = CHANGES[name]
        assert key(ds, **args) != key(ds)
    else:
        assert key(ds, **{name: CHANGES[name]}) != key(ds)


def test_dataset_content_changes_the_key(root, ds):
    """One answer edited in place (same file name), then the file restored: the key follows the
    content, not the file's name or time. A file added to the dataset changes it too."""
    d = root / "edited"
    shutil.copytree(ds, d)
    (f,) = d.glob("*.parquet")
    original = f.read_bytes()
    k0 = key(d)
    table = pq.read_table(f)
    answers = table.column("answer").to_pylist()
    answers[2] = answers[2] + " Really."
    pq.write_table(table.set_column(table.schema.get_field_index("answer"), "answer",
                                    [answers]), f)  # fmt: skip
    assert key(d) != k0
    f.write_bytes(original)
    assert key(d) == k0
    shutil.copy(f, d / "train-00001-of-00001.parquet")
    assert key(d) != k0


def _processor_copy(root: Path, name: str) -> Path:
    from torchtitan_ext.vl.processor import offline_processor_dir

    d = root / name  # processors are cached per path: one directory per variant
    shutil.copytree(offline_processor_dir(), d)
    return d


def test_processor_changes_the_key(root, ds):
    """The tokenizer and the image settings enter the key (the chat template: test_vl_layouts);
    a copy of the same processor under another path gives the same key."""
    base = key(ds)
    assert key(ds, model_path=str(_processor_copy(root, "same"))) == base
    tok = _processor_copy(root, "tok")
    doc = json.loads((tok / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # two ordinary tokens swap ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tok / "tokenizer.json").write_text(json.dumps(doc))
    assert key(ds, model_path=str(tok)) != base
    img = _processor_copy(root, "img")
    cfg = json.loads((img / "preprocessor_config.json").read_text())
    cfg["size"]["longest_edge"] //= 2
    (img / "preprocessor_config.json").write_text(json.dumps(cfg))
    assert key(ds, model_path=str(img)) != base


def test_format_version_and_label_rule_change_the_key(ds, monkeypatch):
    base = key(ds)
    monkeypatch.setattr(B, "FORMAT_VERSION", B.FORMAT_VERSION + 1)
    assert key(ds) != base
    monkeypatch.undo()
    assert key(ds) == base
    monkeypatch.setattr(B, "LABEL_RULE", B.LABEL_RULE + " (changed)")
    assert key(ds) != base


def test_builder_and_loader_knobs_keep_the_key(root, ds, monkeypatch):
    """Workers, progress, strictness, the rank layout and the cache directory do not enter the
    key: a second build with other values finds the first one's cache without writing. The
    loader's training knobs (order, workers, batch format, normalisation) find it too."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.pack_source import key_args

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    first = B.build_cache(ds, "train", root / "c", SEQ, BUF, num_workers=0, show_progress=False)
    stamp = (first / "metadata.json").stat().st_mtime_ns
    again = B.build_cache(ds, "train", root / "c", SEQ, BUF, num_workers=2, show_progress=True,
                          strict=True, rank=0, world_size=1, wait_timeout=5)  # fmt: skip
    assert again == first and (first / "metadata.json").stat().st_mtime_ns == stamp
    other_dir = B.resolve(B.config_from(ds, "train", SEQ, BUF), root / "elsewhere")
    assert other_dir.key == key(ds) and other_dir.kdir.name == first.name
    meta = json.loads((first / "metadata.json").read_text())
    assert meta["key"] == key(ds)
    base = CachedVLDataLoader.Config(dataset_path=str(ds), cache_dir=str(root / "c"),
                                     buffer_size=BUF)  # fmt: skip
    knobs = dict(num_workers=2, prefetch_factor=4, pin_memory=True, seed=9, shuffle=False,
                 infinite=False, remainder="wrap", batch_format="hf", normalize_on="device",
                 preprocess_workers=3, strict=True, build_if_missing=True)  # fmt: skip
    for name, value in knobs.items():
        req = dataclasses.replace(base, **{name: value})
        assert B.find_cache(**key_args(req, SEQ)) == first, name
    assert B.find_cache(**key_args(dataclasses.replace(base, buffer_size=4), SEQ)) is None


def test_image_files_read_by_path_are_not_in_the_key(root):
    """The documented limit (docs/vl-data-formats.md, "Cache key"): images a row names by path
    are not hashed into the key, so editing such a file in place keeps the key (rebuild with
    --force); the Parquet file itself is."""
    import pyarrow as pa

    from .support.vl_chat import image_bytes

    d = root / "by_path"
    d.mkdir()
    (d / "a.jpg").write_bytes(image_bytes(0, (64, 48)))
    conv = [[{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A dot."}]]
    pq.write_table(pa.table({"image": ["a.jpg"], "conversations": conv}), d / "t.parquet")
    k0 = key(d)
    (d / "a.jpg").write_bytes(image_bytes(1, (80, 60)))
    assert key(d) == k0
