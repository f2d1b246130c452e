"""What torchtitan 0.3.0 calls that the pinned torch (2.13) lacks: fixed on every device.

Unlike :mod:`torchtitan_ext.cpu_compat` (shims that are inert when CUDA is present), each fix
here is needed on a GPU too, and each one does nothing once torch has the name.

1. ``torchtitan/distributed/utils.py:595`` (``set_pg_timeouts``, called by ``trainer.py:1062``
   right after the first step) calls ``torch.distributed.set_timeout``, which torch 2.13 does not
   have: every training job stopped with an ``AttributeError`` after its first step on an H200.
   ``distributed_c10d._set_pg_timeout(timeout, group)`` does the same job.
"""

from __future__ import annotations

from typing import Any


def apply() -> None:
    """Install every fix whose name torch lacks. Idempotent; call before a job's first step."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed import distributed_c10d

        def set_timeout(timeout: Any, group: Any = None) -> None:
            distributed_c10d._set_pg_timeout(timeout, group)

        dist.set_timeout = set_timeout  # type: ignore[attr-defined]
