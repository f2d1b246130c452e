"""qwen3_vl under ``torch.compile`` (``models/qwen3_vl/compile.py``) and the matmul patch
embedding (``models/qwen3_vl/patch_embed.py``): the loop-free vision attention gives
transformers' outputs, compiling the blocks takes a bounded number of compilations however the
sequence bucket, image count and patch count vary, and ``patch_embed = "matmul"`` gives the
Conv3d's outputs with the same checkpoint keys."""

from __future__ import annotations

import copy

import pytest
import torch

from torchtitan_ext.models.qwen3_vl import compile as vl_compile
from torchtitan_ext.models.qwen3_vl.flavors import OFFLINE_TOKEN_IDS, flavor_config
from torchtitan_ext.models.qwen3_vl.model import Qwen3VLModel

PATCH_DIM = 3 * 2 * 16 * 16  # channels x temporal patch x patch x patch (debug flavors)
# (t, h, w) in patches: different sizes (padding inside the attention), a two-frame video-like
# entry (two segments) and an image whose patch count is not the longest's
GRID = [[1, 8, 12], [2, 4, 6], [1, 6, 6], [1, 2, 4]]


def tiny(flavor: str = "debugmodel", **cfg) -> Qwen3VLModel:
    torch.manual_seed(0)
    model = Qwen3VLModel(Qwen3VLModel.Config(hf_config=flavor_config(flavor), **cfg))
    model.init_states()
    return model


def pixels(grid: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.tensor(grid)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(g.prod(-1).sum()), PATCH_DIM, generator=gen), g


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_loop_free_vision_attention_gives_transformers_outputs(flavor):
    """The vision tower with :func:`prepare`'s attention (one SDPA over segments padded to the
    longest) equals transformers' per-image loop: last hidden state, merged features and every
    DeepStack feature, forward and input gradient."""
    vis = tiny(flavor).model.visual
    prepared = copy.deepcopy(vis)
    assert vl_compile.prepare(prepared) == len(prepared.blocks)
    px, grid = pixels(GRID)
    px_ref, px_new = px.clone().requires_grad_(), px.clone().requires_grad_()
    ref, new = vis(px_ref, grid_thw=grid), prepared(px_new, grid_thw=grid)
    torch.testing.assert_close(new.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(new.pooler_output, ref.pooler_output, atol=1e-5, rtol=0)
    for a, b in zip(new.deepstack_features, ref.deepstack_features, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    ref.pooler_output.sum().backward()
    new.pooler_output.sum().backward()
    torch.testing.assert_close(px_new.grad, px_ref.grad, atol=1e-5, rtol=1e-4)


def test_segment_attention_pads_per_segment_and_keeps_row_order():
    """The layout pads each segment to the longest with a pointer to the zero row ``N``, and
    ``segment_attention`` equals attention computed segment by segment; a single segment gets
    an empty companion (no dimension of size 1 for dynamo to specialise on)."""
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    gather, keep, scatter = vl_compile.vision_layout(cu)
    assert gather.tolist() == [[0, 1, 2, 10, 10], [3, 4, 5, 6, 7], [8, 9, 10, 10, 10]]
    assert keep.sum(1).tolist() == [3, 5, 2]
    assert scatter.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]
    q, k, v = torch.randn(3, 2, 10, 4).unbind(0)
    out = vl_compile.segment_attention(q, k, v, (gather, keep, scatter), scale=0.5)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], scale=0.5
        )
        torch.testing.assert_close(out[a:b], want.transpose(0, 1), atol=1e-6, rtol=0)
    one = vl_compile.vision_layout(torch.tensor([0, 7]))  # plus an empty segment: S >= 2
    assert one[1].tolist() == [[True] * 7, [True] + [False] * 6] and one[0][1].tolist() == [7] * 7
    out = vl_compile.segment_attention(q[:, :7], k[:, :7], v[:, :7], one, scale=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :7], k[:, :7], v[:, :7], scale=0.5)
    torch.testing.assert_close(out, want.transpose(0, 1), atol=1e-6, rtol=0)


def batch(length: int, grid: list[list[int]], seed: int) -> dict[str, torch.Tensor]:
    """A 2-row batch of ``length`` tokens holding the images of ``grid`` (their placeholder
    tokens in row 0); plain positions (the shapes are what matters here)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 500, (2, length), generator=gen)
    n_img_tokens = sum(t * h * w for t, h, w in grid) // 4
    tokens[0, 4 : 4 + n_img_tokens] = OFFLINE_TOKEN_IDS["image_token_id"]
    pos = torch.arange(length).expand(4, 2, length).contiguous()
    px, g = pixels(grid, seed)
    return {"tokens": tokens, "position_ids": pos, "pixel_values": px, "image_grid_thw": g}


# sequence buckets x image counts x patch counts, in an order that changes them all
BATCHES = [
    (64, [[1, 4, 4]]),
    (96, [[1, 8, 8], [1, 4, 6]]),
    (128, [[1, 6, 6], [1, 2, 2], [1, 4, 8]]),
    (64, [[1, 4, 10], [1, 4, 4]]),
    (96, [[1, 2, 6]]),
    (128, [[1, 8, 6], [1, 6, 6], [1, 2, 4], [1, 2, 2]]),
    (64, [[1, 6, 8], [1, 2, 2], [1, 4, 4]]),
    (96, [[1, 10, 4], [1, 4, 4]]),
]
MAX_FRAMES = 8
"""Frames dynamo may compile over :data:`BATCHES` (measured: 5, in the first two batches): the
decoder layer (static at the first length, symbolic at the second) and the vision block
(dynamic shapes, plus what the first batch's shapes happened to specialise). Transformers' loop
compiled 21 frames and was still compiling at batch 6."""


@pytest.fixture(scope="module")
def compiled_run() -> dict[str, int]:
    """Train steps (forward + backward) of the tiny model with compiled blocks (aot_eager) over
    :data:`BATCHES`; dynamo's counts before and after each."""
    torch._dynamo.reset()
    model = tiny()
    vl_compile.compile_blocks(model, "aot_eager")
    counts = []
    for k, (length, grid) in enumerate(BATCHES):
        before = vl_compile.compile_counts()["frames"]
        b = batch(length, grid, seed=k)
        logits = model(b.pop("tokens"), **b)
        logits.float().pow(2).mean().backward()
        counts.append(vl_compile.compile_counts()["frames"] - before)
    torch._dynamo.reset()
    print("frames compiled per batch:", counts)
    return {"per_batch": counts}


def test_compiled_blocks_stop_compiling_after_two_shapes(compiled_run):
    """Over 8 batches through 3 sequence buckets, 1-4 images and 16-112 patches per image, the
    compiled blocks compile in the first two batches only, at most :data:`MAX_FRAMES` frames;
    transformers' vision attention recompiled at every new image or patch count."""
    per_batch = compiled_run["per_batch"]
    assert sum(per_batch) <= MAX_FRAMES, per_batch
    assert per_batch[2:] == [0] * (len(BATCHES) - 2), per_batch


# ----------------------------------------------------------------------- patch_embed = "matmul"
def test_matmul_patch_embed_gives_the_conv_outputs_without_the_conv():
    """``patch_embed = "matmul"`` embeds patches without calling the Conv3d (it would raise
    here) and gives its outputs (float32, tight), for the patch embedding and the whole tower
    (forward and weight gradient)."""
    conv, mm = tiny(), tiny(patch_embed="matmul")
    mm.load_state_dict(conv.state_dict())

    def no_conv(*a, **k):
        raise AssertionError("the Conv3d ran")

    mm.model.visual.patch_embed.proj.forward = no_conv
    px, grid = pixels(GRID)
    ref = conv.model.visual.patch_embed(px)
    torch.testing.assert_close(mm.model.visual.patch_embed(px), ref, atol=1e-5, rtol=1e-5)
    a, b = conv.model.visual(px, grid_thw=grid), mm.model.visual(px, grid_thw=grid)
    torch.testing.assert_close(b.pooler_output, a.pooler_output, atol=1e-5, rtol=1e-5)
    a.pooler_output.sum().backward()
    b.pooler_output.sum().backward()
    wa, wb = (m.model.visual.patch_embed.proj.weight.grad for m in (conv, mm))
    torch.testing.assert_close(wb, wa, atol=1e-5, rtol=1e-4)


def test_matmul_patch_embed_keeps_the_checkpoint_layout(tmp_path):
    """Same state-dict keys, shapes and tensors as transformers' Conv3d (``proj.weight`` stays
    ``[out, C, T, P, P]``): a conv checkpoint loads strictly into the matmul model and saves
    back unchanged."""
    conv, mm = tiny(), tiny(patch_embed="matmul")
    sd = conv.state_dict()
    assert {k: v.shape for k, v in mm.state_dict().items()} == {k: v.shape for k, v in sd.items()}
    torch.save(sd, tmp_path / "conv.pt")
    mm.load_state_dict(torch.load(tmp_path / "conv.pt"), strict=True)
    for k, v in mm.state_dict().items():
        assert torch.equal(v, sd[k]), k
    assert mm.model.visual.patch_embed.proj.weight.shape == (32, 3, 2, 16, 16)


@pytest.mark.parametrize("cuda, want", [(False, "conv"), (True, "matmul")])
def test_auto_patch_embed_is_the_matmul_where_cuda_is(monkeypatch, cuda, want):
    """The default: on an H200 the matmul took 0.54 ms where the conv took 16 ms (2B tower,
    bf16, fwd+bwd); on a CPU the conv keeps transformers' own arithmetic (exports equal HF)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    model = tiny()
    assert model.config.patch_embed == "auto"
    embed = model.model.visual.patch_embed
    assert ("forward" in vars(embed)) is (want == "matmul")  # the matmul is an instance forward


def test_bad_patch_embed_is_one_config_error(tmp_path):
    from tests.test_qwen3_vl_model import LOADER, job, own_checks
    from torchtitan_ext.toml_config import ConfigError

    with pytest.raises(ConfigError, match=r"\[model\] patch_embed = 'gemm': expected one of"):
        own_checks(job(tmp_path, LOADER, patch_embed="gemm"))
    own_checks(job(tmp_path, LOADER, patch_embed="matmul"))  # accepted
    with pytest.raises(ValueError, match="patch_embed 'gemm'"):
        tiny(patch_embed="gemm")
