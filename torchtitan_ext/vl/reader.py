"""VLReader: one DP rank's VL batches as a chain of pipeline stages, and the facts about them.

Free of torchtitan: the ``cached_vl`` loader (``loaders/vl.py``) picks each stage's options out of
its Config (``vl/options.py``) and speaks torchtitan's checkpoint format around this class.

Opening. :func:`~torchtitan_ext.vl.pack_source.open_packs` chooses the data source once (an
existing cache, a cache built now, or the slow online fallback, warned) and opens it for this rank;
the reader checks the trainer's tokenizer against the cache's special tokens first.

The chain (``vl/stages.py``): with ``num_workers = 0`` (always for the online fallback)
``Prefetch(CountBatches(CollatePacks(CachePacks | OnlinePacks)))`` — fetch and collate run in the
one background thread (:class:`~torchtitan_ext.pipeline.prefetch.Prefetch`), the training thread
only pops a ready batch; device staging fuses its copy into that Prefetch (``.pipeline``). With
workers: ``CountBatches(WorkerBatches)`` — the DataLoader's processes are one stage and prefetch
themselves. Either way the data order is the same, and the state is the global position right
after the last batch handed over (``vl/stages.py``), the same on every rank.

Cost: ``python -m benchmarks vl_dataset`` (rows in ``benchmarks/RESULTS.md``) times the fetch +
collate of a pack, the training thread's wait in ``next()`` with the loader in process (the
Prefetch hand-off) and with one worker, and opening the loader over an existing cache.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.vl.collate import (
    BATCH_FORMATS,
    PackCollator,
    PixelNorm,
    finish_on_device,
)
from torchtitan_ext.vl.collate_torchtitan import check_special_tokens
from torchtitan_ext.vl.options import BatchOptions, OrderOptions, SourceOptions, WorkerOptions
from torchtitan_ext.vl.pack_source import open_packs
from torchtitan_ext.vl.stages import (
    SOURCE_ONLINE,
    CachePacks,
    CollatePacks,
    CountBatches,
    OnlinePacks,
    WorkerBatches,
    position_of,
    with_position,
)


def processor_path(model_path: str | None, hf_assets_path: str | None) -> str | None:
    """The processor that tokenizes the cache: ``model_path``; unset, the model's own directory
    (the trainer's ``hf_assets_path``) when it holds a Qwen3-VL processor; else None (the
    embedded offline processor). The path itself is not part of the cache key, its contents are."""
    if model_path:
        return model_path
    if hf_assets_path and (Path(hf_assets_path) / "preprocessor_config.json").is_file():
        return str(hf_assets_path)
    return None


def _check(batch: BatchOptions, order: OrderOptions, batch_size: int, seq_len: int | None) -> int:
    """The pack length, after refusing settings no reader can serve (one line each)."""
    if batch.batch_format not in BATCH_FORMATS:
        raise ValueError(
            f"dataloader.batch_format must be one of {BATCH_FORMATS}, got {batch.batch_format!r}"
        )
    if batch.normalize_on not in ("collate", "device"):
        raise ValueError(
            f"dataloader.normalize_on must be 'collate' or 'device', got {batch.normalize_on!r}"
        )
    if order.remainder not in ("drop", "wrap"):
        raise ValueError(f"dataloader.remainder must be 'drop' or 'wrap', got {order.remainder!r}")
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


class VLReader:
    """Batches of one DP rank's packs (cache or online fallback) with an exact global position.

    ``tokenizer``: the trainer's, optional. The cache carries its own special-token ids (from the
    processor it was built with); a torchtitan-shaped VLM tokenizer's must equal them
    (:func:`check_model_tokenizer`, before any cache is built), and its ``tokenizer_path`` (the
    trainer's ``hf_assets_path``) is the processor when ``model_path`` is unset
    (:func:`processor_path`).

    Facts for probes, tests and benchmarks: ``source`` ("cache" / "online"), ``cache_path``,
    ``dataset`` (``CachedVLDataset`` / ``OnlineVLDataset``), ``model_path``, ``pack_seq_len``,
    ``num_workers`` (0 for the online fallback), ``special_tokens``, ``pixel_norm``, ``collate``;
    ``pipeline`` is the top stage.
    """

    def __init__(
        self,
        source: SourceOptions,
        order: OrderOptions,
        batch: BatchOptions,
        workers: WorkerOptions,
        prefetch: PrefetchOptions,
        *,
        seq_len: int | None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        batch_size: int = 1,
        tokenizer: Any = None,
    ) -> None:
        self.pack_seq_len = _check(batch, order, batch_size, seq_len)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.batch_size = batch_size

        t0 = time.perf_counter()
        self.model_path = processor_path(
            source.model_path, getattr(tokenizer, "tokenizer_path", None)
        )
        check_model_tokenizer(tokenizer, source.cache_path, self.model_path)
        if self.model_path != source.model_path:  # the processor that keys the cache
            source = replace(source, model_path=self.model_path)
        packs = open_packs(
            source,
            order,
            seq_len=self.pack_seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            block_size=batch_size,
        )
        self.source, self.cache_path, self.dataset = packs.source, packs.path, packs.dataset
        self.special_tokens = packs.special_tokens
        self.num_workers = workers.num_workers if packs.source == "cache" else 0
        self.open_s = time.perf_counter() - t0
        self.pixel_norm = PixelNorm.from_metadata(packs.metadata)
        self.collate = PackCollator(
            batch.batch_format, self.special_tokens, self.pixel_norm, batch.normalize_on
        )
        if packs.source == "cache":  # no private pixel copy where the collate makes its own
            self.dataset.copy_pixels = not self.collate.copies_pixels
        self.pipeline = self._chain(batch, workers, prefetch)
        self._wait_s = self._wait_last_s = 0.0

    def _chain(
        self, batch: BatchOptions, workers: WorkerOptions, prefetch: PrefetchOptions
    ) -> Stage[Any]:
        pad_id = self.collate.pad_id
        if self.num_workers > 0:
            inner = WorkerBatches(
                self.dataset, self.batch_size, self.collate, workers, batch.pin_memory
            )
            return CountBatches(inner, pad_id)
        src = CachePacks(self.dataset) if self.source == "cache" else OnlinePacks(self.dataset)
        collated = CollatePacks(src, self.batch_size, self.collate, batch.pin_memory)
        return Prefetch(CountBatches(collated, pad_id), prefetch, name="vl-loader")

    # -- iteration ------------------------------------------------------------------------------
    def next(self) -> Any:
        """The next batch; ``StopIteration`` at the end of a finite pass, after which the chain
        stands at the next epoch's start (the next call reads it)."""
        t0 = time.perf_counter()
        try:
            batch = self.pipeline.next()
        except StopIteration:
            self.pipeline.reset(self.pipeline.state())  # re-arm: the next pass starts there
            raise
        self._wait_last_s = time.perf_counter() - t0
        self._wait_s += self._wait_last_s
        return batch

    def finish_on_device(self, batch: Any) -> Any:
        """Normalise uint8 pixel_values where the batch now lives (``normalize_on="device"``)."""
        return finish_on_device(batch, self.pixel_norm)

    def close(self) -> None:
        self.pipeline.close()

    # -- state ----------------------------------------------------------------------------------
    def rank_state(self) -> State:
        """The global position after the batches handed over: plain ints (and a short list of
        ints for the online source), the same on every rank; ``source`` 0: cache, 1: online."""
        return position_of(self.pipeline.state())

    def check_source(self, position: State) -> None:
        """A position saved reading the other source (cache vs online) is refused: the orders
        differ. ValueError naming both. A mixture's position: the mixture's one line."""
        if "names" in position:  # a mixture's position (vl/mix_reader.py)
            from torchtitan_ext.pipeline.mix import MixtureError, mismatch_message

            raise MixtureError(mismatch_message(list(position["names"]), []))
        saved_online = int(position.get("source", 0)) == SOURCE_ONLINE
        if saved_online != (self.source == "online"):
            raise ValueError(
                f"VL loader state was saved from the {'online' if saved_online else 'cache'} "
                f"source but this loader reads from the {self.source}; the orders differ"
            )

    def load_rank_state(self, position: State) -> None:
        """Restore a :meth:`rank_state` (saved at any DP degree); reading restarts there."""
        self.check_source(position)
        self.pipeline.reset(with_position(self.pipeline.state(), dict(position)))

    # -- stats ----------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """Numbers for the step log line (cumulative unless the name says ``last``)."""
        top = self.pipeline
        if isinstance(top, Prefetch):
            out = top.get_stats()  # + queue depth, producer busy time, thread policy
        else:
            out = {**top.stats(top.state()), "consumer_wait_ms": 1e3 * self._wait_s}
        out["wait_ms_last"] = 1e3 * self._wait_last_s
        out["open_s"] = self.open_s
        return {k: float(v) for k, v in out.items()}
