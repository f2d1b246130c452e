"""A deterministic toy loader for config / trainer tests that must not depend on a real one.

It yields ``(input_dict, labels)`` batches of pseudo-random token ids from a counter, so its
state is one int (``step``): resume exactness is easy to check through torchtitan checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader


class ToyLoader(BaseDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 256
        """Token ids are drawn from [3, vocab_size)."""
        seed: int = 0
        """Base seed; batch i uses seed + 1000 * dp_rank + i."""
        infinite: bool = True
        """Unused (the toy stream is always infinite); torchtitan's validator sets it."""

    def __init__(
        self,
        config: Config,
        *,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        tokenizer: Any = None,
        seq_len: int = 16,
        local_batch_size: int = 2,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.batch_size = seq_len, local_batch_size
        self.step = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.config.seed + 1000 * self.dp_rank + self.step)
            x = torch.randint(
                3, self.config.vocab_size, (self.batch_size, self.seq_len + 1), generator=g
            )
            self.step += 1
            pos = torch.arange(self.seq_len).expand(self.batch_size, -1).contiguous()
            yield {"input": x[:, :-1], "positions": pos}, x[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.dp_rank}": {"step": self.step}, "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.step = int(state_dict[f"dp_rank_{self.dp_rank}"]["step"])

    def get_stats(self) -> dict[str, Any]:
        return {"batches": self.step}
