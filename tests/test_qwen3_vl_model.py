"""The qwen3_vl model module without a trainer: flavors, the batch format, the HF checkpoint
adapter, and every config error a job must raise before anything is built.

(Training, resume, pack independence in the trainer and HF-weight logits: test_qwen3_vl_train.py.)
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from torchtitan_ext import preflight
from torchtitan_ext.config import ConfigError, load_config
from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.models.qwen3_vl import flavors as fl
from torchtitan_ext.models.qwen3_vl.model import (
    Qwen3VLModel,
    build_hf_model,
    count_params_and_flops,
)
from torchtitan_ext.models.qwen3_vl.state_dict_adapter import (
    Qwen3VLStateDictAdapter,
    safetensors_shapes,
)
from torchtitan_ext.vl.collate import collate_hf, collate_qwen3_vl


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A private asset root (offline processor, sample set) and a small cache at seq 1024."""
    from tests.support.vl_sample import sample_cache
    from torchtitan_ext.vl.cache import VLCache

    with sample_cache(tmp_path_factory, "qwen3_vl_model") as s:
        yield {**s, "cache": Path(s["path"]), "vl": VLCache.open(s["path"])}


def job(tmp_path: Path, body: str = "", assets: Path | None = None, **model: str) -> Path:
    """A qwen3_vl job TOML: the tiny defaults plus ``body`` (tables) and ``hf_assets_path``."""
    m = {"module": "qwen3_vl", "flavor": "debugmodel", **model}
    head = "\n".join(f'{k} = "{v}"' for k, v in m.items())
    top = f'hf_assets_path = "{assets}"\n' if assets else ""
    p = tmp_path / "job.toml"
    p.write_text(f"{top}[model]\n{head}\n" + textwrap.dedent(body))
    return p


def checked(path: Path):
    """The config as ``python -m torchtitan_ext.train`` sees it: loaded, then preflight."""
    cfg = load_config(path)
    preflight.run(cfg, str(path))
    return cfg


def own_checks(path: Path):
    """Only qwen3_vl's preflight checks (where a generic check would object first)."""
    from torchtitan_ext.models.qwen3_vl.preflight import check, check_format_owner

    cfg = load_config(path)
    job = preflight.Job(cfg, str(path))
    check_format_owner(job)
    if cfg.model.module == "qwen3_vl":
        check(job)
    return cfg


# ------------------------------------------------------------------------------------- flavors
def test_debug_flavors_speak_the_offline_processors_tokens(env):
    from torchtitan_ext.vl.processor import load_processor, special_token_ids

    proc = load_processor(None)
    ids = special_token_ids(proc)
    for name in ("debugmodel", "debugmodel_moe"):
        cfg = fl.FLAVORS[name]
        assert cfg["image_token_id"] == ids["image_pad_id"]
        assert cfg["video_token_id"] == ids["video_pad_id"]
        assert cfg["vision_start_token_id"] == ids["vision_start_id"]
        assert cfg["vision_end_token_id"] == ids["vision_end_id"]
        assert len(proc.tokenizer) <= cfg["text_config"]["vocab_size"]


# name -> (total parameters, parameters each token multiplies incl. lm_head), in billions:
# the published names (2B ... 235B-A22B; "A3B"/"A22B" = active parameters).
PUBLISHED = {
    "2B": (2.1, None),
    "4B": (4.4, None),
    "8B": (8.8, None),
    "32B": (33.4, None),
    "30B-A3B": (31.1, 3.0),
    "235B-A22B": (235.7, 21.6),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_flavors_have_the_published_sizes(name):
    with torch.device("meta"):
        hf = build_hf_model(fl.FLAVORS[name])
    holder = torch.nn.Module()
    holder.model, holder.lm_head = hf.model, hf.lm_head
    total, flops = count_params_and_flops(holder, fl.FLAVORS[name], seq_len=8192)
    want_total, want_active = PUBLISHED[name]
    assert total / 1e9 == pytest.approx(want_total, abs=0.05)
    text = fl.FLAVORS[name]["text_config"]
    attn = 6 * text["num_hidden_layers"] * text["num_attention_heads"] * 2 * 128 * 8192
    active = (flops - attn) / 6
    if want_active is not None:
        assert active / 1e9 == pytest.approx(want_active, abs=0.05)
    assert hf.config.text_config.rope_parameters["mrope_section"] == [24, 20, 20]


def test_architecture_mismatches_name_each_field():
    a = fl.build_hf_config(fl.flavor_config("8B"))
    b_cfg = fl.flavor_config("8B")
    b_cfg["text_config"]["intermediate_size"] = 1
    b_cfg["vision_config"]["deepstack_visual_indexes"] = [1, 2, 3]
    b_cfg["text_config"]["rope_parameters"]["rope_theta"] = 1e6
    found = fl.architecture_mismatches(a, fl.build_hf_config(b_cfg))
    assert any(m.startswith("text_config.intermediate_size: flavor 12288") for m in found)
    assert any("vision_config.deepstack_visual_indexes" in m for m in found)
    assert any("rope_parameters.rope_theta" in m for m in found)
    assert fl.architecture_mismatches(a, fl.build_hf_config(fl.flavor_config("8B"))) == []


def test_unknown_flavor_is_a_config_error(tmp_path, env):
    with pytest.raises(ConfigError, match=r"\[model\] flavor 'tiny'.*known flavors: debugmodel"):
        load_config(job(tmp_path, flavor="tiny"))


def test_flex_attention_is_refused_at_config_load(tmp_path, env):
    """transformers' Qwen3-VL refuses ``flex_attention`` when the model is built: the key is
    refused when the config loads, not with a traceback after the rendezvous."""
    with pytest.raises(ConfigError, match=r"attn_backend 'flex': expected one of \['eager', "):
        load_config(job(tmp_path, LOADER), ["--model.attn_backend", "flex"])


def test_vl_jobs_turn_off_the_whole_step_cuda_graph(tmp_path, env):
    """torchtitan 0.3.0 replays forward+backward as one CUDA graph by default, and the graph
    refuses a batch of other shapes: a VL pack's patch count changes every step (on an H200
    the second step stopped the job). Text packs keep one shape, so their default stays."""
    assert load_config(job(tmp_path, LOADER)).training.disable_cuda_graphs is True
    text = tmp_path / "text.toml"
    text.write_text('[model]\nmodule = "llama3"\nflavor = "debugmodel"\n')
    assert load_config(text).training.disable_cuda_graphs is False


# -------------------------------------------------------------------------------- batch format
def test_qwen3_vl_format_is_the_hf_tensors_with_shifted_labels(env):
    vl = env["vl"]
    special = vl.special_tokens
    packs = [vl.pack(0), vl.pack(1)]
    ref = collate_hf(packs, pad_id=special["pad_id"])
    inp, labels = collate_qwen3_vl(packs, pad_id=special["pad_id"])
    assert set(inp) == {"input", "position_ids", "pixel_values", "image_grid_thw"}
    assert torch.equal(inp["input"], ref["input_ids"])
    assert torch.equal(inp["position_ids"], ref["position_ids"])
    assert inp["position_ids"].shape[:2] == (4, 2)
    assert torch.equal(inp["pixel_values"], ref["pixel_values"])
    assert torch.equal(inp["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(labels[:, :-1], ref["labels"][:, 1:])
    assert (labels[:, -1] == IGNORE_INDEX).all()

    text_only = {**packs[0]}
    text_only["image_grid_thw"] = torch.zeros((0, 3), dtype=torch.int64)
    text_only["pixel_u8"] = torch.zeros((0, 768), dtype=torch.uint8)
    inp, _ = collate_qwen3_vl([text_only], pad_id=special["pad_id"])
    assert "pixel_values" not in inp and "image_grid_thw" not in inp


def test_model_refuses_other_position_layouts():
    model = Qwen3VLModel(Qwen3VLModel.Config(hf_config=fl.flavor_config("debugmodel")))
    with pytest.raises(ValueError, match=r"position_ids \[4, B, L\]"):
        model(torch.zeros(1, 8, dtype=torch.long), position_ids=torch.zeros(1, 8, dtype=torch.long))


def test_state_dict_keys_are_the_hf_checkpoint_keys():
    model = Qwen3VLModel(Qwen3VLModel.Config(hf_config=fl.flavor_config("debugmodel")))
    hf = build_hf_model(fl.flavor_config("debugmodel"))
    assert set(model.state_dict()) == set(hf.state_dict())


# ---------------------------------------------------------------------------- checkpoint adapter
def _write_header(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file with these tensors (zeros): only the header matters here."""
    from safetensors.torch import save_file

    save_file({k: torch.zeros(v) for k, v in shapes.items()}, str(path / "model.safetensors"))


@pytest.mark.parametrize("layout", ["published", "model"])
def test_adapter_maps_fused_experts_by_the_checkpoints_own_shapes(tmp_path, layout):
    cfg = Qwen3VLModel.Config(hf_config=fl.flavor_config("debugmodel_moe"))
    key_gu = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    key_dn = "model.language_model.layers.0.mlp.experts.down_proj"
    model_shapes = {key_gu: [4, 96, 64], key_dn: [4, 64, 48]}
    disk = (
        model_shapes
        if layout == "model"
        else {k: [v[0], v[2], v[1]] for k, v in model_shapes.items()}
    )
    _write_header(tmp_path, disk)
    assert {k: list(v) for k, v in safetensors_shapes(tmp_path).items()} == disk
    adapter = Qwen3VLStateDictAdapter(cfg, str(tmp_path))
    sd = {k: torch.randn(v) for k, v in model_shapes.items()}
    sd["model.language_model.norm.weight"] = torch.randn(64)
    hf = adapter.to_hf(sd)
    assert {k: list(hf[k].shape) for k in model_shapes} == disk
    back = adapter.from_hf(hf)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    # without a checkpoint to look at, the published (transposed) layout is written
    assert list(Qwen3VLStateDictAdapter(cfg, None).to_hf(sd)[key_gu].shape) == [4, 64, 96]


def test_adapter_skips_the_tied_lm_head():
    cfg = Qwen3VLModel.Config(hf_config=fl.flavor_config("2B"))
    adapter = Qwen3VLStateDictAdapter(cfg, None)
    w = torch.zeros(3)
    out = adapter.to_hf({"lm_head.weight": w, "model.language_model.embed_tokens.weight": w})
    assert list(out) == ["model.language_model.embed_tokens.weight"]


# ------------------------------------------------------------------------------- config errors
LOADER = """
[dataloader]
name = "cached_vl"
dataset = "sample"
batch_format = "qwen3_vl"
"""


def test_tiny_job_config_loads(tmp_path, env):
    cfg = checked(job(tmp_path, "[training]\nseq_len = 1024\n" + LOADER))
    assert cfg.model_spec.name == "qwen3_vl" and cfg.model_spec.flavor == "debugmodel"
    assert cfg.dataloader.model_path is None  # offline processor: the sample cache's key
    assert Path(cfg.hf_assets_path, "preprocessor_config.json").is_file()
    moe = checked(job(tmp_path, LOADER, flavor="debugmodel_moe"))
    assert moe.model_spec.model.hf_config["text_config"]["num_experts"] == 4


@pytest.mark.parametrize(
    "body, model, match",
    [
        (
            LOADER.replace('"qwen3_vl"', '"torchtitan"'),
            {},
            r"\[dataloader\] batch_format = 'torchtitan' does not match \[model\] module "
            r"'qwen3_vl'",
        ),
        (LOADER, {"module": "llama3"}, r"batch_format = 'qwen3_vl' is the input of \[model\]"),
        (
            '[dataloader]\nname = "parquet_prefetch"\n',
            {},
            r"\[dataloader\] name: qwen3_vl trains on the cached_vl loader",
        ),
        (
            LOADER + "[parallelism]\ntensor_parallel_degree = 2\n",
            {},
            r"\[parallelism\] tensor_parallel_degree = 2",
        ),
        (
            LOADER + '[parallelism]\nspmd_backend = "spmd_types"\n',
            {},
            r"\[parallelism\] spmd_backend = 'spmd_types'",
        ),
        *[
            (
                LOADER + f"[parallelism]\n{kind}_parallel_degree = 2\n",
                {},
                rf"\[parallelism\] {kind}_parallel_degree = 2: qwen3_vl supports data parallelism",
            )
            for kind in ("pipeline", "context", "expert")
        ],
    ],
    ids=["format", "format-other-model", "text-loader", "tp", "spmd", "pp", "cp", "ep"],
)
def test_job_errors(tmp_path, env, body, model, match):
    with pytest.raises(ConfigError, match=match):
        own_checks(job(tmp_path, body, **model))


def _copy_cache(env, tmp_path: Path, counts: dict | None = None, **special: int) -> Path:
    """A copy of the cache whose manifest says other special tokens / counts, re-signed (the
    digest matches), as a cache built that way would be."""
    from torchtitan_ext.vl.format import manifest_digest

    dst = tmp_path / "cache_copy"
    shutil.copytree(env["cache"], dst)
    meta = json.loads((dst / "metadata.json").read_text())
    meta["special_tokens"].update(special)
    meta["counts"].update(counts or {})
    meta["digest"] = manifest_digest(meta)
    (dst / "metadata.json").write_text(json.dumps(meta))
    return dst


def test_cache_tokens_must_fit_the_model(tmp_path, env):
    cache = _copy_cache(env, tmp_path, image_pad_id=700)
    body = LOADER + f'cache_path = "{cache}"\n[training]\nseq_len = 1024\n'
    with pytest.raises(ConfigError, match=r"cache_path .* image_id cache=700 model=572.*; token "
                       r"ids \{'image_pad_id': 700\} >= the model's vocab_size 640"):  # fmt: skip
        checked(job(tmp_path, body))
    ok = LOADER + f'cache_path = "{env["cache"]}"\n[training]\nseq_len = 1024\n'
    checked(job(tmp_path, ok))


def test_explicit_cache_must_read_and_hold_packs_for_every_rank(tmp_path, env):
    """An explicit cache_path whose manifest is damaged, that holds no packs, or fewer packs
    than ranks (remainder "drop") is a config error before anything is built."""
    cache = _copy_cache(env, tmp_path)
    body = LOADER + f'cache_path = "{cache}"\n[training]\nseq_len = 1024\n'
    checked(job(tmp_path, body))  # a re-signed copy is a good cache
    meta = json.loads((cache / "metadata.json").read_text())
    meta["counts"]["rows_read"] += 1  # edited, not re-signed
    (cache / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"cache_path = .*metadata.json.*counts"):
        checked(job(tmp_path, body))
    # more ranks than packs: each rank would get none with remainder "drop"
    cfg = load_config(job(tmp_path, LOADER + f'cache_path = "{env["cache"]}"\n'))
    n = int(env["vl"].metadata["counts"]["packs"])
    with pytest.raises(ConfigError, match=rf"holds {n} packs, fewer than the {n + 1} data-par"):
        preflight.run(cfg, "job.toml", world_size=n + 1)
    # a real build in which every row was skipped
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchtitan_ext.vl.build import build_cache

    src = tmp_path / "bad"
    src.mkdir()
    pq.write_table(
        pa.table({"image": [b"not an image"], "question": ["q"], "answer": ["a"]}),
        src / "rows.parquet",
    )
    empty = build_cache(src, "train", tmp_path / "caches", 1024, 16, show_progress=False)
    body = LOADER + f'cache_path = "{empty}"\n[training]\nseq_len = 1024\n'
    with pytest.raises(ConfigError, match=r"holds no packs: all 1 rows read were skipped"):
        checked(job(tmp_path, body))


def test_pack_length_must_be_the_caches(tmp_path, env):
    body = LOADER + f'cache_path = "{env["cache"]}"\n[training]\nseq_len = 512\n'
    with pytest.raises(ConfigError, match=r"\[training\] seq_len = 512 but .* holds packs of 1024"):
        checked(job(tmp_path, body))
    body = LOADER + f'cache_path = "{env["cache"]}"\npack_seq_len = 2048\n'
    with pytest.raises(ConfigError, match=r"\[dataloader\] pack_seq_len = 2048"):
        checked(job(tmp_path, body))


@pytest.fixture(scope="module")
def hf_dir(env):
    """A tiny random Qwen3-VL saved by transformers, with the offline processor's files."""
    from torchtitan_ext.vl.processor import offline_processor_dir

    out = env["root"] / "hf_debugmodel"
    build_hf_model(fl.flavor_config("debugmodel")).save_pretrained(out)
    for f in offline_processor_dir().iterdir():
        shutil.copy(f, out / f.name)
    return out


def test_the_cache_is_tokenized_by_the_models_own_processor(tmp_path, env, hf_dir):
    """One name: hf_assets_path holds the model, its tokenizer and its processor; the loader's
    model_path left unset follows it (and falls back to the offline processor without one)."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader, processor_path

    ck = "[checkpoint]\nenable = true\ninitial_load_in_hf = true\n"
    cfg = checked(job(tmp_path, LOADER + ck, hf_dir))
    assert cfg.dataloader.model_path is None
    assert processor_path(None, cfg.hf_assets_path) == str(hf_dir)
    assert processor_path("/x", str(hf_dir)) == "/x"
    assert processor_path(None, str(tmp_path)) is None
    tok = type("Tok", (), {"tokenizer_path": str(hf_dir)})()
    loader = CachedVLDataLoader.Config(
        dataset_path=str(env["data"]), cache_dir=str(env["root"] / "cache"), buffer_size=8,
        buckets=[512, 768], batch_format="qwen3_vl", build_if_missing=True,
    ).build(tokenizer=tok, seq_len=1024, local_batch_size=1)  # fmt: skip
    assert loader.model_path == str(hf_dir) and loader.source == "cache"


def test_weights_in_hf_assets_path_must_be_loaded(tmp_path, hf_dir):
    with pytest.raises(ConfigError, match=r"holds weights .* initial_load_in_hf = true"):
        checked(job(tmp_path, LOADER, hf_dir))
    load_only = "[checkpoint]\nenable = true\ninitial_load_in_hf = true\nload_only = true\n"
    checked(job(tmp_path, LOADER + load_only, hf_dir))
    with pytest.raises(ConfigError, match=r"initial_load_in_hf = true but .* no \*.safetensors"):
        checked(job(tmp_path, LOADER + load_only))


def test_config_json_must_match_the_flavor(tmp_path, hf_dir):
    body = LOADER + "[checkpoint]\nenable = true\ninitial_load_in_hf = true\n"
    with pytest.raises(ConfigError, match=r"flavor 'debugmodel_moe' does not match hf_assets_path"):
        checked(job(tmp_path, body, hf_dir, flavor="debugmodel_moe"))


@pytest.mark.parametrize(
    "name, flavor", [("qwen3_vl_real.toml", "30B-A3B"), ("qwen3_vl_8b.toml", "8B")]
)
def test_gpu_configs_are_real_jobs_whose_only_blanks_are_paths(name, flavor):
    import re

    from tests.conftest import REPO

    path = REPO / "train_configs" / name
    values = [ln.split("#")[0] for ln in path.read_text().splitlines()]
    blanks = [ln.split("=")[0].strip() for ln in values if "/path/to" in ln]
    assert sorted(blanks) == ["cache_dir", "hf_assets_path"]
    with pytest.raises(ConfigError, match=r"hf_assets_path = '/path/to/.*' is not a directory"):
        checked(path)
    cfg = load_config(path)
    assert (cfg.model_spec.name, cfg.model_spec.flavor) == ("qwen3_vl", flavor)
    assert cfg.training.seq_len == 8192 and cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.dataloader.batch_format == "qwen3_vl" and cfg.dataloader.normalize_on == "device"
    assert cfg.staging.enable and cfg.checkpoint.enable and cfg.checkpoint.initial_load_in_hf
    assert type(cfg.loss).__qualname__ == "ChunkedLossWrapper.Config"
    assert re.fullmatch(r"HuggingFaceM4/VQAv2", cfg.dataloader.dataset)


def test_reflavoured_gpu_config_keeps_its_loss(tmp_path):
    cfg = load_config(job(tmp_path, config="qwen3_vl_30b_a3b", flavor="235B-A22B"))
    assert cfg.model_spec.flavor == "235B-A22B" and cfg.staging.enable
    assert type(cfg.loss).__qualname__ == "ChunkedLossWrapper.Config"


def test_demo_vl_builds_the_cache_the_tiny_config_looks_for():
    """`make demo-vl` builds the cache with preprocess-cached, then trains with the TOML: the
    two must agree on every part of the cache key, or the job would build a second cache."""
    import re
    import tomllib

    from tests.conftest import REPO

    recipe = (REPO / "Makefile").read_text().split("demo-vl: setup")[1].split("\n\n")[0]
    flags = dict(re.findall(r"--([a-z-]+) (\S+)", recipe.replace("\\\n", " ")))
    table = tomllib.loads((REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml").read_text())
    dl = table["dataloader"]
    assert flags["dataset"] == dl["dataset"] == "sample"
    assert int(flags["seq-len"]) == table["training"]["seq_len"] and "pack_seq_len" not in dl
    assert int(flags["buffer-size"]) == dl["buffer_size"]
    assert [int(b) for b in flags["buckets"].split(",")] == dl["buckets"]
    assert flags["cache-dir"].rstrip("/") == dl["cache_dir"].rstrip("/")
    assert dl.get("split", "train") == "train" and "--split" not in recipe
    assert "model_path" not in dl and "max_samples" not in dl and "--model-path" not in recipe
