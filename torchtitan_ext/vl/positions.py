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
