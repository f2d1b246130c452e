"""Video through the offline cache and the cached_vl loader.

Layouts read video cells (HF ``messages`` video parts + ``videos`` column, LLaVA-Video
``<video>``, a VQA ``video`` column); a cache built from rows holding the fixture videos gives
HF's answers (tests/fixtures/video/*.npz, made by transformers 5.23: ids, grids, and the
normalised rows' sha256) for the video and for an image and a video together; packs read from
the cache give each sample's logits alone and transformers' own (tiny model); the loader yields
video batches in the ``hf`` and ``qwen3_vl`` formats and resumes bitwise; bad videos are counted
skips with their reasons (or an error naming the row under ``strict``); a VQA row missing its
media is a skip, not a text-only sample.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from tests.conftest import REPO
from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl import layouts as L
from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.video import VideoOptions, VideoProcessor, normalize_video_patches

FIXTURES = REPO / "tests" / "fixtures" / "video"
DEFAULT_CASES = ("halfround_2.5fps", "odd_30fps", "qvga_24fps", "small_10fps")
QUESTION = "What is in the video?"  # the fixtures' prompt (scripts/make_video_fixtures.py)
VID, IMG = {"type": "video"}, {"type": "image"}


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _png(size=(64, 48), colour=(200, 40, 40)) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", size, colour).save(b, "PNG")
    return b.getvalue()


# ------------------------------------------------------------------------------------ layouts
def test_messages_layout_reads_video_parts_and_the_videos_column():
    s = L.MessagesLayout("messages", "images", "videos").parse({
        "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                                  {"type": "video_url"}, "Same?"]},
                     {"role": "assistant", "content": "No."}],
        "images": [b"i"], "videos": ["a.mp4", {"bytes": b"v", "path": None}],
    })  # fmt: skip
    assert s.messages[0]["content"] == [IMG, VID, VID, {"type": "text", "text": "Same?"}]
    assert s.images == [b"i"] and s.videos == ["a.mp4", {"bytes": b"v", "path": None}]
    lay = L.choose_layout(["messages", "images", "videos"], "x.parquet")
    assert (lay.image, lay.video) == ("images", "videos")
    assert lay.describe()["columns"]["video"] == "videos"
    # a layout without a video column describes itself as before videos (its key is unchanged)
    assert "video" not in L.choose_layout(["messages", "images"], "x").describe()["columns"]
    # one video given as frames: a list inside the list
    frames = L.MessagesLayout("messages", None, "videos").parse(
        {"messages": [{"role": "user", "content": [VID]}], "videos": [[b"f0", b"f1"]]}
    )
    assert frames.videos == [[b"f0", b"f1"]]


def test_llava_video_and_image_markers_in_order():
    s = L.LlavaLayout("conversations", "image", "video").parse({
        "conversations": [{"from": "human", "value": "<video>\nThen <image> and <video>?"},
                          {"from": "gpt", "value": "Both."}],
        "image": "p.jpg", "video": ["a.mp4", "b.mp4"],
    })  # fmt: skip
    assert s.messages[0]["content"] == [
        VID, {"type": "text", "text": "\nThen "}, IMG, {"type": "text", "text": " and "}, VID,
        {"type": "text", "text": "?"},
    ]  # fmt: skip
    assert s.images == ["p.jpg"] and s.videos == ["a.mp4", "b.mp4"]
    assert L.choose_layout(["conversations", "video"], "x").video == "video"


def test_vqa_video_column_and_missing_media():
    vqa = L.choose_layout(["video", "question", "answer"], "x.parquet")
    assert (vqa.name, vqa.image, vqa.video) == ("vqa", None, "video")
    s = vqa.parse({"video": "clip.mp4", "question": "Q?", "answer": "A."})
    assert s.videos == ["clip.mp4"] and s.messages[0]["content"][0] == VID
    for cell in (None, []):  # a VQA row about a video it does not have: skipped, not text-only
        with pytest.raises(SampleError) as e:
            vqa.parse({"video": cell, "question": "Q?", "answer": "A."})
        assert e.value.reason == "missing_video" and "'video'" in str(e.value)
        with pytest.raises(SampleError) as e:
            L.VQALayout("image", "question", "answer").parse(
                {"image": cell, "question": "Q?", "answer": "A."}
            )
        assert e.value.reason == "missing_image"
    both = L.VQALayout("image", "question", "answer", "video")
    assert both.parse({"image": None, "video": "v.mp4", "question": "q", "answer": "a"}).videos
    with pytest.raises(SampleError, match="missing_image: column 'image' / 'video'"):
        both.parse({"image": None, "video": None, "question": "q", "answer": "a"})
    # a text-only QA set (no media column) and chat rows without media stay text samples
    assert L.VQALayout(None, "q", "a").parse({"q": "1+1?", "a": "2"}).images == []
    chat = L.MessagesLayout("messages", "images", "videos").parse(
        {"messages": [{"role": "user", "content": "Hi"}], "images": None, "videos": []}
    )
    assert chat.images == [] and chat.videos == []


# -------------------------------------------------------------------------- a cache of videos
def _chat(parts: list, answer: str) -> list[dict]:
    content = [{"type": p, "text": None} if p in ("image", "video") else {"type": "text", "text": p}
               for p in parts]  # fmt: skip
    return [{"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]  # fmt: skip


def _sample(messages: list, images: list, videos: list = ()) -> L.ChatSample:
    """A conversation as a layout hands it on (normalised parts) with its media cells."""
    s = L.MessagesLayout("messages", None, None).parse({"messages": messages})
    return L.ChatSample(s.messages, list(images), list(videos))


def _cell(data: bytes | None = None, path: str | None = None) -> dict:
    return {"bytes": data, "path": path}


def _long_clip() -> bytes:
    """A 8 s clip at 10 fps, 256x256: 16 sampled frames, 8x12x12 = 288 video tokens."""
    from torchtitan_ext.vl.sample_video import encode_mp4

    t, y, x = np.arange(80)[:, None, None], np.arange(256)[None, :, None], np.arange(256)
    gray = ((x + y + 3 * t) % 256).astype(np.uint8)
    return encode_mp4(np.repeat(gray[..., None], 3, axis=3), fps=10)


def _one_frame() -> bytes:
    from torchtitan_ext.vl.sample_video import encode_mp4

    return encode_mp4(np.zeros((1, 48, 64, 3), np.uint8))


GOOD = 6
"""Rows 0..5 are good: the four default fixtures, an image + a video, a text-only chat row."""
BAD_REASONS = {
    6: "corrupt_video",  # not a video at all
    7: "truncated_video",  # the data ends inside a frame
    8: "missing_video",  # a relative path to no file
    9: "too_few_frames",  # one frame: the model needs two
    10: "too_long",  # 288 video tokens + text > seq_len (packed cache; a store keeps it)
}
SEQ = 320


def write_video_rows(d: Path) -> Path:
    """The dataset: ``messages`` + ``images`` + ``videos`` rows (``{bytes, path}`` structs)."""
    d.mkdir(parents=True)
    (d / "clips").mkdir()
    shutil.copy(FIXTURES / "small_10fps.mp4", d / "clips" / "small.mp4")
    mp4 = {c: (FIXTURES / f"{c}.mp4").read_bytes() for c in DEFAULT_CASES}
    rows = [
        (_chat(["video", QUESTION], f"Clip {c}."), [], [_cell(mp4[c])]) for c in DEFAULT_CASES[:3]
    ]
    rows.append((_chat(["video", QUESTION], "Clip small."), [], [_cell(path="clips/small.mp4")]))
    rows.append((_chat(["image", "video", "Do they match?"], "No."), [_cell(_png())],
                 [_cell(mp4["qvga_24fps"])]))  # fmt: skip
    rows.append((_chat(["Say hi."], "Hi."), [], []))
    q = mp4["qvga_24fps"]
    rows += [
        (_chat(["video", QUESTION], "?"), [], [_cell(b"not a video")]),
        (_chat(["video", QUESTION], "?"), [], [_cell(q[: len(q) * 6 // 10])]),
        (_chat(["video", QUESTION], "?"), [], [_cell(path="clips/no_such.mp4")]),
        (_chat(["video", QUESTION], "?"), [], [_cell(_one_frame())]),
        (_chat(["video", QUESTION], "Long."), [], [_cell(_long_clip())]),
    ]
    media = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    schema = pa.schema([
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(part))]))),
        ("images", media), ("videos", media),
    ])  # fmt: skip
    table = [{"messages": m, "images": i, "videos": v} for m, i, v in rows]
    pq.write_table(pa.Table.from_pylist(table, schema=schema), d / "train.parquet")
    return d


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A sample store and a packed cache (seq_len ``SEQ``) of the same video rows."""
    from torchtitan_ext.vl.build import build_cache

    root = tmp_path_factory.mktemp("vl_video_cache")
    data = write_video_rows(root / "data")
    kw = dict(show_progress=False, buckets=None)
    store = build_cache(data, "train", root / "cache", SEQ, 8, store=True, **kw)
    packed = build_cache(data, "train", root / "cache", SEQ, 8, **kw)
    return {"root": root, "data": data, "store": store, "packed": packed}


def store_samples(path: Path) -> dict[int, dict]:
    """Input row -> its sample (a store's entry j is one unpadded sample)."""
    from torchtitan_ext.vl.cache import VLCache

    c = VLCache.open(path)
    return {c.pack_rows(j)[0]: c.pack(j) for j in range(len(c))}


def test_video_samples_equal_hf_through_the_cache(env, proc):
    """ids up to the generation prompt = HF's, labels on the answer only, video_grid_thw = HF's,
    and ``normalize_video_patches(video_u8)`` = HF's float32 ``pixel_values_videos`` (sha256)."""
    got = store_samples(env["store"])
    for row, case in enumerate([*DEFAULT_CASES[:3], "small_10fps"]):
        ref, s = np.load(FIXTURES / f"{case}.npz"), got[row]
        n = len(ref["input_ids"])
        assert s["input_ids"][:n].tolist() == ref["input_ids"].tolist(), case
        assert (s["labels"][:n] == IGNORE_INDEX).all()
        answer = proc.tokenizer.decode(s["input_ids"][s["labels"] != IGNORE_INDEX])
        assert answer == ("Clip small." if row == 3 else f"Clip {case}.") + "<|im_end|>"
        assert s["video_grid_thw"].tolist() == [ref["grid_thw"].tolist()]
        assert s["video_u8"].dtype == torch.uint8 and s["video_u8"].shape[1] == 1536
        assert _sha(normalize_video_patches(s["video_u8"]).numpy()) == str(
            ref["pixel_values_sha256"]
        )
        assert s["pixel_u8"].shape[0] == 0 and "video_u8" in s


def test_an_image_and_a_video_together_equal_hf(env, proc):
    """The HF processor's text: the chat template, each <|image_pad|> repeated per image token
    and each <|video_pad|> replaced by the video's prompt (checked against HF per fixture in
    tests/test_vl_video.py), tokenised in one go; the image rows are the image path's."""
    from torchtitan_ext.vl.build_config import BuildConfig
    from torchtitan_ext.vl.row_work import process_parsed

    s = store_samples(env["store"])[4]
    v = VideoProcessor()(FIXTURES / "qvga_24fps.mp4")
    msgs = [{"role": "user", "content": [IMG, VID, {"type": "text", "text": "Do they match?"}]},
            {"role": "assistant", "content": "No."}]  # fmt: skip
    image = process_parsed(proc, _sample(_chat(["image", "Q"], "A"), [_png()]),
                           BuildConfig(dataset="x"), positions=False)  # fmt: skip
    n_img = int(image.image_grid_thw.prod() // 4)
    text = proc.apply_chat_template(msgs, tokenize=False)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * n_img)
    text = text.replace("<|video_pad|>", v.placeholder())
    assert s["input_ids"].tolist() == proc.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert torch.equal(s["pixel_u8"], image.pixel_u8)
    assert torch.equal(s["image_grid_thw"], image.image_grid_thw)
    assert torch.equal(s["video_u8"], torch.from_numpy(v.patches))
    assert proc.tokenizer.decode(s["input_ids"][s["labels"] != -100]) == "No.<|im_end|>"


@pytest.mark.parametrize("case", ["budget_24fps", "capped_30fps"])
def test_video_options_reach_the_samples(proc, case):
    """The other fixtures' HF options, given as the build's ``video_*`` knobs."""
    from torchtitan_ext.vl.build_config import VIDEO_OPTIONS, BuildConfig
    from torchtitan_ext.vl.row_work import process_parsed

    ref = np.load(FIXTURES / f"{case}.npz")
    o = VideoOptions.from_config(json.loads(str(ref["options"])))
    cfg = BuildConfig(dataset="x", **{k: getattr(o, f) for k, f in VIDEO_OPTIONS.items()})
    sample = _sample(_chat(["video", QUESTION], "A."), [], [FIXTURES / f"{case}.mp4"])
    s = process_parsed(proc, sample, cfg, positions=True)
    assert s.input_ids[: len(ref["input_ids"])].tolist() == ref["input_ids"].tolist()
    assert s.video_grid_thw.tolist() == [ref["grid_thw"].tolist()]
    assert _sha(normalize_video_patches(s.video_u8).numpy()) == str(ref["pixel_values_sha256"])


def test_a_video_given_as_frames(proc):
    """A list of frame images is one video at HF's assumed 24 fps (``FRAME_LIST_FPS``)."""
    from torchtitan_ext.vl.build_config import BuildConfig
    from torchtitan_ext.vl.row_work import FRAME_LIST_FPS, process_parsed

    frames = [np.full((48, 64, 3), 20 * k, np.uint8) for k in range(10)]
    pngs = [{"bytes": _png_of(f), "path": None} for f in frames]
    sample = _sample(_chat(["video", "Q?"], "A."), [], [pngs])
    s = process_parsed(proc, sample, BuildConfig(dataset="x"), positions=True)
    v = VideoProcessor().from_frames(frames, FRAME_LIST_FPS)
    assert FRAME_LIST_FPS == 24.0 and s.video_grid_thw.tolist() == [list(v.grid_thw)]
    assert torch.equal(s.video_u8, torch.from_numpy(v.patches))
    with pytest.raises(SampleError, match=r"empty_video: videos\[0\] of 1: frame list: no frames"):
        process_parsed(proc, _sample(_chat(["video", "Q?"], "A."), [], [[]]),
                       BuildConfig(dataset="x"), positions=True)  # fmt: skip


def _png_of(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, "PNG")
    return b.getvalue()


# ------------------------------------------------------------------------- format and packing
def test_packs_store_video_and_count_it(env):
    """Every pack of the packed cache is the plan's pack over the store (bitwise, video keys
    included); video tokens are in the pack lengths; the stats count videos and text-only
    samples; verify covers the video files."""
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    packed = VLCache.open(env["packed"])
    planned = PlannedStore.open(env["store"], PlanOptions.make(SEQ, 8, None))
    assert len(packed) == len(planned) >= 3 and packed.verify() == []
    videos = 0
    for i in range(len(packed)):
        a, b = packed.pack(i), planned.pack(i)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert int(a["num_tokens"]) == int(a["seq_lens"].sum()) <= SEQ
        if "video_grid_thw" in a:
            vg = a["video_grid_thw"]
            assert a["video_u8"].shape == (int(vg.prod(1).sum()), 1536)
            videos += len(vg)
    assert videos == 5 and planned.plan.too_long == 1
    st = json.loads((env["packed"] / "packing_stats.json").read_text())
    assert st["skipped"] == {r: 1 for r in BAD_REASONS.values()}
    assert st["videos"] == 5 and st["images"] == 1 and st["samples_text_only"] == 1
    assert st["videos_per_pack"]["max"] >= 1
    meta = packed.metadata
    assert meta["format_version"] == 3 and meta["counts"]["videos"] == 5
    files = {Path(f).name for f in meta["files"]}
    assert {"video_pixels.memmap", "video_grid_thw.memmap", "video_offsets.memmap"} <= files
    from torchtitan_ext.vl.inspect import format_table, summary

    table = format_table(summary(env["packed"]))
    assert re.search(r"videos \(per pack mean\) +5 \(", table) and "text-only samples" in table


def test_an_image_only_cache_has_no_video_files_or_keys(tmp_path):
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    data = sample_dataset_path(n=6, root=tmp_path / "data")
    k = build_cache(data, "train", tmp_path / "c", 1024, 8, show_progress=False)
    c = VLCache.open(k)
    assert not any("video" in f for f in c.metadata["files"])
    assert all("video_u8" not in c.pack(i) for i in range(len(c)))


def test_damaged_video_index_is_named(env, tmp_path):
    from torchtitan_ext.vl.cache import CacheError, VLCache

    dst = tmp_path / "copy"
    shutil.copytree(env["packed"], dst)
    f = dst / "shards" / "00000" / "video_offsets.memmap"
    a = np.fromfile(f, dtype=np.int64)
    a[-1] += 1
    a.tofile(f)
    problems = VLCache.open(dst).verify()
    assert any("video_offsets.memmap: sha256 mismatch" in p for p in problems)
    with pytest.raises(CacheError, match=r"video_offsets.memmap: first/last rows"):
        VLCache.open(dst).pack(0)  # the index is checked when the shard is first mapped


def test_bad_videos_are_counted_or_named_under_strict(env, tmp_path):
    from torchtitan_ext.vl.build import build_cache

    st = json.loads((env["store"] / "packing_stats.json").read_text())
    assert st["skipped"] == {r: 1 for r in BAD_REASONS.values() if r != "too_long"}
    assert st["skipped_example_rows"]["truncated_video"] == [7]
    with pytest.raises(ValueError, match=r"row 6: corrupt_video: videos\[0\] of 1: "):
        build_cache(env["data"], "train", tmp_path / "c", SEQ, 8, strict=True,
                    show_progress=False)  # fmt: skip


def test_a_vqa_row_without_its_media_is_a_counted_skip(tmp_path):
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.online import OnlineVLDataset

    d = tmp_path / "vqa"
    d.mkdir()
    clip = (FIXTURES / "small_10fps.mp4").read_bytes()
    pq.write_table(pa.table({
        "video": [clip, None, b""], "question": ["What?", "What?", "What?"],
        "answer": ["A square.", "x", "y"],
    }), d / "train.parquet")  # fmt: skip
    k = build_cache(d, "train", tmp_path / "c", 1024, 8, show_progress=False)
    st = json.loads((k / "packing_stats.json").read_text())
    assert st["samples_packed"] == 1 and st["skipped"] == {"missing_video": 2}
    assert st["videos"] == 1 and st["samples_text_only"] == 0
    ds = OnlineVLDataset(  # the online fallback counts them too
        d, "train", seq_len=1024, buffer_size=8, buckets=None, infinite=False, shuffle=False
    )
    assert len(list(ds)) == 1 and dict(ds.skips) == {"missing_video": 2}


# ------------------------------------------------------------------------------------- model
def test_packed_video_packs_from_the_cache_equal_each_sample_alone_and_hf(env, special):
    """The tiny debugmodel: a pack read from the cache (videos, an image, text) gives each
    sample's logits alone (its store entry) and transformers' own forward."""
    from tests.test_vl_video_model import run_hf, run_ours
    from torchtitan_ext.models.qwen3_vl import flavors as fl
    from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel, build_hf_model
    from torchtitan_ext.vl.cache import VLCache

    torch.manual_seed(0)
    ours = Qwen3VLModel(Qwen3VLModel.Config(hf_config=fl.flavor_config("debugmodel"))).eval()
    hf = build_hf_model(fl.flavor_config("debugmodel")).eval()
    hf.load_state_dict(ours.state_dict())
    packed = VLCache.open(env["packed"])
    alone = store_samples(env["store"])
    i = max(range(len(packed)), key=lambda j: len(packed.pack_rows(j)))
    pack, rows = packed.pack(i), packed.pack_rows(i)
    assert len(rows) >= 2 and "video_grid_thw" in pack
    logits = run_ours(ours, [pack], special)[0]
    o = 0
    for r in rows:
        s = alone[r]
        n = len(s["input_ids"])
        one = run_ours(ours, [s], special)[0]
        assert (logits[o : o + n] - one).abs().max() <= 1e-5
        assert (one - run_hf(hf, s, special)[0]).abs().max() <= 1e-5
        o += n


# ------------------------------------------------------------------------------------ loader
def loader(env, **cfg):
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    c = CachedVLDataLoader.Config(cache_path=str(env["store"]), buffer_size=8, **cfg)
    return c.build(dp_rank=0, dp_world_size=1, seq_len=SEQ, local_batch_size=2)


@pytest.mark.parametrize("fmt", ["hf", "qwen3_vl"])
def test_the_loader_yields_video_batches(env, fmt):
    """Normalised here, or uint8 until ``finish_on_device`` (bitwise the same floats)."""
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    planned = PlannedStore.open(env["store"], PlanOptions.make(SEQ, 8, None))
    rows = {tuple(planned.pack(i)["input_ids"].tolist()): planned.pack(i)
            for i in range(len(planned))}  # fmt: skip
    here = next(iter(loader(env, batch_format=fmt, shuffle=False)))
    dl = loader(env, batch_format=fmt, shuffle=False, normalize_on="device")
    dev = next(iter(dl))
    h, d = (here, dev) if fmt == "hf" else (here[0], dev[0])
    ids = h["input_ids"] if fmt == "hf" else h["input"]
    packs = [rows[tuple(r.tolist())] for r in ids]
    want = [p for p in packs if "video_u8" in p]
    assert want, "the first batch holds a video"
    u8 = torch.cat([p["video_u8"] for p in want])
    assert torch.equal(h["pixel_values_videos"], normalize_video_patches(u8))
    assert torch.equal(h["video_grid_thw"], torch.cat([p["video_grid_thw"] for p in want]))
    assert d["pixel_values_videos"].dtype == torch.uint8
    done = dl.finish_on_device(dev)
    done = done if fmt == "hf" else done[0]
    assert torch.equal(done["pixel_values_videos"], h["pixel_values_videos"])


def test_the_loader_yields_torchtitan_video_batches(env):
    """The ``torchtitan`` format from the cache: each video one item per merged frame
    (``tests/test_vl_video_torchtitan.py`` checks the layout against torchtitan's own code), the
    same floats whether normalised here or on the device."""
    here = next(iter(loader(env, batch_format="torchtitan", shuffle=False)))
    dl = loader(env, batch_format="torchtitan", shuffle=False, normalize_on="device")
    dev = next(iter(dl))
    frames = here[0]["grid_thw_videos"]
    assert frames is not None and len(frames) and frames[:, 0].eq(1).all()
    assert dev[0]["pixel_values_videos"].dtype == torch.uint8
    done = dl.finish_on_device(dev)[0]
    for key in ("pixel_values_videos", "grid_thw_videos", "mrope_positions"):
        assert torch.equal(done[key], here[0][key]), key
    vid = here[0]["input"] == here[0]["special_tokens"]["video_id"]
    assert int(vid.sum()) == int((frames.prod(-1) // 4).sum())


def test_video_batches_resume_exactly(env):
    """The one resume harness, same degree: the batches after a resume are bitwise those of an
    uninterrupted run (a DP change: the resume matrix's ``cached_vl_video``)."""
    from tests.support.resume import LoaderSpec, assert_resume_exact
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    planned = PlannedStore.open(env["store"], PlanOptions.make(SEQ, 8, None))
    ids = {tuple(planned.pack(i)["input_ids"].tolist()): i for i in range(len(planned))}

    def build(rank: int, world: int, infinite: bool):
        c = CachedVLDataLoader.Config(cache_path=str(env["store"]), buffer_size=8,
                                      batch_format="qwen3_vl", infinite=infinite)  # fmt: skip
        return c.build(dp_rank=rank, dp_world_size=world, seq_len=SEQ, local_batch_size=1)

    def doc_ids(batch):
        return [ids[tuple(r.tolist())] for r in batch[0]["input"]]

    spec = LoaderSpec("cached_vl", build, doc_ids, set(ids.values()), steps=1)
    (batches,) = assert_resume_exact(spec, 2, 1)
    assert any("pixel_values_videos" in b[0] for b in batches)


def test_the_online_fallback_packs_video_as_the_cache_does(env):
    """No cache: packs made now from the rows carry the same video keys, counting the same
    skips (the VQA layout's ``missing_*`` included: a parse failure is the row's skip)."""
    from torchtitan_ext.vl.online import OnlineVLDataset
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    ds = OnlineVLDataset(env["data"], "train", seq_len=SEQ, buffer_size=8, buckets=None,
                         infinite=False, shuffle=False)  # fmt: skip
    packs = list(ds)
    assert dict(ds.skips) == {r: 1 for r in BAD_REASONS.values()}
    planned = PlannedStore.open(env["store"], PlanOptions.make(SEQ, 8, None))
    cached = {tuple(planned.pack(i)["input_ids"].tolist()): planned.pack(i)
              for i in range(len(planned))}  # fmt: skip
    assert len(packs) == len(cached)
    for p in packs:
        c = cached[tuple(p["input_ids"].tolist())]
        assert p.keys() - {"pack_index"} == c.keys()
        for k in ("video_u8", "video_grid_thw", "position_ids", "labels", "pixel_u8"):
            if k in c:
                assert torch.equal(p[k], c[k]), k


def test_a_video_option_that_cannot_work_is_one_line_before_the_build(
    monkeypatch, capsys, tmp_path
):
    """Preflight names the key (the job never reaches the trainer)."""
    from torchtitan_ext import train

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")  # restored (unset) after the test: main() fills them in
        monkeypatch.delenv(k)
    monkeypatch.setattr("torchtitan.tools.logging.init_logger", lambda: None)
    built: list = []
    monkeypatch.setattr(train, "run", lambda cfg: built.append(cfg) or 0)
    config = REPO / "train_configs" / "qwen3_vl_video_tiny.toml"
    rc = train.main(["--config-file", str(config), "--dataloader.video_min_frames", "9",
                     "--dataloader.video_max_frames", "8", "--dump_folder", str(tmp_path)])  # fmt: skip
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not built and len(lines) == 1, lines
    assert "[dataloader] video_min_frames (9) and video_max_frames (8)" in lines[0]
