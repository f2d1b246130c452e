"""torchtitan_ext: keep the GPU fed.

Public names are imported lazily (PEP 562) so ``import torchtitan_ext`` stays cheap and a user of
one system (say the BPE trainer) never pays for importing torchtitan or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_EXPORTS: dict[str, str] = {
    "register_loader": "torchtitan_ext.registry:register_loader",
    "get_loader_config": "torchtitan_ext.registry:get_loader_config",
    "available_loaders": "torchtitan_ext.registry:available_loaders",
    "PrefetchingParquetLoader": "torchtitan_ext.text.prefetch:PrefetchingParquetLoader",
    "StreamingTextDataset": "torchtitan_ext.text.streaming:StreamingTextDataset",
    "CachedVLDataset": "torchtitan_ext.vl.dataset:CachedVLDataset",
    "AsyncDeviceLoader": "torchtitan_ext.device.staging:AsyncDeviceLoader",
    "wrap_for_device": "torchtitan_ext.device.staging:wrap_for_device",
    "normalize_pixels": "torchtitan_ext.device.normalize:normalize_pixels",
    "train_bpe": "torchtitan_ext.tokenizer.bpe:train_bpe",
    "ExtTrainerConfig": "torchtitan_ext.config:ExtTrainerConfig",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        target = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'torchtitan_ext' has no attribute {name!r}") from None
    module_name, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
