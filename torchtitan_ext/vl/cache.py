"""Packed Qwen3-VL cache: key, resumable/sharded/atomic writer, memory-mapped reader, verify.

Layout (one directory per cache key, ``<name>_<split>_seq<L>_buf<B>_<key12>/``)::

    metadata.json        config, key, library versions, counts, shard table, per-file size+sha256
    packing_stats.json   packs, samples/pack, fill %, images/pack, buckets, skips by reason
    shards/00000/        one TensorDict memmap per shard of *rows* (``rows_per_shard`` input rows)
        meta.json        (tensordict's, JSON)        tokens.memmap      int32 [T]
        label_mask.memmap uint8 [T] (1 = target)     pixels.memmap      uint8 [P, 768]
        grid_thw.memmap  int32 [I, 3]                sample_lens.memmap int32 [S]
        sample_rows.memmap int64 [S] (input row)     pack_offsets.memmap int64 [K+1, 4]
        pack_len.memmap  int32 [K] (padded length)   stats.json  (shard counts, skips, checksums)

Why per shard of packs and not per pack (the seed's layout): opening must not touch pixel data and
must be fast at 10k packs. Measured (benchmarks/vl_preprocess.py, 10,000 packs): one TensorDict
memmap per pack takes 1.5-7.4 s to open (10k ``load_memmap`` calls, 50k files; the range is machine
load); per shard of 1,000 packs it takes 2-11 ms (metadata.json + 10 ``load_memmap`` calls + the small pack-offset arrays;
no pixel or token bytes are read). ``pack(i)`` is then a bisect over shard offsets plus slices of
the mapped arrays: ~2.7 ms per 18 MB pack (20 images) including the position_ids computation and
a private copy of the pixels, ~0.6 ms with ``copy_pixels=False``.

Only content tokens are stored (padding is added at read time) and ``position_ids`` are not stored:
they are a pure function of the tokens and ``image_grid_thw`` (``processor.position_rows``, ~0.1 ms
per pack). Labels are a 1-byte mask. So a pack costs 768 B per patch + 5 B per token, vs 6144 B per
patch + 48 B per token for the seed's float32/int64 layout: <= 1/8 of its bytes, losslessly.

Build (0.06-0.16 s per pack of ~20 640x480 images on 2 cores, vs the seed's 1.7 s): rows
are split into fixed shards of ``rows_per_shard`` input rows; each shard is processed
(process pool: decode -> resize -> uint8 patchify -> tokenise), packed on its own (best fit, the
buffer restarts per shard), written into ``shards/.tmp-*`` and renamed into place atomically.
So the content does not depend on the number of ranks or on interruptions: a restart skips the
complete shards (SIGKILL-safe), and with ``RANK``/``WORLD_SIZE`` rank r builds shards r, r+W, ....
When all shards exist, whichever rank sees it first (under a manifest lock) writes
``packing_stats.json`` then ``metadata.json`` (atomic renames; ``metadata.json`` last = the commit
marker). A per-(key, rank) ``fcntl`` lock keeps two writers off the same shards.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_NAME = "torchtitan_ext.vl_cache"
FORMAT_VERSION = 1
DEFAULT_ROWS_PER_SHARD = 1024
_PATCH_DIM = 768

# ----------------------------------------------------------------------------------------------
# dataset sources


class RowSource:
    """Random access to (image, question, answer) rows of a local Parquet dataset or a hub one."""

    name: str
    num_rows: int

    def fingerprint(self) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, start: int, stop: int) -> list[dict[str, Any]]:
        raise NotImplementedError


def _pick_column(names: Sequence[str], options: Sequence[str], what: str, where: str) -> str:
    for o in options:
        if o in names:
            return o
    raise ValueError(f"{where}: no {what} column (looked for {list(options)}; have {list(names)})")


def _file_fingerprint(path: Path) -> dict[str, Any]:
    """Name, size and sha256 of the first and last 1 MiB (cheap for huge files, catches edits
    of the header/footer where Parquet keeps its metadata)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read())
        elif size > 1 << 20:
            h.update(f.read())
    return {"name": path.name, "size": size, "sha256_head_tail": h.hexdigest()}


class ParquetSource(RowSource):
    """Local Parquet files (a file, a directory, or a glob), read with pyarrow row groups."""

    IMAGE_COLS = ("image", "images", "img")
    QUESTION_COLS = ("question", "prompt", "query")
    ANSWER_COLS = ("answer", "multiple_choice_answer", "answers", "response")

    def __init__(self, dataset: str | Path, split: str):
        import pyarrow.parquet as pq

        self.files = self._resolve(str(dataset), split)
        self.name = Path(str(dataset).rstrip("/")).stem or "dataset"
        self._pq = pq
        self._meta = [pq.ParquetFile(f).metadata for f in self.files]
        counts = [m.num_rows for m in self._meta]
        self._starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.num_rows = int(self._starts[-1])
        schema = pq.ParquetFile(self.files[0]).schema_arrow
        names = schema.names
        self.image_col = _pick_column(names, self.IMAGE_COLS, "image", str(self.files[0]))
        self.question_col = _pick_column(names, self.QUESTION_COLS, "question", str(self.files[0]))
        self.answer_col = _pick_column(names, self.ANSWER_COLS, "answer", str(self.files[0]))
        self._open: dict[int, Any] = {}

    @staticmethod
    def _resolve(dataset: str, split: str) -> list[Path]:
        p = Path(dataset)
        if p.is_file():
            return [p]
        if p.is_dir():
            for pat in (
                f"{split}-*.parquet",
                f"{split}/*.parquet",
                f"**/{split}-*.parquet",
                f"**/{split}/*.parquet",
                f"*{split}*.parquet",
            ):
                files = sorted(p.glob(pat))
                if files:
                    return files
            files = sorted(p.glob("**/*.parquet"))
            # HF-style names ("train-00000-of-00001.parquet") name their split: a split that is
            # not among them is an error, not "use everything".
            hf_style = re.compile(r"(\w+?)-\d+-of-\d+")
            if files and all(hf_style.match(f.name) for f in files):
                named = sorted({hf_style.match(f.name).group(1) for f in files})
                raise FileNotFoundError(
                    f"--dataset {dataset}: no files for split {split!r} (splits here: {named})"
                )
            if files:
                return files
            raise FileNotFoundError(f"--dataset {dataset}: no .parquet files in the directory")
        files = sorted(Path(f) for f in glob.glob(dataset, recursive=True))
        if files:
            return files
        raise FileNotFoundError(f"--dataset {dataset}: no such file, directory or glob match")

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "parquet", "files": [_file_fingerprint(f) for f in self.files]}

    def read(self, start: int, stop: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        fi = int(np.searchsorted(self._starts, start, side="right") - 1)
        pos = start
        while pos < stop and fi < len(self.files):
            f0, f1 = int(self._starts[fi]), int(self._starts[fi + 1])
            lo, hi = pos - f0, min(stop, f1) - f0
            pf = self._open.get(fi)
            if pf is None:
                pf = self._open[fi] = self._pq.ParquetFile(self.files[fi])
            md = self._meta[fi]
            # only the row groups that overlap [lo, hi)
            rg_start, groups, first = 0, [], None
            for g in range(md.num_row_groups):
                n = md.row_group(g).num_rows
                if rg_start + n > lo and rg_start < hi:
                    groups.append(g)
                    first = rg_start if first is None else first
                rg_start += n
            cols = [self.image_col, self.question_col, self.answer_col]
            tbl = pf.read_row_groups(groups, columns=cols).slice(lo - first, hi - lo)
            for r in tbl.to_pylist():
                ans = r[self.answer_col]
                if isinstance(ans, list):  # VQAv2-style list of answers: take the first
                    ans = ans[0] if ans else ""
                    ans = ans.get("answer", "") if isinstance(ans, dict) else ans
                rows.append(
                    {"image": r[self.image_col], "question": r[self.question_col], "answer": ans}
                )
            pos = f1
            fi += 1
        return rows


class HubSource(RowSource):
    """A Hugging Face hub dataset (downloaded by ``datasets``; images not decoded). Untested here:
    the tests and demo use local Parquet."""

    def __init__(self, dataset: str, split: str):
        import datasets

        ds = datasets.load_dataset(dataset, split=split)
        self.name = dataset.replace("/", "_")
        names = ds.column_names
        self.image_col = _pick_column(names, ParquetSource.IMAGE_COLS, "image", dataset)
        self.question_col = _pick_column(names, ParquetSource.QUESTION_COLS, "question", dataset)
        self.answer_col = _pick_column(names, ParquetSource.ANSWER_COLS, "answer", dataset)
        self.ds = ds.cast_column(self.image_col, datasets.Image(decode=False))
        self.num_rows = len(ds)
        self._id = dataset

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "hub", "name": self._id, "fingerprint": self.ds._fingerprint}

    def read(self, start: int, stop: int) -> list[dict[str, Any]]:
        out = []
        for r in self.ds.select(range(start, stop)):
            ans = r[self.answer_col]
            if isinstance(ans, list):
                ans = ans[0] if ans else ""
                ans = ans.get("answer", "") if isinstance(ans, dict) else ans
            out.append(
                {"image": r[self.image_col], "question": r[self.question_col], "answer": ans}
            )
        return out


def open_source(dataset: str | Path, split: str) -> RowSource:
    """Local path (file, dir, glob) -> ParquetSource; anything else -> HubSource."""
    s = str(dataset)
    if Path(s).exists() or any(ch in s for ch in "*?["):
        return ParquetSource(s, split)
    if s.startswith((".", "/", "~")):
        raise FileNotFoundError(f"--dataset {s}: no such local path")
    return HubSource(s, split)


# ----------------------------------------------------------------------------------------------
# config and key


@dataclass
class BuildConfig:
    """Everything that determines the cache bytes (and so the key)."""

    dataset: str
    """Local Parquet file/dir/glob or hub dataset name."""
    split: str = "train"
    """Split (hub) or file-name filter (local: ``{split}-*.parquet`` / ``{split}/``; else all)."""
    seq_len: int = 8192
    """Maximum tokens per pack; longer samples are skipped (reason ``too_long``)."""
    buffer_size: int = 64
    """Best-fit buffer: candidates considered for each pack."""
    buckets: list[int] | None = None
    """Padded pack lengths (each <= seq_len); None = always pad to seq_len."""
    max_samples: int | None = None
    """Read at most this many input rows (reads = packed + skipped)."""
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD
    """Input rows per shard: the unit of resume, scale-out and atomic write."""
    model_path: str | None = None
    """Qwen3-VL processor directory; None = the offline processor."""
    max_image_pixels: int = 89_478_485
    """Decoded images above this many pixels are skipped (PIL's decompression-bomb limit)."""


def _versions() -> dict[str, str]:
    import PIL
    import tensordict
    import tokenizers
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tensordict": tensordict.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
    }


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def cache_key(
    config: BuildConfig, source_fingerprint: dict[str, Any], processor_fp: dict[str, Any]
) -> str:
    """sha256 over the format version, dataset fingerprint, split, processor/tokenizer fingerprint
    and every packing parameter (the model path itself is not in it: two copies of the same
    processor give the same key)."""
    cfg = asdict(config)
    cfg.pop("dataset")
    cfg.pop("model_path")
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dataset": source_fingerprint,
        "processor": processor_fp,
        "config": cfg,
    }
    return hashlib.sha256(_canonical(doc).encode()).hexdigest()


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.-]+", "-", s).strip("-")[:40] or "dataset"


def key_dir_name(config: BuildConfig, source_name: str, key: str) -> str:
    return (
        f"{_slug(source_name)}_{_slug(config.split)}_seq{config.seq_len}_buf{config.buffer_size}_"
        f"{key[:12]}"
    )


# ----------------------------------------------------------------------------------------------
# sample processing (runs in pool workers)

_W: dict[str, Any] = {}


def _worker_init(model_path: str | None, seq_len: int, max_image_pixels: int) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    from torchtitan_ext.vl.processor import load_processor

    _W["proc"] = load_processor(model_path)
    _W["seq_len"] = seq_len
    _W["max_image_pixels"] = max_image_pixels


def _is_skip(v: tuple) -> bool:
    return isinstance(v[0], str)


def _process_row(item: tuple[int, dict[str, Any]]) -> tuple[int, Any]:
    """(row, raw row) -> (row, (ids int32, mask uint8, pixels uint8, grid int32)) or
    (row, ("skip", reason, message))."""
    from torchtitan_ext.vl.processor import SampleError, decode_image, process_sample

    row, r = item
    try:
        img = r["image"]
        imgs = img if isinstance(img, list) else [img]
        if not imgs:
            raise SampleError("missing_image", "empty image list")
        pil = [decode_image(x, _W["max_image_pixels"]) for x in imgs]
        s = process_sample(
            _W["proc"],
            pil,
            r.get("question"),
            r.get("answer"),
            max_len=_W["seq_len"],
            positions=False,
        )
    except SampleError as e:
        return row, ("skip", e.reason, str(e))
    ids = s.input_ids.numpy().astype(np.int32)
    mask = (s.labels.numpy() != -100).astype(np.uint8)
    mask[0] = 0  # first token of each sample never a target (packing contract)
    return row, (ids, mask, s.pixel_u8.numpy(), s.image_grid_thw.numpy().astype(np.int32))


# ----------------------------------------------------------------------------------------------
# writer


class CacheLockedError(RuntimeError):
    """Another process holds the writer lock for this cache key (and rank)."""


@contextlib.contextmanager
def _flock(path: Path, blocking: bool, what: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CacheLockedError(
                    f"{what}: another process is writing this cache (lock {path} is held); "
                    "wait for it or use another --cache-dir"
                ) from None
            raise
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class _ShardResult:
    packs: int = 0
    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    images: int = 0
    patches: int = 0
    rows_read: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_rows: dict[str, list[int]] = field(default_factory=dict)


def _write_shard(
    out: Path,
    results: list[tuple[int, Any]],
    seq_len: int,
    buffer_size: int,
    buckets: list[int],
) -> dict[str, Any]:
    """Pack one shard's processed samples and write its TensorDict memmap into ``out``."""
    from tensordict import TensorDict

    from torchtitan_ext.vl.packing import best_fit_packs, bucket_length

    ok = [(row, v) for row, v in results if not (_is_skip(v))]
    st = _ShardResult(rows_read=len(results))
    for row, v in results:
        if _is_skip(v):
            st.skipped[v[1]] = st.skipped.get(v[1], 0) + 1
            st.skipped_rows.setdefault(v[1], [])
            if len(st.skipped_rows[v[1]]) < 5:
                st.skipped_rows[v[1]].append(row)
    lengths = [len(v[0]) for _, v in ok]
    packs = list(best_fit_packs(lengths, seq_len, buffer_size))
    order = [i for p in packs for i in p]
    n_s = len(order)
    tok = [ok[i][1][0] for i in order]
    msk = [ok[i][1][1] for i in order]
    pix = [ok[i][1][2] for i in order]
    grd = [ok[i][1][3] for i in order]
    offsets = np.zeros((len(packs) + 1, 4), dtype=np.int64)  # sample, token, image, patch
    pack_len = np.zeros(len(packs), dtype=np.int32)
    k = 0
    for j, p in enumerate(packs):
        sl = slice(k, k + len(p))
        nt = sum(len(t) for t in tok[sl])
        offsets[j + 1] = offsets[j] + (
            len(p),
            nt,
            sum(len(g) for g in grd[sl]),
            sum(len(x) for x in pix[sl]),
        )
        pack_len[j] = bucket_length(nt, buckets)
        k += len(p)

    def cat(xs: list[np.ndarray], dtype, shape_tail=()) -> torch.Tensor:
        if not xs:
            return torch.from_numpy(np.zeros((0, *shape_tail), dtype=dtype))
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(xs)).astype(dtype, copy=False))

    td = TensorDict(
        {
            "tokens": cat(tok, np.int32),
            "label_mask": cat(msk, np.uint8),
            "pixels": cat(pix, np.uint8, (_PATCH_DIM,)),
            "grid_thw": cat(grd, np.int32, (3,)),
            "sample_lens": torch.tensor([len(t) for t in tok], dtype=torch.int32),
            "sample_rows": torch.tensor([ok[i][0] for i in order], dtype=torch.int64),
            "pack_offsets": torch.from_numpy(offsets),
            "pack_len": torch.from_numpy(pack_len),
        },
        batch_size=[],
    )
    # Hash the tensors from memory (the .memmap files are their raw C-order bytes): re-reading
    # the files would cost ~2x more per 20 MB pack. verify() checks the files themselves.
    mem_hash = {
        f"{k}.memmap": (v.numel() * v.element_size(), hashlib.sha256(v.numpy().data).hexdigest())
        for k, v in td.items()
        if v.numel()
    }
    td.memmap_(str(out))
    st.packs, st.samples = len(packs), n_s
    st.tokens = int(offsets[-1, 1])
    st.padded_tokens = int(pack_len.sum())
    st.images, st.patches = int(offsets[-1, 2]), int(offsets[-1, 3])
    files = {}
    for f in sorted(out.iterdir()):
        size = f.stat().st_size
        if f.name in mem_hash and mem_hash[f.name][0] == size:
            files[f.name] = {"size": size, "sha256": mem_hash[f.name][1]}
        else:  # meta.json (or an unexpected file layout): hash what is on disk
            files[f.name] = {"size": size, "sha256": _sha256_file(f)}
    fills = (offsets[1:, 1] - offsets[:-1, 1]) / np.maximum(pack_len, 1)
    stats = asdict(st) | {
        "files": files,
        "pack_fill": [round(float(x), 6) for x in fills],
        "pack_samples": (offsets[1:, 0] - offsets[:-1, 0]).tolist(),
        "pack_images": (offsets[1:, 2] - offsets[:-1, 2]).tolist(),
        "pack_len": pack_len.tolist(),
    }
    with open(out / "stats.json", "w") as f:
        json.dump(stats, f, sort_keys=True)
        f.write("\n")
    return stats


def _shard_ranges(total: int, rows_per_shard: int) -> list[tuple[int, int]]:
    return [(a, min(a + rows_per_shard, total)) for a in range(0, total, rows_per_shard)]


def _dist_env(rank: int | None, world_size: int | None) -> tuple[int, int]:
    r = int(os.environ.get("RANK", 0)) if rank is None else rank
    w = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not (w >= 1 and 0 <= r < w):
        raise ValueError(f"bad RANK/WORLD_SIZE: {r}/{w}")
    return r, w


def _resolve(config: BuildConfig):
    from torchtitan_ext.vl.processor import load_processor, processor_fingerprint

    src = open_source(config.dataset, config.split)
    proc = load_processor(config.model_path)
    key = cache_key(config, src.fingerprint(), processor_fingerprint(proc))
    return src, proc, key


def _build_config(
    dataset: str | Path,
    split: str,
    seq_len: int,
    buffer_size: int,
    model_path: str | Path | None,
    buckets: Sequence[int] | None,
    max_samples: int | None,
    rows_per_shard: int,
) -> BuildConfig:
    """The :class:`BuildConfig` of ``find_cache`` / ``build_cache`` arguments (one place, so the
    two always compute the same cache key)."""
    from torchtitan_ext.vl.packing import normalize_buckets

    return BuildConfig(
        dataset=str(dataset),
        split=split,
        seq_len=int(seq_len),
        buffer_size=int(buffer_size),
        buckets=normalize_buckets(seq_len, buckets),
        max_samples=max_samples,
        rows_per_shard=int(rows_per_shard),
        model_path=None if model_path is None else str(model_path),
    )


def find_cache(
    dataset: str | Path,
    split: str,
    cache_dir: str | Path,
    seq_len: int,
    buffer_size: int,
    model_path: str | Path | None = None,
    buckets: Sequence[int] | None = None,
    max_samples: int | None = None,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
) -> Path | None:
    """The complete cache directory for these arguments, or None."""
    cfg = _build_config(
        dataset, split, seq_len, buffer_size, model_path, buckets, max_samples, rows_per_shard
    )
    src, _, key = _resolve(cfg)
    d = Path(cache_dir) / key_dir_name(cfg, src.name, key)
    return d if (d / "metadata.json").exists() else None


def build_cache(
    dataset: str | Path,
    split: str,
    cache_dir: str | Path,
    seq_len: int,
    buffer_size: int,
    model_path: str | Path | None = None,
    max_samples: int | None = None,
    num_workers: int = 0,
    strict: bool = False,
    force: bool = False,
    buckets: Sequence[int] | None = None,
    show_progress: bool = True,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    rank: int | None = None,
    world_size: int | None = None,
    wait_timeout: float | None = None,
) -> Path:
    """Build (or finish, or reuse) the cache for these arguments; returns the key directory.

    ``rank``/``world_size`` default to the ``RANK``/``WORLD_SIZE`` environment; every rank returns
    once ``metadata.json`` exists (``wait_timeout`` seconds at most, None = forever).
    ``strict``: the first bad row raises ``ValueError`` naming it instead of being skipped.
    """
    from torchtitan_ext.vl.processor import special_token_ids

    rank, world = _dist_env(rank, world_size)
    cfg = _build_config(
        dataset, split, seq_len, buffer_size, model_path, buckets, max_samples, rows_per_shard
    )
    if cfg.buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {cfg.buffer_size}")
    if cfg.rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {cfg.rows_per_shard}")
    src, proc, key = _resolve(cfg)
    kdir = Path(cache_dir) / key_dir_name(cfg, src.name, key)
    total = src.num_rows if max_samples is None else min(src.num_rows, int(max_samples))
    ranges = _shard_ranges(total, cfg.rows_per_shard)
    shards = kdir / "shards"
    if not force and (kdir / "metadata.json").exists():
        return kdir  # complete: no lock needed to read it (metadata.json is written last)
    with _flock(kdir.parent / f".{kdir.name}.rank{rank}of{world}.lock", False, str(kdir)):
        if force:
            for f in ("metadata.json", "packing_stats.json"):
                with contextlib.suppress(FileNotFoundError):
                    (kdir / f).unlink()
            for k in range(rank, len(ranges), world):
                shutil.rmtree(shards / f"{k:05d}", ignore_errors=True)
        if (kdir / "metadata.json").exists():
            return kdir
        shards.mkdir(parents=True, exist_ok=True)
        for t in shards.glob(f".tmp-*-r{rank}of{world}-*"):  # partial shards of a killed run
            shutil.rmtree(t, ignore_errors=True)
        mine = [
            k
            for k in range(rank, len(ranges), world)
            if not (shards / f"{k:05d}" / "stats.json").exists()
        ]
        _build_shards(
            cfg,
            src,
            mine,
            ranges,
            shards,
            num_workers,
            strict,
            show_progress,
            tag=f"r{rank}of{world}",
        )
    _finalize(kdir, cfg, src, proc, key, ranges, special_token_ids(proc), wait_timeout)
    return kdir


def _build_shards(cfg, src, mine, ranges, shards, num_workers, strict, show_progress, tag):
    from tqdm import tqdm

    from torchtitan_ext.vl.packing import normalize_buckets

    if not mine:
        return
    buckets = normalize_buckets(cfg.seq_len, cfg.buckets)
    n_rows = sum(ranges[k][1] - ranges[k][0] for k in mine)
    bar = tqdm(
        total=n_rows,
        unit="sample",
        desc=f"preprocess {tag}",
        disable=not show_progress,
        dynamic_ncols=True,
        smoothing=0.1,
    )
    pool = None
    init_args = (cfg.model_path, cfg.seq_len, cfg.max_image_pixels)
    if num_workers > 0:
        import multiprocessing as mp

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(num_workers, initializer=_worker_init, initargs=init_args)
    else:
        _worker_init(*init_args)
    skips = packs = 0

    def submit(k: int):
        a, b = ranges[k]
        items = list(zip(range(a, b), src.read(a, b), strict=True))
        return pool.imap(_process_row, items, chunksize=4) if pool else map(_process_row, items)

    try:
        pending = submit(mine[0])
        for n, k in enumerate(mine):
            results = []
            for row, v in pending:
                if _is_skip(v):
                    skips += 1
                    if strict:
                        raise ValueError(f"{cfg.dataset} row {row}: {v[2]} (--strict)")
                results.append((row, v))
                bar.update(1)
            # One shard of look-ahead: the pool works on shard k+1 while this process packs,
            # writes, hashes and fsyncs shard k (~0.1 s per 20 MB pack); memory stays bounded
            # to two shards.
            if n + 1 < len(mine):
                pending = submit(mine[n + 1])
            tmp = shards / f".tmp-{k:05d}-{tag}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            st = _write_shard(tmp, results, cfg.seq_len, cfg.buffer_size, buckets)
            packs += st["packs"]
            for f in tmp.iterdir():  # data must be on disk before the rename publishes it
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            try:
                os.replace(tmp, shards / f"{k:05d}")
            except OSError:
                # the target exists: a concurrent writer of the same shard finished first; the
                # content is deterministic, so keep theirs.
                shutil.rmtree(tmp, ignore_errors=True)
            _fsync_dir(shards)
            bar.set_postfix(packs=packs, skipped=skips, refresh=False)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        bar.close()


def _finalize(kdir, cfg, src, proc, key, ranges, special, wait_timeout) -> None:
    shards = kdir / "shards"
    t0 = time.monotonic()
    while True:
        with _flock(kdir / ".manifest.lock", True, str(kdir)):
            if (kdir / "metadata.json").exists():
                return
            if all((shards / f"{k:05d}" / "stats.json").exists() for k in range(len(ranges))):
                _write_manifest(kdir, cfg, src, proc, key, ranges, special)
                # partial shards left by killed runs of other rank layouts are garbage now
                for t in shards.glob(".tmp-*"):
                    shutil.rmtree(t, ignore_errors=True)
                return
        if wait_timeout is not None and time.monotonic() - t0 > wait_timeout:
            missing = [k for k in range(len(ranges)) if not (shards / f"{k:05d}").exists()]
            raise TimeoutError(f"{kdir}: shards {missing[:10]} still missing after {wait_timeout}s")
        time.sleep(0.5)


def _dist(xs: Sequence[float]) -> dict[str, float]:
    if not len(xs):
        return {"mean": 0.0, "min": 0.0, "p50": 0.0, "max": 0.0}
    a = np.asarray(xs, dtype=np.float64)
    return {
        "mean": round(float(a.mean()), 4),
        "min": round(float(a.min()), 4),
        "p50": round(float(np.median(a)), 4),
        "max": round(float(a.max()), 4),
    }


def _write_manifest(kdir, cfg, src, proc, key, ranges, special) -> None:
    from torchtitan_ext.vl.processor import ImageParams, processor_fingerprint

    shard_docs, files = [], {}
    tot = Counter()
    skipped: Counter = Counter()
    skipped_rows: dict[str, list[int]] = {}
    fill, spp, ipp, plen = [], [], [], []
    for k, (a, b) in enumerate(ranges):
        d = kdir / "shards" / f"{k:05d}"
        st = json.loads((d / "stats.json").read_text())
        for name, meta in st["files"].items():
            files[f"shards/{k:05d}/{name}"] = meta
        files[f"shards/{k:05d}/stats.json"] = {
            "size": (d / "stats.json").stat().st_size,
            "sha256": _sha256_file(d / "stats.json"),
        }
        for c in ("packs", "samples", "tokens", "padded_tokens", "images", "patches", "rows_read"):
            tot[c] += st[c]
        skipped.update(st["skipped"])
        for r, rows in st["skipped_rows"].items():
            skipped_rows.setdefault(r, [])
            skipped_rows[r] = (skipped_rows[r] + rows)[:5]
        fill += st["pack_fill"]
        spp += st["pack_samples"]
        ipp += st["pack_images"]
        plen += st["pack_len"]
        shard_docs.append(
            {
                "name": f"{k:05d}",
                "rows": [a, b],
                "packs": st["packs"],
                "samples": st["samples"],
                "tokens": st["tokens"],
                "patches": st["patches"],
            }
        )
    n_skip = sum(skipped.values())
    if tot["rows_read"] != tot["samples"] + n_skip:
        raise RuntimeError(
            f"{kdir}: counts do not reconcile: read {tot['rows_read']} != packed "
            f"{tot['samples']} + skipped {n_skip}"
        )
    stats = {
        "packs": tot["packs"],
        "rows_read": tot["rows_read"],
        "samples_packed": tot["samples"],
        "skipped_total": n_skip,
        "skipped": dict(sorted(skipped.items())),
        "skipped_example_rows": dict(sorted(skipped_rows.items())),
        "reconciles": True,
        "samples_per_pack": _dist(spp),
        "images_per_pack": _dist(ipp),
        "fill_pct": {k: round(v * 100, 2) for k, v in _dist(fill).items()},
        "tokens": tot["tokens"],
        "padded_tokens": tot["padded_tokens"],
        "images": tot["images"],
        "patches": tot["patches"],
        "bucket_counts": {str(b): c for b, c in sorted(Counter(plen).items())},
    }
    _write_json_atomic(kdir / "packing_stats.json", stats)
    files["packing_stats.json"] = {
        "size": (kdir / "packing_stats.json").stat().st_size,
        "sha256": _sha256_file(kdir / "packing_stats.json"),
    }
    cfg_doc = asdict(cfg)
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "key": key,
        "config": cfg_doc,
        "dataset_fingerprint": src.fingerprint(),
        "processor": processor_fingerprint(proc),
        "image_params": asdict(ImageParams.from_processor(proc)),
        "special_tokens": special,
        "versions": _versions(),
        "counts": {
            "packs": tot["packs"],
            "samples": tot["samples"],
            "rows_read": tot["rows_read"],
            "skipped": n_skip,
            "tokens": tot["tokens"],
            "padded_tokens": tot["padded_tokens"],
            "images": tot["images"],
            "patches": tot["patches"],
        },
        "storage": {
            "tokens": "int32",
            "label_mask": "uint8 (1 = target)",
            "pixels": "uint8 [P, 768]",
            "grid_thw": "int32 [I, 3]",
            "position_ids": "computed at read (not stored)",
            "padding": "added at read to pack_len",
        },
        "shards": shard_docs,
        "files": dict(sorted(files.items())),
    }
    _write_json_atomic(kdir / "metadata.json", meta)
    _fsync_dir(kdir)


# ----------------------------------------------------------------------------------------------
# reader


class VLCache:
    """Read-only view of a complete cache: ``len``, ``pack(i)``, ``pack_shape(i)``, ``verify()``.

    Opening reads metadata.json and memory-maps the shards (no pixel bytes are read).
    """

    def __init__(self, path: Path, metadata: dict[str, Any]):
        from tensordict import TensorDict

        self.path = path
        self.metadata = metadata
        self.special_tokens: dict[str, int] = dict(metadata["special_tokens"])
        ip = metadata["image_params"]
        self.spatial_merge_size = int(ip["merge_size"])
        self.image_params = ip
        self._shards = []
        counts = []
        for s in metadata["shards"]:
            td = TensorDict.load_memmap(str(path / "shards" / s["name"]))
            self._shards.append(td)
            counts.append(int(s["packs"]))
        self._starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self._n = int(self._starts[-1])
        # small per-pack arrays, read eagerly (K+1 x 4 int64 + K int32 per shard)
        self._offsets = [td["pack_offsets"].numpy() for td in self._shards]
        self._pack_len = [td["pack_len"].numpy() for td in self._shards]

    @classmethod
    def open(cls, path: str | Path) -> VLCache:
        p = Path(path)
        mf = p / "metadata.json"
        if not mf.exists():
            raise FileNotFoundError(f"{p}: no metadata.json (not a complete VL cache)")
        try:
            meta = json.loads(mf.read_text())
        except ValueError as e:
            raise ValueError(f"{mf}: not valid JSON ({e})") from None
        if meta.get("format") != FORMAT_NAME or meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{mf}: format {meta.get('format')} v{meta.get('format_version')} is not "
                f"{FORMAT_NAME} v{FORMAT_VERSION}; rebuild with --force"
            )
        return cls(p, meta)

    def __len__(self) -> int:
        return self._n

    def _locate(self, i: int) -> tuple[int, int]:
        if not -self._n <= i < self._n:
            raise IndexError(f"pack {i} out of range (cache has {self._n} packs)")
        i %= self._n
        s = bisect.bisect_right(self._starts, i) - 1
        return s, i - int(self._starts[s])

    def pack_shape(self, i: int) -> int:
        """Padded length L of pack i (its bucket)."""
        s, j = self._locate(i)
        return int(self._pack_len[s][j])

    def pack_lengths(self) -> np.ndarray:
        """Padded lengths of all packs (int64 [len])."""
        if not self._pack_len:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(self._pack_len).astype(np.int64)

    def pack(self, i: int, copy_pixels: bool = True) -> dict[str, torch.Tensor]:
        """Pack i as tensors (see VL-CONTRACT.md).

        ``copy_pixels=False`` returns ``pixel_u8`` as a zero-copy view of the shared file mapping
        (for a consumer that copies it straight into a pinned buffer); never modify such a view
        in place -- it would write into the cache file. The default returns a private copy.
        """
        from torchtitan_ext.vl.processor import position_rows

        s, j = self._locate(i)
        td, o = self._shards[s], self._offsets[s]
        (s0, t0, i0, p0), (s1, t1, i1, p1) = o[j].tolist(), o[j + 1].tolist()
        L = int(self._pack_len[s][j])
        lens = td["sample_lens"][s0:s1].numpy()
        tok = td["tokens"][t0:t1].numpy().astype(np.int64)
        mask = td["label_mask"][t0:t1].numpy().astype(bool)
        grid = td["grid_thw"][i0:i1].numpy().astype(np.int64)
        n = t1 - t0
        ids = np.full(L, self.special_tokens["pad_id"], dtype=np.int64)
        ids[:n] = tok
        labels = np.full(L, -100, dtype=np.int64)
        labels[:n] = np.where(mask, tok, -100)
        pos = np.zeros((4, L), dtype=np.int64)
        img_pad = self.special_tokens["image_pad_id"]
        a, gi = 0, 0
        for ln in lens.tolist():
            seg = tok[a : a + ln]
            n_img = int(
                np.count_nonzero(
                    np.diff(np.concatenate(([0], (seg == img_pad).view(np.int8)))) == 1
                )
            )
            labels[a] = -100
            pos[:, a : a + ln] = position_rows(
                seg, grid[gi : gi + n_img], img_pad, self.spatial_merge_size
            )
            a += ln
            gi += n_img
        pixels = td["pixels"][p0:p1].as_subclass(torch.Tensor)  # plain tensor, not the subclass
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(pos),
            "seq_lens": torch.from_numpy(lens.astype(np.int32)),
            # numpy's copy: torch's clone of a file-backed tensor measured ~20 ms per 1.5 MB here
            "pixel_u8": torch.from_numpy(pixels.numpy().copy()) if copy_pixels else pixels,
            "image_grid_thw": torch.from_numpy(grid),
            "num_tokens": torch.tensor(n, dtype=torch.int64),
        }

    def pack_rows(self, i: int) -> list[int]:
        """Input row index of each sample of pack i."""
        s, j = self._locate(i)
        o = self._offsets[s]
        return self._shards[s]["sample_rows"][int(o[j, 0]) : int(o[j + 1, 0])].tolist()

    def verify(self) -> list[str]:
        """Check every recorded file's size and sha256, and the index; [] when OK."""
        problems = []
        for rel, meta in self.metadata["files"].items():
            f = self.path / rel
            if not f.exists():
                problems.append(f"{rel}: missing (recorded {meta['size']} bytes)")
                continue
            size = f.stat().st_size
            if size != meta["size"]:
                problems.append(
                    f"{rel}: size {size} bytes != recorded {meta['size']} (truncated or appended)"
                )
                continue
            if _sha256_file(f) != meta["sha256"]:
                problems.append(f"{rel}: sha256 mismatch (content corrupted, size unchanged)")
        for k, s in enumerate(self.metadata["shards"]):
            o = self._offsets[k]
            if len(o) != s["packs"] + 1 or int(o[-1, 1]) != s["tokens"]:
                problems.append(f"shards/{s['name']}: pack index disagrees with metadata.json")
        return problems
