"""CLIs: preprocess-cached, inspect-cache (--json, --verify, --render); sample data; benchmark smoke."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.support.vl_sample import bad_rows_dataset
from torchtitan_ext.vl import inspect as I
from torchtitan_ext.vl import preprocess as PP
from torchtitan_ext.vl.sample_data import make_sample_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Private asset cache (offline processor) + a small dataset with all the bad rows."""
    with bad_rows_dataset(tmp_path_factory, "vlcli", n=24) as env:
        yield env


def _cli_args(env) -> list[str]:
    """The preprocess_cached arguments every test here builds its cache with."""
    return [
        "--dataset", str(env["ds"]), "--cache-dir", str(env["root"] / "c"),
        "--seq-len", "1024", "--buffer-size", "8", "--num-workers", "0", "--quiet",
        "--buckets", "512,768", "--rows-per-shard", "16",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def built(env):
    rc = PP.main(_cli_args(env))
    assert rc == 0
    (kdir,) = [p for p in (env["root"] / "c").iterdir() if p.is_dir()]
    return kdir


def test_sample_dataset_loads_with_hf_datasets(env):
    import datasets

    ds = datasets.load_dataset("parquet", data_files=str(env["ds"] / "*.parquet"), split="train")
    assert len(ds) == 24 + 9
    assert set(ds.column_names) >= {"image", "question", "answer"}
    first = ds[0]
    assert isinstance(first["image"], Image.Image) and first["answer"]


def test_sample_dataset_is_deterministic(tmp_path):
    a = make_sample_dataset(tmp_path / "a", n=10, bad_rows=True)
    b = make_sample_dataset(tmp_path / "b", n=10, bad_rows=True)
    import pyarrow.parquet as pq

    ta = pq.read_table(next(a.glob("*.parquet")))
    tb = pq.read_table(next(b.glob("*.parquet")))
    assert ta.equals(tb)


def test_preprocess_with_no_usable_row_exits_2_naming_the_reasons(env, tmp_path, capsys):
    """A build in which every row was skipped made a cache no loader can read: exit 2, one
    error line with the skip reasons (was: exit 0, and a traceback when training started)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "bad"
    src.mkdir()
    pq.write_table(
        pa.table(
            {"image": [b"not an image", b"\xff\xd8"], "question": ["q", "q2"], "answer": ["a", "b"]}
        ),
        src / "rows.parquet",
    )
    rc = PP.main(["--dataset", str(src), "--cache-dir", str(tmp_path / "c"), "--seq-len", "1024",
                  "--num-workers", "0", "--quiet"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "no usable rows" in err[0] and "2 skipped" in err[0] and "corrupt_image" in err[0]


def test_preprocess_cli_output_and_reuse(env, built, capsys):
    rc = PP.main(_cli_args(env))
    out = capsys.readouterr().out
    assert rc == 0 and str(built) in out and "skipped" in out


def test_preprocess_cli_strict_and_missing_dataset(env, capsys):
    rc = PP.main(
        [
            "--dataset",
            str(env["ds"]),
            "--cache-dir",
            str(env["root"] / "strict"),
            "--seq-len",
            "1024",
            "--num-workers",
            "0",
            "--quiet",
            "--strict",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "row 3" in err and "corrupt_image" in err
    rc = PP.main(
        ["--dataset", str(env["root"] / "nope"), "--cache-dir", str(env["root"] / "x"), "--quiet"]
    )
    assert rc == 2 and "nope" in capsys.readouterr().err


def test_inspect_table_and_json(built, capsys):
    assert I.main(["--cache-dir", str(built)]) == 0
    out = capsys.readouterr().out
    for word in (
        "packs",
        "samples per pack",
        "fill %",
        "images",
        "patches",
        "bytes per pack",
        "ratio vs float32",
    ):
        assert word in out
    assert I.main(["--cache-dir", str(built.parent), "--json"]) == 0  # parent with one cache
    s = json.loads(capsys.readouterr().out)
    assert s["packs"] > 0 and s["rows_read"] == s["samples"] + sum(s["skipped"].values())
    # the data files alone are at most 1/8 of the float32 layout; on a cache this small the JSON
    # manifest and stats (a few KB) are a visible part of the total
    json_bytes = sum(f.stat().st_size for f in built.rglob("*.json"))
    f32 = s["float32_bytes_per_pack"] * s["packs"]
    assert 0 < (s["bytes_total"] - json_bytes) / f32 <= 0.125


def test_inspect_verify_names_corrupt_file(built, tmp_path, capsys):
    import shutil

    kdir = tmp_path / "copy" / built.name
    shutil.copytree(built, kdir)
    assert I.main(["--cache-dir", str(kdir), "--verify"]) == 0
    assert "verify: OK" in capsys.readouterr().out
    f = kdir / "shards" / "00001" / "label_mask.memmap"
    b = bytearray(f.read_bytes())
    b[0] ^= 1
    f.write_bytes(bytes(b))
    assert I.main(["--cache-dir", str(kdir), "--verify"]) == 2  # damage: exit 2, one line
    err = capsys.readouterr().err
    assert "shards/00001/label_mask.memmap" in err and "sha256 mismatch" in err


def test_inspect_render_png(built, tmp_path, capsys):
    out = tmp_path / "pack.png"
    assert I.main(["--cache-dir", str(built), "--render", "0", str(out)]) == 0
    im = Image.open(out)
    assert im.width == 1200 and im.height > 200
    # the strip uses the palette: target (green) and image (orange) pixels are present
    colors = {c for _, c in im.convert("RGB").getcolors(1 << 20)}
    assert (46, 160, 67) in colors and (240, 140, 30) in colors


def test_scripts_run_as_files(built, tmp_path):
    for script, args in (
        ("scripts/inspect_cache.py", ["--cache-dir", str(built), "--json"]),
        ("scripts/preprocess_cached.py", ["--help"]),
        ("scripts/make_vl_sample_data.py", [str(tmp_path / "mk"), "--n", "3"]),
    ):
        r = subprocess.run(
            [sys.executable, script, *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "mk" / "train-00000-of-00001.parquet").exists()


@pytest.mark.slow
def test_benchmark_quick_smoke(env):
    from benchmarks.common import BenchArgs
    from benchmarks.vl_preprocess import run

    rows = {r.case: r for r in run(BenchArgs(repeats=1, warmup=0, quick=True))}
    label = "[640x480 JPEG, COCO-sized]"
    head = rows[f"per image ours -> float32 {label}"]  # like for like: equal float32 outputs
    assert head.baseline == f"per image HF Qwen3VLProcessor (PIL), float32 {label}"
    assert head.info["pixels_identical"] and head.ratio > 0
    u8 = rows[f"per image ours uint8, normalisation on the device {label}"]
    assert "not like for like" in u8.note
    fast = rows[f"per image HF Qwen3VLProcessor, fast (torchvision), float32 {label}"]
    assert fast.note is None or fast.note.startswith("not measured")  # measured, or says why not
    assert any("bytes per pack" in n for n in rows)
    # every ratio is against a row of this run; nothing quoted from elsewhere
    assert all(r.baseline in rows for r in rows.values() if r.baseline)
    assert not any("seed" in n.lower() for n in rows)


@pytest.mark.slow
def test_benchmark_open_and_workers_smoke(env):
    from benchmarks.common import BenchArgs
    from benchmarks.vl_build_workers import run as run_workers
    from benchmarks.vl_dataset import run as run_dataset

    extra = {"cases": "open", "open_sizes": "100"}
    rows = {r.case: r for r in run_dataset(BenchArgs(repeats=1, warmup=0, quick=True, extra=extra))}
    ours = rows["open 100 packs ours (VLCache.open)"]
    assert ours.baseline == "baseline: open 100 packs, previous open path"
    assert 40 <= ours.info["packs_per_shard"] <= 48  # 8k-token packs, 1,024 rows per shard
    extra = {"cases": "step", "rows": "60"}
    rows = {r.case: r for r in run_dataset(BenchArgs(repeats=1, warmup=0, quick=True, extra=extra))}
    hf_online = "baseline: HF online (Qwen3VLProcessor on one pack's rows, float32)"
    assert rows["step hf float32 on CPU (collate)"].baseline == hf_online  # float32 both sides
    assert rows["step hf u8 (fetch+collate)"].baseline == "baseline: ours online, hf u8 (no cache)"
    cold = rows["cold read: step hf u8, fetch+collate"]
    assert cold.info["rows_per_shard"] == 1024 and cold.info["resident_after_evict"] < 0.5
    assert all(r.baseline in rows for r in rows.values() if r.baseline)
    extra = {"workers": "0,1", "rows": "24"}
    rows = run_workers(BenchArgs(repeats=1, warmup=0, quick=True, extra=extra))
    assert [r.case for r in rows] == [
        "build s/pack, 0 workers (in process)",
        "build s/pack, 1 workers",
    ]


def test_render_unpatchify_inverts_patchify():
    import numpy as np

    from torchtitan_ext.vl.processor import ImageParams, image_to_patches
    from torchtitan_ext.vl.render import unpatchify

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (256, 320, 3), dtype=np.uint8)  # already a multiple of 32
    u8, grid = image_to_patches(Image.fromarray(arr), ImageParams())
    assert grid == (1, 16, 20)
    assert np.array_equal(unpatchify(u8, grid), arr)
