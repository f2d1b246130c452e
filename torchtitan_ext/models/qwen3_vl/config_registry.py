"""Default job configs for ``[model] module = "qwen3_vl"`` (the TOML layer's defaults).

As torchtitan's own ``config_registry`` modules: each function returns a complete
``Trainer.Config``; ``[model] config`` names one (default ``qwen3_vl_debugmodel``),
``[model] flavor`` swaps the architecture, then the TOML file and ``--section.key value``
override any field.

- ``qwen3_vl_debugmodel`` / ``qwen3_vl_debugmodel_moe``: the tiny random models on CPU, fed by
  the shipped sample set through the offline cache (built on first use); the processor is the
  embedded offline one (``hf_assets_path`` = its directory).
- ``qwen3_vl_8b`` / ``qwen3_vl_30b_a3b``: GPU fine-tuning from the published weights
  (``hf_assets_path`` = the Hugging Face model directory, loaded by the checkpointer), bf16 FSDP,
  selective activation checkpointing, async device staging with pixels normalised on the GPU,
  8192-token packs. Other flavors (2B, 4B, 32B, 235B-A22B) take one of these with
  ``[model] flavor``.
"""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.trainer import Trainer

from torchtitan_ext.loaders.vl import CachedVLDataLoader
from torchtitan_ext.models.qwen3_vl import model_registry

_GPU_PACK = 8192


def _offline_processor() -> str:
    """The embedded offline Qwen3-VL processor directory (built on first use, ~15 ms)."""
    from torchtitan_ext.vl.processor import offline_processor_dir

    return str(offline_processor_dir())


def _schedule(warmup: int) -> LRSchedulersContainer.Config:
    return LRSchedulersContainer.Config(
        warmup_steps=warmup, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    )


def _debug(flavor: str) -> Trainer.Config:
    return Trainer.Config(
        model_spec=model_registry(flavor),
        hf_assets_path=_offline_processor(),
        loss=CrossEntropyLoss.Config(),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=_schedule(2),
        training=TrainingConfig(local_batch_size=2, seq_len=1024, steps=20, max_norm=1.0),
        dataloader=CachedVLDataLoader.Config(
            dataset="sample",
            cache_dir="./outputs/vl_cache",
            buffer_size=16,
            buckets=[512, 768],
            build_if_missing=True,
            batch_format="qwen3_vl",
            normalize_on="collate",
        ),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=None,
        validator=Validator.Config(enable=False),
    )


def qwen3_vl_debugmodel() -> Trainer.Config:
    return _debug("debugmodel")


def qwen3_vl_debugmodel_moe() -> Trainer.Config:
    return _debug("debugmodel_moe")


def _gpu(flavor: str, lr: float) -> Trainer.Config:
    from torchtitan_ext.config import ExtTrainer, StagingSection

    return ExtTrainer.Config(
        model_spec=model_registry(flavor),
        hf_assets_path="/path/to/hf/Qwen3-VL",  # set in the TOML: weights + tokenizer + processor
        # Chunked lm_head + cross-entropy: a 8192 x 151936 logits tensor is never materialised.
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(), num_chunks=8),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=_schedule(50),
        training=TrainingConfig(
            local_batch_size=1,
            seq_len=_GPU_PACK,
            steps=3000,
            max_norm=1.0,
            mixed_precision_param="bfloat16",
            mixed_precision_reduce="float32",
        ),
        dataloader=CachedVLDataLoader.Config(
            dataset="",  # set in the TOML
            buffer_size=64,
            buckets=[4096, 6144],
            batch_format="qwen3_vl",
            normalize_on="device",
        ),
        metrics=MetricsProcessor.Config(log_freq=10),
        parallelism=ParallelismConfig(
            spmd_backend="partial_dtensor", data_parallel_shard_degree=-1
        ),
        checkpoint=CheckpointManager.Config(
            enable=True,
            interval=500,
            initial_load_in_hf=True,
            initial_load_model_only=True,
            last_save_model_only=False,
        ),
        activation_checkpoint=SelectiveAC.Config(),
        validator=Validator.Config(enable=False),
        # pinned buffers + copy stream; the uint8 pixels are normalised on the GPU
        staging=StagingSection(enable=True),
    )


def qwen3_vl_8b() -> Trainer.Config:
    return _gpu("8B", lr=1e-5)


def qwen3_vl_30b_a3b() -> Trainer.Config:
    return _gpu("30B-A3B", lr=1e-5)
