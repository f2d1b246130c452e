"""Offline Qwen3-VL processor: pixels bit-exact vs HF, ids/labels, mRoPE vs get_rope_index.

The HF reference of a VQA sample writes its conversation by hand (tests/support/vl_chat.py),
so the fast path's own ``vqa_messages`` is checked too."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from torchtitan_ext.vl import processor as P
from torchtitan_ext.vl import sample as VS

from .support.vl_chat import vqa_reference

SRC = Path(__file__).parents[1] / "torchtitan_ext" / "data" / "vl_src"


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    d = P.build_offline_processor(tmp_path_factory.mktemp("vlproc") / "proc")
    return P.load_processor(d)


def _src_images():
    return sorted(SRC.iterdir())


def test_offline_processor_is_idempotent_and_deterministic(tmp_path, proc):
    a = P.build_offline_processor(tmp_path / "a")
    b = P.build_offline_processor(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    mtime = (a / "tokenizer.json").stat().st_mtime_ns
    assert P.build_offline_processor(a) == a  # second call: no rebuild
    assert (a / "tokenizer.json").stat().st_mtime_ns == mtime
    cfg = json.loads((a / "preprocessor_config.json").read_text())
    assert cfg["patch_size"] == 16 and cfg["merge_size"] == 2 and cfg["temporal_patch_size"] == 2
    assert cfg["image_mean"] == [0.5] * 3 and cfg["image_std"] == [0.5] * 3
    assert cfg["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}


def test_special_tokens_are_single_ids(proc):
    ids = P.special_token_ids(proc)
    assert set(ids) == {
        "image_pad_id",
        "video_pad_id",
        "vision_start_id",
        "vision_end_id",
        "pad_id",
        "im_start_id",
        "im_end_id",
    }
    assert len(set(ids.values())) == len(ids)
    enc = proc.tokenizer.encode("a<|image_pad|>b", add_special_tokens=False)
    assert ids["image_pad_id"] in enc and enc.count(ids["image_pad_id"]) == 1


def _modes(img: Image.Image):
    yield "RGB", img.convert("RGB")
    yield "L", img.convert("L")
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    yield "RGBA", rgba
    yield "P", img.convert("RGB").quantize(64)
    yield "CMYK", img.convert("CMYK")


@pytest.mark.parametrize("path", _src_images(), ids=lambda p: p.name)
def test_pixels_and_ids_bit_exact_vs_hf(proc, path):
    """uint8 patches normalised == HF pixel_values (0 ulp), for every source image and mode."""
    src = Image.open(path)
    src.load()
    # keep it fast: downscale big sources (the resize path is still exercised: min 256x256)
    src.thumbnail((200, 200))
    for mode, img in _modes(src):
        ours = VS.process_sample(proc, img, "What is it?", "Something.")
        ref = vqa_reference(proc, [img], "What is it?", "Something.")
        assert ours.pixel_u8.dtype == torch.uint8 and ours.pixel_u8.shape[1] == 768
        got = P.normalize_patches(ours.pixel_u8)
        assert got.dtype == ref["pixel_values"].dtype == torch.float32
        assert torch.equal(got, ref["pixel_values"]), (path.name, mode)
        assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
        assert torch.equal(ours.input_ids, ref["input_ids"]), (path.name, mode)


def test_pixels_bit_exact_on_sample_dataset_variants(proc, tmp_path):
    """Every image of a small generated sample dataset (all modes, odd sizes) matches HF."""
    from torchtitan_ext.vl.sample_data import make_sample_dataset

    d = make_sample_dataset(tmp_path / "ds", n=21)
    import pyarrow.parquet as pq

    rows = pq.read_table(next(d.glob("*.parquet"))).to_pylist()
    modes = set()
    for r in rows:
        img = Image.open(io.BytesIO(r["image"]["bytes"]))
        img.load()
        modes.add(img.mode)
        ours = VS.process_sample(proc, img, r["question"], r["answer"])
        ref = vqa_reference(proc, [img], r["question"], r["answer"])
        assert torch.equal(P.normalize_patches(ours.pixel_u8), ref["pixel_values"])
        assert torch.equal(ours.input_ids, ref["input_ids"])
        assert torch.equal(ours.labels, ref["labels"])
    assert {"RGB", "L", "RGBA", "P", "CMYK"} <= modes


def test_labels_only_on_assistant_tokens(proc):
    img = Image.new("RGB", (40, 30), (10, 20, 30))
    s = VS.process_sample(proc, img, "What colour?", "Dark blue.")
    lab = s.labels
    tgt = s.input_ids[lab != -100]
    assert torch.equal(lab[lab != -100], tgt)
    text = proc.tokenizer.decode(tgt.tolist())
    assert text == "Dark blue.<|im_end|>"  # not the template's newline after the turn
    # everything before the answer is masked, including the image tokens
    ids = P.special_token_ids(proc)
    assert (lab[s.input_ids == ids["image_pad_id"]] == -100).all()
    assert lab[0] == -100


def test_two_images_and_one_pixel_image(proc):
    a = Image.new("RGB", (1, 1), (255, 0, 0))  # 1x1 -> upscaled to 256x256 (min pixels)
    b = Image.new("L", (300, 90), 77)
    s = VS.process_sample(proc, [a, b], "Compare.", "Different.")
    ref = vqa_reference(proc, [a, b], "Compare.", "Different.")
    assert s.image_grid_thw.tolist()[0] == [1, 16, 16]
    assert torch.equal(P.normalize_patches(s.pixel_u8), ref["pixel_values"])
    assert torch.equal(s.input_ids, ref["input_ids"])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_normalize_patches_matches_hf_arithmetic(rows, seed):
    u8 = np.random.default_rng(seed).integers(0, 256, (rows, 3, 256), dtype=np.uint8)
    u8[0, 0] = np.arange(256, dtype=np.uint8)  # every uint8 value at least once
    # transformers' np path: float64 rescale -> float32, then (x - mean) / std in float32
    f = (u8.astype(np.float64) * (1 / 255)).astype(np.float32)
    f = (f - np.float32(0.5)) / np.float32(0.5)
    ref = np.broadcast_to(f[:, :, None, :], (f.shape[0], 3, 2, 256)).reshape(f.shape[0], -1)
    got = P.normalize_patches(torch.from_numpy(u8.reshape(-1, 768)))
    assert np.array_equal(got.numpy(), ref)


@pytest.fixture(scope="module")
def tiny_model():
    from .support.tiny_qwen3vl import rope_model

    return rope_model()


def _hf_rope(model, ids: np.ndarray, grid: np.ndarray, pad: int) -> np.ndarray:
    t = torch.from_numpy(ids)[None]
    pos, _ = model.get_rope_index(t, (t == pad).int(), image_grid_thw=torch.from_numpy(grid))
    return pos[:, 0].numpy()


def test_mrope_matches_get_rope_index_on_real_sample(proc, tiny_model):
    pad = P.special_token_ids(proc)["image_pad_id"]
    s = VS.process_sample(
        proc,
        [Image.new("RGB", (500, 120)), Image.new("RGB", (64, 200))],
        "Two images?",
        "Yes, two.",
    )
    ref = _hf_rope(tiny_model, s.input_ids.numpy(), s.image_grid_thw.numpy(), pad)
    assert np.array_equal(s.position_ids[1:].numpy(), ref)
    assert np.array_equal(s.position_ids[0].numpy(), np.arange(len(s.input_ids)))


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(1, 4)), min_size=0, max_size=3
    ),
    st.integers(0, 5),
)
def test_mrope_property_vs_get_rope_index(tiny_model, segs, tail):
    """Random text/image layouts (grid h, w even): our rows == transformers' get_rope_index."""
    pad = 7
    ids, grids = [], []
    for text_len, h2, w2 in segs:
        ids += [1] * text_len + [2]  # text then a vision_start-like separator
        grids.append([1, 2 * h2, 2 * w2])
        ids += [pad] * (h2 * w2) + [3]
    ids += [4] * (tail + 1)
    a = np.asarray(ids, dtype=np.int64)
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    ours = P.mrope_positions(a, g, pad, 2)
    ref = _hf_rope(tiny_model, a, g, pad) if len(g) else np.tile(np.arange(len(a)), (3, 1))
    assert np.array_equal(ours, ref)


def _png(img: Image.Image) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"not an image at all", "corrupt_image"),
        (None, "missing_image"),
        (b"", "missing_image"),
    ],
)
def test_decode_errors_have_reasons(data, reason):
    with pytest.raises(P.SampleError) as e:
        P.load_image(P.decode_image(data))
    assert e.value.reason == reason


def test_bad_samples_have_reasons(proc):
    good = _png(Image.new("RGB", (50, 40)))
    trunc = P.decode_image(good[: len(good) // 2])
    cases = [
        (lambda: VS.process_sample(proc, trunc, "q", "a"), "corrupt_image"),
        (lambda: VS.process_sample(proc, Image.new("L", (1, 300)), "q", "a"), "bad_aspect_ratio"),
        (lambda: VS.process_sample(proc, Image.new("RGB", (8, 8)), "q", "  "), "empty_text"),
        (
            lambda: VS.process_sample(proc, Image.new("RGB", (8, 8)), "see <|image_pad|>", "a"),
            "placeholder_mismatch",
        ),
        (
            lambda: VS.process_sample(
                proc, Image.new("RGB", (8, 8)), "why " * 500, "a", max_len=256
            ),
            "too_long",
        ),
        (
            lambda: VS.process_sample(proc, Image.new("RGB", (4000, 4000)), "q", "a", max_len=1024),
            "too_long",
        ),
    ]
    for fn, reason in cases:
        with pytest.raises(P.SampleError) as e:
            fn()
        assert e.value.reason == reason, (reason, str(e.value))


def test_decode_rejects_oversized_images_before_decoding():
    big = _png(Image.new("RGB", (3000, 2000)))
    with pytest.raises(P.SampleError) as e:
        P.decode_image(big, max_image_pixels=1_000_000)
    assert e.value.reason == "image_too_large"


def test_load_processor_rejects_non_processor_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        P.load_processor(tmp_path)


def test_a_row_without_images_is_a_text_only_sample(proc):
    s = VS.process_sample(proc, [], "What is two plus two?", "Four.")
    ref = vqa_reference(proc, [], "What is two plus two?", "Four.")
    assert torch.equal(s.input_ids, ref["input_ids"])
    assert torch.equal(s.labels, ref["labels"])
    assert s.pixel_u8.shape == (0, 768) and s.image_grid_thw.shape == (0, 3)
    assert proc.tokenizer.decode(s.input_ids[s.labels != -100].tolist()) == "Four.<|im_end|>"


def test_offline_tokenizer_is_identical_across_processes(tmp_path):
    """The BPE is trained at first use: every process (rank, machine) must get the same vocab,
    or the cache keys would differ."""
    import subprocess
    import sys

    code = (
        "import hashlib; from torchtitan_ext.vl.processor import _build_tokenizer_json as b; "
        "print(hashlib.sha256(b().encode()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import hashlib

    assert out.stdout.strip() == hashlib.sha256(P._build_tokenizer_json().encode()).hexdigest()


@pytest.mark.cuda
def test_normalize_patches_on_cuda_equals_cpu():
    u8 = torch.randint(0, 256, (64, 768), dtype=torch.uint8)
    u8[0, :256] = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(P.normalize_patches(u8.cuda()).cpu(), P.normalize_patches(u8))


def test_load_processor_from_a_copied_dir_and_missing_template(proc, tmp_path):
    """A Qwen3-VL-style dir (Fast image-processor type, min/max_pixels keys) loads with the same
    image values; without any chat template the error says so."""
    import shutil

    src = P.build_offline_processor(tmp_path / "orig")
    d = tmp_path / "like_qwen"
    shutil.copytree(src, d)
    cfg = json.loads((d / "preprocessor_config.json").read_text())
    cfg.update(
        image_processor_type="Qwen2VLImageProcessorFast", min_pixels=65536, max_pixels=16777216
    )
    cfg.pop("size")
    (d / "preprocessor_config.json").write_text(json.dumps(cfg))
    other = P.load_processor(d)
    assert P.ImageParams.from_processor(other) == P.ImageParams.from_processor(proc)
    assert P.special_token_ids(other) == P.special_token_ids(proc)
    (d / "chat_template.jinja").unlink()
    P._PROCESSORS.clear()
    with pytest.raises(ValueError, match="no chat template"):
        P.load_processor(d)
