"""mRoPE position rows of one unpacked Qwen3-VL sample, computed without the model's weights.

``mrope_positions`` re-implements ``Qwen3VLModel.get_rope_index`` (transformers 5.23) for one
sample: text runs advance by their length, an image of llm grid (t, h, w) gets t/h/w meshgrid
positions offset by the running position, which then advances by ``max(h, w)``. It needs only
``spatial_merge_size``, no weights (equality with the real method is tested, several images in
one sample included).

Videos (``<|video_pad|>`` runs, ``video_grid_thw``): ``get_rope_index`` first splits each video
grid (t, h, w) into t frame grids (1, h, w) (``repeat_interleave`` over t), because the prompt
puts a timestamp and vision end/start between merged frames; each frame's run of video tokens is
then placed like an image of grid (1, h, w). Image and video runs take their grids from their
own lists, each in token order (:func:`frame_grids`, :func:`vision_run_grids`).
"""

from __future__ import annotations

import numpy as np

from torchtitan_ext.vl.errors import SampleError

TEXT, IMAGE, VIDEO = 0, 1, 2
"""Token kinds, as ``get_rope_index``'s ``mm_token_type_ids`` numbers them."""


def frame_grids(video_grid_thw: np.ndarray | None) -> np.ndarray:
    """One (1, h, w) row per merged frame of every video: ``get_rope_index``'s
    ``repeat_interleave(video_grid_thw, t)`` with t set to 1."""
    g = np.asarray(video_grid_thw if video_grid_thw is not None else [], dtype=np.int64)
    g = g.reshape(-1, 3)
    out = np.repeat(g, g[:, 0], axis=0)
    out[:, 0] = 1
    return out


def token_kinds(ids: np.ndarray, image_pad_id: int, video_pad_id: int | None) -> np.ndarray:
    """int8 [L]: TEXT, IMAGE or VIDEO per token (``mm_token_type_ids``)."""
    kind = (ids == image_pad_id).astype(np.int8)  # IMAGE is 1, TEXT 0
    if video_pad_id is not None:
        kind[ids == video_pad_id] = VIDEO
    return kind


def vision_runs(kind: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of every run of one vision kind. A run ends where the kind changes or a
    sample begins (``first``: bool [L], True at each sample's first token), so an image run
    that meets a video run, or a run that meets the next sample's, stays two runs."""
    n = kind.shape[0]
    vis = kind != TEXT
    # starts_run[i]: token i is a sample's first or differs in kind from token i - 1
    starts_run = first.copy()
    np.logical_or(starts_run[1:], kind[1:] != kind[:-1], out=starts_run[1:])
    if n:
        starts_run[0] = True
    ends_run = np.empty(n, dtype=bool)  # token i + 1 starts a run (or there is none)
    ends_run[:-1] = starts_run[1:]
    ends_run[-1:] = True
    start = np.flatnonzero(vis & starts_run)
    end = np.flatnonzero(vis & ends_run) + 1
    return start, end


def vision_run_grids(
    run_kind: np.ndarray, grid_thw: np.ndarray, video_grid_thw: np.ndarray | None
) -> np.ndarray:
    """The grid [n_runs, 3] of each vision run in token order: image runs take ``grid_thw``'s
    rows in order, video runs take :func:`frame_grids`' rows in order. Counts that disagree
    raise ``SampleError("placeholder_mismatch")``."""
    img = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    is_vid = run_kind == VIDEO
    n_img, n_vid = int((~is_vid).sum()), int(is_vid.sum())
    if n_img != len(img):
        raise SampleError("placeholder_mismatch", f"{n_img} image token runs but {len(img)} images")
    if n_vid == 0 and (video_grid_thw is None or len(video_grid_thw) == 0):
        return img  # no video: the common case, kept cheap
    frames = frame_grids(video_grid_thw)
    if n_vid != len(frames):
        n_videos = 0 if video_grid_thw is None else len(np.asarray(video_grid_thw).reshape(-1, 3))
        raise SampleError(
            "placeholder_mismatch",
            f"{n_vid} video token runs but {len(frames)} video frames ({n_videos} videos)",
        )
    out = np.empty((len(run_kind), 3), dtype=np.int64)
    out[~is_vid] = img
    out[is_vid] = frames
    return out


def mrope_positions(
    input_ids: np.ndarray,
    grid_thw: np.ndarray,
    image_pad_id: int,
    spatial_merge_size: int,
    *,
    video_grid_thw: np.ndarray | None = None,
    video_pad_id: int | None = None,
) -> np.ndarray:
    """3 mRoPE rows [3, L] of one unpacked sample, as ``Qwen3VLModel.get_rope_index`` computes them.

    Text runs: positions continue from the running position on all 3 rows. Vision run with grid
    (t, h, w) -> llm grid (t, h/m, w/m): rows = (start + t_idx, start + h_idx, start + w_idx) over a
    meshgrid in (t, h, w) order; afterwards the running position advances by ``max(h, w) / m``.
    A video is one such run per merged frame, each of grid (1, h, w) (module docstring).
    """
    ids = np.asarray(input_ids)
    n = ids.shape[0]
    out = np.empty((3, n), dtype=np.int64)
    kind = token_kinds(ids, image_pad_id, video_pad_id)
    first = np.zeros(n, dtype=bool)
    first[:1] = True
    starts, ends = vision_runs(kind, first)
    grids = vision_run_grids(kind[starts], grid_thw, video_grid_thw)
    pos, prev = 0, 0
    ms = spatial_merge_size
    for s, e, (t, h, w) in zip(starts.tolist(), ends.tolist(), grids.tolist(), strict=True):
        tl = s - prev
        out[:, prev:s] = np.arange(pos, pos + tl, dtype=np.int64)
        pos += tl
        lt, lh, lw = t, h // ms, w // ms
        if e - s != lt * lh * lw:
            raise SampleError(
                "placeholder_mismatch",
                f"{_KIND_NAME[int(kind[s])]} run of {e - s} tokens, grid {t}x{h}x{w} needs "
                f"{lt * lh * lw}",
            )
        out[0, s:e] = np.repeat(np.arange(lt, dtype=np.int64), lh * lw) + pos
        out[1, s:e] = np.tile(np.repeat(np.arange(lh, dtype=np.int64), lw), lt) + pos
        out[2, s:e] = np.tile(np.arange(lw, dtype=np.int64), lt * lh) + pos
        pos += max(h, w) // ms
        prev = e
    out[:, prev:] = np.arange(pos, pos + n - prev, dtype=np.int64)
    return out


_KIND_NAME = {IMAGE: "image", VIDEO: "video"}


def position_rows(
    input_ids: np.ndarray,
    grid_thw: np.ndarray,
    image_pad_id: int,
    spatial_merge_size: int,
    *,
    video_grid_thw: np.ndarray | None = None,
    video_pad_id: int | None = None,
) -> np.ndarray:
    """The 4 position rows [4, L]: row 0 = arange(L), rows 1..3 = ``mrope_positions``."""
    ids = np.asarray(input_ids)
    out = np.empty((4, ids.shape[0]), dtype=np.int64)
    out[0] = np.arange(ids.shape[0])
    out[1:] = mrope_positions(
        ids,
        grid_thw,
        image_pad_id,
        spatial_merge_size,
        video_grid_thw=video_grid_thw,
        video_pad_id=video_pad_id,
    )
    return out


def pack_position_rows(
    tokens: np.ndarray,
    sample_lens: np.ndarray,
    grid_thw: np.ndarray,
    image_pad_id: int,
    spatial_merge_size: int,
    *,
    video_grid_thw: np.ndarray | None = None,
    video_pad_id: int | None = None,
) -> np.ndarray:
    """The 4 position rows [4, n] of several samples laid end to end: for each sample exactly
    ``position_rows`` of that sample alone (row 0 restarts at 0, the mRoPE rows restart at 0),
    with ``grid_thw`` holding every image's grid and ``video_grid_thw`` every video's, each in
    token order.

    Why not a loop over samples: an 8k-token pack holds ~20 samples, and ~15 small numpy calls
    per sample cost ~100 us each (2.3 ms per pack, as much as copying its 20 MB of pixels); here
    the whole pack is a dozen array passes. The rule, per sample: a running position starts at
    0; a text token takes it and advances it by 1; a vision run (an image, or one merged frame of
    a video) of llm grid (t, h, w) takes ``start + (t_idx, h_idx, w_idx)`` over a (t, h, w)
    meshgrid and then advances it by ``max(h, w)`` (``mrope_positions``, itself checked against
    transformers' ``get_rope_index``). So a token's position = (sum of the increments of the
    tokens before it in its sample) + its grid offset, an exclusive cumulative sum restarted per
    sample.
    """
    ids = np.asarray(tokens)
    n = ids.shape[0]
    lens = np.asarray(sample_lens, dtype=np.int64)
    if int(lens.sum()) != n:
        raise ValueError(f"sample lengths sum to {int(lens.sum())}, tokens are {n}")
    starts = np.cumsum(lens) - lens  # each sample's first token
    sample_of = np.repeat(np.arange(len(lens)), lens)
    out = np.empty((4, n), dtype=np.int64)
    if n == 0:
        return out
    out[0] = np.arange(n, dtype=np.int64) - starts[sample_of]
    kind = token_kinds(ids, image_pad_id, video_pad_id)
    first = np.zeros(n, dtype=bool)
    first[starts[lens > 0]] = True
    run_start, run_end = vision_runs(kind, first)  # never crossing a sample boundary
    grid = vision_run_grids(kind[run_start], grid_thw, video_grid_thw)
    ms = spatial_merge_size
    lt, lh, lw = grid[:, 0], grid[:, 1] // ms, grid[:, 2] // ms
    run_len = run_end - run_start
    bad = np.flatnonzero(run_len != lt * lh * lw)
    if len(bad):
        k = int(bad[0])
        raise SampleError(
            "placeholder_mismatch",
            f"{_KIND_NAME[int(kind[run_start[k]])]} run of {int(run_len[k])} tokens, grid "
            f"{lt[k]}x{int(grid[k, 1])}x{int(grid[k, 2])} needs {int(lt[k] * lh[k] * lw[k])}",
        )
    is_vis = kind != TEXT
    inc = (~is_vis).astype(np.int64)  # text: +1; a vision run: +max(h, w) at its last token
    inc[run_end - 1] = np.maximum(lh, lw)
    csum = np.cumsum(inc)
    before = csum - inc  # inclusive -> exclusive
    out[1:] = before - before[starts[sample_of]]  # restart at each sample
    if len(run_start):
        run_of = np.repeat(np.arange(len(run_start)), run_len)
        vis_at = np.flatnonzero(is_vis)
        j = vis_at - run_start[run_of]  # index within the run
        hw = (lh * lw)[run_of]
        out[1, vis_at] += j // hw
        out[2, vis_at] += (j // lw[run_of]) % lh[run_of]
        out[3, vis_at] += j % lw[run_of]
    return out
