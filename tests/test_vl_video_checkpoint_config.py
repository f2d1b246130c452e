"""A checkpoint's ``video_preprocessor_config.json`` sets the ``video_*`` knobs left unset, as HF's
processor loaded from that directory would use it; a knob set in the config wins; the resolved
values are what the cache key holds; a bad file is one line naming it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from torchtitan_ext.vl.build_config import (
    VIDEO_CONFIG_FILE,
    config_from,
    processor_video_defaults,
)
from torchtitan_ext.vl.video import VideoOptions

SEQ = 1024
FILE = {"fps": 1.0, "min_frames": 2, "size": {"shortest_edge": 4096, "longest_edge": 200704}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from torchtitan_ext.vl.processor import offline_processor_dir
    from torchtitan_ext.vl.sample_video import video_sample_path

    root = tmp_path_factory.mktemp("ckpt_video")
    ckpt = root / "ckpt"
    shutil.copytree(offline_processor_dir(), ckpt)
    (ckpt / VIDEO_CONFIG_FILE).write_text(json.dumps(FILE))
    return {"ckpt": ckpt, "data": video_sample_path(n=4, root=root / "data"), "root": root}


def test_unset_knobs_take_the_checkpoints_values(env):
    cfg = config_from(env["data"], "train", SEQ, 8, store=True, model_path=str(env["ckpt"]))
    assert (cfg.video_fps, cfg.video_min_frames, cfg.video_max_frames) == (1.0, 2, 768)
    assert (cfg.video_min_pixels, cfg.video_max_pixels) == (4096, 200704)
    bare = config_from(env["data"], "train", SEQ, 8, store=True)  # embedded processor: no file
    d = VideoOptions()
    assert (bare.video_fps, bare.video_max_pixels) == (d.fps, d.max_pixels)


def test_a_knob_set_in_the_config_wins(env):
    cfg = config_from(env["data"], "train", SEQ, 8, store=True, model_path=str(env["ckpt"]),
                      video_fps=2.0)  # fmt: skip
    assert (cfg.video_fps, cfg.video_min_frames) == (2.0, 2)


def test_the_build_samples_with_the_checkpoints_values(env):
    """1-second clips at the file's 1 fps with min_frames 2: two frames, one merged frame each
    (the class defaults give 4 frames, two merged). The same knobs set by hand find the same
    cache (the key holds the resolved values), the defaults do not."""
    from torchtitan_ext.vl.build import build_cache, resolve
    from torchtitan_ext.vl.cache import VLCache

    kw = {"store": True, "show_progress": False}
    kdir = build_cache(env["data"], "train", env["root"] / "c", SEQ, 8,
                       model_path=str(env["ckpt"]), **kw)  # fmt: skip
    cache = VLCache.open(kdir)
    grids = [cache.pack(i).get("video_grid_thw") for i in range(len(cache))]
    t = np.concatenate([g.numpy()[:, 0] for g in grids if g is not None])
    assert len(t) and (t == 1).all()
    by_hand = dict(video_fps=1.0, video_min_frames=2, video_min_pixels=4096,
                   video_max_pixels=200704)  # fmt: skip
    same = config_from(env["data"], "train", SEQ, 8, store=True, **by_hand)
    assert resolve(same, env["root"] / "c").kdir == kdir
    default = config_from(env["data"], "train", SEQ, 8, store=True)
    assert resolve(default, env["root"] / "c").kdir != kdir


@pytest.mark.parametrize(
    "text, match",
    [("{not json", "Expecting property name"), (json.dumps({"num_frames": 8}), "num_frames=8")],
)
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, match):
    (tmp_path / VIDEO_CONFIG_FILE).write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        processor_video_defaults(tmp_path)
    assert str(tmp_path / VIDEO_CONFIG_FILE) in str(e.value) and "\n" not in str(e.value)
    assert processor_video_defaults(tmp_path / "absent") == VideoOptions()
    assert processor_video_defaults(None) == VideoOptions()


def test_the_key_holds_the_resolved_values_however_the_config_was_made(env):
    """A ``BuildConfig`` made directly (knobs left None) keys as the one ``config_from`` fills."""
    from torchtitan_ext.vl.build import _resolve
    from torchtitan_ext.vl.build_config import BuildConfig

    ckpt = str(env["ckpt"])
    raw = BuildConfig(dataset=str(env["data"]), seq_len=SEQ, buffer_size=8, store=True,
                      model_path=ckpt)  # fmt: skip
    made = config_from(env["data"], "train", SEQ, 8, store=True, model_path=ckpt)
    assert raw.video_fps is None and made.video_fps == 1.0
    assert _resolve(raw)[2] == _resolve(made)[2]
