"""torch_compat: what torchtitan 0.3.0 calls and torch 2.13 lacks is fixed on a GPU too."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d

from torchtitan_ext import cpu_compat


def test_set_timeout_is_installed_where_cuda_is_present(monkeypatch):
    """torchtitan's trainer calls ``torch.distributed.set_timeout`` right after the first step;
    when only the CPU shims supplied it, every job on an H200 stopped there."""
    monkeypatch.delattr(dist, "set_timeout", raising=False)
    monkeypatch.setattr(cpu_compat, "needed", lambda: False)  # as on a CUDA machine
    assert cpu_compat.apply() is False  # the CPU shims stay off...
    assert hasattr(dist, "set_timeout")  # ...and the missing name is there all the same
    calls = []
    monkeypatch.setattr(distributed_c10d, "_set_pg_timeout", lambda t, g=None: calls.append((t, g)))
    dist.set_timeout(datetime.timedelta(seconds=100), "group")
    assert calls == [(datetime.timedelta(seconds=100), "group")]
