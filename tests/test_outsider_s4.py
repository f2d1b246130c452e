"""Inputs a new user tries that the first authors did not: a cut WebM, bad ``preprocess-cached``
flags, ``video_*`` values that can never work, and a Parquet directory whose file names state
their splits. Each must be one clear line (or a counted skip), never a silent wrong answer."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from torchtitan_ext.vl import build as B
from torchtitan_ext.vl import preprocess as PP
from torchtitan_ext.vl import sources as S
from torchtitan_ext.vl.build_config import BuildConfig, check_video_options
from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.video import VideoOptions, VideoProcessor


def _webm(n: int = 30, fps: int = 10) -> bytes:
    """A VP9 WebM of ``n`` frames (no frame count in the container; its duration is stated)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="webm") as c:
        s = c.add_stream("libvpx-vp9", rate=Fraction(fps))
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for i in range(n):
            a = np.full((48, 64, 3), (i * 37) % 256, dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


@pytest.fixture(scope="module")
def webm() -> bytes:
    return _webm()


def test_a_whole_webm_is_read_with_every_frame(webm: bytes) -> None:
    v = VideoProcessor(VideoOptions())(webm)
    assert v.total_frames == 30 and v.frame_indices[-1] == 29


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_a_cut_webm_is_truncated_video_not_a_shorter_video(webm: bytes, keep: float) -> None:
    # Matroska states no frame count: the packets are counted, so a cut file used to be
    # sampled as a shorter clip (0.9 s of a 3 s video) with nothing said
    with pytest.raises(SampleError) as e:
        VideoProcessor(VideoOptions())(webm[: int(len(webm) * keep)])
    assert e.value.reason == "truncated_video"
    assert "lasts 3.00 s" in str(e.value) and "\n" not in str(e.value)


def _main_refuses(argv: list[str], capsys, monkeypatch) -> str:
    """Run preprocess-cached; it must exit 2 with one line, before the build starts."""

    def no_build(*a, **k):
        raise AssertionError("the build started")

    monkeypatch.setattr(B, "build_cache", no_build)
    assert PP.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("preprocess-cached: error: ") and "\n" not in err
    return err


@pytest.mark.parametrize("tool", ["preprocess-cached", "inspect-cache"])
def test_cli_refuses_bad_buckets_as_a_usage_error(tmp_path, capsys, tool) -> None:
    # was a ValueError traceback (exit code 1), after the data was fingerprinted
    from torchtitan_ext.vl import inspect as I

    main = PP.main if tool == "preprocess-cached" else I.main
    argv = ["--dataset", "sample"] if tool == "preprocess-cached" else ["--seq-len", "512"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--cache-dir", str(tmp_path), "--buckets", "512,abc"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"{tool}: error: argument --buckets: '512,abc': expected comma-separated "
                   "token counts, e.g. 512,768")  # fmt: skip


def test_preprocess_cli_refuses_a_cache_dir_under_a_file(tmp_path, capsys, monkeypatch) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    for cache_dir in (f, f / "sub"):
        argv = ["--dataset", "sample", "--cache-dir", str(cache_dir), "-q"]
        err = _main_refuses(argv, capsys, monkeypatch)
        assert f"{f} is a file, not a directory" in err


@pytest.mark.parametrize(
    ("knobs", "says"),
    [
        ({"video_fps": float("inf")}, "video_fps must be a finite number > 0, got inf"),
        ({"video_min_frames": 1, "video_max_frames": 1}, "video_max_frames (1) must be >= 2"),
    ],
)
def test_video_options_that_skip_every_video_are_refused(knobs: dict, says: str) -> None:
    with pytest.raises(ValueError) as e:
        check_video_options(BuildConfig(dataset="", **knobs))
    assert says in str(e.value)


def test_video_options_at_the_edge_still_work() -> None:
    check_video_options(BuildConfig(dataset="", video_min_frames=1, video_max_frames=2))
    check_video_options(BuildConfig(dataset="", video_fps=1e6))


def _parquet(path) -> None:
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), path)


def test_a_split_not_among_plain_split_file_names_is_an_error(tmp_path) -> None:
    # train.parquet + test.parquet and --split validation used to read BOTH files
    for name in ("train.parquet", "test.parquet"):
        _parquet(tmp_path / name)
    assert [f.name for f in S._resolve_files(str(tmp_path), "test")] == ["test.parquet"]
    with pytest.raises(FileNotFoundError) as e:
        S._resolve_files(str(tmp_path), "validation")
    assert "split 'validation' (splits here: ['test', 'train'])" in str(e.value)


def test_files_that_name_no_split_are_all_read(tmp_path) -> None:
    for name in ("part-a.parquet", "part-b.parquet"):
        _parquet(tmp_path / name)
    got = [f.name for f in S._resolve_files(str(tmp_path), "validation")]
    assert got == ["part-a.parquet", "part-b.parquet"]


# ---------------------------------------------------------------- a checkpoint's video settings

_QWEN3_VL_VIDEO_CONFIG = {  # what the published Qwen3-VL checkpoints ship
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The offline processor plus a checkpoint's ``video_preprocessor_config.json``."""
    import json
    import shutil

    from torchtitan_ext.vl.offline_processor import offline_processor_dir

    d = tmp_path_factory.mktemp("model") / "qwen3vl"
    shutil.copytree(offline_processor_dir(), d)
    (d / "video_preprocessor_config.json").write_text(json.dumps(_QWEN3_VL_VIDEO_CONFIG))
    return d


def test_the_published_checkpoints_video_settings_are_used(model_dir) -> None:
    """Left unset, the video knobs take the checkpoint's file (the default knobs used to process
    video at 1/32 of the checkpoint's pixel budget, with nothing said)."""
    from torchtitan_ext.vl.build_config import config_from
    from torchtitan_ext.vl.pack_source import resolve_dataset

    cfg = config_from(resolve_dataset("sample_video"), "train", 1024, 16, model_path=str(model_dir))
    assert (cfg.video_min_pixels, cfg.video_max_pixels) == (4096, 25165824)
    assert (cfg.video_fps, cfg.video_min_frames, cfg.video_max_frames) == (2, 4, 768)


def test_the_loader_says_what_the_cache_build_skipped(tmp_path, caplog) -> None:
    # the step log's skipped: counts only this run's skips; a cache that dropped rows at build
    # time trained with "skipped: 0" and no word of them
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.pack_source import log_build_skips

    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "ok.mp4").write_bytes(_webm(8, 8))
    rows = {"video": ["nope.mp4", None, "ok.mp4"], "question": ["q0", "q1", "q2"],
            "answer": ["a0", "a1", "a2"]}  # fmt: skip
    pq.write_table(pa.table(rows), ds / "train.parquet")
    path = B.build_cache(str(ds), "train", str(tmp_path / "c"), 512, 4, store=True,
                         num_workers=0, show_progress=False)  # fmt: skip
    with caplog.at_level("INFO", logger="torchtitan_ext.vl.pack_source"):
        log_build_skips(VLCache.open(path))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "was built from 3 rows; 2 were skipped then {'missing_video': 2}" in said


@pytest.mark.parametrize(
    ("weights", "p"),
    [((1e308, 1e308), (0.5, 0.5)), ((1e308, 0.0, 1e308), (0.5, 0.0, 0.5)), ((7, 3), (0.7, 0.3))],
)
def test_mixture_weights_whose_sum_overflows_still_mix(weights, p) -> None:
    # each weight is finite (accepted), but their sum was inf: every share 0, every source
    # "ended" and the loader ended before its first batch, exit code 0
    from torchtitan_ext.pipeline.mix import SourceSpec, check_sources, normalized

    specs = [SourceSpec(name=f"s{i}", weight=w, path=f"d{i}") for i, w in enumerate(weights)]
    check_sources(specs)
    got = normalized(specs)
    assert np.allclose(got, p, rtol=0, atol=1e-15) and got.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("value", ["-1", "two"])
def test_preprocess_refuses_a_bad_worker_count(value, capsys) -> None:
    from torchtitan_ext.vl.preprocess import main

    with pytest.raises(SystemExit) as e:
        main(["--dataset", "sample", "--cache-dir", "x", "--num-workers", value])
    assert e.value.code == 2 and "--num-workers" in capsys.readouterr().err


def test_peek_names_an_empty_mixture_source_before_building(tmp_path, capsys) -> None:
    """peek runs the data checks training runs first: one line, exit code 2, nothing built."""
    from torchtitan_ext.peek import EXIT_CONFIG, main

    repo = Path(__file__).resolve().parents[1]
    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty / "train-0.parquet")
    cfg = (repo / "train_configs" / "llama3_mixture_cpu.toml").read_text()
    assert 'path = "embedded:shakespeare"' in cfg
    job = tmp_path / "job.toml"
    job.write_text(cfg.replace('path = "embedded:shakespeare"', f'path = "{empty}"'))
    assert main(["--config-file", str(job), "--batches", "1"]) == EXIT_CONFIG == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "source 'shakespeare'" in err[0] and "empty source" in err[0]
