"""Preflight checks of a ``qwen3_vl`` job (``torchtitan_ext.preflight.MODEL_CHECKS``).

They run after the generic checks (paths, parallel degrees, tokenizer, checkpoint) and before
anything is built; each failure is one :class:`~torchtitan_ext.toml_config.ConfigError` naming
the file and the key to change, and none needs the model, the cache's data or a process group:

- **parallelism**: data parallelism only (FSDP on the ``partial_dtensor`` backend);
- **freeze**: ``[model] freeze`` names known components and leaves one to train (tied
  embeddings: ``embeddings`` and ``lm_head`` together), every ``[optimizer] param_groups``
  pattern keeps a trainable parameter, and the chunked loss has more than ``lm_head`` to train
  (freeze.py);
- **patch embedding**: ``[model] patch_embed`` is one of ``model.PATCH_EMBEDS``;
- **batch format**: the loader must be ``cached_vl`` with ``batch_format = "qwen3_vl"``
  (:func:`check_format_owner`, run for every job, refuses that format for any other model);
- **tokens**: the model's image / video / vision start / vision end token ids must be those of
  the processor that tokenizes the cache (``[dataloader] model_path``, by default the model's
  own in ``hf_assets_path``: ``loaders.vl.processor_path``), and its vocabulary must hold every
  token id of that tokenizer; an explicit ``cache_path`` is checked against the ids recorded in
  its manifest;
- **pack length**: an explicit ``cache_path`` must have been built for the job's pack length;
- **weights**: ``config.json`` in ``hf_assets_path`` must describe the flavor's architecture;
  safetensors there must be loaded (``[checkpoint] enable`` + ``initial_load_in_hf``) and
  ``initial_load_in_hf`` needs safetensors to load; the tensors the checkpointer would load
  (``initial_load_path``, else ``hf_assets_path``) are read from the files' headers and must be
  all there, in the flavor's shapes and floating point, with nothing the model would drop
  (``weights.check_checkpoint``), unless the job resumes from its own checkpoint instead.

``[model] flavor`` itself is checked when the flavor is looked up (``flavor_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torchtitan_ext.models.qwen3_vl.flavors import (
    architecture_mismatches,
    build_hf_config,
    flavor_config,
)

FORMAT = "qwen3_vl"
# torchtitan's special-token names (as vl.collate_torchtitan.check_special_tokens compares them) -> the
# model config's keys
TOKEN_KEYS = {
    "image_id": "image_token_id",
    "video_id": "video_token_id",
    "vision_start_id": "vision_start_token_id",
    "vision_end_id": "vision_end_token_id",
}


def check(job: Any) -> None:
    """Every check of the module docstring on ``job.config`` (a ``preflight.Job``)."""
    from torchtitan_ext.toml_config import ConfigError

    cfg, file = job.config, job.file

    def fail(msg: str) -> ConfigError:
        return ConfigError(f"{file}: {msg}")

    hf_config = cfg.model_spec.model.hf_config
    flavor = cfg.model_spec.flavor
    _check_parallelism(cfg.parallelism, fail)
    problem = cfg.model_spec.model.option_problem()  # as the config loader (direct API use)
    if problem:
        raise fail(problem)
    _check_freeze(cfg, fail)
    for where, loader in job.loaders():
        _check_format(where, loader, fail)
        _check_tokens(cfg, flavor, hf_config, where, loader, fail)
        _check_explicit_cache(cfg, flavor, hf_config, where, loader, fail)
    _check_chunked_loss(cfg, fail)
    _check_weights(cfg, flavor, fail)
    job.notes.extend(_check_tensors(cfg, flavor, fail))


def check_format_owner(job: Any) -> None:
    """``batch_format = "qwen3_vl"`` is the input of the qwen3_vl model only (any job)."""
    from torchtitan_ext.toml_config import ConfigError

    module = job.config.model.module
    for where, loader in job.loaders():
        if getattr(loader, "batch_format", None) == FORMAT and module != FORMAT:
            raise ConfigError(
                f"{job.file}: [{where}] batch_format = {FORMAT!r} is the input of [model] module "
                f"{FORMAT!r}, not of {module!r}"
            )


def _check_parallelism(par: Any, fail: Any) -> None:
    for key in (
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
    ):
        if getattr(par, key) != 1:
            raise fail(
                f"[parallelism] {key} = {getattr(par, key)}: qwen3_vl supports data parallelism "
                "only (FSDP); set it to 1"
            )
    if par.spmd_backend != "partial_dtensor":
        raise fail(
            f"[parallelism] spmd_backend = {par.spmd_backend!r}: qwen3_vl (transformers modules "
            "under FSDP) needs 'partial_dtensor'"
        )


def _check_freeze(cfg: Any, fail: Any) -> None:
    """What ``[model] freeze`` leaves to train fits the loss and the optimizer groups (the names
    themselves: ``Config.option_problem``, asked just before)."""
    from torchtitan_ext.models.qwen3_vl.freeze import COMPONENTS, frozen_only_patterns

    model = cfg.model_spec.model
    freeze = list(model.freeze)
    if not freeze:
        return
    chunks = getattr(cfg.loss, "num_chunks", None)
    if chunks and set(COMPONENTS) - set(freeze) == {"lm_head"}:
        raise fail(
            f"[model] freeze = {freeze} leaves only lm_head to train, but the chunked loss "
            f"([loss] num_chunks = {chunks}) back-propagates from hidden states that would need "
            "no gradient, so none would reach lm_head; leave another component trainable"
        )
    patterns = [g.pattern for g in cfg.optimizer.param_groups]
    bad = frozen_only_patterns(_parameter_names(model.hf_config), freeze, patterns)
    if bad:
        raise fail(
            f"[optimizer] param_groups pattern {bad[0]!r} matches only parameters that "
            f"[model] freeze = {freeze} keeps fixed (an optimizer group needs a trainable "
            "parameter); remove that group or freeze less"
        )


def _parameter_names(hf_config: dict) -> list[str]:
    """The model's parameter names, from a meta-device build (no memory, no init)."""
    import torch

    from torchtitan_ext.models.qwen3_vl.model import build_hf_model

    with torch.device("meta"):
        return [n for n, _ in build_hf_model(hf_config).named_parameters()]


def _check_format(where: str, loader: Any, fail: Any) -> None:
    fmt = getattr(loader, "batch_format", None)
    if fmt is None:
        raise fail(
            f"[{where}] name: qwen3_vl trains on the cached_vl loader (offline Qwen3-VL "
            f"cache); {type(loader).__qualname__} yields no Qwen3-VL batches"
        )
    if fmt != FORMAT:
        raise fail(
            f"[{where}] batch_format = {fmt!r} does not match [model] module 'qwen3_vl'; set "
            f'batch_format = "{FORMAT}" (input, 4-row position_ids, pixel_values, '
            "image_grid_thw and shifted labels for torchtitan's trainer)"
        )


def _processor_tokens(model_path: str | None) -> tuple[dict[str, int], int]:
    from torchtitan_ext.vl.processor import load_processor, special_token_ids

    proc = load_processor(model_path)
    return special_token_ids(proc), len(proc.tokenizer)


def _token_problems(
    hf_config: dict, special: dict[str, int], vocab: int | None, model_from: str, cache_from: str
) -> list[str]:
    """Why the cache's special tokens / vocabulary do not fit the model ([] if they do)."""
    from torchtitan_ext.vl.collate_torchtitan import check_special_tokens

    out = []
    try:
        model_ids = {k: hf_config[v] for k, v in TOKEN_KEYS.items()}
        check_special_tokens(model_ids, special, model_from=model_from, cache_from=cache_from)
    except (ValueError, KeyError) as e:
        out.append(str(e).strip("'\""))
    model_vocab = hf_config["text_config"]["vocab_size"]
    too_big = {k: v for k, v in special.items() if v >= model_vocab}
    if too_big:
        out.append(f"token ids {too_big} >= the model's vocab_size {model_vocab}")
    if vocab is not None and vocab > model_vocab:
        out.append(f"the tokenizer has {vocab} tokens > the model's vocab_size {model_vocab}")
    return out


def _check_tokens(
    cfg: Any, flavor: str, hf_config: dict, where: str, loader: Any, fail: Any
) -> None:
    from torchtitan_ext.loaders.vl import processor_path

    if getattr(loader, "cache_path", None):
        return  # the cache's own recorded ids are checked instead
    path = processor_path(loader.model_path, cfg.hf_assets_path)
    try:
        special, vocab = _processor_tokens(path)
    except (OSError, ValueError) as e:
        raise fail(f"[{where}] model_path: cannot load the Qwen3-VL processor: {e}") from None
    src = path or "the embedded offline processor"
    problems = _token_problems(
        hf_config, special, vocab, f"[model] flavor {flavor!r}", f"the processor {src}"
    )
    if problems:
        raise fail(
            f"[model] flavor {flavor!r} does not fit the processor that tokenizes the cache "
            f"([{where}] model_path / hf_assets_path: {src}): {'; '.join(problems)}"
        )


def _check_explicit_cache(
    cfg: Any, flavor: str, hf_config: dict, where: str, loader: Any, fail: Any
) -> None:
    path = getattr(loader, "cache_path", None)
    if not path:
        return
    from torchtitan_ext.vl.format import CacheError, read_manifest

    try:  # checked already by the common VL-cache preflight, which runs first
        meta = read_manifest(Path(path))
    except CacheError as e:
        raise fail(f"[{where}] cache_path = {path!r}: {e}") from None
    problems = _token_problems(
        hf_config,
        meta.get("special_tokens", {}),
        None,
        f"[model] flavor {flavor!r}",
        f"the VL cache {path}",
    )
    if problems:
        raise fail(
            f"[{where}] cache_path {path!r} was built with special tokens that do not fit "
            f"[model] flavor {flavor!r}: {'; '.join(problems)}"
        )
    built = meta.get("config", {}).get("seq_len")
    want = loader.pack_seq_len or cfg.training.seq_len
    if built is not None and int(built) != int(want):
        key = f"[{where}] pack_seq_len" if loader.pack_seq_len else "[training] seq_len"
        raise fail(
            f"{key} = {want} but [{where}] cache_path {path!r} holds packs of {built} tokens; "
            f"set {key} = {built} or build a cache for {want}"
        )


def _check_chunked_loss(cfg: Any, fail: Any) -> None:
    chunks = getattr(cfg.loss, "num_chunks", None)
    if not chunks:
        return
    loader = cfg.dataloader
    lengths = set(loader.buckets or []) | {loader.pack_seq_len or cfg.training.seq_len}
    bad = sorted(n for n in lengths if n % chunks)
    if bad:
        raise fail(
            f"[dataloader] buckets / pack length {bad} not divisible by [loss] num_chunks "
            f"{chunks} (the chunked loss splits every batch's length evenly)"
        )


def _check_weights(cfg: Any, flavor: str, fail: Any) -> None:
    assets = Path(cfg.hf_assets_path)
    if (assets / "config.json").is_file():
        from transformers import AutoConfig

        try:
            found = AutoConfig.from_pretrained(str(assets), local_files_only=True)
            bad = architecture_mismatches(build_hf_config(flavor_config(flavor)), found)
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise fail(
                f"hf_assets_path {str(assets)!r}: config.json is not a Qwen3-VL config "
                f"({type(e).__name__}: {e})"
            ) from None
        if bad:
            raise fail(
                f"[model] flavor {flavor!r} does not match hf_assets_path {str(assets)!r} "
                f"(config.json): {'; '.join(bad[:6])}"
            )
    ck = cfg.checkpoint
    loads = ck.enable and ck.initial_load_in_hf
    source = Path(ck.initial_load_path or assets)
    if loads and not any(source.glob("*.safetensors")):
        raise fail(
            f"[checkpoint] initial_load_in_hf = true but {str(source)!r} holds no *.safetensors "
            "(set it to false to start from random weights)"
        )
    if not loads and any(assets.glob("*.safetensors")):
        raise fail(
            f"hf_assets_path {str(assets)!r} holds weights (*.safetensors) that would not be "
            "loaded: set [checkpoint] enable = true and initial_load_in_hf = true (add "
            "load_only = true to load without saving checkpoints), or use a directory without "
            "weights for a random start"
        )


def _check_tensors(cfg: Any, flavor: str, fail: Any) -> list[str]:
    """The safetensors the checkpointer would load fit the flavor's model (headers only; see
    ``weights.check_checkpoint``); returns lines for the log. Skipped when nothing is loaded
    from HF: torchtitan loads them only when ``checkpoint.folder`` has no step to resume from
    (and a ``load_step`` resumes, or fails in the generic checkpoint check)."""
    from torchtitan_ext.models.qwen3_vl.weights import WeightsError, check_checkpoint
    from torchtitan_ext.preflight.checkpoint import saved_steps

    ck = cfg.checkpoint
    if not (ck.enable and ck.initial_load_in_hf) or ck.load_step != -1:
        return []
    if saved_steps(Path(cfg.dump_folder) / ck.folder):
        return []
    where = "[checkpoint] initial_load_path" if ck.initial_load_path else "hf_assets_path"
    source = ck.initial_load_path or cfg.hf_assets_path
    try:
        return check_checkpoint(source, cfg.model_spec.model, cfg.hf_assets_path, flavor)
    except WeightsError as e:
        raise fail(f"the HF weights to load ({where}) do not fit: {e}") from None
