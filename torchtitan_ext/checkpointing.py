"""torchtitan's checkpoint manager, writing the job record next to each save.

:class:`RecordingCheckpointManager` is the checkpoint manager an ``ExtTrainer`` builds (the
``[checkpoint]`` section is its Config: torchtitan's fields, nothing added). It saves exactly as
torchtitan's ``CheckpointManager`` and, for each save that happened, rank 0 writes the job record
the trainer gave it (:meth:`set_job_record`; what the data state depends on and which model it
is, :mod:`torchtitan_ext.preflight.checkpoint`) into the step's folder, where the next job's
preflight and ``torchtitan-ext-export`` read it.

The last save in Hugging Face format (``last_save_in_hf``) with a state-dict adapter that can
export (:class:`HFExporter`, e.g. qwen3_vl's) runs inside the adapter's ``exporting()`` and,
once every rank's weights are written, gets the model's ``config.json`` and processor
(``write_hf_assets``). The record is written after torchtitan's save returns (for an async save:
once it is staged).

It overrides ``_save``, the hook torchtitan's ``BaseCheckpointManager.save`` dispatches to when
checkpointing is enabled, so every caller (the training loop, a seed checkpoint) gets the record.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torchtitan.components.checkpointer import CheckpointManager


@runtime_checkable
class HFExporter(Protocol):
    """A state-dict adapter that can write a Hugging Face model folder, not only read one."""

    def exporting(self) -> AbstractContextManager[None]:
        """Within: ``to_hf`` serves a save (the published layout)."""
        ...

    def write_hf_assets(self, step_dir: str | Path, model_record: dict[str, Any]) -> None:
        """After the weights are written: ``config.json`` and the processor."""
        ...


class RecordingCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager that writes the job record with each save (see the module
    docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``[checkpoint]`` fields, unchanged; builds
        :class:`RecordingCheckpointManager`."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.job_record: dict[str, Any] | None = None

    def set_job_record(self, record: dict[str, Any]) -> None:
        """The record written next to each save from now on (a ``"model"`` entry included)."""
        self.job_record = record

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        adapter = self.sd_adapter
        export = last_step and self.last_save_in_hf and isinstance(adapter, HFExporter)
        with adapter.exporting() if export else nullcontext():  # type: ignore[union-attr]
            saved = super()._save(curr_step, last_step)
        if saved and export and dist.is_initialized():
            dist.barrier()  # every rank's safetensors are complete before config.json
        if saved and self.job_record is not None and _is_rank0():
            self._write_record(curr_step, export)
        return saved

    def _write_record(self, curr_step: int, export: bool) -> None:
        from torchtitan_ext.preflight.checkpoint import write_record

        assert self.job_record is not None
        step_dir = self._create_checkpoint_id(curr_step)
        write_record(step_dir, self.job_record)
        if export:
            self.sd_adapter.write_hf_assets(step_dir, self.job_record["model"])  # type: ignore[union-attr]


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


__all__ = ["HFExporter", "RecordingCheckpointManager"]
