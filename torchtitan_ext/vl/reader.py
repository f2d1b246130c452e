"""VLReader: one DP rank's batches of packed VL samples, and the position the consumer reached.

Free of torchtitan: the ``cached_vl`` loader (``loaders/vl.py``) maps its Config onto this class
and only speaks torchtitan's checkpoint format around it.

Reading. :func:`~torchtitan_ext.vl.pack_source.open_packs` chooses the data source once (an
existing cache, a cache built now, or the slow online fallback, warned) and opens it for this rank.
Batches come from a ``torch.utils.data.DataLoader`` over ``CachedVLDataset`` (``num_workers``
processes, each reading a disjoint block-interleaved slice of this rank's packs, in the same order
as with no workers) and ``vl.collate.PackCollator`` (``batch_format`` "torchtitan" ->
``(input_dict, labels)`` for torchtitan's trainer, "hf" -> Qwen3-VL forward kwargs).

Position. The reader counts the packs it has *handed to the consumer* since the anchor (the global
``(epoch, cursor)`` where the current DataLoader pass started) and reports the global position
reached. Invariant: ``position() == advance(anchor, packs handed out since the anchor)``
(``vl/dataset.py``), so prefetched-but-unconsumed batches in worker queues never leak into a
state: resume is bitwise exact with any ``num_workers``, and elastic (a DP=2 state loads at DP=1
and vice versa). The state is a dict of plain ints.

Cost: ``python -m benchmarks vl_dataset`` (rows in ``benchmarks/RESULTS.md``) times opening the
loader over an existing cache, the training thread's fetch + collate with ``num_workers=0``, and
its wait with one worker (the batch only crosses shared memory). One worker showed no clear gain,
so the GPU configs keep ``num_workers=0`` and let ``AsyncDeviceLoader``'s background thread call
the loader (``[staging] enable``; pass ``device_transform=loader.finish_on_device`` when
``normalize_on="device"``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from torch.utils.data import DataLoader

from torchtitan_ext.vl.collate import (
    BATCH_FORMATS,
    PackCollator,
    PixelNorm,
    check_special_tokens,
    finish_on_device,
)
from torchtitan_ext.vl.dataset import CachedVLDataset, advance
from torchtitan_ext.vl.pack_source import PackRequest, open_packs


def processor_path(model_path: str | None, hf_assets_path: str | None) -> str | None:
    """The processor that tokenizes the cache: ``model_path``; unset, the model's own directory
    (the trainer's ``hf_assets_path``) when it holds a Qwen3-VL processor; else None (the
    embedded offline processor). The path itself is not part of the cache key, its contents are."""
    if model_path:
        return model_path
    if hf_assets_path and (Path(hf_assets_path) / "preprocessor_config.json").is_file():
        return str(hf_assets_path)
    return None


class ReadRequest(PackRequest, Protocol):
    """The attributes :class:`VLReader` reads besides :class:`PackRequest`'s (the ``cached_vl``
    loader Config, a dataclass, has them all)."""

    model_path: str | None
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    batch_format: str
    normalize_on: str


def _check_request(req: ReadRequest, batch_size: int, seq_len: int | None) -> int:
    """The pack length, after refusing settings no reader can serve (one line each)."""
    if req.batch_format not in BATCH_FORMATS:
        raise ValueError(
            f"dataloader.batch_format must be one of {BATCH_FORMATS}, got {req.batch_format!r}"
        )
    if req.normalize_on not in ("collate", "device"):
        raise ValueError(
            f"dataloader.normalize_on must be 'collate' or 'device', got {req.normalize_on!r}"
        )
    if req.remainder not in ("drop", "wrap"):
        raise ValueError(f"dataloader.remainder must be 'drop' or 'wrap', got {req.remainder!r}")
    if batch_size < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {batch_size}")
    if not seq_len:
        raise ValueError("need dataloader.pack_seq_len or the trainer's seq_len")
    return int(seq_len)


def check_model_tokenizer(tokenizer: Any, cache_path: str | None, model_path: str | None) -> None:
    """With a VLM tokenizer in torchtitan's shape (``MultiModalTokenizer``: ``TOKEN_FIELDS`` and
    ``<name>_id`` attributes), refuse a cache whose special-token ids differ from it. Uses
    ``cache_path``'s (checked) manifest, else the processor the cache is keyed on
    (``model_path``), so nothing is built first. Other tokenizers (or None) pass."""
    fields = getattr(tokenizer, "TOKEN_FIELDS", None)
    if not fields:
        return
    model = {f"{n}_id": int(getattr(tokenizer, f"{n}_id")) for n in fields}
    if cache_path:
        from torchtitan_ext.vl.cache import read_manifest

        meta = Path(cache_path) / "metadata.json"
        special = read_manifest(Path(cache_path))["special_tokens"] if meta.is_file() else None
        cache_from = f"the VL cache {cache_path}"
    else:
        from torchtitan_ext.vl.processor import load_processor, special_token_ids

        special = special_token_ids(load_processor(model_path))
        cache_from = (
            f"the VL cache's processor ({model_path})"
            if model_path
            else "the VL cache's processor (dataloader.model_path unset: the embedded "
            "offline processor)"
        )
    if special is not None:  # a missing cache_path is reported by open_packs
        check_special_tokens(
            model,
            special,
            model_from=f"hf_assets_path={getattr(tokenizer, 'tokenizer_path', '?')}",
            cache_from=cache_from,
        )


def batch_arrays(batch: Any) -> tuple[Any, Any]:
    """(token ids [B, L], image grids [I, 3] or None) of a batch in any ``BATCH_FORMATS``."""
    if isinstance(batch, tuple):
        inp = batch[0]
        return inp["input"], inp.get("grid_thw", inp.get("image_grid_thw"))
    return batch["input_ids"], batch.get("image_grid_thw")


@dataclass
class ReadStats:
    """What the consumer has received so far, and how long it waited for it."""

    batches: int = 0
    packs: int = 0
    tokens: int = 0
    """Real (non-pad) tokens."""
    pad_tokens: int = 0
    images: int = 0
    patches: int = 0
    wait_s: float = 0.0
    last_wait_s: float = 0.0

    def add(self, batch: Any, pad_id: int, wait_s: float) -> int:
        """Count one batch handed to the consumer; returns its packs."""
        tokens, grid = batch_arrays(batch)
        n = int(tokens.shape[0])
        pad = int((tokens == pad_id).sum())
        self.batches += 1
        self.packs += n
        self.tokens += int(tokens.numel()) - pad
        self.pad_tokens += pad
        if grid is not None:
            self.images += int(grid.shape[0])
            self.patches += int(grid.prod(dim=-1).sum())
        self.wait_s += wait_s
        self.last_wait_s = wait_s
        return n


class VLReader:
    """Batches of one DP rank's packs (cache or online fallback) with an exact global position.

    ``tokenizer``: the trainer's, optional. The cache carries its own special-token ids (from the
    processor it was built with); a torchtitan-shaped VLM tokenizer's must equal them
    (:func:`check_model_tokenizer`, before any cache is built), and its ``tokenizer_path`` (the
    trainer's ``hf_assets_path``) is the processor when ``model_path`` is unset
    (:func:`processor_path`).
    """

    def __init__(
        self,
        req: ReadRequest,
        *,
        seq_len: int | None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        batch_size: int = 1,
        tokenizer: Any = None,
    ) -> None:
        self.pack_seq_len = _check_request(req, batch_size, seq_len)
        self.config = req
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batch_size = batch_size

        t0 = time.perf_counter()
        self.model_path = processor_path(req.model_path, getattr(tokenizer, "tokenizer_path", None))
        check_model_tokenizer(tokenizer, req.cache_path, self.model_path)
        keyed = req  # the request whose processor keys the cache
        if self.model_path != req.model_path:
            keyed = replace(req, model_path=self.model_path)  # type: ignore[type-var]
        packs = open_packs(
            keyed,
            seq_len=self.pack_seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            block_size=batch_size,
        )
        self.source, self.cache_path, self.dataset = packs.source, packs.path, packs.dataset
        self.special_tokens = packs.special_tokens
        self.num_workers = req.num_workers if packs.source == "cache" else 0
        self.open_s = time.perf_counter() - t0
        self.pixel_norm = PixelNorm.from_metadata(packs.metadata)
        self.collate = PackCollator(
            req.batch_format,  # type: ignore[arg-type]
            self.special_tokens,
            norm=self.pixel_norm,
            normalize_on=req.normalize_on,  # type: ignore[arg-type]
        )
        self.stats = ReadStats()
        self._reset_position()

    # -- iteration ------------------------------------------------------------------------------
    def _reset_position(self) -> None:
        """(Re)start reading at the dataset's current anchor."""
        self._packs_since_anchor = 0
        self._iterator: Iterator[Any] | None = None
        ds = self.dataset
        # Global position where the current DataLoader pass starts. Kept here (not read live from
        # the dataset) because with workers the main-process dataset never iterates.
        self._anchor = (ds._epoch, ds._cursor) if self.source == "cache" else (0, 0)

    def _make_loader(self) -> DataLoader:
        kw: dict[str, Any] = {}
        if self.num_workers > 0:
            kw["num_workers"] = self.num_workers
            if self.config.prefetch_factor is not None:
                kw["prefetch_factor"] = self.config.prefetch_factor
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            collate_fn=self.collate,
            pin_memory=self.config.pin_memory,
            **kw,
        )

    def __iter__(self) -> Iterator[Any]:
        if self._iterator is None:
            self._iterator = iter(self._make_loader())
        it = self._iterator
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                # Finite pass over: move the anchor past it (the workers' copies did the same).
                if self.source == "cache":
                    ds = self.dataset
                    ds._epoch, ds._cursor = self.position()
                    ds._yielded = 0
                self._reset_position()
                return
            wait = time.perf_counter() - t0
            self._packs_since_anchor += self.stats.add(batch, self.collate.pad_id, wait)
            yield batch

    def finish_on_device(self, batch: Any) -> Any:
        """Normalise uint8 pixel_values where the batch now lives (``normalize_on="device"``)."""
        return finish_on_device(batch, self.pixel_norm)

    # -- state ----------------------------------------------------------------------------------
    def position(self) -> tuple[int, int]:
        """Global ``(epoch, cursor)`` after the packs handed to the consumer (cache source)."""
        ds: CachedVLDataset = self.dataset
        return advance(
            ds.num_packs,
            ds.dp_world_size,
            *self._anchor,
            self._packs_since_anchor,
            ds.remainder,
        )

    def state_dict(self) -> dict[str, Any]:
        """The consumer's position as plain ints, the same on every rank (``source`` 0: cache,
        1: online)."""
        if self.source == "online":
            # In process (no workers, no read-ahead): the dataset's own state is the consumer's.
            return {"source": 1, **self.dataset.state_dict()}
        epoch, cursor = self.position()
        st = self.dataset.state_dict()  # compatibility fields (num_packs, seed, ...)
        st.update({"epoch": epoch, "cursor": cursor, "yielded": 0, "source": 0})
        return st

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (saved at any DP degree); reading restarts there."""
        st = dict(state)
        source = int(st.pop("source", 0))
        if (source == 1) != (self.source == "online"):
            raise ValueError(
                f"VL loader state was saved from the {'online' if source else 'cache'} source but "
                f"this loader reads from the {self.source}; the orders differ"
            )
        self.dataset.load_state_dict(st)
        self._reset_position()

    # -- stats ----------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """Numbers for the step log line (cumulative unless the name says ``last``)."""
        s = self.stats
        total = s.tokens + s.pad_tokens
        online = self.source == "online"
        return {
            "batches": float(s.batches),
            "packs": float(s.packs),
            "tokens": float(s.tokens),
            "pad_pct": 100.0 * s.pad_tokens / total if total else 0.0,
            "images": float(s.images),
            "patches": float(s.patches),
            "consumer_wait_ms": 1e3 * s.wait_s,
            "wait_ms_last": 1e3 * s.last_wait_s,
            "epoch": float(self.state_dict()["epoch"]),
            "online": 1.0 if online else 0.0,
            "skipped": float(sum(self.dataset.skips.values())) if online else 0.0,
            "open_s": self.open_s,
        }
