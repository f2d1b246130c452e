"""Preflight checks of the tokenizer against the loader and the model.

The trainer builds its tokenizer from ``hf_assets_path``; a text loader uses that one, or its own
``tokenizer_path``. Two things go wrong only later otherwise: a token id the model's embedding
does not have (``IndexError: index out of range in self`` inside the first forward), and a BOS or
EOS token the loader needs but the tokenizer does not declare (a ValueError from the loader's
background thread, naming no file). The tokenizer is loaded with the same code the loader uses
(:meth:`TextTokenizer.coerce`), so the BOS / EOS it finds are the loader's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torchtitan_ext.preflight import Job, loader_name
from torchtitan_ext.toml_config import ConfigError

# Registry name -> (needs BOS, needs EOS) for a loader Config.
TOKEN_NEEDS: dict[str, Callable[[Any], tuple[bool, bool]]] = {
    # every document and row starts with BOS (BOS-aligned packing); EOS only with add_eos
    "parquet_prefetch": lambda c: (True, bool(c.add_eos)),
    # EOS is the document boundary; BOS only with add_bos
    "streaming_text": lambda c: (bool(c.add_bos), True),
}


def trainer_tokenizer(job: Job) -> Any:
    """``config.tokenizer.build(tokenizer_path=hf_assets_path)`` as the trainer calls it (cached
    in ``job.cache``); ConfigError naming hf_assets_path if it fails."""
    if "trainer_tokenizer" not in job.cache:
        cfg = job.config
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.WARNING)  # the trainer logs "Loading tokenizer ..." itself, later
        try:
            tok = cfg.tokenizer.build(tokenizer_path=cfg.hf_assets_path)
        except (OSError, ValueError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                f"{job.file}: hf_assets_path = {cfg.hf_assets_path!r}: no usable tokenizer there "
                f"({first}); point it at a directory with tokenizer.json"
            ) from None
        finally:
            root.setLevel(level)
        job.cache["trainer_tokenizer"] = tok
    return job.cache["trainer_tokenizer"]


def model_vocab_size(config: Any) -> int | None:
    """The model's vocabulary size, or None for a model without a plain decoder vocabulary."""
    try:
        from torchtitan.models.common.config_utils import decoder_vocab_size

        return int(decoder_vocab_size(config.model_spec))
    except (ImportError, AssertionError, AttributeError):
        return None


def _source(job: Job, section: str, loader_cfg: Any) -> tuple[str, Any]:
    path = getattr(loader_cfg, "tokenizer_path", None)
    if path:
        return f"[{section}] tokenizer_path = {path!r}", path
    if getattr(job.config, "tokenizer", None) is None:
        return "", None
    return f"hf_assets_path = {job.config.hf_assets_path!r}", trainer_tokenizer(job)


def check_tokenizer(job: Job) -> None:
    """BOS / EOS where the loader needs them; the tokenizer's vocabulary fits the model's."""
    from torchtitan_ext.text.tokenize import TextTokenizer

    if getattr(job.config, "tokenizer", None) is not None:
        trainer_tokenizer(job)
    vocab = model_vocab_size(job.config)
    for section, loader_cfg in job.loaders():
        needs = TOKEN_NEEDS.get(loader_name(loader_cfg))
        if needs is None:
            continue
        where, obj = _source(job, section, loader_cfg)
        if obj is None:
            continue  # the loader picks its own (the embedded corpus's) tokenizer
        bos_token = getattr(loader_cfg, "bos_token", None)
        try:
            tok = TextTokenizer.coerce(obj, engine="hf", bos_token=bos_token)
        except (OSError, ValueError) as e:
            key = where if bos_token is None else f"[{section}] bos_token = {bos_token!r}"
            raise ConfigError(f"{job.file}: {key}: {e}") from None
        need_bos, need_eos = needs(loader_cfg)
        if need_bos and tok.bos_id is None:
            fix = (
                f'set [{section}] bos_token = "<a special token of it>" (e.g. its end-of-text '
                "token), or train it with train-tokenizer --bos-token"
                if hasattr(loader_cfg, "bos_token")
                else f"set [{section}] add_bos = false, or use a tokenizer that declares one"
            )
            raise ConfigError(
                f"{job.file}: the tokenizer ({where}) declares no BOS token, and loader "
                f"{loader_name(loader_cfg)!r} starts every document with one; {fix}"
            )
        if need_eos and tok.eos_id is None:
            raise ConfigError(
                f"{job.file}: the tokenizer ({where}) declares no EOS token, which loader "
                f"{loader_name(loader_cfg)!r} needs; use a tokenizer whose tokenizer_config.json "
                "names an eos_token (train-tokenizer --eos-token)"
            )
        if vocab is not None and tok.vocab_size > vocab:
            m = job.config.model
            raise ConfigError(
                f"{job.file}: the tokenizer ({where}) has {tok.vocab_size:,} tokens but the model "
                f"([model] {m.module} / {m.flavor or m.config}) embeds only {vocab:,}: token ids "
                f">= {vocab:,} would index past its embedding. Use a tokenizer with at most "
                f"{vocab:,} tokens (train-tokenizer --vocab-size {vocab}) or a [model] flavor "
                f"whose vocabulary holds {tok.vocab_size:,}"
            )
