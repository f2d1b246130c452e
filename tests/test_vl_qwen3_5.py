"""``batch_format = "torchtitan"`` judged by the code that consumes it: torchtitan 0.3.0's own VLM.

1. Our batch equals torchtitan's ``MultiModalCollator`` output for the same samples. The samples
   torchtitan's collator gets are built independently of our preprocessing, the way its
   ``mm_datasets`` builds them (``input_ids``/``labels``/``positions`` + one float (1, H, W, C)
   image per picture, packed by its own ``MMSamplePacker._merge_samples``): token ids from the
   Hugging Face processor on the chat text, pixels from the HF image processor (its normalised
   image, captured right before it patchifies; torchtitan's own decoder needs torchvision).
2. torchtitan's ``Qwen35VisionEncoder``, image-token merge, MRoPE and per-document masks run on our
   batch, through its trainer's ``post_dataloading_process`` (the GatedDeltaNet layers need
   flash-linear-attention on a GPU, so the forward uses a full-attention-only variant).
3. The loader refuses a cache whose special-token ids differ from the model's tokenizer.
4. The GPU train config loads.

Runs on CPU: ``cpu_compat`` imports ``torchtitan.models.qwen3_5`` without fla / torchvision;
torch.compile'd flex attention is replaced by its eager form (same function, no CPU compile).
"""

from __future__ import annotations

import io
import json
import types
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtitan_ext import cpu_compat

cpu_compat.apply()  # before torchtitan.trainer; imports qwen3_5 with import-only fla/torchvision

try:
    import torchtitan.models.qwen3_5 as qwen3_5  # noqa: E402
except ModuleNotFoundError as e:  # on CUDA cpu_compat is inert: the real fla must be installed
    pytest.skip(
        f"torchtitan.models.qwen3_5 needs {e.name!r} on a CUDA machine", allow_module_level=True
    )
from torchtitan.components.tokenizer import MultiModalTokenizer  # noqa: E402
from torchtitan.hf_datasets.multimodal.mm_collator import MultiModalCollator  # noqa: E402
from torchtitan.hf_datasets.multimodal.utils.packing import MMSamplePacker  # noqa: E402

from torchtitan_ext.vl.collate import PixelNorm, collate_torchtitan  # noqa: E402

from .support.tt_qwen3_5 import eager_flex_attention, small_qwen3_5, trainer_stub  # noqa: E402
from .support.vl_sample import sample_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQ = 1024
BUCKETS = [512, 768]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import pyarrow.parquet as pq

    from torchtitan_ext.vl.cache import VLCache
    from torchtitan_ext.vl.processor import load_processor, offline_processor_dir

    with sample_cache(tmp_path_factory, "qwen3_5", seq_len=SEQ, buckets=BUCKETS) as built:
        tok = MultiModalTokenizer(
            MultiModalTokenizer.Config(**qwen3_5.QWEN3_5_SPECIAL_TOKENS),
            tokenizer_path=str(offline_processor_dir()),
        )
        rows = pq.read_table(sorted(Path(built["data"]).glob("*.parquet"))[0]).to_pylist()
        yield types.SimpleNamespace(
            **built, cache=VLCache.open(built["path"]), rows=rows, tok=tok, proc=load_processor()
        )


def torchtitan_sample(proc, row: dict) -> dict:
    """One sample as torchtitan's mm_datasets hands it to the collator, from the raw row, with
    the Hugging Face processor (not our fast path): ids of the chat text with expanded image
    tokens, labels on the answer turn (its text and <|im_end|>), positions, and the normalised image as (1, H, W, C)."""
    from PIL import Image

    img = Image.open(io.BytesIO(row["image"]["bytes"]))
    user = {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": row["question"]}],
    }
    chat = [user, {"role": "assistant", "content": row["answer"]}]
    full = proc.apply_chat_template(chat, tokenize=False)
    prompt = proc.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    ip, seen = proc.image_processor, []
    patchify = ip.patchify

    def capture(image, **kw):  # HF's resized + rescaled + normalised (C, H, W) float32 image
        seen.append(torch.from_numpy(image.copy()))
        return patchify(image, **kw)

    ip.patchify = capture
    try:
        ids = proc(text=[full], images=[img], return_tensors="pt")["input_ids"][0]
        n_prompt = proc(text=[prompt], images=[img], return_tensors="pt")["input_ids"].shape[1]
    finally:
        del ip.patchify
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    end = n_prompt + int((ids[n_prompt:] == im_end).nonzero()[0])  # the answer's <|im_end|>
    at = torch.arange(len(ids))
    return {
        "input_ids": ids,
        "labels": torch.where((at >= n_prompt) & (at <= end), ids, -100),
        "positions": torch.arange(len(ids)),
        "pixel_values": [seen[0].permute(1, 2, 0).unsqueeze(0)],
    }


def their_collator(tok, batch_size: int) -> MultiModalCollator:
    """torchtitan's collator as its qwen3_5 configs set it up (config_registry._dataloader)."""
    return MultiModalCollator(
        batch_size=batch_size,
        seq_len=SEQ,
        max_images_per_batch=10**6,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        tokenizer=tok,
        build_mrope_positions=True,
    )


def assert_same_batch(theirs, ours) -> None:
    (t_in, t_labels), (o_in, o_labels) = theirs, ours
    assert list(o_in) == list(t_in), "same keys, same order"
    for key, t in t_in.items():
        o = o_in[key]
        if isinstance(t, torch.Tensor):
            assert isinstance(o, torch.Tensor), key
            assert (o.shape, o.dtype) == (t.shape, t.dtype), key
            assert torch.equal(o, t), f"{key}: values differ at {(o != t).nonzero()[:5].tolist()}"
        else:
            assert o == t, key
    assert o_labels.dtype == t_labels.dtype and torch.equal(o_labels, t_labels), "labels"


def test_cache_packs_have_several_samples_images_and_lengths(env):
    """The comparison below is only worth something if the packs are non-trivial."""
    lengths = {env.cache.pack_shape(i) for i in range(len(env.cache))}
    assert len(lengths) >= 2, lengths
    assert all(len(env.cache.pack_rows(i)) >= 2 for i in range(len(env.cache)))


@pytest.mark.parametrize("pack_ids", [(0,), (1, 2), (0, 3)])
def test_batch_equals_multimodal_collator(env, pack_ids):
    cache = env.cache
    packs = [cache.pack(i) for i in pack_ids]
    samples = [
        MMSamplePacker._merge_samples(
            [torchtitan_sample(env.proc, env.rows[r]) for r in cache.pack_rows(i)]
        )
        for i in pack_ids
    ]
    theirs = their_collator(env.tok, len(pack_ids))(samples)
    norm = PixelNorm.from_metadata(cache.metadata)
    ours = collate_torchtitan(packs, special_tokens=cache.special_tokens, norm=norm, pad_to=SEQ)
    assert theirs[0]["pixel_values"].shape[0] >= 2 * len(pack_ids)  # several images per pack
    assert_same_batch(theirs, ours)
    # uint8 pixels normalised after the copy give the same batch
    from torchtitan_ext.vl.collate import finish_on_device

    dev = collate_torchtitan(
        packs, special_tokens=cache.special_tokens, norm=norm, pad_to=SEQ, normalize_on="device"
    )
    assert_same_batch(theirs, finish_on_device(dev, norm))


def _pack(samples: list[tuple[list[int], list[tuple[int, int]]]], length: int) -> dict:
    """A cache-shaped pack from (text-run lengths, image grids (h, w)) per sample: text runs and
    image runs alternate; positions come from the cache's own function (processor.position_rows)."""
    import numpy as np

    from torchtitan_ext.vl.processor import position_rows

    ids, pos, grids = [], [], []
    for runs, imgs in samples:
        seg = []
        for k, n in enumerate(runs):
            seg += [11 + k] * n
            if k < len(imgs):
                h, w = imgs[k]
                seg += [IMG] * (h * w // 4)
        g = np.array([[1, h, w] for h, w in imgs], dtype=np.int64).reshape(-1, 3)
        pos.append(position_rows(np.array(seg), g, IMG, 2))
        ids += seg
        grids += [[1, h, w] for h, w in imgs]
    n = len(ids)
    out_ids = torch.full((length,), PAD, dtype=torch.int64)
    out_ids[:n] = torch.tensor(ids)
    out_pos = torch.zeros((4, length), dtype=torch.int64)
    if n:
        out_pos[:, :n] = torch.from_numpy(np.concatenate(pos, axis=1))
    n_patches = sum(h * w for _, h, w in grids)
    return {
        "input_ids": out_ids,
        "labels": torch.where(out_ids == PAD, -100, out_ids),
        "position_ids": out_pos,
        "pixel_u8": torch.zeros((n_patches, 768), dtype=torch.uint8),
        "image_grid_thw": torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        "num_tokens": torch.tensor(n),
    }


IMG, PAD = 7, 0
SPECIAL = {"image_id": IMG, "video_id": 8, "vision_start_id": 5, "vision_end_id": 6, "pad_id": PAD}
_grid = st.tuples(st.sampled_from([2, 4, 6]), st.sampled_from([2, 4, 8]))
# (text-run lengths, image grids): k images between k + 1 text runs. At least 2 tokens: a
# 1-token sample is the collator's documented blind spot (positions 0, 0 hide the boundary).
_sample = (
    st.integers(0, 3)
    .flatmap(
        lambda k: st.tuples(
            st.lists(st.integers(1, 5), min_size=k + 1, max_size=k + 1),
            st.lists(_grid, min_size=k, max_size=k),
        )
    )
    .filter(lambda s: sum(s[0]) + len(s[1]) >= 2)
)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.lists(st.lists(_sample, min_size=1, max_size=4), min_size=1, max_size=3),
    extra=st.integers(0, 6),
)
def test_mrope_matches_collator_on_any_pack(batch, extra):
    """Text-only samples, several images per sample, any padding, several packs: our
    mrope_positions equal the collator's ``_build_mrope_positions`` on the same tokens, grids
    and positions."""
    packs = []
    for samples in batch:
        n = sum(sum(r) + sum(h * w // 4 for h, w in i) for r, i in samples)
        packs.append(_pack(samples, n + extra))
    inp, _ = collate_torchtitan(packs, special_tokens=SPECIAL)
    if inp["grid_thw"] is None:
        assert "mrope_positions" not in inp  # the collator builds none for text-only batches
        return
    fake_tok = types.SimpleNamespace(pad_id=PAD)
    coll = MultiModalCollator(
        batch_size=len(packs), seq_len=SEQ, max_images_per_batch=99, patch_size=16,
        temporal_patch_size=2, spatial_merge_size=2, tokenizer=fake_tok,
        build_mrope_positions=True,
    )  # fmt: skip
    theirs = coll._build_mrope_positions(
        inp["input"], inp["grid_thw"], None, inp["positions"], image_token_id=IMG, video_token_id=8
    )
    assert torch.equal(inp["mrope_positions"], theirs)


def test_text_only_batch_equals_collator():
    packs = [_pack([([6], []), ([3], [])], 12), _pack([([4], [])], 12)]
    samples = [
        {
            "input_ids": p["input_ids"][: int(p["num_tokens"])],
            "labels": p["labels"][: int(p["num_tokens"])],
            "positions": p["position_ids"][0, : int(p["num_tokens"])],
        }
        for p in packs
    ]
    tok = types.SimpleNamespace(pad_id=PAD, TOKEN_FIELDS=MultiModalTokenizer.TOKEN_FIELDS)
    for name in tok.TOKEN_FIELDS:
        setattr(tok, f"{name}_id", SPECIAL[f"{name}_id"])
    coll = MultiModalCollator(
        batch_size=2, seq_len=12, max_images_per_batch=9, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, tokenizer=tok, build_mrope_positions=True,
    )  # fmt: skip
    assert_same_batch(coll(samples), collate_torchtitan(packs, special_tokens=SPECIAL))


# ------------------------------------------------------------------------------- the model side
@pytest.fixture
def eager_flex():
    with eager_flex_attention():
        yield


def _our_batch(env, pack_ids=(0,)):
    cache = env.cache
    return collate_torchtitan(
        [cache.pack(i) for i in pack_ids],
        special_tokens=cache.special_tokens,
        norm=PixelNorm.from_metadata(cache.metadata),
    )


def test_vision_encoder_and_image_merge_run_on_our_batch(env, eager_flex):
    inp, _ = _our_batch(env, (0, 1))
    _, model = small_qwen3_5(vocab=env.tok.get_vocab_size())
    grid = inp["grid_thw"]
    with torch.no_grad():
        vision = model.vision_encoder(inp["pixel_values"], grid_thw=grid)
        assert vision.shape[:2] == (grid.shape[0], inp["pixel_values"].shape[1] // 4)
        assert torch.isfinite(vision).all()
        embeds = model._prepare_multimodal_embeds(
            inp["input"],
            pixel_values=inp["pixel_values"],
            pixel_values_videos=None,
            grid_thw=grid,
            grid_thw_videos=None,
            special_tokens=inp["special_tokens"],
        )  # get_vision_positions raises on any run / grid mismatch
        text = model.tok_embeddings(inp["input"])
    is_img = inp["input"] == inp["special_tokens"]["image_id"]
    assert is_img.sum() == int((grid.prod(-1) // 4).sum())
    assert torch.equal(embeds[~is_img], text[~is_img])
    counts = (grid.prod(-1) // 4).tolist()
    expected = torch.cat([vision[i, :c] for i, c in enumerate(counts)])
    assert torch.equal(embeds[is_img], expected), "image i's features land on image i's tokens"


def test_forward_through_trainer_keeps_packed_samples_independent(env, eager_flex):
    """torchtitan's Trainer.post_dataloading_process turns our batch into the model's kwargs
    (attention masks from our positions); the last sample of a pack gets the same logits as when
    it is alone: no position, mRoPE, mask or vision path merges the samples of a pack."""
    from torchtitan.trainer import Trainer

    cfg, model = small_qwen3_5(vocab=env.tok.get_vocab_size())
    cache = env.cache
    pack = cache.pack(0)
    lens = pack["seq_lens"].tolist()
    assert len(lens) >= 2
    start, n = sum(lens[:-1]), lens[-1]
    is_img = (pack["input_ids"][start : start + n] == cache.special_tokens["image_pad_id"]).long()
    n_img = int((torch.diff(is_img, prepend=torch.zeros(1, dtype=torch.long)) == 1).sum())
    assert n_img >= 1, "the last sample has an image"
    grid = pack["image_grid_thw"][-n_img:]
    alone = {
        "input_ids": pack["input_ids"][start : start + n],
        "labels": pack["labels"][start : start + n],
        "position_ids": pack["position_ids"][:, start : start + n],
        "pixel_u8": pack["pixel_u8"][-int(grid.prod(-1).sum()) :],
        "image_grid_thw": grid,
        "num_tokens": torch.tensor(n),
    }
    trainer = trainer_stub(cfg, model)
    norm = PixelNorm.from_metadata(cache.metadata)
    logits = []
    for packs in ([pack], [alone]):
        batch = collate_torchtitan(packs, special_tokens=cache.special_tokens, norm=norm)
        inputs, labels, extra = Trainer.post_dataloading_process(trainer, *batch)
        assert set(extra) == set(batch[0]) - {"input"} | {"attention_masks"}
        with torch.no_grad():
            logits.append(model(inputs, **extra))
    packed, single = logits[0][0, start : start + n], logits[1][0]
    assert torch.isfinite(packed).all()
    torch.testing.assert_close(packed, single, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------- special-token agreement
def _tokenizer_dir(root: Path, specials: list[str]) -> Path:
    """A tokenizer directory whose special tokens are registered in the given order."""
    from tokenizers import Tokenizer, models

    d = root / f"tok_{abs(hash(tuple(specials)))}"
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return d


def _build_loader(env, tok, **cfg):
    from torchtitan_ext.loaders.vl import CachedVLDataLoader

    return CachedVLDataLoader.Config(**cfg).build(
        dp_rank=0, dp_world_size=1, tokenizer=tok, seq_len=SEQ, local_batch_size=1
    )


def test_mismatching_special_tokens_are_refused_before_building(env, tmp_path, monkeypatch):
    from torchtitan_ext.vl.processor import QWEN_SPECIAL_TOKENS

    wrong = MultiModalTokenizer(
        MultiModalTokenizer.Config(**qwen3_5.QWEN3_5_SPECIAL_TOKENS),
        tokenizer_path=str(_tokenizer_dir(tmp_path, list(reversed(QWEN_SPECIAL_TOKENS)))),
    )
    with pytest.raises(ValueError) as err:
        _build_loader(env, wrong, cache_path=str(env.path))
    msg = str(err.value)
    assert "\n" not in msg and "hf_assets_path=" in msg and str(env.path) in msg
    ours = env.cache.special_tokens
    for key, mine in (("image_id", "image_pad_id"), ("pad_id", "pad_id")):
        assert f"{key} cache={ours[mine]} model={getattr(wrong, key)}" in msg
    # keyed lookup / build: refused from the processor's ids, before any cache is built
    import torchtitan_ext.vl.build as vl_cache

    def no_build(*a, **k):
        raise AssertionError("a cache was built before the special-token check")

    monkeypatch.setattr(vl_cache, "build_cache", no_build)
    with pytest.raises(ValueError, match="image_id cache="):
        _build_loader(
            env, wrong, dataset_path=str(env.data), cache_dir=str(tmp_path / "c"),
            build_if_missing=True,
        )  # fmt: skip


def test_matching_tokenizer_is_accepted(env):
    loader = _build_loader(env, env.tok, cache_path=str(env.path), infinite=False)
    inp, _ = next(iter(loader))
    assert inp["special_tokens"] == {
        f"{n}_id": getattr(env.tok, f"{n}_id") for n in env.tok.TOKEN_FIELDS
    }


# --------------------------------------------------------------------------------- the GPU config
def test_gpu_config_loads_with_agreeing_paths():
    from torchtitan_ext.config import load_config

    cfg = load_config(REPO / "train_configs" / "qwen3_5_vl_gpu.toml")
    assert cfg.model_spec.name == "qwen3_5" and cfg.model_spec.flavor == "9B"
    assert isinstance(cfg.tokenizer, MultiModalTokenizer.Config)
    dl = cfg.dataloader
    assert type(dl).__name__ == "Config" and dl.batch_format == "torchtitan"
    assert dl.model_path == cfg.hf_assets_path == cfg.checkpoint.initial_load_path
    assert dl.normalize_on == "device" and cfg.staging.enable
    assert cfg.training.seq_len == 8192 and dl.buckets == [4096, 6144]


# ------------------------------------------------------------------------- cpu_compat's stand-ins
def test_import_only_stand_ins_leave_no_trace():
    """qwen3_5 imported (above) without fla / torchvision; afterwards neither is in sys.modules
    nor findable, and the GatedDeltaNet kernel names the missing package when called."""
    import importlib.util
    import sys

    from torchtitan.models.qwen3_5 import model as qwen3_5_model

    for root in ("fla", "torchvision"):
        if getattr(sys.modules.get(root), "__cpu_compat_stub__", False):
            pytest.fail(f"{root} stand-in left in sys.modules")
    if importlib.util.find_spec("fla") is None:
        assert not any(n == "fla" or n.startswith("fla.") for n in sys.modules)
        with pytest.raises(RuntimeError, match="flash-linear-attention"):
            qwen3_5_model._fla_chunk_gated_delta_rule(None)
