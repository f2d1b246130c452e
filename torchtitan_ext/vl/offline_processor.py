"""The offline Qwen3-VL processor: a processor directory built entirely locally (no download).

``build_offline_processor`` writes a small byte-level BPE (HF ``tokenizers``, trained on an
embedded corpus) with Qwen's special tokens registered as *special* tokens (otherwise
``<|image_pad|>`` is byte-split), Qwen3-VL's own chat template
(``torchtitan_ext/data/qwen3_vl_chat_template.jinja``, the Qwen3-VL Instruct models' template byte
for byte), and ``Qwen2VLImageProcessorPil`` set to Qwen3-VL's values (patch 16, temporal 2, merge
2, mean = std = 0.5, 256²..4096² pixels, bicubic, 1/255). ``vl/processor.py`` loads it (or a real
checkpoint's processor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchtitan_ext.data.cachedir import build_atomically, cache_root

# Qwen2/3 special tokens in Qwen's order (ids are relative to our small vocab, not 151643...).
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2's pre-tokenizer split pattern (as in Qwen2/Qwen3 tokenizer.json).
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE_FILE = Path(__file__).resolve().parents[1] / "data" / "qwen3_vl_chat_template.jinja"
"""Qwen3-VL's chat template (the Instruct models' ``chat_template``; see DATA_LICENSES.md)."""


def qwen3_vl_chat_template() -> str:
    return CHAT_TEMPLATE_FILE.read_text()


# Qwen3-VL image-processor values (the transformers class defaults are Qwen2-VL's).
QWEN3_VL_IMAGE_CONFIG: dict[str, Any] = {
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "resample": 3,  # PIL.Image.BICUBIC
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "do_resize": True,
}

_OFFLINE_VERSION = 2  # 2: Qwen3-VL's own chat template
_VOCAB_SIZE = 1024


def _embedded_corpus() -> list[str]:
    """A small deterministic English corpus for the offline BPE (VQA-flavoured words)."""
    words = (
        "what is the colour of the object in this picture how many are there is it a cat dog "
        "person man woman child car bus bike sky tree grass water building sign text page letter "
        "yes no red green blue yellow black white grey orange purple brown left right top bottom "
        "center image photo show shows describe answer question which where when who why does do "
        "one two three four five six seven eight nine ten zero many few some none all both"
    ).split()
    lines = []
    for i, w in enumerate(words):
        for j in range(1, 6):
            lines.append(
                f"What is the {w}? The {words[(i * j) % len(words)]} is {words[(i + j) % len(words)]}."
            )
            lines.append(f"How many {w}s are in image {i * j}? There are {j} {w}s.\n")
    return lines


def _build_tokenizer_json() -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_embedded_corpus(), trainer)
    # Registered as *special* tokens: the added-vocabulary pass splits them out before the BPE.
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    return tok.to_str()


def build_offline_processor(out_dir: str | Path) -> Path:
    """Write a Qwen3-VL processor directory built locally (no download). Idempotent: a directory
    that still matches its manifest is reused, anything else there is rebuilt
    (:func:`torchtitan_ext.data.cachedir.build_atomically`).

    Files: ``tokenizer.json`` + ``tokenizer_config.json`` (Qwen special tokens registered as
    special, chat template), ``chat_template.jinja``, ``preprocessor_config.json`` (Qwen3-VL values).
    """

    def fill(tmp: Path) -> None:
        from tokenizers import Tokenizer
        from transformers import Qwen2VLImageProcessorPil, TokenizersBackend

        fast = TokenizersBackend(
            tokenizer_object=Tokenizer.from_str(_build_tokenizer_json()),
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            chat_template=qwen3_vl_chat_template(),
            model_max_length=1 << 20,
        )
        fast.save_pretrained(tmp)
        ip = Qwen2VLImageProcessorPil(**QWEN3_VL_IMAGE_CONFIG)
        ip.save_pretrained(tmp)
        (tmp / "chat_template.jinja").write_text(qwen3_vl_chat_template())
        (tmp / "offline_processor.json").write_text(json.dumps({"version": _OFFLINE_VERSION}))

    return build_atomically(Path(out_dir), fill, {"offline_processor_version": _OFFLINE_VERSION})


def default_cache_root() -> Path:
    """Root for locally generated assets (processor dir, sample dataset): the package's one
    cache root, :func:`torchtitan_ext.data.cachedir.cache_root`."""
    return cache_root()


def offline_processor_dir() -> Path:
    """The offline processor's directory, built first when missing and rebuilt when it no longer
    matches its manifest: a caller may read or copy it right away."""
    return build_offline_processor(
        default_cache_root() / f"qwen3vl_offline_processor_v{_OFFLINE_VERSION}"
    )
