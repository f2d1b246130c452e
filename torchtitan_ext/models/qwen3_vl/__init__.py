"""Qwen3-VL for torchtitan 0.3.0: ``[model] module = "qwen3_vl"``, ``flavor = "8B"`` etc.

Layout as torchtitan's model modules: :func:`model_registry` (flavor -> ``ModelSpec``) here,
the flavor table in ``flavors.py``, the model (transformers' Qwen3-VL behind torchtitan's model
protocol) in ``model.py``, AC / compile / FSDP in ``parallelize.py``, HF checkpoint mapping in
``state_dict_adapter.py``, the Hugging Face export (``config.json``, processor, DCP ->
safetensors) in ``export.py``, default job configs in ``config_registry.py`` and the checks run
before anything is built in ``preflight.py`` (registered in ``torchtitan_ext.preflight``).
"""

from __future__ import annotations

from torchtitan.protocols.model_spec import ModelSpec

from torchtitan_ext.models.qwen3_vl.flavors import FLAVORS, flavor_config
from torchtitan_ext.models.qwen3_vl.model import ATTN_BACKENDS, Qwen3VLModel
from torchtitan_ext.models.qwen3_vl.parallelize import parallelize_qwen3_vl
from torchtitan_ext.models.qwen3_vl.state_dict_adapter import Qwen3VLStateDictAdapter

MODEL_NAME = "qwen3_vl"


def model_registry(flavor: str, attn_backend: str | None = None) -> ModelSpec:
    """The ``ModelSpec`` of a flavor; ``attn_backend`` is a key of ``ATTN_BACKENDS``."""
    backend = attn_backend or "sdpa"
    if backend not in ATTN_BACKENDS:
        raise ValueError(
            f"qwen3_vl attn_backend {backend!r}: expected one of {sorted(ATTN_BACKENDS)}"
        )
    return ModelSpec(
        name=MODEL_NAME,
        flavor=flavor,
        model=Qwen3VLModel.Config(
            flavor=flavor, hf_config=flavor_config(flavor), attn_backend=backend
        ),
        parallelize_fn=parallelize_qwen3_vl,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=Qwen3VLStateDictAdapter,
    )


__all__ = ["FLAVORS", "MODEL_NAME", "Qwen3VLModel", "model_registry"]
