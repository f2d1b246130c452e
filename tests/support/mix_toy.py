"""A mixture loader for the torchtitan-facing tests (step log, peek, validator, preflight, TOML),
independent of how the real text loaders wire ``[[dataloader.sources]]``.

``MixToyLoader.Config`` inherits :class:`~torchtitan_ext.pipeline.mix.MixOptions` like the real
loaders' Configs. With ``sources`` it reads one toy JSONL chain per source (``tests/support/
toy_source.py``: byte tokens, packed rows), interleaved by :class:`~torchtitan_ext.pipeline.mix.
Mix`; without, ``dataset_path`` alone. Its ``get_stats()`` is the ``Mix.stats`` shape (plus the
Prefetch's own counters), each source also counting ``tokens``. Same-degree resume only.

``python -m tests.support.mix_toy ARGS`` = the train launcher with it registered as ``mix_toy``.
"""

from __future__ import annotations

import glob
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader

from tests.support.toy_source import JsonlSource, PackRows
from torchtitan_ext.pipeline import checkpoint
from torchtitan_ext.pipeline.mix import Mix, MixOptions, SourceSpec
from torchtitan_ext.pipeline.prefetch import Prefetch
from torchtitan_ext.pipeline.stage import Stage, State

NAME = "mix_toy"


def files_of(path: str) -> list[Path]:
    p = Path(path)
    found = sorted(p.glob("*.jsonl")) if p.is_dir() else [Path(f) for f in sorted(glob.glob(path))]
    if not found:
        raise FileNotFoundError(f"{NAME}: no .jsonl files at {path}")
    return found


class CountTokens(Stage[Any]):
    """torchtitan batches (``input`` and ``positions``; the toy's document ids dropped) from its
    upstream's, counting their tokens (the text loaders' ``tokens``)."""

    def __init__(self, upstream: Stage[Any]) -> None:
        self.upstream, self.tokens = upstream, 0

    def next(self) -> Any:
        inputs, labels = self.upstream.next()
        x = inputs["input"]
        self.tokens += int(labels.numel())
        positions = torch.arange(x.shape[1]).expand(x.shape[0], -1).contiguous()
        return {"input": x, "positions": positions}, labels

    def state(self) -> State:
        return {"at": self.upstream.state(), "tokens": self.tokens}

    def reset(self, state: State | None = None) -> None:
        self.upstream.reset(None if state is None else state["at"])
        self.tokens = 0 if state is None else int(state["tokens"])

    def stats(self, state: State) -> dict[str, Any]:
        return {**self.upstream.stats(state["at"]), "tokens": int(state["tokens"])}


class MixToyLoader(BaseDataLoader):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config, MixOptions):
        dataset_path: str | None = None
        """A .jsonl file, glob or directory (the single-source case)."""
        dataset: str = ""
        """Unused (hub datasets are not read)."""
        text_column: str = "text"
        """Unused (the toy reads ``text``)."""
        split: str = "train"
        """Unused."""
        seed: int = 0
        """Seed of the mixture's draws."""
        infinite: bool = True
        """Cycle each source forever; torchtitan's validator sets it."""

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
        self.config, self.rank, self.world = config, dp_rank, dp_world_size
        specs = config.sources or [SourceSpec(name="data", path=config.dataset_path)]

        def chain(s: SourceSpec) -> Stage[Any]:
            src = JsonlSource(files_of(s.path or ""), dp_rank, dp_world_size, config.infinite)
            return CountTokens(PackRows(src, seq_len, local_batch_size))

        chains = [chain(s) for s in specs]
        top = (
            Mix(chains, specs, seed=config.seed, stream=dp_rank, stop=config.mix_stop)
            if config.sources
            else chains[0]
        )
        self.pipeline = Prefetch(top, name=NAME)

    def __iter__(self):
        return self.pipeline

    def state_dict(self) -> dict[str, Any]:
        ranks = checkpoint.gather(self.pipeline.state(), self.rank, self.world)
        return checkpoint.envelope(NAME, ranks, "same")

    def load_state_dict(self, value: dict[str, Any]) -> None:
        if value:
            self.pipeline.reset(checkpoint.open_envelope(value, NAME, self.world)[self.rank])

    def get_stats(self) -> dict[str, Any]:
        return self.pipeline.get_stats()

    def close(self) -> None:
        self.pipeline.close()


def register() -> None:
    from torchtitan_ext.registry import register_loader

    register_loader(NAME, "tests.support.mix_toy:MixToyLoader.Config", overwrite=True)


# ------------------------------------------------------------------------- test configs
TOY_TOML = Path(__file__).resolve().parents[1] / "data" / "configs" / "toy_debug.toml"


def write_sources(d: Path) -> Path:
    """Two toy JSONL sources in ``d``, ``web.jsonl`` and ``code.jsonl`` (40 documents each)."""
    for name, word in (("web", "hello web page "), ("code", "def f(): return 1 ")):
        lines = [json.dumps({"text": word * (1 + i % 5) + str(i)}) for i in range(40)]
        (d / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return d


def sources_toml(data: Path, section: str = "dataloader") -> str:
    """``[[section.sources]]`` tables: ``web`` (weight 7) and ``code`` (weight 3) in ``data``."""
    out = ""
    for name, weight in (("web", 7), ("code", 3)):
        out += f'\n[[{section}.sources]]\nname = "{name}"\nweight = {weight}\n'
        out += f'path = "{data / f"{name}.jsonl"}"\n'
    return out


def mix_config(tmp: Path, data: Path, body: str = "", sources: str | None = None) -> Path:
    """``tests/data/configs/toy_debug.toml`` with ``[dataloader]`` this loader over the sources
    of ``data`` (or the ``[dataloader]`` keys ``sources``), plus ``body``; written to ``tmp``."""
    base = TOY_TOML.read_text().replace('name = "toy"\nvocab_size = 200', f'name = "{NAME}"')
    text = base + (sources_toml(data) if sources is None else sources) + body
    f = tmp / "mix.toml"
    f.write_text(text)
    return f


if __name__ == "__main__":
    register()
    from torchtitan_ext.train import main

    sys.exit(main(sys.argv[1:]))
