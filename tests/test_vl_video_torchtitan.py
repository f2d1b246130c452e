"""``batch_format = "torchtitan"`` with video, judged by torchtitan 0.3.0's own code.

1. Each video travels as one item per merged frame (grid ``[1, h, w]``), its rows HF's
   ``pixel_values_videos`` rows bit for bit, zero-padded per item; normalising on the device
   gives the same batch.
2. ``mrope_positions`` equals torchtitan's ``MultiModalCollator._build_mrope_positions`` given
   the whole videos' grids (it splits them per frame itself).
3. torchtitan's ``qwen3_5`` model runs on a pack mixing a video, an image and text through its
   trainer's ``post_dataloading_process``: each frame's features land on that frame's tokens,
   and every sample of the pack gets the logits it gets alone. One item per whole video is what
   its ``get_vision_positions`` refuses (Qwen3-VL's prompt puts timestamps between frames).
"""

from __future__ import annotations

import pytest
import torch

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

from torchtitan_ext.vl.collate import collate_hf, collate_torchtitan, finish_on_device  # noqa: E402
from torchtitan_ext.vl.collate_torchtitan import _pad_per_image  # noqa: E402

from .support.tt_qwen3_5 import eager_flex_attention, small_qwen3_5, trainer_stub  # noqa: E402
from .support.video_packs import mixed_samples, pack_of  # noqa: E402


@pytest.fixture(scope="module")
def samples(proc):
    return mixed_samples(proc)  # video (2 frames), image, text only, video (3 frames)


@pytest.fixture(scope="module")
def tok():
    from torchtitan_ext.vl.processor import offline_processor_dir

    return MultiModalTokenizer(
        MultiModalTokenizer.Config(**qwen3_5.QWEN3_5_SPECIAL_TOKENS),
        tokenizer_path=str(offline_processor_dir()),
    )


@pytest.fixture(scope="module")
def packs(samples, special):
    return [pack_of(samples[:3], special), pack_of(samples[3:], special)]


def test_each_merged_frame_is_one_item_with_hf_rows(packs, special):
    inp, _ = collate_torchtitan(packs, special_tokens=special)
    hf = collate_hf(packs, pad_id=special["pad_id"])
    videos, frames = inp["pixel_values_videos"], inp["grid_thw_videos"]
    want = [[1, h, w] for t, h, w in hf["video_grid_thw"].tolist() for _ in range(t)]
    assert frames.tolist() == want and len(want) == 5  # 2 + 3 merged frames
    assert videos.dtype == torch.float32 and videos.shape[1] % 4 == 0
    rows, o = hf["pixel_values_videos"], 0
    for i, (_, h, w) in enumerate(frames.tolist()):
        assert torch.equal(videos[i, : h * w], rows[o : o + h * w]), f"frame item {i}"
        assert not videos[i, h * w :].any(), f"frame item {i}: padding is exactly 0"
        o += h * w
    assert o == rows.shape[0]
    # the images of the same packs are what they are without the videos
    no_video = [{k: v for k, v in p.items() if not k.startswith("video")} for p in packs]
    plain, _ = collate_torchtitan(no_video, special_tokens=special)
    for key in ("input", "positions", "pixel_values", "grid_thw", "mrope_positions"):
        assert torch.equal(inp[key], plain[key]), key


def test_normalising_on_the_device_gives_the_same_batch(packs, special):
    here = collate_torchtitan(packs, special_tokens=special)
    there = collate_torchtitan(packs, special_tokens=special, normalize_on="device")
    assert there[0]["pixel_values_videos"].dtype == torch.uint8
    done = finish_on_device(there)
    assert torch.equal(done[1], here[1])
    for key, value in here[0].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(done[0][key], value), key


def test_mrope_equals_the_collators_for_the_whole_videos(packs, special, tok):
    inp, _ = collate_torchtitan(packs, special_tokens=special)
    whole = collate_hf(packs, pad_id=special["pad_id"])["video_grid_thw"]
    collator = MultiModalCollator(
        batch_size=2, seq_len=int(inp["input"].shape[1]), max_images_per_batch=10**6,
        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, tokenizer=tok,
        build_mrope_positions=True,
    )  # fmt: skip
    theirs = collator._build_mrope_positions(
        inp["input"],
        inp["grid_thw"],
        whole.clone(),  # it splits per frame in place
        inp["positions"],
        image_token_id=inp["special_tokens"]["image_id"],
        video_token_id=inp["special_tokens"]["video_id"],
    )
    assert torch.equal(inp["mrope_positions"], theirs)


@pytest.fixture
def eager_flex():
    with eager_flex_attention():
        yield


def _frame_features(model, inp) -> torch.Tensor:
    """The vision tower's features of each frame item, in token order."""
    frames = inp["grid_thw_videos"]
    feats = model.vision_encoder(inp["pixel_values_videos"], grid_thw=frames)
    return torch.cat([feats[i, :c] for i, c in enumerate((frames.prod(-1) // 4).tolist())])


def test_qwen3_5_runs_a_video_pack_and_keeps_its_samples_apart(samples, special, tok, eager_flex):
    from torchtitan.trainer import Trainer

    cfg, model = small_qwen3_5(vocab=tok.get_vocab_size())
    trainer = trainer_stub(cfg, model)
    mixed = samples[:3]  # video, image, text only

    def run(group):
        batch = collate_torchtitan([pack_of(group, special)], special_tokens=special)
        inputs, _, extra = Trainer.post_dataloading_process(trainer, *batch)
        with torch.no_grad():
            return batch[0], model(inputs, **extra)[0]

    inp, packed = run(mixed)
    with torch.no_grad():
        embeds = model._prepare_multimodal_embeds(
            inp["input"],
            pixel_values=inp["pixel_values"],
            pixel_values_videos=inp["pixel_values_videos"],
            grid_thw=inp["grid_thw"],
            grid_thw_videos=inp["grid_thw_videos"],
            special_tokens=inp["special_tokens"],
        )
        is_vid = inp["input"] == inp["special_tokens"]["video_id"]
        assert torch.equal(embeds[is_vid], _frame_features(model, inp))
        hf = collate_hf([pack_of(mixed, special)], pad_id=special["pad_id"])
        whole = hf["video_grid_thw"]
        with pytest.raises(ValueError, match="Multimodal misalignment"):
            model._prepare_multimodal_embeds(  # one item per whole video: refused upstream
                inp["input"],
                pixel_values=None,
                pixel_values_videos=_pad_per_image(hf["pixel_values_videos"], whole, 2),
                grid_thw=None,
                grid_thw_videos=whole,
                special_tokens=inp["special_tokens"],
            )
    assert torch.isfinite(packed).all()
    o = 0
    for s in mixed:
        n = len(s["input_ids"])
        _, alone = run([s])
        torch.testing.assert_close(packed[o : o + n], alone, rtol=1e-4, atol=1e-4)
        o += n


def test_a_video_only_batch_has_mrope_and_no_image_items(samples, special, tok):
    inp, _ = collate_torchtitan([pack_of(samples[3:], special)], special_tokens=special)
    assert inp["pixel_values"] is None and inp["grid_thw"] is None
    assert len(inp["grid_thw_videos"]) == 3 and inp["grid_thw_videos"][:, 0].eq(1).all()
    assert inp["mrope_positions"].shape == (*inp["input"].shape, 3)
    assert torch.equal(
        inp["mrope_positions"][0].T, pack_of(samples[3:], special)["position_ids"][1:]
    )
