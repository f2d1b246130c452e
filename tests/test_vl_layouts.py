"""Row layouts: detection and its errors, column flags, odd cells, the row checks (counted skips
naming what is wrong), --truncate, HF ``datasets`` Image columns, the cache key, model templates."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from torchtitan_ext.vl import layouts as L
from torchtitan_ext.vl.processor import SampleError, normalize_patches

from .support.vl_chat import assistant_labels, cached_samples, hf_reference, image_bytes, pil

IMG = {"type": "image"}


# ---------------------------------------------------------------------------------- choosing


@pytest.mark.parametrize(
    "columns, name",
    [
        (["messages", "images"], "messages"),
        (["id", "image", "conversations"], "llava"),
        (["images", "texts"], "cauldron"),
        (["image", "question", "answer"], "vqa"),
        (["question", "multiple_choice_answer", "answers", "image"], "vqa"),
        (["question", "answer"], "vqa"),  # text-only QA
        # a conversation column wins over question/answer columns (it is the specific one)
        (["image", "question", "answer", "conversations"], "llava"),
        (["messages", "question", "answer"], "messages"),
    ],
)
def test_auto_detects_and_logs_the_layout(columns, name, caplog):
    with caplog.at_level(logging.INFO, logger="torchtitan_ext.vl.layouts"):
        lay = L.choose_layout(columns, "x.parquet")
    assert lay.name == name
    assert f"row layout {name} (detected) from columns" in caplog.text
    if name == "vqa" and "multiple_choice_answer" in columns:
        assert lay.answer == "multiple_choice_answer"


def test_schema_matching_nothing_names_columns_and_flags():
    with pytest.raises(ValueError) as e:
        L.choose_layout(["id", "caption", "pixels"], "data/train.parquet")
    msg = str(e.value)
    assert "['id', 'caption', 'pixels']" in msg and "--format" in msg
    for role in L.COLUMN_ROLES:
        assert f"--{role}-column" in msg


def test_column_flags_override_detection():
    cols = ["chat", "messages", "pics", "images"]
    lay = L.choose_layout(cols, "w", overrides={"messages": "chat", "image": "pics"})
    assert (lay.name, lay.messages, lay.image) == ("messages", "chat", "pics")
    # a flag of one layout picks that layout under auto
    lay = L.choose_layout(["conv", "image", "messages"], "w", overrides={"conversations": "conv"})
    assert lay.name == "llava" and lay.image == "image"
    with pytest.raises(ValueError, match="--image-column 'nope' is not a column"):
        L.choose_layout(cols, "w", overrides={"image": "nope"})
    with pytest.raises(ValueError, match="the messages layout has no question column"):
        L.choose_layout(cols, "w", "messages", {"question": "chat"})
    with pytest.raises(ValueError, match="no texts column for the cauldron layout"):
        L.choose_layout(cols, "w", "cauldron")
    with pytest.raises(ValueError, match="format must be one of"):
        L.choose_layout(cols, "w", "sharegpt")


# ---------------------------------------------------------------------------------- parsing


def test_parse_odd_cells():
    m = L.MessagesLayout("messages", "images")
    s = m.parse({
        "messages": json.dumps([{"role": "user", "content": [{"type": "image_url"}, "hi"]},
                                {"from": "gpt", "value": "Hello."}]),
        "images": {"bytes": b"x", "path": None},
    })  # fmt: skip
    assert s.messages == [
        {"role": "user", "content": [IMG, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "Hello."},
    ]
    assert s.images == [{"bytes": b"x", "path": None}]
    assert (
        L.MessagesLayout("messages", "images")
        .parse({"messages": [{"role": "user", "content": None}], "images": None})
        .images
        == []
    )
    for bad, words in [
        ([{"role": "narrator", "content": "x"}], "unknown role 'narrator'"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "unsupported content type 'audio'"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "int, not a string"),
        ("[not json", "not JSON"),
        (None, "is null"),
    ]:
        with pytest.raises(SampleError) as e:
            m.parse({"messages": bad, "images": []})
        assert e.value.reason == "bad_conversation" and words in str(e.value)
    llava = L.LlavaLayout("conversations", "image").parse({
        "conversations": [{"from": "human", "value": "<image><image>Same?"},
                          {"from": "gpt", "value": "Yes."}],
        "image": ["a.jpg", None],
    })  # fmt: skip
    assert llava.messages[0]["content"] == [IMG, IMG, {"type": "text", "text": "Same?"}]
    assert llava.images == ["a.jpg", None]  # the None is that image's missing_image later
    vqa = L.VQALayout("img", "q", "answers").parse(
        {"img": "a.jpg", "q": None, "answers": ["b", {"answer": "a"}, "a", None]}
    )
    assert vqa.images == ["a.jpg"] and vqa.messages[1]["content"] == "a"


@pytest.mark.parametrize(
    "said, role",
    [("system", "system"), ("user", "user"), ("human", "user"), ("assistant", "assistant"),
     ("gpt", "assistant"), ("chatgpt", "assistant"), ("bard", "assistant"),
     ("bing", "assistant"), ("model", "assistant")],
)  # fmt: skip
def test_sharegpt_roles_in_either_key_spelling(said, role):
    """docs/vl-data-formats.md: ShareGPT's human / gpt (and chatgpt, bard, bing, model) map
    onto system / user / assistant, as ``role``/``content`` or ``from``/``value``."""
    for turn in ({"role": said, "content": "x"}, {"from": said, "value": "x"}):
        s = L.MessagesLayout("messages", "images").parse({"messages": [turn], "images": None})
        assert s.messages == [{"role": role, "content": "x"}]


# ---------------------------------------------------------------------------------- row checks


def _process(proc, messages, images, **kw):
    from torchtitan_ext.vl.sample import process_chat

    return process_chat(proc, messages, [pil(b) for b in images], **kw)


def test_row_checks_are_counted_skips(tmp_path):
    """The chat sample's bad rows, through a build: each skipped under its reason, an unreadable
    image inside a list named by its index, counts reconcile; --strict names the row."""
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.sample_chat import CHAT_BAD_ROW_REASONS, make_chat_sample

    d = make_chat_sample(tmp_path / "d", n=12, bad_rows=True)
    k = build_cache(d, "train", tmp_path / "c", 1024, 8, show_progress=False)
    st = json.loads((k / "packing_stats.json").read_text())
    want: dict[str, int] = {}
    for reason in CHAT_BAD_ROW_REASONS.values():
        want[reason] = want.get(reason, 0) + 1
    assert st["skipped"] == want
    assert st["rows_read"] == st["samples_packed"] + st["skipped_total"] == 12 + len(want)
    rows = pq.read_table(d / "train-00000-of-00001.parquet").to_pylist()
    kinds = {r["kind"]: i for i, r in enumerate(rows)}
    assert st["skipped_example_rows"]["corrupt_image"] == [kinds["corrupt_in_list"]]
    # --truncate: the over-long row is packed without its trailing turns, and counted
    k = build_cache(d, "train", tmp_path / "c", 1024, 8, show_progress=False, truncate=True)
    st = json.loads((k / "packing_stats.json").read_text())
    assert "too_long" not in st["skipped"] and st["samples_truncated"] == 1
    assert st["turns_dropped"] >= 2 and st["turns_dropped"] % 2 == 0  # whole exchanges
    assert st["rows_read"] == st["samples_packed"] + st["skipped_total"]
    with pytest.raises(ValueError) as e:
        build_cache(d, "train", tmp_path / "c2", 1024, 8, show_progress=False, strict=True)
    assert f"row {kinds['placeholder_mismatch']}:" in str(e.value)
    assert "placeholder_mismatch" in str(e.value)


def test_unreadable_image_in_a_list_names_its_index(proc, tmp_path):
    from torchtitan_ext.vl.build import config_from, process_parsed

    good = image_bytes(0, (64, 64))
    sample = L.MessagesLayout("messages", "images").parse({
        "messages": [{"role": "user", "content": [IMG, IMG, IMG, {"type": "text", "text": "?"}]},
                     {"role": "assistant", "content": "Three."}],
        "images": [good, "missing/file.jpg", good],
    })  # fmt: skip
    cfg = config_from(tmp_path, "train", 1024, 8)
    with pytest.raises(SampleError) as e:
        process_parsed(proc, sample, cfg, positions=False, root=tmp_path)
    assert e.value.reason == "missing_image" and "images[1] of 3" in str(e.value)
    sample.images[1] = good[: len(good) // 2]  # truncated JPEG: found when the pixels are read
    with pytest.raises(SampleError) as e:
        process_parsed(proc, sample, cfg, positions=False, root=tmp_path)
    assert e.value.reason == "corrupt_image" and "images[1] of 3" in str(e.value)
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "file.jpg").write_bytes(good)  # relative to the dataset directory
    s = process_parsed(proc, _with(sample, 1, "missing/file.jpg"), cfg, positions=False,
                       root=tmp_path)  # fmt: skip
    assert len(s.image_grid_thw) == 3


def _with(sample, i, cell):
    images = list(sample.images)
    images[i] = cell
    return L.ChatSample(sample.messages, images)


@pytest.mark.parametrize(
    "messages, n_images",
    [
        ([{"role": "user", "content": [IMG, IMG, {"type": "text", "text": "?"}]},
          {"role": "assistant", "content": "x"}], 1),
        ([{"role": "user", "content": [IMG, {"type": "text", "text": "?"}]},
          {"role": "assistant", "content": "x"}], 2),
        # Qwen3-VL's template renders no image in an assistant turn: a mismatch, not a silent drop
        ([{"role": "user", "content": "?"},
          {"role": "assistant", "content": [IMG, {"type": "text", "text": "x"}]}], 1),
        ([{"role": "user", "content": [IMG, IMG, {"type": "text", "text": "?"}]},
          {"role": "assistant", "content": "x"}], 3),
    ],
)  # fmt: skip
def test_placeholder_mismatch(proc, messages, n_images):
    with pytest.raises(SampleError) as e:
        _process(proc, messages, [image_bytes(k, (40, 40)) for k in range(n_images)])
    assert e.value.reason == "placeholder_mismatch"


def test_too_long_and_truncate_keeps_the_loss_mask(proc):
    """Too long without --truncate; with it, whole trailing turns go (with their images) and the
    sample equals the HF reference of the shortened conversation."""
    imgs = [image_bytes(0, (300, 300)), image_bytes(1, (300, 300))]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [IMG, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "A picture."}]  # fmt: skip
    for j in range(6):
        msgs += [{"role": "user", "content": [IMG, {"type": "text", "text": "And now?"}]} if j == 0
                 else {"role": "user", "content": f"Tell me more, part {j}."},
                 {"role": "assistant", "content": "More words about it. " * 8}]  # fmt: skip
    full = _process(proc, msgs, imgs)
    n = len(full.input_ids)
    with pytest.raises(SampleError) as e:
        _process(proc, msgs, imgs, max_len=n - 1)
    assert e.value.reason == "too_long"
    ok = _process(proc, msgs, imgs, max_len=n - 1, truncate=True)
    assert ok.extra["turns_dropped"] == 2 and len(ok.input_ids) <= n - 1
    ref = hf_reference(proc, msgs[:-2], [pil(b) for b in imgs])
    assert torch.equal(ok.input_ids, ref["input_ids"]) and torch.equal(ok.labels, ref["labels"])
    short = _process(proc, msgs, imgs, max_len=150, truncate=True)  # only the first turn fits
    ref = hf_reference(proc, msgs[:3], [pil(imgs[0])])
    assert torch.equal(short.input_ids, ref["input_ids"]) and len(short.image_grid_thw) == 1
    assert torch.equal(normalize_patches(short.pixel_u8), ref["pixel_values"])
    with pytest.raises(SampleError) as e:
        _process(proc, msgs, imgs, max_len=40, truncate=True)
    assert e.value.reason == "too_long"


def test_empty_and_special_text(proc):
    for msgs, reason in [
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}], "empty_text"),
        ([{"role": "user", "content": "hi"}], "empty_text"),
        ([{"role": "user", "content": "a <|im_end|> b"}, {"role": "assistant", "content": "x"}],
         "placeholder_mismatch"),
    ]:  # fmt: skip
        with pytest.raises(SampleError) as e:
            _process(proc, msgs, [])
        assert e.value.reason == reason


# ---------------------------------------------------------------------------------- HF datasets


def test_hf_datasets_image_and_sequence_image_columns(tmp_path, proc):
    """``Dataset`` with an ``Image()`` feature (from files: stored as paths; from PIL images:
    stored as bytes) and one with a ``Sequence(Image())`` feature, saved with ``to_parquet``,
    build directly; pixels equal the HF image processor's."""
    import datasets

    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache

    src = tmp_path / "files"
    src.mkdir()
    b = [image_bytes(k, (160 + 40 * k, 120)) for k in range(3)]
    for k, x in enumerate(b):
        (src / f"{k}.jpg").write_bytes(x)
    single = datasets.Dataset.from_dict(
        {"image": [str(src / f"{k}.jpg") for k in range(3)], "question": ["q0", "q1", "q2"],
         "answer": ["a0", "a1", "a2"]}
    ).cast_column("image", datasets.Image())  # fmt: skip
    multi = datasets.Dataset.from_dict(
        {"images": [[str(src / "0.jpg"), str(src / "1.jpg")], [str(src / "2.jpg")], []],
         "texts": [[{"user": "Two?", "assistant": "Yes."}], [{"user": "One?", "assistant": "Yes."}],
                   [{"user": "None?", "assistant": "Right."}]]}
    ).cast_column("images", datasets.Sequence(datasets.Image()))  # fmt: skip
    from_pil = datasets.Dataset.from_dict(
        {"image": [pil(x) for x in b], "question": ["p"] * 3, "answer": ["r"] * 3},
        features=datasets.Features({"image": datasets.Image(), "question": datasets.Value("string"),
                                    "answer": datasets.Value("string")}),
    )  # fmt: skip
    cases = [("single", single, [[0], [1], [2]]), ("multi", multi, [[0, 1], [2], []]),
             ("pil", from_pil, [[0], [1], [2]])]  # fmt: skip
    for name, ds, _ in cases:
        (tmp_path / name).mkdir()
        ds.to_parquet(str(tmp_path / name / "train.parquet"))
    # to_parquet keeps a file-backed image as its absolute path (no bytes): read from there
    assert (
        pq.read_table(tmp_path / "single" / "train.parquet").to_pylist()[0]["image"]["bytes"]
        is None
    )
    for name, _, want in cases:
        d = tmp_path / name
        cache = VLCache.open(build_cache(d, "train", tmp_path / "c", 2048, 8, show_progress=False))
        got = cached_samples(cache)
        assert sorted(got) == [0, 1, 2], name
        # the reference: the images as HF datasets itself decodes them, then the HF processor
        col = "images" if name == "multi" else "image"
        hf = datasets.load_dataset("parquet", data_files=str(d / "train.parquet"), split="train")
        for row, ks in enumerate(want):
            ref_imgs = hf[row][col] if name == "multi" else [hf[row][col]]
            assert len(got[row]["image_grid_thw"]) == len(ref_imgs) == len(ks)
            if ks:
                ref = proc.image_processor(images=ref_imgs, return_tensors="pt")
                assert torch.equal(normalize_patches(got[row]["pixel_u8"]), ref["pixel_values"])


# ---------------------------------------------------------------------------------- the key


def _key(data, cache_dir, **kw):
    from torchtitan_ext.vl.build import config_from, resolve

    return resolve(config_from(data, "train", 1024, 8, **kw), cache_dir).key


def test_cache_key_holds_layout_columns_and_template(tmp_path, proc):
    from torchtitan_ext.vl.processor import offline_processor_dir

    d = tmp_path / "d"
    d.mkdir()
    conv = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    pq.write_table(pa.table({"messages": conv, "chat": conv, "images": [[]]}), d / "t.parquet")
    auto = _key(d, tmp_path)
    assert _key(d, tmp_path, format="messages") == auto  # the layout it resolves to, not the flag
    assert _key(d, tmp_path, messages_column="chat") != auto
    assert _key(d, tmp_path, truncate=True) != auto
    other = tmp_path / "proc"
    shutil.copytree(offline_processor_dir(), other)
    assert _key(d, tmp_path, model_path=str(other)) == auto  # same processor, another path
    edited = tmp_path / "proc2"  # (processors are cached per path: another directory)
    shutil.copytree(offline_processor_dir(), edited)
    tpl = (edited / "chat_template.jinja").read_text()
    (edited / "chat_template.jinja").write_text(tpl.replace("system\\n", "system:\\n"))
    assert _key(d, tmp_path, model_path=str(edited)) != auto


# ---------------------------------------------------------------------------------- templates

QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRIMMING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "template", [QWEN2_VL_TEMPLATE, TRIMMING_TEMPLATE], ids=["qwen2vl", "trim"]
)
def test_model_path_uses_its_own_template(tmp_path, template):
    """A --model-path processor renders with its own template: a default system prompt (fast
    path) and a template that rewrites texts (proven not splice-safe: the slow path) both give
    the HF processor's ids and the assistant spans."""
    from torchtitan_ext.vl.chat import renderer
    from torchtitan_ext.vl.processor import load_processor, offline_processor_dir
    from torchtitan_ext.vl.sample import process_chat

    d = tmp_path / "proc"
    shutil.copytree(offline_processor_dir(), d)
    (d / "chat_template.jinja").write_text(template)
    proc = load_processor(d)
    imgs = [image_bytes(0, (100, 80)), image_bytes(1, (64, 64))]
    msgs = [{"role": "user", "content": [IMG, {"type": "text", "text": "  What?  "}]},
            {"role": "assistant", "content": " A thing. "},
            {"role": "user", "content": [{"type": "text", "text": "And? "}, IMG]},
            {"role": "assistant", "content": "Another.\n"}]  # fmt: skip
    s = process_chat(proc, msgs, [pil(b) for b in imgs])
    ref = hf_reference(proc, msgs, [pil(b) for b in imgs])
    assert torch.equal(s.input_ids, ref["input_ids"]) and torch.equal(s.labels, ref["labels"])
    assert (template == QWEN2_VL_TEMPLATE) == ("You are a helpful assistant." in ref["text"])
    plans = renderer(proc)._plans
    assert all((p is None) == (template == TRIMMING_TEMPLATE) for p in plans.values())


def test_fast_path_equals_the_template_on_random_conversations(proc):
    """Splicing texts into a structure's pieces reproduces apply_chat_template exactly, and the
    spans are the assistant labels found independently, on awkward texts."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from torchtitan_ext.vl.chat import renderer
    from torchtitan_ext.vl.sample import _encode, _pipeline

    txt = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                  max_size=12).filter(lambda t: "<|" not in t)  # fmt: skip
    part = st.one_of(st.just(IMG), txt.map(lambda t: {"type": "text", "text": t}))
    HEADER = "<|im_start|>assistant\n"  # the Qwen chat template's assistant header
    turn = st.tuples(st.sampled_from(["user", "assistant"]),
                     st.one_of(txt, st.lists(part, max_size=3)))  # fmt: skip

    @settings(max_examples=60, deadline=None)
    @given(st.booleans(), txt, st.lists(turn, min_size=1, max_size=5))
    def run(system, sys_text, turns):
        msgs = [{"role": "system", "content": sys_text}] if system else []
        msgs += [{"role": r, "content": c} for r, c in turns]
        if any(m["role"] == "assistant" and not isinstance(m["content"], str)
               and any(p["type"] == "image" for p in m["content"]) for m in msgs):  # fmt: skip
            return
        text = proc.apply_chat_template(msgs, tokenize=False)
        assert renderer(proc).render(msgs).text == text
        e = _encode(_pipeline(proc), msgs)
        ids = torch.from_numpy(e.ids)
        want = assistant_labels(proc, ids)
        # An assistant text starting with whitespace merges into its header's newline token:
        # compare where unambiguous. Decided from the template's text, not from the spans under
        # test (a span starting one character early would otherwise switch the check off).
        after = [text[m.end() : m.end() + 1] for m in re.finditer(re.escape(HEADER), text)]
        if not any(c in ("\n", "\r", " ") for c in after):
            assert torch.equal(torch.where(torch.from_numpy(e.target), ids, -100), want)

    run()


def test_hub_source_keeps_image_lists_undecoded(tmp_path):
    """A ``datasets`` dataset (what a hub name loads; here a local directory) with a
    ``Sequence(Image())`` column yields raw ``{bytes, path}`` cells, not PIL images."""
    from torchtitan_ext.vl.sample_chat import make_chat_sample
    from torchtitan_ext.vl.sources import HubSource, Rows

    d = make_chat_sample(tmp_path / "d", n=6)
    src = HubSource(str(d), "train")
    rows = Rows(src, L.choose_layout(src.column_names, src.where))
    raw = rows.read(0, 3)
    assert rows.layout.name == "messages"
    cells = [c for r in raw for c in r["images"]]
    assert cells and all(isinstance(c, dict) and c["bytes"] for c in cells)
    sample = rows.parse(raw[2])
    assert len(sample.images) == 3 and sample.messages[0]["role"] == "system"
