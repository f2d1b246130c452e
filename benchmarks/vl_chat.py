"""Chat rows vs VQA rows: per-image preprocessing time of the cache build's per-row step.

Both workloads use the same 640x480 JPEGs (COCO-sized), so the image work is identical and what
differs is the text side: a VQA row is one image, a question and an answer; a chat row (the
``messages`` layout, as HF ``datasets`` stores it) has a system prompt, two or three turns and two
or three images spread over them. Each pass runs exactly what a build worker does per row
(``vl.build.process_row``: parse the raw row with its layout, open the images, render the chat
template, tokenise, locate the assistant spans, resize and patchify), starting from the raw rows
as the Parquet reader returns them. Passes alternate VQA / chat (the order flips every round), so
both see the same machine load; the ratio of the medians is the result (target: chat within 10 %
of VQA per image). Wall time and the process's CPU time are both reported: on a shared machine
the CPU time is the steadier of the two (one thread does all the work of a pass).

    python -m benchmarks vl_chat [--repeats 7] [--quick] [--set images=96]
"""

from __future__ import annotations

import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.common import BenchArgs, Row, compare


def _jpegs(n: int) -> list[bytes]:
    from torchtitan_ext.vl.sample_data import source_dir

    srcs = sorted(p for p in source_dir().iterdir() if p.suffix in (".jpg", ".png"))
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        im = Image.open(srcs[i % len(srcs)]).convert("RGB")
        size = (640, 480) if i % 3 else (480, 640)
        arr = np.asarray(im.resize(size, Image.BICUBIC)).astype(np.int16)
        arr = arr + rng.integers(-8, 9, (size[1], size[0], 3))
        b = io.BytesIO()
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(b, "JPEG", quality=90)
        out.append(b.getvalue())
    return out


def _vqa_rows(jpegs: list[bytes]) -> list[dict]:
    return [
        {
            "image": {"bytes": b, "path": None},
            "question": f"What is shown in picture number {i}?",
            "answer": f"It shows object number {i % 17} on a plain background.",
        }
        for i, b in enumerate(jpegs)
    ]


def _chat_rows(jpegs: list[bytes]) -> list[dict]:
    """Rows of 2 or 3 images over 2 or 3 turns with a system prompt (HF struct layout)."""

    def t(text):
        return {"type": "text", "text": text}

    img = {"type": "image", "text": None}
    rows, i, k = [], 0, 0
    while i < len(jpegs):
        n = 3 if k % 2 == 0 else 2
        imgs = jpegs[i : i + n]
        msgs = [
            {"role": "system", "content": [t("You are a careful assistant. Be brief.")]},
            {"role": "user", "content": [img, t(f"What is shown in picture number {i}?")]},
            {"role": "assistant", "content": [t(f"It shows object number {i % 17}.")]},
            {"role": "user", "content": [t("And in these?"), *[img] * (len(imgs) - 1)]},
            {"role": "assistant", "content": [t("Objects on a plain background, again.")]},
        ]
        if len(imgs) == 3:
            msgs += [{"role": "user", "content": [t("Which one is wider?")]},
                     {"role": "assistant", "content": [t("The first one.")]}]  # fmt: skip
        rows.append({"messages": msgs, "images": [{"bytes": b, "path": None} for b in imgs]})
        i += len(imgs)
        k += 1
    return rows


def _parquet_rows(rows: list[dict], path: Path) -> list[dict]:
    """The rows as the Parquet reader returns them (written by ``datasets``, read by pyarrow)."""
    import datasets
    import pyarrow.parquet as pq

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return pq.read_table(path).to_pylist()


def run(args: BenchArgs) -> list[Row]:
    from torchtitan_ext.vl import build as B
    from torchtitan_ext.vl.layouts import MessagesLayout, VQALayout

    n = int(args.extra.get("images", 24 if args.quick else 96))
    jpegs = _jpegs(n)
    with tempfile.TemporaryDirectory(prefix="bench_vl_chat_") as tmp:
        vqa = _parquet_rows(_vqa_rows(jpegs), Path(tmp) / "vqa.parquet")
        chat = _parquet_rows(_chat_rows(jpegs), Path(tmp) / "chat.parquet")
    cfg = B.config_from("bench", "train", 8192, 64)
    layouts = {"vqa": VQALayout("image", "question", "answer"),
               "chat": MessagesLayout("messages", "images")}  # fmt: skip
    work = {"vqa": vqa, "chat": chat}

    def one_pass(name: str) -> tuple[float, float]:
        """(wall ms, CPU ms) per image of one pass over a workload."""
        B._worker_init(cfg, layouts[name], None)
        t0, c0 = time.perf_counter(), time.process_time()
        for i, raw in enumerate(work[name]):
            r = B.process_row((i, raw))
            if isinstance(r, B.Skip):
                raise RuntimeError(f"{name} row {i} skipped: {r.message}")
        return (time.perf_counter() - t0) / n * 1e3, (time.process_time() - c0) / n * 1e3

    for name in work:  # warm-up: processor, template plans, page cache
        for _ in range(max(1, args.warmup)):
            one_pass(name)
    wall: dict[str, list[float]] = {"vqa": [], "chat": []}
    cpu: dict[str, list[float]] = {"vqa": [], "chat": []}
    for r in range(args.repeats):
        for name in ("vqa", "chat") if r % 2 == 0 else ("chat", "vqa"):
            w, c = one_pass(name)
            wall[name].append(w)
            cpu[name].append(c)
    info = {"images": n, "vqa_rows": len(vqa), "chat_rows": len(chat), "rounds": args.repeats}
    rows = []
    for what, d in (("wall", wall), ("CPU", cpu)):
        per_round = [round(c / v, 3) for v, c in zip(d["vqa"], d["chat"], strict=True)]
        vqa_row = Row(f"per image {what}, VQA rows (1 image, 1 turn)", statistics.median(d["vqa"]),
                      "ms", higher_is_better=False, samples=d["vqa"], info=info)  # fmt: skip
        chat_row = Row(f"per image {what}, chat rows (2-3 images, 2-3 turns, system)",
                       statistics.median(d["chat"]), "ms", higher_is_better=False,
                       samples=d["chat"], info=info | {"chat/vqa per round": per_round})  # fmt: skip
        rows += [vqa_row, chat_row]
        compare(rows, chat_row.case, vqa_row.case)
        # ratio = vqa / chat (lower is better): within 10 % means chat <= 1.10 x vqa
        chat_row.target, chat_row.met = "chat <= 1.10x VQA", chat_row.ratio >= 1 / 1.10
    return rows
