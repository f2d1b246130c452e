"""Proof: a packed batch from the cache trains a Qwen3-VL model exactly like its samples alone.

A tiny randomly initialised ``Qwen3VLForConditionalGeneration`` (built from a config, no
download; vocabulary covering the offline tokenizer) runs (a) a batch collated from cached packs
and (b) every sample of those packs alone, processed again from its source row by
``process_sample`` (the unpacked path, independent of the cache). Logits agree to 1e-5, the
packed loss equals the token-weighted mean of the per-sample losses, the torchtitan-format labels
give the same loss, and one optimizer step runs on the packed batch.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtitan_ext.vl.collate import PixelNorm, collate_hf, collate_torchtitan  # noqa: E402
from torchtitan_ext.vl.dataset import CachedVLDataset  # noqa: E402

from .support.tiny_qwen3vl import run_alone, tiny_model  # noqa: E402
from .support.vl_sample import sample_cache  # noqa: E402


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.processor import load_processor

    with sample_cache(tmp_path_factory, "vl_eq") as env:
        yield {**env, "cache": VLCache.open(env["path"]), "proc": load_processor(None)}


def alone_samples(env, pack_index: int):
    """Re-process the pack's source rows from scratch (the unpacked path)."""
    import datasets

    from torchtitan_ext.vl.processor import decode_image
    from torchtitan_ext.vl.sample import process_sample

    rows = env["cache"].pack_rows(pack_index)
    ds = datasets.load_dataset(
        "parquet", data_files=str(env["data"] / "*.parquet"), split="train"
    ).cast_column("image", datasets.Image(decode=False))
    out = []
    for r in rows:
        row = ds[int(r)]
        out.append(
            process_sample(env["proc"], decode_image(row["image"]), row["question"], row["answer"])
        )
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
    for row, idx in enumerate([i_long, i_short]):
        samples = alone_samples(env, idx)
        assert len(samples) == len(packs[row]["seq_lens"]) >= 1
        offset = 0
        for s in samples:
            n = int(s.input_ids.numel())
            # The cache holds exactly the unpacked sample's tokens, positions and pixels.
            assert torch.equal(batch["input_ids"][row, offset : offset + n], s.input_ids)
            assert torch.equal(batch["position_ids"][:, row, offset : offset + n], s.position_ids)
            ref = run_alone(model, s, norm)
            d = (out.logits[row, offset : offset + n] - ref.logits[0]).abs().max().item()
            worst = max(worst, d)
            k = int((s.labels[1:] != -100).sum())
            total_loss += ref.loss.item() * k
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


def test_training_loop_with_loader_resumes_exactly(env):
    """HF training loop fed by CachedVLDataLoader: 4 steps straight == 2 steps, checkpoint
    (model, optimizer, loader state), restore into fresh objects, 2 more steps — same losses."""
    import copy

    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    def loader():
        cfg = CachedVLDataLoader.Config(
            cache_path=str(env["path"]), batch_format="hf", normalize_on="device", seed=3
        )
        return cfg.build(dp_rank=0, dp_world_size=1, seq_len=1024, local_batch_size=2)

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
