"""Test-only qwen3_vl flavors (no side effects; tests.support.qwen3_vl_probe registers them)."""

from __future__ import annotations

import copy
from typing import Any

from torchtitan_ext.models.qwen3_vl.flavors import FLAVORS


def _tied(flavor: str) -> dict[str, Any]:
    cfg = copy.deepcopy(FLAVORS[flavor])
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = True
    return cfg


# A tied-embedding debug model: the layout of the published 2B and 4B (lm_head shares the
# embedding; FSDP must keep them in one unit, the checkpoint has no lm_head.weight).
TEST_FLAVORS: dict[str, dict[str, Any]] = {"debugmodel_tied": _tied("debugmodel")}
