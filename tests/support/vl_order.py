"""The packs' visiting order as the docs state it (docs/vl-cache.md, "Order, sharding and
resume"): epoch ``e`` visits the packs in ``randperm(N, seed + e)``. Written here with torch alone,
so that order tests do not compare ``vl/dataset.py`` with itself."""

from __future__ import annotations

import torch


def documented_order(num_packs: int, seed: int, epoch: int) -> list[int]:
    """Pack indices in the order epoch ``epoch`` visits them (shuffle on)."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_packs, generator=g).tolist()
