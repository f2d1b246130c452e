"""Packed chat samples (several images, several turns, text-only ones) train a Qwen3-VL exactly
like the same samples run one at a time.

The chat sample set is built into a cache; two packs holding multi-image, multi-turn samples are
collated into one batch and run through a tiny random ``Qwen3VLForConditionalGeneration``. Each
of their samples is then made from its raw Parquet row (read with pyarrow) by transformers alone:
``apply_chat_template`` + ``Qwen3VLProcessor``, labels on the assistant spans found in the ids,
and run alone with the model's own mRoPE positions. The batch holds exactly those ids and
``get_rope_index``'s positions, logits agree to 1e-5 on every token, and the packed loss is the
token-weighted mean of the per-sample losses.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from torchtitan_ext.vl.collate import PixelNorm, collate_hf

from .support.tiny_qwen3vl import run_hf, tiny_model
from .support.vl_chat import chat_reference, positions_reference


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.processor import load_processor
    from torchtitan_ext.vl.sample_chat import chat_sample_path

    root = tmp_path_factory.mktemp("chatpack")
    data = chat_sample_path(n=36, root=root / "data")
    path = build_cache(data, "train", root / "cache", 1024, 8, buckets=[512, 768],
                       show_progress=False)  # fmt: skip
    return {
        "cache": VLCache.open(path),
        "rows": pq.read_table(sorted(data.glob("*.parquet"))).to_pylist(),
        "proc": load_processor(None),
    }


def test_packed_chat_equals_unpacked_logits(env):
    cache = env["cache"]
    special = cache.special_tokens
    pad = special["image_pad_id"]

    def images_per_sample(i: int) -> list[int]:
        p = cache.pack(i)
        out, at = [], 0
        for n in p["seq_lens"].tolist():
            is_img = (p["input_ids"][at : at + n] == pad).int()
            out.append(int((torch.diff(is_img, prepend=torch.zeros(1)) == 1).sum()))
            at += n
        return out

    counts = [images_per_sample(i) for i in range(len(cache))]
    richest = max(range(len(cache)), key=lambda i: (max(counts[i]), len(counts[i])))
    with_text_only = next(i for i in range(len(cache)) if i != richest and 0 in counts[i])
    packs_i = [richest, with_text_only]
    packs = [cache.pack(i) for i in packs_i]
    norm = PixelNorm.from_metadata(cache.metadata)
    batch = collate_hf(packs, pad_id=special["pad_id"], norm=norm)
    model = tiny_model(special, vocab=1100).eval()
    with torch.no_grad():
        out = model(**batch)

    worst, total_loss, total_n = 0.0, 0.0, 0
    seen_multi_image_multi_turn = seen_text_only = False
    for b, idx in enumerate(packs_i):
        offset = 0
        for r in cache.pack_rows(idx):
            row = env["rows"][r]
            ref = chat_reference(env["proc"], row)
            ids = ref["input_ids"]
            n = int(ids.numel())
            assert torch.equal(batch["input_ids"][b, offset : offset + n], ids)
            want = positions_reference(model.model, ids, ref["image_grid_thw"], pad)
            assert torch.equal(batch["position_ids"][:, b, offset : offset + n], want)
            turns = sum(m["role"] == "assistant" for m in row["messages"])
            seen_multi_image_multi_turn |= len(row["images"]) >= 2 and turns >= 2
            seen_text_only |= not row["images"]
            alone = run_hf(model, ref)
            d = (out.logits[b, offset : offset + n] - alone.logits[0]).abs().max().item()
            worst = max(worst, d)
            k = int((ref["labels"][1:] != -100).sum())
            total_loss += alone.loss.item() * k
            total_n += k
            offset += n
        assert offset == int(packs[b]["num_tokens"])
    assert seen_multi_image_multi_turn, "the packs hold no multi-image, multi-turn sample"
    assert seen_text_only, "the packs hold no text-only sample"
    assert worst <= 1e-5, f"max |dlogit| {worst}"
    assert abs(out.loss.item() - total_loss / total_n) <= 1e-5
