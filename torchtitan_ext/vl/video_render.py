"""Draw a pack's videos: patch rows back to frames, frames as a captioned strip.

A pack may carry ``video_u8`` uint8 [N, C*T*P*P] and ``video_grid_thw`` [n_vid, 3]
(``vl/video_batch.py``). :func:`video_frames` is the exact inverse of
:func:`~torchtitan_ext.vl.video.patchify_video`: it gives back the resized frames the processor
patchified (the temporal padding frame included), so the picture is what the model sees.

The timestamps shown are the ones the model reads: the ``<t seconds>`` text the prompt puts
before each merged frame (``VideoPatches.placeholder``), found in the pack's tokens by
:func:`timestamps_in_tokens` (a tokenizer is needed to read them; without one the frames are
numbered instead). A video's merged frames are its ``grid_thw[0]`` runs of ``<|video_pad|>``
tokens, in token order (``vl/positions.py`` places them the same way).

Used by ``vl/render.py`` (``inspect-cache --render``, ``peek --render``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

VIDEO_COLOR = (215, 60, 110)
"""Token strip colour of ``<|video_pad|>`` tokens."""

_PATCHIFY_AXES = (0, 2, 5, 3, 6, 8, 1, 4, 7)  # vl.video.patchify_video's transpose
_UNPATCHIFY_AXES = tuple(int(i) for i in np.argsort(_PATCHIFY_AXES))
_SECONDS = re.compile(r"<(\d+(?:\.\d+)?) seconds>")


def video_frames(
    rows: np.ndarray, grid: Sequence[int], patch: int = 16, merge: int = 2, temporal: int = 2
) -> np.ndarray:
    """uint8 video rows [gt*gh*gw, 3*temporal*patch²] (``vl.video`` row order) -> the frames
    uint8 [gt*temporal, gh*patch, gw*patch, 3]; the exact inverse of ``patchify_video``."""
    gt, gh, gw = (int(x) for x in grid)
    width = 3 * temporal * patch * patch
    if rows.ndim != 2 or rows.shape != (gt * gh * gw, width) or gh % merge or gw % merge:
        raise ValueError(
            f"video rows {tuple(rows.shape)} do not fit grid ({gt}, {gh}, {gw}) with patch "
            f"{patch}, merge {merge}, temporal {temporal} (expected [{gt * gh * gw}, {width}])"
        )
    a = rows.reshape(gt, gh // merge, gw // merge, merge, merge, 3, temporal, patch, patch)
    a = a.transpose(_UNPATCHIFY_AXES)  # (gt, tp, gh/m, m, ps, gw/m, m, ps, C)
    return np.ascontiguousarray(a).reshape(gt * temporal, gh * patch, gw * patch, 3)


def pack_videos(
    pack: Mapping[str, Any], patch: int = 16, merge: int = 2, temporal: int = 2
) -> list[np.ndarray]:
    """Every video of a pack as frames (:func:`video_frames`), in token order; [] without
    video keys. ``video_grid_thw`` must account for every row of ``video_u8``."""
    if "video_grid_thw" not in pack:
        return []
    grids = np.asarray(pack["video_grid_thw"]).reshape(-1, 3)
    rows = np.asarray(pack["video_u8"])
    need = int(grids.prod(axis=1).sum())
    if need != rows.shape[0]:
        raise ValueError(
            f"video_grid_thw accounts for {need} patches but video_u8 has {rows.shape[0]}"
        )
    out, off = [], 0
    for g in grids:
        n = int(np.prod(g))
        out.append(video_frames(rows[off : off + n], g, patch, merge, temporal))
        off += n
    return out


def token_runs(ids: np.ndarray, token: int) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of ``token`` in ``ids``."""
    m = np.concatenate(([0], (np.asarray(ids) == token).view(np.int8), [0]))
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def timestamps_in_tokens(
    ids: np.ndarray, runs: Sequence[tuple[int, int]], decode: Callable[[list[int]], str]
) -> list[float | None]:
    """Per video-pad run, the seconds of the ``<t seconds>`` text right before it (within the 16
    tokens after the previous run); None where there is none."""
    out: list[float | None] = []
    prev = 0
    for a, b in runs:
        window = [int(t) for t in ids[max(prev, a - 16) : a]]
        found = _SECONDS.findall(decode(window)) if window else []
        out.append(float(found[-1]) if found else None)
        prev = b
    return out


@dataclass
class PackVideo:
    """One video of a pack, ready to draw."""

    frames: np.ndarray
    """uint8 [T, H, W, 3], T = grid_thw[0] * temporal (padding frame included)."""
    grid_thw: tuple[int, int, int]
    sample: int
    """Index of the pack's sample the video belongs to (-1: its tokens were not found)."""
    number: int
    """Its place among that sample's videos."""
    token_start: int
    """Pack position of its first ``<|video_pad|>`` token (-1: not found)."""
    timestamps: list[float | None]
    """Seconds per merged frame as the prompt writes them (None: unknown)."""


def pack_video_list(
    pack: Mapping[str, Any],
    video_pad_id: int,
    params: Mapping[str, Any],
    decode: Callable[[list[int]], str] | None = None,
) -> list[PackVideo]:
    """The pack's videos with the sample they belong to and their timestamps. ``params``: the
    cache's ``image_params`` (``patch_size``, ``merge_size``, ``temporal_patch_size``)."""
    frames = pack_videos(
        pack,
        int(params.get("patch_size", 16)),
        int(params.get("merge_size", 2)),
        int(params.get("temporal_patch_size", 2)),
    )
    if not frames:
        return []
    ids = np.asarray(pack["input_ids"])
    ends = np.cumsum(np.asarray(pack["seq_lens"]))
    runs = token_runs(ids, video_pad_id)
    stamps = timestamps_in_tokens(ids, runs, decode) if decode is not None else [None] * len(runs)
    grids = np.asarray(pack["video_grid_thw"]).reshape(-1, 3)
    out, r, seen = [], 0, {}
    for f, g in zip(frames, grids, strict=True):
        t = int(g[0])
        mine = runs[r : r + t]
        start = mine[0][0] if mine else -1
        sample = int(np.searchsorted(ends, start, side="right")) if mine else -1
        number = seen.get(sample, 0)
        seen[sample] = number + 1
        ts = (stamps[r : r + t] + [None] * t)[:t]
        out.append(PackVideo(f, (t, int(g[1]), int(g[2])), sample, number, start, ts))
        r += t
    return out


def _caption(ts: float | None, k: int) -> str:
    return f"{ts:.1f} s" if ts is not None else f"#{k}"


def frame_thumbnail(frame: np.ndarray, box: int) -> Image.Image:
    """uint8 [H, W, 3] -> a picture whose longer side is at most ``box`` (bilinear; a frame that
    fits is drawn as it is)."""
    im = Image.fromarray(frame)
    h, w = frame.shape[:2]
    s = min(1.0, box / max(h, w))
    return im if s == 1 else im.resize((max(1, round(w * s)), max(1, round(h * s))), Image.BILINEAR)


def video_panel(
    video: PackVideo, max_width: int, frame_box: int = 96, max_pairs: int = 48
) -> Image.Image:
    """A video as one picture: a header (``s<sample> video #<k> T x H x W``), then its frames in
    rows, the ``temporal`` frames of each merged frame side by side under one caption (its
    timestamp, or ``#k`` when unknown); at most ``max_pairs`` merged frames, the rest counted."""
    frames = video.frames
    gt = video.grid_thw[0]
    tp = max(1, len(frames) // max(gt, 1))
    h, w = frames.shape[1:3]
    fw, fh = frame_thumbnail(frames[0], frame_box).size
    pair_w = tp * (fw + 2) + 10
    per_row = max(1, (max_width - 4) // pair_w)
    shown = min(gt, max_pairs)
    rows = max(1, -(-shown // per_row))
    cell_h = fh + 16
    panel = Image.new("RGB", (max_width, 16 + rows * cell_h + (14 if shown < gt else 0)), "white")
    d = ImageDraw.Draw(panel)
    who = f"s{video.sample} video #{video.number}" if video.sample >= 0 else "video"
    d.text(
        (0, 0),
        f"{who}: {gt} merged frames x {tp} ({len(frames)} frames), {h}x{w} px, "
        f"grid {gt}x{video.grid_thw[1]}x{video.grid_thw[2]}",
        fill="black",
    )
    for k in range(shown):
        r, c = divmod(k, per_row)
        x, y = c * pair_w, 16 + r * cell_h
        for j in range(tp):
            panel.paste(frame_thumbnail(frames[k * tp + j], frame_box), (x + j * (fw + 2), y))
        d.text((x, y + fh + 1), _caption(video.timestamps[k], k), fill=VIDEO_COLOR)
    if shown < gt:
        d.text((0, 16 + rows * cell_h), f"... {gt - shown} more merged frames", fill="black")
    return panel
