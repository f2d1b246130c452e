"""Loading a Qwen3-VL processor (a checkpoint's, or the offline one) and what the cache keeps of it.

``load_processor`` loads a processor directory (never downloading; ``None``: the offline processor
of ``vl/offline_processor.py``, built on first use) and checks that Qwen's special tokens are
single tokens; ``special_token_ids`` gives the ids packing and collation use;
``processor_fingerprint`` is everything about it that changes the cache bytes (part of the key).

The rest of preprocessing lives by job, and is importable from here too: images and pixels
(``vl/images.py``), mRoPE position rows (``vl/positions.py``), the bad-sample error
(``vl/errors.py``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torchtitan_ext.vl.errors import SampleError
from torchtitan_ext.vl.images import (
    ImageParams,
    decode_image,
    image_to_patches,
    load_image,
    normalize_patches,
    smart_resize,
    to_rgb,
)
from torchtitan_ext.vl.offline_processor import (
    CHAT_TEMPLATE_FILE,
    QWEN3_VL_IMAGE_CONFIG,
    QWEN_SPECIAL_TOKENS,
    _build_tokenizer_json,
    build_offline_processor,
    default_cache_root,
    offline_processor_dir,
    qwen3_vl_chat_template,
)
from torchtitan_ext.vl.positions import mrope_positions, position_rows


def _processor_class():
    """``Qwen3VLProcessor`` subclass accepting ``video_processor=None`` (facts.md: the base class
    raises without torchvision)."""
    from transformers import Qwen3VLProcessor

    class OfflineQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):  # noqa: D401
            if argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return OfflineQwen3VLProcessor


_PROCESSORS: dict[str, Any] = {}


def load_processor(model_path: str | Path | None = None) -> Any:
    """Load a Qwen3-VL processor: ``None`` -> the offline one (built on first use); a directory
    with ``tokenizer.json``/``tokenizer_config.json`` and ``preprocessor_config.json`` (a real
    Qwen3-VL checkpoint) also works. Never downloads. Cached per path within a process."""
    path = Path(model_path) if model_path is not None else offline_processor_dir()
    key = str(path.resolve())
    if key in _PROCESSORS:
        return _PROCESSORS[key]
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model-path {path}: not a directory (expected a Qwen3-VL processor directory with "
            "tokenizer.json and preprocessor_config.json)"
        )
    if not (path / "preprocessor_config.json").exists():
        raise FileNotFoundError(f"{path}: missing preprocessor_config.json")
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ip = Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    template = getattr(tok, "chat_template", None)
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text()
    elif (path / "chat_template.json").exists():
        template = json.loads((path / "chat_template.json").read_text())["chat_template"]
    if not template:
        raise ValueError(
            f"{path}: no chat template (looked for chat_template.jinja, chat_template.json and "
            "tokenizer_config.json's chat_template)"
        )
    proc = _processor_class()(
        image_processor=ip, tokenizer=tok, video_processor=None, chat_template=template
    )
    for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"):
        ids = tok.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"{path}: token {t} is not a single special token in the tokenizer (got {ids}); "
                "register Qwen's special tokens"
            )
    _PROCESSORS[key] = proc
    return proc


def special_token_ids(processor) -> dict[str, int]:
    """Ids of the Qwen special tokens used by packing/collation."""
    tok = processor.tokenizer

    def one(t: str) -> int:
        i = tok.convert_tokens_to_ids(t)
        if i is None or (tok.unk_token_id is not None and i == tok.unk_token_id):
            raise ValueError(f"tokenizer has no special token {t}")
        return int(i)

    return {
        "image_pad_id": one("<|image_pad|>"),
        "video_pad_id": one("<|video_pad|>"),
        "vision_start_id": one("<|vision_start|>"),
        "vision_end_id": one("<|vision_end|>"),
        "pad_id": one("<|endoftext|>"),
        "im_start_id": one("<|im_start|>"),
        "im_end_id": one("<|im_end|>"),
    }


def processor_fingerprint(processor) -> dict[str, Any]:
    """Everything about a processor that changes the cache bytes (for the cache key)."""
    tok = processor.tokenizer
    backend = getattr(tok, "backend_tokenizer", None) or tok._tokenizer
    vocab_hash = hashlib.sha256(backend.to_str().encode()).hexdigest()
    p = ImageParams.from_processor(processor)
    template = (
        processor.chat_template
        if isinstance(processor.chat_template, str)
        else json.dumps(processor.chat_template, sort_keys=True)
    )
    return {
        "tokenizer_sha256": vocab_hash,
        "chat_template_sha256": hashlib.sha256((template or "").encode()).hexdigest(),
        "image": {
            "patch_size": p.patch_size,
            "temporal_patch_size": p.temporal_patch_size,
            "merge_size": p.merge_size,
            "min_pixels": p.min_pixels,
            "max_pixels": p.max_pixels,
            "resample": p.resample,
            "mean": list(p.mean),
            "std": list(p.std),
            "rescale_factor": p.rescale_factor,
        },
    }


__all__ = [
    "CHAT_TEMPLATE_FILE",
    "QWEN3_VL_IMAGE_CONFIG",
    "QWEN_SPECIAL_TOKENS",
    "ImageParams",
    "SampleError",
    "_build_tokenizer_json",
    "build_offline_processor",
    "decode_image",
    "default_cache_root",
    "image_to_patches",
    "load_image",
    "load_processor",
    "mrope_positions",
    "normalize_patches",
    "offline_processor_dir",
    "position_rows",
    "processor_fingerprint",
    "qwen3_vl_chat_template",
    "smart_resize",
    "special_token_ids",
    "to_rgb",
]
