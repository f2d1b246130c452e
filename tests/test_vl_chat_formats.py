"""Each row layout on data written the way its public datasets write it, through the whole build
(Parquet -> layout -> images -> template -> cache), against transformers' Qwen3VLProcessor.

For every row the test writes the conversation a second time by hand in Hugging Face's chat
format, renders it with ``apply_chat_template`` and runs the processor on it with the same images
(decoded by PIL from the same bytes). The cached sample must equal it in ``input_ids`` and
``image_grid_thw``; its uint8 pixels, normalised, must equal ``pixel_values`` bit for bit; its
labels must be the assistant spans as found in the reference ids by ``assistant_labels`` (which
does not use the code under test); its mRoPE rows must equal ``get_rope_index``.

* LLaVA-Instruct (``llava``): a ``conversations`` list of ``{from, value}`` with ``<image>`` in a
  value, an ``image`` column of file names relative to the dataset directory, ShareGPT text-only
  rows (null image), a system turn; a LLaVA-OneVision-style multi-image file (``images`` list).
* the_cauldron (``cauldron``): ``images`` = ``Sequence(Image())``, ``texts`` = list of
  ``{user, assistant, source}``; written by ``datasets.Dataset.to_parquet``.
* HF chat (``messages``): llava-instruct-mix-vsft's layout, content parts ``{index, text, type}``.
* VQAv2 (``vqa``): ``question``, ``multiple_choice_answer``, ``answers`` (list of ``{answer,
  answer_confidence, answer_id}``), ``image`` (``Image()``) and its other columns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan_ext.vl.processor import normalize_patches

from .support.vl_chat import (
    cached_samples,
    hf_reference,
    image_bytes,
    pil,
    rope_reference,
)

SEQ = 4096


@pytest.fixture(scope="module")
def rope_model():
    from .support.tiny_qwen3vl import rope_model as make

    return make()


def build(data: Path, cache_dir: Path, **options):
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache

    k = build_cache(data, "train", cache_dir, SEQ, 8, show_progress=False, **options)
    return VLCache.open(k)


def check(proc, rope_model, cache, expected: dict[int, tuple[list[dict], list[bytes]]]) -> None:
    """Every expected row is in the cache and equals the HF reference (module docstring)."""
    got = cached_samples(cache)
    assert sorted(got) == sorted(expected)
    pad = cache.special_tokens["image_pad_id"]
    for row, (messages, images) in expected.items():
        ours = got[row]
        ref = hf_reference(proc, messages, [pil(b) for b in images])
        assert torch.equal(ours["input_ids"], ref["input_ids"]), (row, ref["text"])
        assert torch.equal(ours["labels"], ref["labels"]), row
        assert (ref["labels"] != -100).any()
        assert torch.equal(ours["image_grid_thw"], ref["image_grid_thw"]), row
        if images:
            assert torch.equal(normalize_patches(ours["pixel_u8"]), ref["pixel_values"]), row
        else:
            assert ours["pixel_u8"].shape[0] == 0 and ref["pixel_values"] is None
        want = rope_reference(rope_model, ref["input_ids"], ref["image_grid_thw"], pad)
        assert np.array_equal(ours["position_ids"][1:].numpy(), want), row
        assert torch.equal(ours["position_ids"][0], torch.arange(len(ours["input_ids"])))


def text(t: str) -> dict:
    return {"type": "text", "text": t}


IMG = {"type": "image"}


# ---------------------------------------------------------------------------------- llava


def test_llava_instruct_rows(tmp_path, proc, rope_model):
    """LLaVA-Instruct-150K's JSON converted to Parquet as it is: image file names relative to
    the dataset directory, ``<image>`` before or after the text, ShareGPT text-only rows."""
    d = tmp_path / "llava"
    (d / "coco").mkdir(parents=True)
    files = {
        "coco/000000033471.jpg": image_bytes(0, (640, 480)),
        "coco/000000052846.jpg": image_bytes(1, (480, 360), "L"),
        "coco/000000334872.png": image_bytes(2, (200, 300), "RGBA", "PNG"),
    }
    for name, b in files.items():
        (d / name).write_bytes(b)
    conv = [
        [
            {"from": "human", "value": "<image>\nWhat are the colors of the bus in the image?"},
            {"from": "gpt", "value": "The bus in the image is white and red."},
            {"from": "human", "value": "What feature can be seen on the back of the bus?"},
            {"from": "gpt", "value": "The back of the bus features an advertisement."},
        ],
        [
            {"from": "system", "value": "You are a helpful assistant."},
            {"from": "human", "value": "Describe the picture.\n<image>"},
            {"from": "gpt", "value": "A grey street scene with a cat on a wall."},
        ],
        [
            {"from": "human", "value": "Write a haiku about spring."},
            {"from": "gpt", "value": "Soft rain on new leaves,\nthe garden wakes up slowly,\nbirds rehearse their songs."},
        ],
        [
            {"from": "human", "value": "Is there a person here? <image> Answer yes or no."},
            {"from": "gpt", "value": "No."},
        ],
    ]  # fmt: skip
    image = ["coco/000000033471.jpg", "coco/000000052846.jpg", None, "coco/000000334872.png"]
    table = pa.table({"id": [f"id{i}" for i in range(4)], "image": image, "conversations": conv})
    pq.write_table(table, d / "llava_instruct.parquet")
    cache = build(d, tmp_path / "c")
    assert cache.metadata["layout"] == {
        "layout": "llava", "columns": {"conversations": "conversations", "image": "image"}
    }  # fmt: skip
    expected = {
        0: ([{"role": "user", "content": [IMG, text("\nWhat are the colors of the bus in the image?")]},
             {"role": "assistant", "content": "The bus in the image is white and red."},
             {"role": "user", "content": "What feature can be seen on the back of the bus?"},
             {"role": "assistant", "content": "The back of the bus features an advertisement."}],
            [files["coco/000000033471.jpg"]]),
        1: ([{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": [text("Describe the picture.\n"), IMG]},
             {"role": "assistant", "content": "A grey street scene with a cat on a wall."}],
            [files["coco/000000052846.jpg"]]),
        2: ([{"role": "user", "content": "Write a haiku about spring."},
             {"role": "assistant", "content": conv[2][1]["value"]}], []),
        3: ([{"role": "user", "content": [text("Is there a person here? "), IMG,
                                           text(" Answer yes or no.")]},
             {"role": "assistant", "content": "No."}],
            [files["coco/000000334872.png"]]),
    }  # fmt: skip
    check(proc, rope_model, cache, expected)


def test_llava_multi_image_rows(tmp_path, proc, rope_model):
    """LLaVA-OneVision-style rows: an ``images`` list of paths, one ``<image>`` per image in the
    turns, images in a later turn too (mRoPE and pixels in order)."""
    d = tmp_path / "ov"
    d.mkdir()
    b = [image_bytes(k, s) for k, s in enumerate([(320, 240), (96, 400), (512, 300), (64, 64)])]
    for k, x in enumerate(b):
        (d / f"{k}.jpg").write_bytes(x)
    conv = [
        [{"from": "human", "value": "<image>\n<image>\nWhich of the two is taller?"},
         {"from": "gpt", "value": "The second one."},
         {"from": "human", "value": "And compared with this one?\n<image>"},
         {"from": "gpt", "value": "This one is shorter than both."}],
        [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "A dot."}],
    ]  # fmt: skip
    pq.write_table(pa.table({"images": [["0.jpg", "1.jpg", "2.jpg"], ["3.jpg"]],
                             "conversations": conv}), d / "train.parquet")  # fmt: skip
    cache = build(d, tmp_path / "c", format="llava")
    expected = {
        0: ([{"role": "user", "content": [IMG, text("\n"), IMG, text("\nWhich of the two is taller?")]},
             {"role": "assistant", "content": "The second one."},
             {"role": "user", "content": [text("And compared with this one?\n"), IMG]},
             {"role": "assistant", "content": "This one is shorter than both."}], b[:3]),
        1: ([{"role": "user", "content": [IMG, text("What is it?")]},
             {"role": "assistant", "content": "A dot."}], b[3:]),
    }  # fmt: skip
    check(proc, rope_model, cache, expected)


# ---------------------------------------------------------------------------------- cauldron


def test_the_cauldron_rows(tmp_path, proc, rope_model):
    """the_cauldron's layout, written by ``datasets``: ``images`` a ``Sequence(Image())``, ``texts``
    a list of ``{user, assistant, source}``; the images lead the first user turn."""
    import datasets

    b = [image_bytes(k, s) for k, s in enumerate([(300, 200), (150, 150), (400, 120)])]
    rows = [
        {"images": [{"bytes": b[0], "path": None}],
         "texts": [{"user": "What is the main colour?\nAnswer briefly.", "assistant": "Grey.",
                    "source": "vqav2"},
                   {"user": "Is it outdoors?", "assistant": "Yes, it looks like a street.",
                    "source": "vqav2"}]},
        {"images": [{"bytes": b[1], "path": None}, {"bytes": b[2], "path": None}],
         "texts": [{"user": "Are the two images the same size?",
                    "assistant": "No: the first is square, the second is wide.",
                    "source": "mimic_cgd"}]},
    ]  # fmt: skip
    text_t = datasets.Value("string")
    feats = datasets.Features({
        "images": datasets.Sequence(datasets.Image()),
        "texts": datasets.List({"user": text_t, "assistant": text_t, "source": text_t}),
    })  # fmt: skip
    d = tmp_path / "cauldron" / "vqav2"
    d.mkdir(parents=True)
    datasets.Dataset.from_list(rows, features=feats).to_parquet(
        str(d / "train-00000-of-00001.parquet")
    )
    cache = build(d, tmp_path / "c")
    assert cache.metadata["layout"]["layout"] == "cauldron"
    t0, t1 = rows[0]["texts"], rows[1]["texts"]
    expected = {
        0: ([{"role": "user", "content": [IMG, text(t0[0]["user"])]},
             {"role": "assistant", "content": t0[0]["assistant"]},
             {"role": "user", "content": [text(t0[1]["user"])]},
             {"role": "assistant", "content": t0[1]["assistant"]}], b[:1]),
        1: ([{"role": "user", "content": [IMG, IMG, text(t1[0]["user"])]},
             {"role": "assistant", "content": t1[0]["assistant"]}], b[1:]),
    }  # fmt: skip
    check(proc, rope_model, cache, expected)


# ---------------------------------------------------------------------------------- messages


def test_hf_messages_rows(tmp_path, proc, rope_model):
    """HF chat ``messages`` as llava-instruct-mix-vsft writes them (content parts carry
    ``index``, ``text``, ``type``; an image part's text is null), a system turn, an image in the
    second user turn, a text-only row with an empty image list."""
    import datasets

    b = [image_bytes(k, s, m, f) for k, (s, m, f) in
         enumerate([((333, 222), "RGB", "JPEG"), ((120, 500), "L", "JPEG"),
                    ((260, 260), "P", "PNG")])]  # fmt: skip

    def part(kind, t=None, index=None):
        return {"index": index, "text": t, "type": kind}

    rows = [
        {"messages": [
            {"role": "system", "content": [part("text", "Answer like a pirate.")]},
            {"role": "user", "content": [part("image", index=0), part("text", "What is this?")]},
            {"role": "assistant", "content": [part("text", "Arr, a fine picture it be.")]},
            {"role": "user", "content": [part("text", "And this one?"), part("image", index=1)]},
            {"role": "assistant", "content": [part("text", "Another, matey.")]}],
         "images": [{"bytes": b[0], "path": None}, {"bytes": b[1], "path": None}]},
        {"messages": [
            {"role": "user", "content": [part("text", "Say hi.")]},
            {"role": "assistant", "content": [part("text", "Hi!")]}],
         "images": []},
        {"messages": [
            {"role": "user", "content": [part("text", "Look: "), part("image", index=0),
                                         part("text", " -- how many colours?")]},
            {"role": "assistant", "content": [part("text", "About "), part("text", "thirty.")]}],
         "images": [{"bytes": b[2], "path": None}]},
    ]  # fmt: skip
    t = datasets.Value("string")
    content = datasets.List({"index": datasets.Value("int64"), "text": t, "type": t})
    feats = datasets.Features({
        "messages": datasets.List({"role": t, "content": content}),
        "images": datasets.Sequence(datasets.Image()),
    })  # fmt: skip
    d = tmp_path / "mix"
    d.mkdir()
    datasets.Dataset.from_list(rows, features=feats).to_parquet(str(d / "train.parquet"))
    cache = build(d, tmp_path / "c")
    assert cache.metadata["layout"] == {
        "layout": "messages", "columns": {"messages": "messages", "image": "images"}
    }  # fmt: skip
    expected = {
        0: ([{"role": "system", "content": [text("Answer like a pirate.")]},
             {"role": "user", "content": [IMG, text("What is this?")]},
             {"role": "assistant", "content": [text("Arr, a fine picture it be.")]},
             {"role": "user", "content": [text("And this one?"), IMG]},
             {"role": "assistant", "content": [text("Another, matey.")]}], b[:2]),
        1: ([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}], []),
        2: ([{"role": "user", "content": [text("Look: "), IMG, text(" -- how many colours?")]},
             {"role": "assistant", "content": [text("About "), text("thirty.")]}], b[2:]),
    }  # fmt: skip
    check(proc, rope_model, cache, expected)


# ---------------------------------------------------------------------------------- vqa


def _vqav2(b: list[bytes], with_mc: bool) -> list[dict]:
    answers = [
        ["no", "yes", "yes", "yes"],  # the most frequent is not the first
        ["two", "2", "2", "3"],
        ["maroon", "red", "red", "maroon"],  # a tie: the first of the most frequent
    ]
    rows = []
    questions = ["Is it day?", "How many?", "What colour?"]
    for i, (q, ans) in enumerate(zip(questions, answers, strict=True)):
        r = {
            "question_type": "what", "answer_type": "other", "image_id": 1000 + i,
            "question_id": 7 * i, "question": q,
            "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": j + 1}
                        for j, a in enumerate(ans)],
            "image": {"bytes": b[i], "path": f"COCO_val2014_{1000 + i:012d}.jpg"},
        }  # fmt: skip
        if with_mc:
            r["multiple_choice_answer"] = ["yes", "2", "red"][i]  # VQAv2's own choice
        rows.append(r)
    return rows


@pytest.mark.parametrize("with_mc", [True, False], ids=["multiple_choice_answer", "answers"])
def test_vqav2_rows(tmp_path, proc, rope_model, with_mc):
    """VQAv2 as HuggingFaceM4/VQAv2 stores it. ``multiple_choice_answer`` is the target when
    present; with only ``answers`` the most frequent answer is (ties: the first)."""
    import datasets

    b = [image_bytes(k, s) for k, s in enumerate([(640, 480), (500, 375), (427, 640)])]
    t = datasets.Value("string")
    cols = {
        "question_type": t, "answer_type": t, "image_id": datasets.Value("int64"),
        "question_id": datasets.Value("int64"), "question": t,
        "answers": datasets.List({"answer": t, "answer_confidence": t,
                                  "answer_id": datasets.Value("int64")}),
        "image": datasets.Image(),
    }  # fmt: skip
    if with_mc:
        cols["multiple_choice_answer"] = t
    d = tmp_path / "vqav2"
    d.mkdir()
    ds = datasets.Dataset.from_list(_vqav2(b, with_mc), features=datasets.Features(cols))
    ds.to_parquet(str(d / "validation-00000-of-00001.parquet"))
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache

    cache = VLCache.open(build_cache(d, "validation", tmp_path / "c", SEQ, 8, show_progress=False))
    want_col = "multiple_choice_answer" if with_mc else "answers"
    assert cache.metadata["layout"]["columns"]["answer"] == want_col
    targets = ["yes", "2", "red"] if with_mc else ["yes", "2", "maroon"]
    questions = ["Is it day?", "How many?", "What colour?"]
    expected = {
        i: ([{"role": "user", "content": [IMG, text(questions[i])]},
             {"role": "assistant", "content": targets[i]}], [b[i]])
        for i in range(3)
    }  # fmt: skip
    check(proc, rope_model, cache, expected)
