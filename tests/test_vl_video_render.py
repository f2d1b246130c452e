"""Drawing video: a pack's ``video_u8`` rows back to frames (the exact inverse of
``vl.video.patchify_video``), ``inspect-cache --render`` / ``peek --render`` pictures of packs
with video (and mixing image and video), and a smoke run of ``python -m benchmarks vl_video``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import REPO
from torchtitan_ext.vl.images import ImageParams
from torchtitan_ext.vl.video import (
    VideoOptions,
    VideoProcessor,
    patchify_video,
    read_video,
    resize_frames,
    target_size,
)
from torchtitan_ext.vl.video_render import (
    frame_thumbnail,
    pack_video_list,
    pack_videos,
    token_runs,
    video_frames,
)

FIXTURES = REPO / "tests" / "fixtures" / "video"
CASES = sorted(p.stem for p in FIXTURES.glob("*.mp4"))


# ============================================================ frames <-> patches
@pytest.mark.parametrize("case", CASES)
def test_patches_back_to_frames_round_trip_on_the_fixtures(case):
    """The frames the processor resized -> its patches -> video_frames: equal, padding frame
    included (a repeat of the last frame)."""
    o = VideoOptions()
    frames, _, _, _ = read_video(FIXTURES / f"{case}.mp4", o)
    h, w = target_size(len(frames), frames.shape[1], frames.shape[2], o)
    resized = resize_frames(frames, h, w)
    patches, grid = patchify_video(resized, o)
    back = video_frames(patches, grid)
    assert back.dtype == np.uint8 and back.shape == (grid[0] * 2, h, w, 3)
    assert np.array_equal(back[: len(resized)], resized)
    assert all(np.array_equal(f, resized[-1]) for f in back[len(resized) :])
    # and the processor's own patches are those
    assert np.array_equal(VideoProcessor(o)(FIXTURES / f"{case}.mp4").patches, patches)


def test_round_trip_on_random_frames_with_other_sizes():
    rng = np.random.default_rng(0)
    o = VideoOptions(patch_size=8, merge_size=2, temporal_patch_size=3)
    frames = rng.integers(0, 256, (7, 32, 48, 3), dtype=np.uint8)  # 7 -> padded to 9
    patches, grid = patchify_video(frames, o)
    assert grid == (3, 4, 6)
    back = video_frames(patches, grid, patch=8, merge=2, temporal=3)
    assert np.array_equal(back[:7], frames) and np.array_equal(back[7], frames[6])
    # not a transpose that happens to work on one shape: each row element lands once
    assert np.array_equal(
        np.sort(back.ravel()), np.sort(np.concatenate([frames, frames[-1:], frames[-1:]]).ravel())
    )


def test_rows_that_do_not_fit_the_grid_are_named():
    with pytest.raises(ValueError, match=r"video rows \(8, 1536\) do not fit grid \(1, 4, 4\)"):
        video_frames(np.zeros((8, 1536), np.uint8), (1, 4, 4))


# ============================================================ packs with video
@pytest.fixture(scope="module")
def parts(proc):
    """Samples: video (small_10fps), image, video (budget_24fps), and the processor outputs."""
    from tests.support.video_packs import image_sample, video_sample

    gradient = Image.fromarray(np.tile(np.arange(96, dtype=np.uint8), (64, 1))).convert("RGB")
    names = ["small_10fps.mp4", "budget_24fps.mp4"]
    samples = [
        video_sample(proc, names[0], "What moves?", "A square."),
        image_sample(proc, gradient, "Which way is it lighter?", "To the right."),
        video_sample(proc, names[1], "And here?", "A gradient."),
    ]
    return samples, [VideoProcessor()(FIXTURES / n) for n in names]


@pytest.fixture(scope="module")
def mixed_pack(parts, special):
    """One pack: video, image, video, then 40 pad tokens."""
    from tests.support.video_packs import pack_of

    p = pack_of(parts[0], special)
    pad = torch.full((40,), special["pad_id"], dtype=torch.int64)
    p["input_ids"] = torch.cat([p["input_ids"], pad])
    p["labels"] = torch.cat([p["labels"], torch.full((40,), -100, dtype=torch.int64)])
    return p


def test_pack_videos_with_their_samples_and_timestamps(mixed_pack, parts, special, proc):
    _, vids = parts
    dec = lambda t: proc.tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
    got = pack_video_list(mixed_pack, special["video_pad_id"], {}, dec)
    assert [(v.sample, v.number) for v in got] == [(0, 0), (2, 0)]
    for v, ref in zip(got, vids, strict=True):
        assert v.grid_thw == ref.grid_thw
        assert np.array_equal(v.frames, video_frames(ref.patches, ref.grid_thw))
        # the seconds the prompt wrote (one decimal), one per merged frame
        assert v.timestamps == [float(f"{t:.1f}") for t in ref.timestamps]
    runs = token_runs(mixed_pack["input_ids"].numpy(), special["video_pad_id"])
    assert [v.token_start for v in got] == [runs[0][0], runs[vids[0].grid_thw[0]][0]]
    # without a decoder the frames are still there, the timestamps unknown
    blind = pack_video_list(mixed_pack, special["video_pad_id"], {})
    assert all(t is None for v in blind for t in v.timestamps)
    assert np.array_equal(blind[1].frames, got[1].frames)


@dataclass
class FakeCache:
    """What render_pack reads of a VLCache."""

    packs: list[dict[str, Any]]
    special_tokens: dict[str, int]
    image_params: dict[str, Any] = field(default_factory=lambda: asdict(ImageParams()))
    metadata: dict[str, Any] = field(default_factory=lambda: {"config": {"model_path": None}})

    def pack(self, i: int) -> dict[str, Any]:
        return self.packs[i]

    def __len__(self) -> int:
        return len(self.packs)


def _find(canvas: np.ndarray, frame: np.ndarray) -> list[tuple[int, int]]:
    """(y, x) of every place where ``frame`` sits in ``canvas`` pixel for pixel."""
    fh, fw = frame.shape[:2]
    ys, xs = np.nonzero((canvas[: -fh + 1, : -fw + 1] == frame[0, 0]).all(-1))
    return [
        (int(y), int(x)) for y, x in zip(ys, xs, strict=True)
        if np.array_equal(canvas[y : y + fh, x : x + fw], frame)
    ]  # fmt: skip


def test_render_pack_draws_every_frame_of_each_video(mixed_pack, parts, special, tmp_path):
    from torchtitan_ext.vl.render import render_pack
    from torchtitan_ext.vl.video_render import VIDEO_COLOR

    cache = FakeCache([mixed_pack], special)
    canvas = np.asarray(Image.open(render_pack(cache, 0, tmp_path / "p.png")).convert("RGB"))
    for v in parts[1]:
        for k, f in enumerate(video_frames(v.patches, v.grid_thw)):
            assert _find(canvas, np.asarray(frame_thumbnail(f, 96))), f"frame {k} is not drawn"
    assert (canvas == VIDEO_COLOR).all(-1).sum() > 100  # video tokens in the strip, captions


def test_peek_render_draws_the_videos_of_cache_packs(mixed_pack, parts, special, tmp_path,
                                                      monkeypatch):  # fmt: skip
    """peek --render draws a cached VL batch with the pack picture: video frames included."""
    from torchtitan_ext import peek_render
    from torchtitan_ext.vl.collate import collate_qwen3_vl

    cache = FakeCache([mixed_pack, mixed_pack], special)
    monkeypatch.setattr(peek_render, "vl_pack_indices", lambda *a: (cache, [0, 1]))
    view = peek_render.BatchView(pad_id=special["pad_id"], image_ids={special["image_pad_id"]})
    inp, labels = collate_qwen3_vl([mixed_pack, mixed_pack], pad_id=special["pad_id"])
    flat = {**{k: v for k, v in inp.items() if torch.is_tensor(v)}, "labels": labels}
    out = peek_render.render_batch(view, flat, tmp_path / "b.png", index=0, state_before={})
    canvas = np.asarray(Image.open(out).convert("RGB"))
    v = parts[1][0]
    first = np.asarray(frame_thumbnail(video_frames(v.patches, v.grid_thw)[0], 96))
    assert len(_find(canvas, first)) >= 2  # once per row


def test_a_video_only_pack_has_no_empty_thumbnail_row(parts, special, tmp_path):
    from tests.support.video_packs import pack_of
    from torchtitan_ext.vl.render import render_pack

    pack = pack_of(parts[0][:1], special)
    canvas = np.asarray(Image.open(render_pack(FakeCache([pack], special), 0, tmp_path / "v.png")))
    v = parts[1][0]
    (y, _), *_ = _find(
        canvas[..., :3], np.asarray(frame_thumbnail(video_frames(v.patches, v.grid_thw)[0], 96))
    )
    assert y < 60  # under the title and the video's header, not under a 140 px empty row


def test_video_rows_that_the_grid_does_not_account_for_are_named(mixed_pack):
    bad = {**mixed_pack, "video_u8": mixed_pack["video_u8"][:-4]}
    with pytest.raises(
        ValueError, match="video_grid_thw accounts for 568 patches but video_u8 has 564"
    ):
        pack_videos(bad)


def test_peek_show_marks_video_tokens_apart_from_image_tokens(mixed_pack, special):
    from torchtitan_ext.peek_view import BatchView, Shower
    from torchtitan_ext.vl.collate import collate_qwen3_vl

    vid = special["video_pad_id"]
    view = BatchView(pad_id=special["pad_id"], image_ids={special["image_pad_id"], vid},
                     video_ids={vid})  # fmt: skip
    inp, labels = collate_qwen3_vl([mixed_pack], pad_id=special["pad_id"])
    flat = {"input": inp["input"], "labels": labels}
    text = Shower(view, max_chars=100_000).render_batch(0, flat, {}, {})
    runs = token_runs(mixed_pack["input_ids"].numpy(), vid)
    assert text.count("«VID×") == len(runs) == 5  # 2 + 3 merged frames, one mark per frame
    assert text.count("«IMG×") == 1


def test_a_pack_with_zero_videos_renders_as_one_without_video_keys(parts, special, tmp_path):
    from tests.support.video_packs import pack_of
    from torchtitan_ext.vl.render import render_pack

    plain = pack_of(parts[0][1:2], special)
    empty = {**plain, "video_u8": torch.zeros((0, 1536), dtype=torch.uint8),
             "video_grid_thw": torch.zeros((0, 3), dtype=torch.int64)}  # fmt: skip
    a = render_pack(FakeCache([plain], special), 0, tmp_path / "a.png")
    b = render_pack(FakeCache([empty], special), 0, tmp_path / "b.png")
    assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))


def test_patchify_gives_the_same_bytes_from_either_memory_layout():
    """patchify_video pads channels-first frames (resize_frames' output) without changing their
    layout: the rows equal those of the same frames stored channels-last, padded or not."""
    rng = np.random.default_rng(1)
    o = VideoOptions()
    for n in (4, 5):
        nchw = rng.integers(0, 256, (n, 3, 64, 96), dtype=np.uint8)
        view = nchw.transpose(0, 2, 3, 1)  # NHWC view of NCHW memory, as resize_frames returns
        a, ga = patchify_video(view, o)
        b, gb = patchify_video(np.ascontiguousarray(view), o)
        assert ga == gb == (-(-n // 2), 4, 6) and np.array_equal(a, b)
        assert np.array_equal(video_frames(a, ga)[:n], view)


# ============================================================ the benchmark
def test_benchmark_vl_video_quick_smoke():
    from benchmarks.__main__ import available
    from benchmarks.common import BenchArgs
    from benchmarks.vl_video import run

    assert "vl_video" in available()
    rows = {r.case: r for r in run(BenchArgs(repeats=1, warmup=0, quick=True, noise_tol=0))}
    big = "[320x180 2 s 30 fps]"
    ours = rows[f"ours: decode + process to uint8 {big}"]
    assert ours.unit == "frames/s" and ours.value > 0 and ours.info["source_frames"] == 60
    assert ours.baseline == f"decode floor: PyAV decode of the sampled frames {big}"
    hf = rows[f"HF Qwen3VLVideoProcessor (PyAV reader), float32 {big}"]
    if hf.note.startswith("n/a"):  # no torchvision here: the row says why, nothing is compared
        assert "torchvision" in hf.note and rows[f"ours -> float32 {big}"].baseline is None
    else:
        assert hf.note == "output equal to ours -> float32" and hf.value > 0
    for clips in ("[fixture clips]", big):
        steps = [r.case.split(" (")[0] for r in rows.values() if r.case.endswith(clips)]
        assert [s for s in steps if s.startswith("step: ")] == [
            "step: probe", "step: decode", "step: resize", "step: patchify"
        ]  # fmt: skip
    assert all(r.baseline in rows for r in rows.values() if r.baseline)
    assert not any("seed" in n.lower() for n in rows)
