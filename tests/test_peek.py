"""peek: pickle-free state round trips, batch files, the resume-equality property for every
registered loader (workers 0 and 2), --show / --render, and config errors (exit code 2)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_ext.peek import main
from torchtitan_ext.peek_files import (
    META_KEY,
    flatten_batch,
    load_batches,
    load_state,
    save_state,
)
from torchtitan_ext.registry import _BUILTIN, available_loaders, register_loader

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "data" / "configs"
TOY_PATH = "tests.support.toy_loader:ToyLoader.Config"


@pytest.fixture(autouse=True)
def _toy_registered():
    register_loader("toy", TOY_PATH, overwrite=True)
    yield


@pytest.fixture(scope="session")
def vl_cache_dir(tmp_path_factory) -> Path:
    # One cache per test session (built on first use by the loader itself, ~5 s).
    return tmp_path_factory.mktemp("peek_vl_cache")


def _loader_names() -> list[str]:
    register_loader("toy", TOY_PATH, overwrite=True)
    return sorted(set(available_loaders()) | {"toy"})


def _config_args(name: str, vl_cache_dir: Path) -> list[str]:
    cfg = CONFIGS / f"peek_{name}.toml"
    if not cfg.is_file():
        if name in _BUILTIN or name == "toy":
            pytest.fail(f"no peek test config for built-in loader {name!r}: add {cfg}")
        pytest.skip(f"loader {name!r} was registered at run time (not built in): no {cfg.name}")
    args = ["--config-file", str(cfg)]
    if name == "cached_vl":
        args += ["--dataloader.cache_dir", str(vl_cache_dir)]
    return args


def _has_num_workers(name: str) -> bool:
    from dataclasses import fields

    from torchtitan_ext.registry import get_loader_config

    return "num_workers" in {f.name for f in fields(get_loader_config(name))}


def _assert_same_batches(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert sorted(x) == sorted(y), f"batch {i}: keys differ"
        for k in x:
            assert x[k].dtype == y[k].dtype, f"batch {i} {k}: dtype {x[k].dtype} vs {y[k].dtype}"
            assert x[k].shape == y[k].shape, f"batch {i} {k}: shape differs"
            assert x[k].tobytes() == y[k].tobytes(), f"batch {i} {k}: values differ"


# ============================================================ save_state / load_state
def _eq(a, b) -> bool:
    """Structural equality that also checks container, scalar and array types and dtypes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_eq(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def test_state_round_trip_all_types(tmp_path):
    state = {
        "dp_rank_0": {
            "cursor": [0, 5, 128],
            "tokens": list(range(-3, 1000)),  # long int list -> int64 array
            "big": [2**70, -(2**65)] + [1] * 20,  # beyond int64: stays JSON
            "mixed": [1, 2.5, "x", None, True, b"\x00\xff", [1, [2, (3, 4)]]],
            "blob": b"pickled-by-someone-else\x00\x01",
            "ba": bytearray(b"abc"),
            "floats": [0.1, 1e300, float("inf"), float("-inf"), float("nan"), -0.0],
            "t_i64": torch.arange(6).reshape(2, 3),
            "t_bf16": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
            "t_f32_0d": torch.tensor(3.25),
            "t_bool": torch.tensor([True, False]),
            "np_u8": np.arange(10, dtype=np.uint8),
            "np_f16": np.array([[1.0, 2.0]], dtype=np.float16),
            "np_scalar": np.int32(7),
            "np_f64": np.float64(0.5),
            "tuple": (1, "a", (2.0, None)),
            "empty": {},
            "empty_list": [],
        },
        "int_keys": {0: "a", 1: {2: "b"}, (3, 4): "tuple key"},
        "__dict__": "a key that looks like a tag",
        "world_size": 1,
    }
    p = save_state(state, tmp_path / "state")
    assert p == tmp_path / "state"  # exactly the path asked for (no ".npz" appended)
    back = load_state(p)
    assert _eq(state, back), back
    # no pickle anywhere: every member loads with allow_pickle=False
    with np.load(p, allow_pickle=False) as z:
        for k in z.files:
            assert z[k].dtype != object


def test_state_rejects_unsupported_type_naming_where(tmp_path):
    with pytest.raises(TypeError, match=r"state\.a\[1\]\.b: object"):
        save_state({"a": [1, {"b": object()}]}, tmp_path / "s")
    with pytest.raises(TypeError, match="object array"):
        save_state({"a": np.array([1, "x"], dtype=object)}, tmp_path / "s")


def test_load_state_rejects_other_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_state(tmp_path / "missing")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a peek state"):
        load_state(bad)
    other = tmp_path / "other.npz"
    np.savez(other, x=np.arange(3))
    with pytest.raises(ValueError, match="not a peek state"):
        load_state(other)


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=16),
    st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=16, max_size=40),
    st.builds(
        lambda xs: np.array(xs, dtype=np.int16), st.lists(st.integers(-100, 100), max_size=5)
    ),
    st.builds(
        lambda xs: torch.tensor(xs, dtype=torch.float64), st.lists(st.floats(-1e6, 1e6), max_size=5)
    ),
)
_state = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.tuples(kids, kids),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-5, 5)), kids, max_size=4),
    ),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(state=_state)
def test_state_round_trip_property(tmp_path_factory, state):
    p = tmp_path_factory.mktemp("prop") / "s"
    assert _eq(state, load_state(save_state(state, p)))


# ============================================================ flatten_batch
def test_flatten_batch_shapes():
    x, y = torch.zeros(2, 3), torch.ones(2, 3)
    assert list(flatten_batch(({"input": x, "positions": x}, y))) == [
        "input",
        "positions",
        "labels",
    ]
    # a DataLoader's default collate makes the tuple a list: same names
    assert list(flatten_batch([{"input": x}, y])) == ["input", "labels"]
    flat = flatten_batch({"input_ids": x, "extra": {"a": x, "b": [x, 3]}, "use_cache": False})
    assert list(flat) == ["input_ids", "extra.a", "extra.b.0", "extra.b.1", "use_cache"]
    with pytest.raises(ValueError, match="labels"):
        flatten_batch(({"labels": x}, y))


# ============================================================ the resume-equality property
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", _loader_names())
def test_resume_equals_uninterrupted(name, workers, tmp_path, vl_cache_dir, capsys):
    """peek --batches 2K == (peek --batches K --save-state-after K s) + (peek --load-state s
    --batches K), bitwise, for every registered loader."""
    base = _config_args(name, vl_cache_dir) + ["--num-workers", str(workers)]
    K = 3
    if workers > 0 and not _has_num_workers(name):
        # A loader without worker processes must say so, clearly, not silently ignore it.
        rc = main([*base, "--batches", str(2 * K), "--out", str(tmp_path / "full.npz")])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert "has no setting dataloader.num_workers" in err, err
        return
    full, first, second = (tmp_path / f"{n}.npz" for n in ("full", "first", "second"))
    state = tmp_path / "state"
    assert main([*base, "--batches", str(2 * K), "--out", str(full)]) == 0
    assert (
        main(
            [
                *base,
                "--batches",
                str(K),
                "--save-state-after",
                str(K),
                str(state),
                "--out",
                str(first),
            ]
        )
        == 0
    )
    assert state.is_file()
    assert main([*base, "--load-state", str(state), "--batches", str(K), "--out", str(second)]) == 0
    b_full, meta = load_batches(full)
    b_first, _ = load_batches(first)
    b_second, meta2 = load_batches(second)
    assert len(b_full) == 2 * K
    _assert_same_batches(b_full, b_first + b_second)
    # the batches are not all the same (a loader stuck on one batch would pass the above)
    assert any(b_full[0][k].tobytes() != b_full[K][k].tobytes() for k in b_full[0] if "label" in k)
    assert meta["loader"] == name and meta2["load_state"] == str(state)
    assert len(meta["stats_per_batch"]) == 2 * K


def test_resume_vl_torchtitan_format_uint8_pixels(tmp_path, vl_cache_dir):
    """The (input_dict, labels) VL layout with uint8 pixels (normalised later on the device),
    with workers; --no-staging shows the batches before the staging wrapper."""
    base = _config_args("cached_vl", vl_cache_dir) + [
        "--dataloader.batch_format", "torchtitan", "--dataloader.normalize_on", "device",
        "--num-workers", "2", "--staging.enable",
    ]  # fmt: skip
    # with [staging] (required by normalize_on=device) the pixels arrive normalised ...
    staged = tmp_path / "staged.npz"
    assert main([*base, "--batches", "1", "--out", str(staged)]) == 0
    assert load_batches(staged)[0][0]["pixel_values"].dtype == np.float32
    # ... and --no-staging shows the loader's own output: uint8 pixels
    base.append("--no-staging")
    full, first, second, state = (tmp_path / n for n in ("f.npz", "a.npz", "b.npz", "s"))
    assert main([*base, "--batches", "4", "--out", str(full)]) == 0
    assert (
        main([*base, "--batches", "1", "--save-state-after", "1", str(state), "--out", str(first)])
        == 0
    )
    assert main([*base, "--load-state", str(state), "--batches", "3", "--out", str(second)]) == 0
    b_full, meta = load_batches(full)
    _assert_same_batches(b_full, load_batches(first)[0] + load_batches(second)[0])
    b0 = b_full[0]
    assert {"input", "positions", "mrope_positions", "grid_thw", "labels"} <= set(b0)
    assert b0["pixel_values"].dtype == np.uint8
    assert "special_tokens.pad_id" in b0  # nested dict flattened, ints as 0-d arrays
    assert meta["batch_notes"][0]["other"]["pixel_values_videos"] is None


@pytest.mark.parametrize("name", ["toy", "streaming_text"])
def test_resume_equals_uninterrupted_with_staging(name, tmp_path, vl_cache_dir):
    """[staging] enable wraps the loader in AsyncDeviceLoader, as ExtTrainer does; its state
    accounts for the batches it has prefetched, so resume is still exact."""
    base = _config_args(name, vl_cache_dir) + ["--staging.enable"]
    full, first, second, state = (tmp_path / n for n in ("f.npz", "a.npz", "b.npz", "s"))
    assert main([*base, "--batches", "4", "--out", str(full)]) == 0
    assert (
        main([*base, "--batches", "2", "--save-state-after", "2", str(state), "--out", str(first)])
        == 0
    )
    assert main([*base, "--load-state", str(state), "--batches", "2", "--out", str(second)]) == 0
    b_full, meta = load_batches(full)
    _assert_same_batches(b_full, load_batches(first)[0] + load_batches(second)[0])
    assert meta["config"]["staging"]["enable"] is True


# ============================================================ batch files / metadata
def test_out_file_metadata_readable_without_pickle(tmp_path):
    out = tmp_path / "b.npz"
    rc = main(
        ["--config-file", str(CONFIGS / "peek_toy.toml"), "--batches", "2", "--out", str(out)]
    )
    assert rc == 0
    with np.load(out, allow_pickle=False) as z:
        names = set(z.files)
        meta = json.loads(z[META_KEY].tobytes().decode())
    assert {"0/input", "0/positions", "0/labels", "1/input", "1/labels"} <= names
    assert meta["format"].startswith("torchtitan_ext.peek.batches")
    assert meta["stats"] == {"batches": 2}
    assert meta["config"]["training"]["seq_len"] == 16
    assert meta["config"]["dataloader"]["__class__"] == "ToyLoader.Config"
    batches, _ = load_batches(out)
    assert batches[0]["input"].shape == (2, 16) and batches[0]["input"].dtype == np.int64
    # the toy loader's batch 1 is reproducible from its seed: peek stored the right tensors
    g = torch.Generator().manual_seed(0 + 1)
    x = torch.randint(3, 200, (2, 17), generator=g)
    assert np.array_equal(batches[1]["input"], x[:, :-1].numpy())
    assert np.array_equal(batches[1]["labels"], x[:, 1:].numpy())


def test_dp_ranks_see_different_data(tmp_path):
    outs = []
    for r in (0, 1):
        out = tmp_path / f"r{r}.npz"
        args = [
            "--config-file",
            str(CONFIGS / "peek_streaming_text.toml"),
            "--batches",
            "1",
            "--dp-rank",
            str(r),
            "--dp-world-size",
            "2",
            "--out",
            str(out),
        ]
        assert main(args) == 0
        outs.append(load_batches(out))
    (b0, m0), (b1, m1) = outs
    assert m0["dp_rank"] == 0 and m1["dp_rank"] == 1
    assert b0[0]["input"].tobytes() != b1[0]["input"].tobytes()


def test_validator_loader(tmp_path, capsys):
    """--validator builds [validator.dataloader] (its own offset) instead of the train loader."""
    cfg = ["--config-file", str(CONFIGS / "peek_streaming_text.toml"), "--batches", "1"]
    tr, va = tmp_path / "train.npz", tmp_path / "val.npz"
    assert main([*cfg, "--out", str(tr)]) == 0
    assert main([*cfg, "--validator", "--out", str(va)]) == 0
    (bt,), mt = load_batches(tr)
    (bv,), mv = load_batches(va)
    assert mt["loader_section"] == "dataloader" and mv["loader_section"] == "validator.dataloader"
    assert bt["input"].shape == bv["input"].shape
    assert bt["input"].tobytes() != bv["input"].tobytes()
    # paths are checked under the validator's own key
    rc = main([*cfg, "--validator", "--validator.dataloader.dataset_path", str(tmp_path / "nope")])
    assert rc == 2 and "validator.dataloader.dataset_path" in capsys.readouterr().err


def test_vl_batches_pixels_and_sha256(tmp_path, vl_cache_dir):
    base = _config_args("cached_vl", vl_cache_dir) + ["--batches", "1"]
    raw, sha = tmp_path / "raw.npz", tmp_path / "sha.npz"
    assert main([*base, "--out", str(raw)]) == 0
    assert main([*base, "--pixels", "sha256", "--out", str(sha)]) == 0
    (br,), meta = load_batches(raw)
    (bs,), meta_s = load_batches(sha)
    assert {"input_ids", "position_ids", "labels", "image_grid_thw", "pixel_values"} <= set(br)
    assert br["position_ids"].shape[0] == 4
    import hashlib

    pv = np.ascontiguousarray(br["pixel_values"])
    assert bs["pixel_values.sha256"].tobytes() == hashlib.sha256(pv.tobytes()).digest()
    assert "pixel_values" not in bs
    assert meta_s["batch_notes"][0]["sha256_of"]["pixel_values"]["shape"] == list(pv.shape)
    assert meta["batch_notes"][0]["other"] == {} and "images" in meta["stats"]


# ============================================================ --show / --render
def test_show_marks_documents_masks_and_fill(capsys, vl_cache_dir):
    rc = main(
        _config_args("cached_vl", vl_cache_dir) + ["--batches", "1", "--show", "--color", "never"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "── batch 0 ──" in out and "┃doc 0" in out and "┃doc 1" in out
    assert "fill " in out and "masked " in out
    assert "⟦" in out  # prompt tokens (label -100) bracketed
    assert "«IMG×" in out and "«PAD×" in out


def test_show_text_loader(capsys):
    rc = main(
        [
            "--config-file",
            str(CONFIGS / "peek_parquet_prefetch.toml"),
            "--batches",
            "2",
            "--show",
            "--color",
            "never",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("── batch") == 2 and "«BOS»" in out
    assert "tokens_cropped +" in out  # per-batch crop count from the loader's stats


def test_render_text_strips(tmp_path):
    from PIL import Image

    from torchtitan_ext.peek_render import BatchView, render_strips, row_infos

    # two rows: docs [BOS a b EOS][BOS c EOS] + pad, and one 7-token document
    inp = torch.tensor([[0, 5, 6, 1, 0, 7, 1, 2], [0, 3, 4, 5, 6, 7, 8, 9]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6, 7]])
    labels = torch.tensor([[5, 6, 1, -100, 7, 1, -100, -100], [3, 4, 5, 6, 7, 8, 9, 10]])
    flat = {"input": inp, "positions": pos, "labels": labels}
    view = BatchView(bos_id=0, eos_id=1, pad_id=2)
    r0, r1 = row_infos(view, flat)
    assert (r0.valid, r0.starts, r0.masked) == (7, [0, 4], 2)
    assert (r1.valid, r1.starts, r1.masked) == (8, [0], 0)
    assert list(r0.kinds[:4]) == ["bos", "text", "text", "eos"] and r0.kinds[7] == "pad"
    out = render_strips(view, flat, tmp_path / "x.png", title="t")
    img = Image.open(out)
    assert img.width == 1400 and img.height > 100
    # BOS tick (black) at the first cell of row 0
    px = img.convert("RGB").load()
    assert any(px[x, y] == (0, 0, 0) for x in range(12, 20) for y in range(52, 70))


def test_render_vl_pack_picture(tmp_path, vl_cache_dir):
    from PIL import Image

    out = tmp_path / "vl.png"
    rc = main(
        _config_args("cached_vl", vl_cache_dir)
        + ["--batches", "2", "--render", str(out), "--render-batch", "1"]
    )
    assert rc == 0
    img = Image.open(out)
    assert img.width >= 1200 and img.height > 300  # two stacked pack pictures with thumbnails


def test_render_text_loader(tmp_path):
    out = tmp_path / "t.png"
    rc = main(
        [
            "--config-file",
            str(CONFIGS / "peek_streaming_text.toml"),
            "--batches",
            "1",
            "--render",
            str(out),
        ]
    )
    assert rc == 0 and out.stat().st_size > 1000


# ============================================================ errors
def test_unknown_loader_is_config_error(tmp_path, capsys):
    cfg = tmp_path / "bad.toml"
    cfg.write_text((CONFIGS / "peek_toy.toml").read_text().replace('"toy"', '"no_such_loader"'))
    assert main(["--config-file", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "dataloader" in err and "no_such_loader" in err


def test_missing_dataset_path_names_the_key(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    rc = main(
        [
            "--config-file",
            str(CONFIGS / "peek_parquet_prefetch.toml"),
            "--dataloader.dataset_path",
            str(missing),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "dataloader.dataset_path" in err and str(missing) in err


def test_option_errors_exit_2(tmp_path, capsys):
    toy = ["--config-file", str(CONFIGS / "peek_toy.toml")]
    assert main([*toy, "--num-workers", "2"]) == 2  # the toy loader has no workers
    assert "num_workers" in capsys.readouterr().err
    assert main([*toy, "--dp-rank", "2", "--dp-world-size", "2"]) == 2
    assert main([*toy, "--batches", "2", "--save-state-after", "3", str(tmp_path / "s")]) == 2
    assert main([*toy, "--load-state", str(tmp_path / "missing")]) == 2
    assert main(["--config-file", str(tmp_path / "missing.toml")]) == 2


def test_out_files_are_zip_npz(tmp_path):
    out = tmp_path / "b.npz"
    assert (
        main(["--config-file", str(CONFIGS / "peek_toy.toml"), "--batches", "1", "--out", str(out)])
        == 0
    )
    assert zipfile.is_zipfile(out)


# ============================================================ CLI smoke
@pytest.mark.integration
def test_cli_smoke(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torchtitan_ext.peek",
        "--config-file",
        str(CONFIGS / "peek_streaming_text.toml"),
        "--batches",
        "1",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "batch 0:" in r.stdout
