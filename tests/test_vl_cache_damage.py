"""A VL cache one cannot fool: a planted pickle never runs, readers never write (also from a
read-only directory), every flip of the metadata is an error at open naming the file and field,
and ``inspect-cache --verify`` answers every kind of damage with exit 2 and one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchtitan_ext.vl import cache as C
from torchtitan_ext.vl import inspect as I
from torchtitan_ext.vl.build import build_cache

REPO = Path(__file__).resolve().parents[1]
SEQ = 1024


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("vl_damage")
    mp.setenv("TORCHTITAN_EXT_CACHE", str(root / "home"))
    from torchtitan_ext.vl.sample_data import sample_dataset_path

    data = sample_dataset_path(n=30, root=root / "data")
    kdir = build_cache(
        data, "train", root / "cache", SEQ, 8, buckets=[512, 768], rows_per_shard=12,
        num_workers=0, show_progress=False,
    )  # fmt: skip
    yield {"root": root, "data": data, "kdir": kdir, "cache_dir": root / "cache"}
    mp.undo()


@pytest.fixture
def cache(env, tmp_path) -> Path:
    """A private copy of the built cache (key directory), safe to damage."""
    dst = tmp_path / "c" / env["kdir"].name
    shutil.copytree(env["kdir"], dst)
    return dst


def _snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """Every file and directory under root: bytes, mtime and mode."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = (p.read_bytes() if p.is_file() else b"", st.st_mtime_ns,
                                         st.st_mode)  # fmt: skip
    return out


def _inspect_verify(kdir: Path, capsys) -> tuple[int, list[str]]:
    rc = I.main(["--cache-dir", str(kdir), "--verify"])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


# ---------------------------------------------------------------------------------- pickle


def _plant_pickle(shard: Path, marker: Path) -> None:
    """Add a tensordict NonTensorData entry whose other.pickle creates ``marker`` when loaded:
    exactly what an unguarded ``TensorDict.load_memmap`` unpickles."""
    from tensordict import NonTensorData, TensorDict

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    donor = shard.parent / "donor"
    td = TensorDict({}, batch_size=[])
    td["other"] = NonTensorData(Payload())
    td.memmap_(str(donor))
    shutil.copytree(donor / "other", shard / "other")
    shutil.rmtree(donor)
    meta = json.loads((shard / "meta.json").read_text())
    meta["other"] = {"type": "NonTensorData"}
    (shard / "meta.json").write_text(json.dumps(meta))


def test_planted_pickle_is_refused_everywhere_and_never_runs(env, cache, tmp_path, capsys):
    from tensordict import TensorDict

    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.dataset import CachedVLDataset

    marker = tmp_path / "PAYLOAD_RAN"
    shard = cache / "shards" / "00000"
    _plant_pickle(shard, marker)
    # the plant is live: an unguarded tensordict load runs it
    with pytest.warns(FutureWarning):
        TensorDict.load_memmap(str(shard), allow_pickle=None)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(C.CacheError, match=r"shards/00000/meta.json.*unexpected entry 'other'"):
        C.VLCache.open(cache)
    rc, err = _inspect_verify(cache, capsys)
    assert rc == 2 and len(err) == 1 and "shards/00000/meta.json" in err[0]
    assert I.main(["--cache-dir", str(cache)]) == 2  # the summary alone refuses it too
    assert "unexpected entry 'other'" in capsys.readouterr().err
    assert any("meta.json" in p for p in C.verify_cache(cache))
    with pytest.raises(C.CacheError, match="unexpected entry 'other'"):
        CachedVLDataset(cache, 0, 1)
    cfg = CachedVLDataLoader.Config(cache_path=str(cache))
    with pytest.raises(C.CacheError, match="unexpected entry 'other'"):
        cfg.build(dp_rank=0, dp_world_size=1, seq_len=SEQ, local_batch_size=1)
    assert not marker.exists(), "the pickle payload ran"


def test_every_tensordict_load_refuses_pickle():
    """No load_memmap call in the package or the benchmarks may leave pickle allowed."""
    import ast

    bad = []
    for root in (REPO / "torchtitan_ext", REPO / "benchmarks"):
        for f in sorted(root.rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in (
                    "load_memmap",
                    "load",
                ):
                    owner = getattr(n.func.value, "id", "")
                    if n.func.attr == "load" and owner != "TensorDict":
                        continue
                    kw = {k.arg: k.value for k in n.keywords}
                    v = kw.get("allow_pickle")
                    if not (isinstance(v, ast.Constant) and v.value is False):
                        bad.append(f"{f.relative_to(REPO)}:{n.lineno}")
    assert not bad, bad


def test_planted_pickle_without_meta_entry_is_a_planted_file(cache, tmp_path, capsys):
    marker = tmp_path / "PAYLOAD_RAN"
    shard = cache / "shards" / "00001"
    _plant_pickle(shard, marker)
    # restore meta.json: only the files stay planted
    meta = json.loads((shard / "meta.json").read_text())
    del meta["other"]
    (shard / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(C.CacheError):
        C.VLCache.open(cache)
    rc, err = _inspect_verify(cache, capsys)
    assert rc == 2 and len(err) == 1 and "shards/00001/" in err[0]
    assert not marker.exists()


# ---------------------------------------------------------------------------------- no writes


def test_open_iterate_verify_write_nothing(env, cache):
    from torchtitan_ext.vl.dataset import CachedVLDataset

    before = _snapshot(cache.parent)
    c = C.VLCache.open(cache)
    for i in range(len(c)):
        p = c.pack(i, copy_pixels=False)
        p["pixel_u8"].fill_(7)  # a write through the zero-copy view stays in this process
        assert p["input_ids"].shape[0] == c.pack_shape(i)
    assert c.verify() == []
    ds = CachedVLDataset(cache, 0, 1, infinite=False)
    assert sum(1 for _ in ds) == len(c)
    assert C.VLCache.open(cache).verify() == []
    assert _snapshot(cache.parent) == before


_READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import sys
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.dataset import CachedVLDataset
    from torchtitan_ext.vl import inspect as I
    kdir = sys.argv[1]
    c = VLCache.open(kdir)
    assert c.verify() == [], c.verify()
    n = sum(int(p["num_tokens"]) for p in CachedVLDataset(kdir, 0, 1, infinite=False))
    assert I.main(["--cache-dir", kdir, "--verify", "--json"]) == 0
    try:
        open(kdir + "/probe", "w")
    except PermissionError:
        print("READ-ONLY OK", n)
    """
)


def test_read_only_cache_directory_works(cache, tmp_path):
    """chmod -R a-w, then open + iterate + verify + inspect in a process that cannot write it
    (as root, capabilities dropped: root otherwise writes through any mode bits)."""
    before = _snapshot(cache.parent)
    subprocess.run(["chmod", "-R", "a-w", str(cache.parent)], check=True)
    try:
        cmd = [sys.executable, "-c", _READ_ONLY_SCRIPT, str(cache)]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("running as root without setpriv: cannot drop the write capability")
            cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all",
                   "--securebits=+noroot,+noroot_locked", *cmd]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "READ-ONLY OK" in r.stdout, (r.stdout, r.stderr[-2000:])
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(cache.parent)], check=True)
    after = _snapshot(cache.parent)
    assert {k: v[:2] for k, v in after.items()} == {k: v[:2] for k, v in before.items()}


def test_truncated_file_is_an_error_at_open_never_zeros(cache):
    f = cache / "shards" / "00000" / "tokens.memmap"
    size = f.stat().st_size
    os.truncate(f, size // 2)
    with pytest.raises(C.CacheError, match=r"shards/00000/tokens.memmap: size .* \(truncated\)"):
        C.VLCache.open(cache)
    assert f.stat().st_size == size // 2, "open must not grow the file back"
    # a shape raised in meta.json (the other way the old reader zero-filled) is refused too
    m = cache / "shards" / "00000" / "meta.json"
    doc = json.loads(m.read_text())
    os.truncate(f, size)
    doc["tokens"]["shape"][0] += 100
    m.write_text(json.dumps(doc))
    with pytest.raises(C.CacheError, match=r"meta.json: field tokens.shape"):
        C.VLCache.open(cache)
    assert f.stat().st_size == size


# ---------------------------------------------------------------------------------- metadata


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _flipped(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v + 0.5
    if isinstance(v, str):
        return (v[:-1] + ("x" if v[-1:] != "x" else "y")) if v else "x"
    if v is None:
        return 0
    return [1] if v == [] else {"x": 1}


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _field_name(path) -> str:
    """The name an error uses for a manifest path (two levels; files grouped by directory)."""
    if path[0] == "files":
        d = os.path.dirname(path[1]) or "."
        return f"files[{d}]"
    if len(path) == 1:
        return path[0]
    return f"{path[0]}[{path[1]}]" if isinstance(path[1], int) else f"{path[0]}.{path[1]}"


def test_every_metadata_field_flip_is_an_error_naming_it(cache):
    mf = cache / "metadata.json"
    original = mf.read_text()
    doc = json.loads(original)
    leaves = [(p, v) for p, v in _leaves(doc) if p[0] != "digest"]
    assert len(leaves) > 100
    for path, value in leaves:
        d = json.loads(original)
        _set(d, path, _flipped(value))
        mf.write_text(json.dumps(d, indent=1, sort_keys=True))
        with pytest.raises(C.CacheError) as e:
            C.VLCache.open(cache)
        msg = str(e.value)
        assert msg.startswith(str(mf)), (path, msg)
        if path[0] not in ("format", "format_version"):
            assert _field_name(path) in msg, (path, msg)
    # the digest itself: its root and each field digest
    for key in ("root", ("fields", "config.seq_len")):
        d = json.loads(original)
        if key == "root":
            d["digest"]["root"] = _flipped(d["digest"]["root"])
        else:
            d["digest"]["fields"]["config.seq_len"] = "0" * 16
        mf.write_text(json.dumps(d))
        with pytest.raises(C.CacheError, match="metadata.json: field"):
            C.VLCache.open(cache)
    mf.write_text(original)
    assert len(C.VLCache.open(cache)) > 0


def test_bit_flips_anywhere_in_metadata_fail_open(cache):
    import random

    mf = cache / "metadata.json"
    original = mf.read_bytes()
    rng = random.Random(0)
    for _ in range(400):
        pos, bit = rng.randrange(len(original)), 1 << rng.randrange(8)
        b = bytearray(original)
        b[pos] ^= bit
        mf.write_bytes(bytes(b))
        with pytest.raises(C.CacheError, match=r"metadata.json: "):
            C.VLCache.open(cache)
    mf.write_bytes(original)


def test_every_shard_meta_json_field_flip_is_an_error_naming_it(cache):
    m = cache / "shards" / "00001" / "meta.json"
    original = m.read_text()
    for path, value in _leaves(json.loads(original)):
        d = json.loads(original)
        _set(d, path, _flipped(value))
        m.write_text(json.dumps(d))
        with pytest.raises(C.CacheError) as e:
            C.VLCache.open(cache)
        name = ".".join(str(p) for p in path if not isinstance(p, int))  # shape[0] -> shape
        assert str(m) in str(e.value) and f"field {name}" in str(e.value), (path, str(e.value))
    m.write_text(original)
    C.VLCache.open(cache)


def test_pack_index_damage_is_refused_before_serving(cache):
    """Same-size changes of the index files pass open (they are data) but the shard is refused
    when first mapped, naming the file: never a wrong pack."""
    import numpy as np

    f = cache / "shards" / "00000" / "pack_offsets.memmap"
    a = np.fromfile(f, dtype=np.int64).reshape(-1, 4)
    a[1, 1] += 1
    a.tofile(f)
    c = C.VLCache.open(cache)
    with pytest.raises(C.CacheError, match="pack_offsets.memmap"):
        c.pack(0)
    assert any("pack_offsets.memmap" in p for p in c.verify())


# ---------------------------------------------------------------------------------- inspect


_TARGETS = [
    "metadata.json",
    "packing_stats.json",
    "shards/00000/meta.json",
    "shards/00001/stats.json",
    "shards/00000/tokens.memmap",
    "shards/00001/pixels.memmap",
    "shards/00000/pack_offsets.memmap",
    "shards/00001/grid_thw.memmap",
]


def _damage(kdir: Path, target: str, kind: str) -> str:
    """Apply one kind of damage; returns the file name the error must name."""
    f = kdir / target
    if kind == "truncated":
        os.truncate(f, f.stat().st_size // 2)
    elif kind == "deleted":
        f.unlink()
    elif kind == "flipped":
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x04
        f.write_bytes(bytes(b))
    elif kind == "garbled":
        f.write_text('{"files": {"not json')
    elif kind == "null":
        f.write_text("null")
    elif kind == "empty":
        f.write_bytes(b"")
    elif kind == "planted":
        p = f.parent / "evil.pickle"
        p.write_bytes(b"\x80\x04K\x01.")
        return str(p.relative_to(kdir))
    return target


_KINDS = ["truncated", "deleted", "flipped", "garbled", "null", "empty", "planted"]
_JSON_ONLY = ("garbled", "null", "empty")


@pytest.mark.parametrize(
    ("target", "kind"),
    [
        (t, k)
        for t in _TARGETS
        for k in _KINDS
        if t.endswith(".json") or k not in ("garbled", "null")
    ],
)
def test_inspect_verify_every_damage_exit_2_one_line(cache, target, kind, capsys):
    named = _damage(cache, target, kind)
    rc, err = _inspect_verify(cache, capsys)
    assert rc == 2, (target, kind, err)
    assert len(err) == 1, err
    assert err[0].startswith("inspect-cache: error:") and named in err[0], (named, err)
    assert "Traceback" not in err[0]


def test_damaged_cache_found_by_key_is_an_error_not_a_fallback(env, tmp_path):
    """The loader finds a damaged cache for its key: an error naming the file, not a silent
    rebuild or the online fallback."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    cache_dir = tmp_path / "cd"
    kdir = build_cache(env["data"], "train", cache_dir, SEQ, 8, buckets=[512, 768],
                       show_progress=False)  # fmt: skip
    _damage(kdir, "shards/00000/pixels.memmap", "truncated")
    cfg = CachedVLDataLoader.Config(
        dataset_path=str(env["data"]), cache_dir=str(cache_dir), buffer_size=8, buckets=[512, 768]
    )
    with pytest.raises(C.CacheError, match="pixels.memmap: size"):
        cfg.build(dp_rank=0, dp_world_size=1, seq_len=SEQ, local_batch_size=1)


def test_old_format_is_named_with_the_fix(cache):
    mf = cache / "metadata.json"
    d = json.loads(mf.read_text())
    d["format_version"] = 1
    mf.write_text(json.dumps(d))
    with pytest.raises(C.CacheError, match=rf"v1 is not .* v{C.FORMAT_VERSION}; rebuild the cache"):
        C.VLCache.open(cache)


def test_pixels_view_write_is_private(cache):
    c = C.VLCache.open(cache)
    view = c.pack(0, copy_pixels=False)["pixel_u8"]
    before = (cache / "shards" / "00000" / "pixels.memmap").read_bytes()
    view.add_(1)
    assert (cache / "shards" / "00000" / "pixels.memmap").read_bytes() == before
    fresh = C.VLCache.open(cache).pack(0)["pixel_u8"]
    assert not torch.equal(fresh, view)
