"""Writing the packed VL cache (format: ``vl/cache.py``): rows in, shard directories out (the
manifest that commits them: ``vl/manifest.py``). No processor and no source here, so a benchmark
or a test can write a real-layout cache from synthetic rows with exactly the code a build uses.

* :func:`write_shard` packs one shard's rows (best fit, the buffer restarts per shard) and writes
  its TensorDict memmap, ``stats.json`` and checksums into a temporary directory;
  :func:`publish_shard` fsyncs it and renames it into place (the rename is the shard's commit).
* :func:`~torchtitan_ext.vl.manifest.write_manifest` (``vl/manifest.py``) then commits the
  cache: ``packing_stats.json`` and ``metadata.json`` from every shard's ``stats.json``.

Rows travel as :class:`ProcessedRow` (a sample's arrays) or :class:`Skip` (a counted reason).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan_ext.data.cachedir import sha256_file
from torchtitan_ext.vl.format import (
    COLUMNS,
    SHARD_META,
    SHARD_STATS,
    column_shape,
    shard_meta_problem,
    shard_meta_template,
)

SKIP_EXAMPLES = 5
"""Rows kept per skip reason as examples in the stats."""


@dataclass
class ProcessedRow:
    """One input row, processed: what its sample stores in a shard."""

    row: int
    tokens: np.ndarray
    """int32 [n] content token ids."""
    label_mask: np.ndarray
    """uint8 [n], 1 = a target token (the first token of a sample is never one)."""
    pixels: np.ndarray
    """uint8 [patches, 3 * patch_size**2] in the processor's row order."""
    grid_thw: np.ndarray
    """int32 [images, 3]."""
    turns_dropped: int = 0
    """Trailing turns cut off to fit ``seq_len`` (``truncate``); 0: the whole row."""
    video_pixels: np.ndarray | None = None
    """uint8 [video patches, 3 * temporal_patch_size * patch_size**2] (``vl/video.py``'s rows),
    videos in token order; None: no video."""
    video_grid_thw: np.ndarray | None = None
    """int32 [videos, 3]; None: no video."""

    @property
    def n_videos(self) -> int:
        return 0 if self.video_grid_thw is None else len(self.video_grid_thw)

    @property
    def n_video_patches(self) -> int:
        return 0 if self.video_pixels is None else len(self.video_pixels)


@dataclass
class Skip:
    """One input row that is not in the cache, and why (counted under ``reason``)."""

    row: int
    reason: str
    message: str
    error_type: str | None = None
    """The exception's class for ``decode_error`` / ``processor_error``."""


@dataclass
class _ShardCounts:
    packs: int = 0
    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    images: int = 0
    patches: int = 0
    videos: int = 0
    video_patches: int = 0
    text_only: int = 0
    """Samples with neither an image nor a video."""
    rows_read: int = 0
    truncated: int = 0
    turns_dropped: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_rows: dict[str, list[int]] = field(default_factory=dict)
    skipped_errors: dict[str, dict[str, int]] = field(default_factory=dict)

    def skip(self, s: Skip) -> None:
        self.skipped[s.reason] = self.skipped.get(s.reason, 0) + 1
        rows = self.skipped_rows.setdefault(s.reason, [])
        if len(rows) < SKIP_EXAMPLES:
            rows.append(s.row)
        if s.error_type:
            types = self.skipped_errors.setdefault(s.reason, {})
            types[s.error_type] = types.get(s.error_type, 0) + 1


def _pack_order(
    ok: list[ProcessedRow], seq_len: int, buffer_size: int, buckets: list[int], store: bool
) -> tuple[list[ProcessedRow], np.ndarray, np.ndarray, np.ndarray]:
    """Samples in pack order, pack offsets [K+1, 4] (sample, token, image, patch), padded
    lengths [K] and video offsets [K+1, 2] (video, video patch). ``store``: every sample its
    own unpadded "pack", in row order."""
    from torchtitan_ext.vl.packing import best_fit_packs, bucket_length

    if store:
        packs = [[i] for i in range(len(ok))]
    else:
        packs = list(best_fit_packs([len(r.tokens) for r in ok], seq_len, buffer_size))
    order = [ok[i] for p in packs for i in p]
    offsets = np.zeros((len(packs) + 1, 4), dtype=np.int64)
    voffsets = np.zeros((len(packs) + 1, 2), dtype=np.int64)
    pack_len = np.zeros(len(packs), dtype=np.int32)
    k = 0
    for j, p in enumerate(packs):
        rows = order[k : k + len(p)]
        nt = sum(len(r.tokens) for r in rows)
        offsets[j + 1] = offsets[j] + (
            len(p),
            nt,
            sum(len(r.grid_thw) for r in rows),
            sum(len(r.pixels) for r in rows),
        )
        voffsets[j + 1] = voffsets[j] + (
            sum(r.n_videos for r in rows),
            sum(r.n_video_patches for r in rows),
        )
        pack_len[j] = nt if store else bucket_length(nt, buckets)
        k += len(p)
    return order, offsets, pack_len, voffsets


def write_shard(
    out: Path,
    rows: Sequence[ProcessedRow | Skip],
    seq_len: int,
    buffer_size: int,
    buckets: list[int],
    patch_dim: int,
    *,
    store: bool = False,
    video_dim: int | None = None,
) -> dict[str, Any]:
    """Pack one shard's rows and write its TensorDict memmap + ``stats.json`` into ``out``.
    ``store``: a sample store's shard: one unpadded sample per pack entry, in row order (the
    same columns, so the same checks, ``verify`` and ``inspect-cache`` apply). ``video_dim``:
    the video row width (default ``2 * patch_dim``: a temporal patch of 2)."""
    from tensordict import TensorDict

    counts = _ShardCounts(rows_read=len(rows))
    ok = []
    for r in rows:
        if isinstance(r, Skip):
            counts.skip(r)
        else:
            ok.append(r)
            counts.truncated += r.turns_dropped > 0
            counts.turns_dropped += r.turns_dropped
            counts.text_only += len(r.grid_thw) == 0 and r.n_videos == 0
    order, offsets, pack_len, voffsets = _pack_order(ok, seq_len, buffer_size, buckets, store)
    video_dim = 2 * patch_dim if video_dim is None else video_dim
    vids = [r for r in order if r.n_videos]

    def cat(xs: list[np.ndarray], dtype, tail=()) -> torch.Tensor:
        if not xs:
            return torch.from_numpy(np.zeros((0, *tail), dtype=dtype))
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(xs)).astype(dtype, copy=False))

    td = TensorDict(
        {
            "tokens": cat([r.tokens for r in order], np.int32),
            "label_mask": cat([r.label_mask for r in order], np.uint8),
            "pixels": cat([r.pixels for r in order], np.uint8, (patch_dim,)),
            "grid_thw": cat([r.grid_thw for r in order], np.int32, (3,)),
            "sample_lens": torch.tensor([len(r.tokens) for r in order], dtype=torch.int32),
            "sample_rows": torch.tensor([r.row for r in order], dtype=torch.int64),
            "pack_offsets": torch.from_numpy(offsets),
            "pack_len": torch.from_numpy(pack_len),
            "video_pixels": cat([r.video_pixels for r in vids], np.uint8, (video_dim,)),
            "video_grid_thw": cat([r.video_grid_thw for r in vids], np.int32, (3,)),
            "video_offsets": torch.from_numpy(voffsets if vids else voffsets[:0]),
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
    counts.packs, counts.samples = len(pack_len), len(order)
    counts.tokens = int(offsets[-1, 1])
    counts.padded_tokens = int(pack_len.sum())
    counts.images, counts.patches = int(offsets[-1, 2]), int(offsets[-1, 3])
    counts.videos, counts.video_patches = int(voffsets[-1, 0]), int(voffsets[-1, 1])
    _check_meta_json(out, asdict(counts), patch_dim, video_dim)
    files = {}
    for f in sorted(out.iterdir()):
        size = f.stat().st_size
        if f.name in mem_hash and mem_hash[f.name][0] == size:
            files[f.name] = {"size": size, "sha256": mem_hash[f.name][1]}
        else:  # meta.json (or an unexpected file layout): hash what is on disk
            files[f.name] = {"size": size, "sha256": sha256_file(f)}
    fills = (offsets[1:, 1] - offsets[:-1, 1]) / np.maximum(pack_len, 1)
    stats = asdict(counts) | {
        "files": files,
        "pack_fill": [round(float(x), 6) for x in fills],
        "pack_samples": (offsets[1:, 0] - offsets[:-1, 0]).tolist(),
        "pack_images": (offsets[1:, 2] - offsets[:-1, 2]).tolist(),
        "pack_videos": (voffsets[1:, 0] - voffsets[:-1, 0]).tolist(),
        "pack_len": pack_len.tolist(),
    }
    with open(out / SHARD_STATS, "w") as f:
        json.dump(stats, f, sort_keys=True)
        f.write("\n")
    return stats


def _check_meta_json(out: Path, counts: dict[str, Any], patch_dim: int, video_dim: int) -> None:
    """tensordict wrote exactly our columns (the format holds no NonTensorData)."""
    doc = json.loads((out / SHARD_META).read_text())
    shapes = {c.name: column_shape(c, counts, patch_dim, video_dim) for c in COLUMNS}
    problem = shard_meta_problem(doc, shapes, shard_meta_template(doc))
    if problem:
        raise RuntimeError(f"{out / SHARD_META}: {problem} (tensordict wrote an unexpected layout)")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_shard(tmp: Path, final: Path) -> bool:
    """fsync a written shard and rename it into place; False (and ``tmp`` removed) when
    ``final`` already exists (content is deterministic: keep the one that is there)."""
    for f in tmp.iterdir():  # data must be on disk before the rename publishes it
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    finally:
        fsync_dir(final.parent)
    return True


JSON_TMP_PREFIX = ".tmp-json-"
"""Temporary files of :func:`write_json_atomic` start with this (so stray ones are found)."""


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{JSON_TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
