"""Proof: a packed batch from the cache trains a Qwen3-VL model exactly like its samples alone.

A tiny randomly initialised ``Qwen3VLForConditionalGeneration`` (built from a config, no
download; vocabulary covering the offline tokenizer) runs (a) a batch collated from cached packs
and (b) every sample of those packs alone as transformers alone makes it: its source row read
with pyarrow, ``Qwen3VLProcessor`` on the chat template's text and the PIL image, labels on the
assistant span found in the ids, and the model's own mRoPE positions (no ``position_ids``
given). The packed batch holds exactly those ids and ``get_rope_index``'s positions, logits agree
to 1e-5, the packed loss equals the token-weighted mean of the per-sample losses, the
torchtitan-format labels give the same loss, and one optimizer step runs on the packed batch.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from torchtitan_ext.vl.collate import PixelNorm, collate_hf, collate_torchtitan
from torchtitan_ext.vl.dataset import CachedVLDataset

from .support.resume import LoaderSpec, assert_resume_exact
from .support.tiny_qwen3vl import run_hf, tiny_model
from .support.vl_chat import pil, positions_reference, vqa_reference
from .support.vl_sample import sample_cache


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.processor import load_processor

    with sample_cache(tmp_path_factory, "vl_eq") as env:
        rows = pq.read_table(sorted(env["data"].glob("*.parquet"))).to_pylist()
        cache = VLCache.open(env["path"])
        yield {**env, "cache": cache, "proc": load_processor(None), "rows": rows}


def alone_references(env, pack_index: int) -> list[dict]:
    """transformers' processing of the pack's source rows (tests/support/vl_chat.py)."""
    out = []
    for r in env["cache"].pack_rows(pack_index):
        row = env["rows"][r]
        out.append(vqa_reference(env["proc"], [pil(row["image"]["bytes"])], row["question"],
                                 row["answer"]))  # fmt: skip
    return out


def test_packed_equals_unpacked_logits_loss_and_step(env):
    cache = env["cache"]
    special = cache.special_tokens
    model = tiny_model(special, vocab=640).eval()
    assert max(special.values()) < 640
    # Two packs of different buckets in one batch: also exercises padding to the longest pack.
    lens = [cache.pack_shape(i) for i in range(len(cache))]
    i_short = min(range(len(cache)), key=lambda i: lens[i])
    i_long = max(range(len(cache)), key=lambda i: (lens[i], -i))
    assert lens[i_short] < lens[i_long], "the fixture needs packs in two buckets"
    packs = [cache.pack(i_long), cache.pack(i_short)]
    norm = PixelNorm.from_metadata(cache.metadata)
    batch = collate_hf(packs, pad_id=special["pad_id"], norm=norm)
    assert batch["position_ids"].shape == (4, 2, lens[i_long])
    with torch.no_grad():
        out = model(**batch)

    total_loss, total_n, worst = 0.0, 0, 0.0
    pad = special["image_pad_id"]
    for row, idx in enumerate([i_long, i_short]):
        refs = alone_references(env, idx)
        assert len(refs) == len(packs[row]["seq_lens"]) >= 2
        offset = 0
        for ref in refs:
            ids = ref["input_ids"]
            n = int(ids.numel())
            # The cache holds exactly transformers' tokens and get_rope_index's positions.
            assert torch.equal(batch["input_ids"][row, offset : offset + n], ids)
            want = positions_reference(model.model, ids, ref["image_grid_thw"], pad)
            assert torch.equal(batch["position_ids"][:, row, offset : offset + n], want)
            alone = run_hf(model, ref)
            d = (out.logits[row, offset : offset + n] - alone.logits[0]).abs().max().item()
            worst = max(worst, d)
            k = int((ref["labels"][1:] != -100).sum())
            total_loss += alone.loss.item() * k
            total_n += k
            offset += n
        assert offset == int(packs[row]["num_tokens"])
    assert worst <= 1e-5, f"max |dlogit| {worst}"
    assert abs(out.loss.item() - total_loss / total_n) <= 1e-5

    # torchtitan layout: labels pre-shifted, same loss on the same logits.
    _, tt_labels = collate_torchtitan(packs, special_tokens=special, norm=norm)
    tt_loss = torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), tt_labels.flatten(), ignore_index=-100
    )
    assert abs(tt_loss.item() - out.loss.item()) <= 1e-5

    # One optimizer step on the packed batch.
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(**batch).loss
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    changed = sum(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert changed > 0.9 * len(before)
    with torch.no_grad():
        assert model(**batch).loss.item() < loss.item()


def test_tiny_training_loop_from_dataset(env):
    """A few HF training steps fed by CachedVLDataset + collate: loss goes down."""
    cache = env["cache"]
    model = tiny_model(cache.special_tokens, vocab=640).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds = CachedVLDataset(env["path"], 0, 1, seed=0)
    norm = PixelNorm.from_metadata(cache.metadata)
    it = iter(ds)
    first = [next(it)]
    losses = []
    for _ in range(6):  # overfit one pack
        batch = collate_hf(first, pad_id=cache.special_tokens["pad_id"], norm=norm)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _hf_loader(env):
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    cfg = CachedVLDataLoader.Config(
        cache_path=str(env["path"]), batch_format="hf", normalize_on="device", seed=3
    )
    return cfg.build(dp_rank=0, dp_world_size=1, seq_len=1024, local_batch_size=2)


def test_loader_of_the_training_loop_resumes_exactly(env):
    """The loader of the loop below, alone, through the resume harness: 2 batches, save (its
    own state_dict), a fresh loader, 2 more == 4 straight, bitwise."""
    spec = LoaderSpec(
        "cached_vl",
        lambda rank, world, infinite: _hf_loader(env),
        state=lambda loaders: loaders[0].state_dict(),
    )
    assert_resume_exact(spec, cuts=(2, 2))


def test_training_loop_with_loader_resumes_exactly(env):
    """HF training loop fed by CachedVLDataLoader: 4 steps straight == 2 steps, checkpoint
    (model, optimizer, loader state), restore into fresh objects, 2 more steps — same losses."""
    import copy

    def loader():
        return _hf_loader(env)

    def steps(model, opt, it, dl, n):
        out = []
        for _ in range(n):
            batch = dl.finish_on_device(next(it))  # uint8 -> float where the batch lives
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    special = env["cache"].special_tokens
    model = tiny_model(special, vocab=640).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dl = loader()
    it = iter(dl)
    first = steps(model, opt, it, dl, 2)
    ck = {
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "data": copy.deepcopy(dl.state_dict()),
    }
    straight = first + steps(model, opt, it, dl, 2)

    model2 = tiny_model(special, vocab=640).train()
    model2.load_state_dict(ck["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    opt2.load_state_dict(ck["opt"])
    dl2 = loader()
    dl2.load_state_dict(ck["data"])
    resumed = first + steps(model2, opt2, iter(dl2), dl2, 2)
    assert resumed == straight
    assert dl2.get_stats()["batches"] == 2
