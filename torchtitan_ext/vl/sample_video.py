"""A small video sample dataset (the ``messages`` layout with a ``videos`` column), generated
deterministically: what ``dataset = "sample_video"`` and ``preprocess-cached --dataset
sample_video`` read.

Each clip is one second (8 frames at 8 fps, 64x48) of a coloured square moving left, right, up
or down over a grey background, encoded in memory with PyAV's bundled libx264 (one thread, fixed
options) and embedded in the Parquet as an HF ``Video``-style ``{bytes, path}`` struct. Rows, in
turn:

* one video, "Which way does the square move?" -> "To the left." (its direction);
* one video, "What colour is the square?" -> "Red." (its colour);
* an image (a flat colour swatch) and a video together: "Is the square the colour of the
  picture?" -> "Yes." / "No.";
* two videos: "Do the two squares move the same way?" -> "Yes, both to the right." / "No: ...";
* a text-only turn (valid in a chat layout).

Answers are true of the clips, so a model can learn them. With the default video options a
clip samples 4 frames (2 merged frames of 8x8 patches: 32 LLM tokens each), so a sample is
~80-180 tokens. 32 rows take well under a second; :func:`video_sample_path` caches them.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_ext.data.cachedir import build_atomically, cache_root

VIDEO_SAMPLE_VERSION = 1
FPS, FRAMES, WIDTH, HEIGHT, SIDE = 8, 8, 64, 48, 12

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 190, 60), "blue": (40, 70, 220), "yellow": (240, 220, 30),
}  # fmt: skip
DIRECTIONS: dict[str, tuple[int, int]] = {
    "left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1),
}  # fmt: skip


def clip_frames(colour: str, direction: str) -> np.ndarray:
    """uint8 [FRAMES, HEIGHT, WIDTH, 3]: the square moving from one side to the other."""
    dx, dy = DIRECTIONS[direction]
    out = np.full((FRAMES, HEIGHT, WIDTH, 3), 128, dtype=np.uint8)
    span_x, span_y = WIDTH - SIDE, HEIGHT - SIDE
    for t in range(FRAMES):
        f = t / (FRAMES - 1)
        x = round(span_x * (f if dx > 0 else 1 - f)) if dx else span_x // 2
        y = round(span_y * (f if dy > 0 else 1 - f)) if dy else span_y // 2
        out[t, y : y + SIDE, x : x + SIDE] = COLOURS[colour]
    return out


def encode_mp4(frames: np.ndarray, fps: int = FPS) -> bytes:
    """H.264 MP4 bytes of uint8 [T, H, W, 3] frames (libx264, one thread: deterministic)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        s.options = {"crf": "23", "preset": "veryfast", "bframes": "0", "threads": "1"}
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def _swatch(colour: str) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (40, 32), COLOURS[colour]).save(b, "PNG")
    return b.getvalue()


def _user(*parts: Any) -> dict[str, Any]:
    kinds = {"<video>": "video", "<image>": "image"}
    content = [{"type": kinds[p], "text": None} if p in kinds else {"type": "text", "text": p}
               for p in parts]  # fmt: skip
    return {"role": "user", "content": content}


def _say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _cell(data: bytes) -> dict[str, Any]:
    return {"bytes": data, "path": None}


class _Maker:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._clips: dict[tuple[str, str], bytes] = {}

    def clip(self) -> tuple[bytes, str, str]:
        colour = self.rng.choice(sorted(COLOURS))
        direction = self.rng.choice(sorted(DIRECTIONS))
        if (colour, direction) not in self._clips:
            self._clips[colour, direction] = encode_mp4(clip_frames(colour, direction))
        return self._clips[colour, direction], colour, direction

    def row(self, i: int) -> dict[str, Any]:
        kind = i % 5
        data, colour, direction = self.clip()
        if kind == 0:
            msgs = [_user("<video>", "Which way does the square move?"),
                    _say(f"To the {direction}." if direction in ("left", "right")
                         else f"{direction.capitalize()}.")]  # fmt: skip
            return {"messages": msgs, "videos": [_cell(data)], "images": []}
        if kind == 1:
            msgs = [_user("<video>", "What colour is the square?"), _say(f"{colour.capitalize()}.")]
            return {"messages": msgs, "videos": [_cell(data)], "images": []}
        if kind == 2:
            pic = colour if self.rng.random() < 0.5 else self.rng.choice(sorted(COLOURS))
            msgs = [_user("<image>", "<video>", "Is the square the colour of the picture?"),
                    _say("Yes." if pic == colour else f"No, the square is {colour}.")]  # fmt: skip
            return {"messages": msgs, "videos": [_cell(data)], "images": [_cell(_swatch(pic))]}
        if kind == 3:
            data2, _, direction2 = self.clip()
            same = direction == direction2
            answer = (f"Yes, both move {direction}." if same
                      else f"No: the first moves {direction}, the second {direction2}.")  # fmt: skip
            msgs = [_user("<video>", "<video>", "Do the two squares move the same way?"),
                    _say(answer)]  # fmt: skip
            return {"messages": msgs, "videos": [_cell(data), _cell(data2)], "images": []}
        msgs = [_user("Name a colour."), _say(f"{colour.capitalize()}.")]
        return {"messages": msgs, "videos": [], "images": []}


def write_video_parquet(rows: list[dict[str, Any]], file: Path) -> Path:
    """Rows of ``messages`` + ``videos`` + ``images`` (``{bytes, path}`` structs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = pa.string()
    media = pa.list_(pa.struct([("bytes", pa.binary()), ("path", text)]))
    part = pa.struct([("type", text), ("text", text)])
    schema = pa.schema([
        ("messages", pa.list_(pa.struct([("role", text), ("content", pa.list_(part))]))),
        ("videos", media),
        ("images", media),
    ])  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), file)
    return file


def make_video_sample(out_dir: str | Path, n: int = 32, seed: int = 0) -> Path:
    """Write ``out_dir/train-00000-of-00001.parquet`` (n rows); returns out_dir. Reused while
    its manifest matches (:func:`torchtitan_ext.data.cachedir.build_atomically`)."""

    def fill(tmp: Path) -> None:
        mk = _Maker(seed)
        write_video_parquet([mk.row(i) for i in range(n)], tmp / "train-00000-of-00001.parquet")

    meta = {"video_sample_version": VIDEO_SAMPLE_VERSION, "n": n, "seed": seed}
    return build_atomically(Path(out_dir), fill, meta)


def video_sample_path(n: int = 32, root: str | Path | None = None) -> Path:
    """The video sample's Parquet directory, generated on first use under ``root`` (default:
    :func:`torchtitan_ext.data.cachedir.cache_root`)."""
    base = Path(root) if root is not None else cache_root()
    return make_video_sample(base / f"vl_video_sample_v{VIDEO_SAMPLE_VERSION}_n{n}", n=n)
