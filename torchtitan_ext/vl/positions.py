"""mRoPE position rows of one unpacked Qwen3-VL sample, computed without the model's weights.

``mrope_positions`` re-implements ``Qwen3VLModel.get_rope_index`` (transformers 5.23) for one
sample: text runs advance by their length, an image of llm grid (t, h, w) gets t/h/w meshgrid
positions offset by the running position, which then advances by ``max(h, w)``. It needs only
``spatial_merge_size``, no weights (equality with the real method is tested, several images in
one sample included).
"""

from __future__ import annotations

import numpy as np

from torchtitan_ext.vl.errors import SampleError


def mrope_positions(
    input_ids: np.ndarray, grid_thw: np.ndarray, image_pad_id: int, spatial_merge_size: int
) -> np.ndarray:
    """3 mRoPE rows [3, L] of one unpacked sample, as ``Qwen3VLModel.get_rope_index`` computes them.

    Text runs: positions continue from the running position on all 3 rows. Image run with grid
    (t, h, w) -> llm grid (t, h/m, w/m): rows = (start + t_idx, start + h_idx, start + w_idx) over a
    meshgrid in (t, h, w) order; afterwards the running position advances by ``max(h, w) / m``.
    """
    ids = np.asarray(input_ids)
    n = ids.shape[0]
    out = np.empty((3, n), dtype=np.int64)
    is_img = ids == image_pad_id
    if not is_img.any():
        out[:] = np.arange(n, dtype=np.int64)
        return out
    # run starts/ends of image tokens
    d = np.diff(np.concatenate(([0], is_img.view(np.int8), [0])))
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    if len(starts) != len(grid_thw):
        raise SampleError(
            "placeholder_mismatch", f"{len(starts)} image token runs but {len(grid_thw)} images"
        )
    pos, prev = 0, 0
    ms = spatial_merge_size
    for (s, e), (t, h, w) in zip(
        zip(starts, ends, strict=True), np.asarray(grid_thw).tolist(), strict=True
    ):
        tl = s - prev
        out[:, prev:s] = np.arange(pos, pos + tl, dtype=np.int64)
        pos += tl
        lt, lh, lw = t, h // ms, w // ms
        if e - s != lt * lh * lw:
            raise SampleError(
                "placeholder_mismatch",
                f"image run of {e - s} tokens, grid {t}x{h}x{w} needs {lt * lh * lw}",
            )
        out[0, s:e] = np.repeat(np.arange(lt, dtype=np.int64), lh * lw) + pos
        out[1, s:e] = np.tile(np.repeat(np.arange(lh, dtype=np.int64), lw), lt) + pos
        out[2, s:e] = np.tile(np.arange(lw, dtype=np.int64), lt * lh) + pos
        pos += max(h, w) // ms
        prev = e
    out[:, prev:] = np.arange(pos, pos + n - prev, dtype=np.int64)
    return out


def position_rows(
    input_ids: np.ndarray, grid_thw: np.ndarray, image_pad_id: int, spatial_merge_size: int
) -> np.ndarray:
    """The 4 position rows [4, L]: row 0 = arange(L), rows 1..3 = ``mrope_positions``."""
    ids = np.asarray(input_ids)
    out = np.empty((4, ids.shape[0]), dtype=np.int64)
    out[0] = np.arange(ids.shape[0])
    out[1:] = mrope_positions(ids, grid_thw, image_pad_id, spatial_merge_size)
    return out


def pack_position_rows(
    tokens: np.ndarray,
    sample_lens: np.ndarray,
    grid_thw: np.ndarray,
    image_pad_id: int,
    spatial_merge_size: int,
) -> np.ndarray:
    """The 4 position rows [4, n] of several samples laid end to end: for each sample exactly
    ``position_rows`` of that sample alone (row 0 restarts at 0, the mRoPE rows restart at 0),
    with ``grid_thw`` holding every image's grid in token order.

    Why not a loop over samples: an 8k-token pack holds ~20 samples, and ~15 small numpy calls
    per sample cost ~100 us each (2.3 ms per pack, as much as copying its 20 MB of pixels); here
    the whole pack is a dozen array passes. The rule, per sample: a running position starts at
    0; a text token takes it and advances it by 1; an image run of llm grid (t, h, w) takes
    ``start + (t_idx, h_idx, w_idx)`` over a (t, h, w) meshgrid and then advances it by
    ``max(h, w)`` (``mrope_positions``, itself checked against transformers' ``get_rope_index``).
    So a token's position = (sum of the increments of the tokens before it in its sample) + its
    grid offset, an exclusive cumulative sum restarted per sample.
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
    is_img = ids == image_pad_id
    # image runs, never crossing a sample boundary
    first = np.zeros(n, dtype=bool)
    first[starts[lens > 0]] = True
    prev_img = np.concatenate(([False], is_img[:-1]))
    run_start = np.flatnonzero(is_img & (first | ~prev_img))
    next_img = np.concatenate((is_img[1:], [False]))
    next_first = np.concatenate((first[1:], [True]))
    run_end = np.flatnonzero(is_img & (~next_img | next_first)) + 1
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if len(run_start) != len(grid):
        raise SampleError(
            "placeholder_mismatch", f"{len(run_start)} image token runs but {len(grid)} images"
        )
    ms = spatial_merge_size
    lt, lh, lw = grid[:, 0], grid[:, 1] // ms, grid[:, 2] // ms
    run_len = run_end - run_start
    bad = np.flatnonzero(run_len != lt * lh * lw)
    if len(bad):
        k = int(bad[0])
        raise SampleError(
            "placeholder_mismatch",
            f"image run of {int(run_len[k])} tokens, grid {lt[k]}x{int(grid[k, 1])}x"
            f"{int(grid[k, 2])} needs {int(lt[k] * lh[k] * lw[k])}",
        )
    inc = (~is_img).astype(np.int64)  # text: +1; an image run: +max(h, w) at its last token
    inc[run_end - 1] = np.maximum(lh, lw)
    csum = np.cumsum(inc)
    before = csum - inc  # inclusive -> exclusive
    out[1:] = before - before[starts[sample_of]]  # restart at each sample
    if len(run_start):
        run_of = np.repeat(np.arange(len(run_start)), run_len)
        img_at = np.flatnonzero(is_img)
        j = img_at - run_start[run_of]  # index within the run
        hw = (lh * lw)[run_of]
        out[1, img_at] += j // hw
        out[2, img_at] += (j // lw[run_of]) % lh[run_of]
        out[3, img_at] += j % lw[run_of]
    return out
