"""OnlineVLDataset: the slow fallback when no cache exists — preprocess and pack inside the loader.

It runs the same code as the offline builder (``vl.sample.process_chat`` per row, then
``vl.packing.best_fit_packs`` with the same ``seq_len`` / ``buffer_size`` / ``buckets``) and yields
pack dicts in exactly the layout of ``VLCache.pack(i)``, so the collate functions and the model see
no difference. Costs what the seed measured for online packing: image decode + resize + patchify
(~5-17 ms per image on this 2-core box, facts.md) on the training process's CPU.

Rows come from the builder's own source reader and layout (``vl.sources.open_source``: same
files, layout and columns) and are processed by the builder's own per-row step
(``vl.row_work.process_parsed``: same options, same skip reasons), in chunks of 256 rows; with ``shuffle`` epoch ``e`` visits the chunks in a
random order and the rows of each chunk in a random order (seed ``seed + e``), so every chunk is
read once per epoch. Sharding keeps the cache's guarantees without knowing the pack count in
advance: every rank processes the *same* global row stream, packs it identically, and takes global packs in rounds of ``W``: rank ``r`` gets pack ``k`` of the
round. A round is released only when complete, so all ranks yield the same number of packs and an
epoch's incomplete last round is dropped for everyone. The price is that every rank preprocesses
all rows (W x the CPU work) — acceptable for a fallback, the reason to build the cache.

State (plain ints + a list of ints, no pickle): ``epoch``, ``next_row`` (rows of this epoch's order
consumed), ``buffered`` (positions of the rows waiting in the packer's buffer, arrival order),
``packs`` (global packs released in the epoch) and the skip counters. Resume re-processes only the
buffered rows (at most ``buffer_size``) and continues: the packer is deterministic given the
arrival order, so the packs after a resume are bitwise those of an uninterrupted run, and the state
is rank-independent (elastic, like the cache's). It runs in the training process only
(``num_workers=0``); the loader enforces this.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.vl.packing import best_fit_packs, bucket_length, normalize_buckets

logger = logging.getLogger(__name__)

_STATE_VERSION = 1


def assemble_pack(samples: Sequence[Any], length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Samples (``VLSample``-like) -> a pack dict in ``VLCache.pack`` layout, padded to ``length``.

    Prefers vlprep's own ``assemble_pack`` (the builder's code) when it exists; this copy follows
    the contract (first label of each sample -100; pads: pad_id / -100 / position 0).
    """
    try:
        from torchtitan_ext.vl.packing import assemble_pack as theirs  # type: ignore[attr-defined]
    except ImportError:  # vlprep exposes none (yet): the contract's layout, written out here
        theirs = None
    if theirs is not None:
        return theirs(samples, length, pad_id)
    lens = [int(s.input_ids.numel()) for s in samples]
    total = sum(lens)
    if total > length:
        raise ValueError(f"pack of {total} tokens does not fit length {length}")
    ids = torch.full((length,), pad_id, dtype=torch.int64)
    labels = torch.full((length,), IGNORE_INDEX, dtype=torch.int64)
    pos = torch.zeros((4, length), dtype=torch.int64)
    o = 0
    for s, n in zip(samples, lens, strict=True):
        ids[o : o + n] = s.input_ids
        labels[o : o + n] = s.labels
        labels[o] = (
            IGNORE_INDEX  # the first token of a sample is never a target (no cross-sample loss)
        )
        pos[:, o : o + n] = s.position_ids
        o += n
    pack = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "pixel_u8": torch.cat([s.pixel_u8 for s in samples]),
        "image_grid_thw": torch.cat([s.image_grid_thw for s in samples]),
        "num_tokens": torch.tensor(total, dtype=torch.int64),
    }
    vids = [s for s in samples if len(s.video_grid_thw)]
    if vids:  # as a cache's pack: the video keys only when the pack holds a video
        pack["video_u8"] = torch.cat([s.video_u8 for s in vids])
        pack["video_grid_thw"] = torch.cat([s.video_grid_thw for s in vids])
    return pack


CHUNK_ROWS = 256
"""Rows read per source access; the shuffle permutes chunks and rows within a chunk, so each
epoch reads every chunk once (random single-row Parquet reads would decode a row group each)."""


class _Rows:
    """Row access over the builder's source (``vl.sources.open_source``: same files, same layout,
    same column picking), one chunk at a time; items are parsed conversations."""

    def __init__(self, config: Any) -> None:
        from torchtitan_ext.vl.layouts import column_overrides
        from torchtitan_ext.vl.sources import open_source

        # the key is never needed: a quick fingerprint
        self.src = open_source(config.dataset, config.split, "quick", config.format,
                               column_overrides(config))  # fmt: skip
        self.root = self.src.root
        n = self.src.num_rows
        mx = config.max_samples
        self.num_rows = n if mx is None else min(n, int(mx))
        self._chunk = -1
        self._rows: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return self.num_rows

    def _parse(self, raw: dict[str, Any]) -> Any:
        """The parsed row, or the SampleError that skips it (raised where rows are processed)."""
        from torchtitan_ext.vl.processor import SampleError

        try:
            return self.src.parse(raw)
        except SampleError as e:
            return e

    def __getitem__(self, i: int) -> Any:
        c = i // CHUNK_ROWS
        if c != self._chunk:
            a = c * CHUNK_ROWS
            raw = self.src.read(a, min(a + CHUNK_ROWS, self.num_rows))
            self._rows = [self._parse(r) for r in raw]
            self._chunk = c
        return self._rows[i - c * CHUNK_ROWS]


class OnlineVLDataset(IterableDataset):
    """Packs produced on the fly from the source rows (see the module docstring)."""

    def __init__(
        self,
        dataset: str | Path,
        split: str = "train",
        *,
        seq_len: int,
        buffer_size: int = 64,
        buckets: Sequence[int] | None = None,
        model_path: str | Path | None = None,
        max_samples: int | None = None,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        seed: int = 0,
        shuffle: bool = True,
        strict: bool = False,
        rows: Any = None,
        **options: Any,
    ) -> None:
        """``rows``: a sequence of parsed samples to use instead of reading ``dataset``;
        ``options``: further ``vl.build.BuildConfig`` fields (``exif_transpose``,
        ``max_image_pixels``), processed exactly as the builder would."""
        super().__init__()
        from torchtitan_ext.vl.build import config_from
        from torchtitan_ext.vl.processor import (
            load_processor,
            processor_fingerprint,
            special_token_ids,
        )

        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"need 0 <= dp_rank < dp_world_size, got {dp_rank}, {dp_world_size}")
        self.build_config = config_from(
            dataset, split, seq_len, buffer_size, buckets=buckets, model_path=model_path,
            max_samples=max_samples, **options,
        )  # fmt: skip
        self.rows = rows if rows is not None else _Rows(self.build_config)
        self.root = getattr(self.rows, "root", None)
        self.num_rows = len(self.rows)
        if self.num_rows == 0:
            raise ValueError(f"dataset {dataset} split {split} has no rows")
        self.processor = load_processor(model_path)
        self.special_tokens = special_token_ids(self.processor)
        self.seq_len, self.buffer_size = int(seq_len), int(buffer_size)
        self.buckets = normalize_buckets(self.seq_len, buckets)
        self.metadata = {
            "source": "online",
            "dataset": str(dataset),
            "split": split,
            "seq_len": self.seq_len,
            "buffer_size": self.buffer_size,
            "buckets": self.buckets,
            "processor": processor_fingerprint(self.processor),
        }
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.infinite, self.seed, self.shuffle, self.strict = infinite, int(seed), shuffle, strict
        # position in the global stream (see state_dict)
        self._epoch, self._next_row, self._buffered, self._packs = 0, 0, [], 0
        self.skips: Counter[str] = Counter()
        self.rows_ok = 0

    # -- preprocessing --------------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        """Row visiting order of an epoch: chunks of CHUNK_ROWS in a random order, rows shuffled
        within each chunk (seed + epoch); identity with shuffle=False."""
        n = self.num_rows
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        n_chunks = -(-n // CHUNK_ROWS)
        order: list[int] = []
        for c in torch.randperm(n_chunks, generator=g).tolist():
            a = c * CHUNK_ROWS
            size = min(CHUNK_ROWS, n - a)
            order += (torch.randperm(size, generator=g) + a).tolist()
        return order

    def _process(self, row_index: int) -> Any:
        """One row -> VLSample, or None with the skip counted under its reason (the builder's
        per-row step: the same options, the same reasons)."""
        from torchtitan_ext.vl.processor import SampleError
        from torchtitan_ext.vl.row_work import process_parsed

        try:
            row = self.rows[row_index]
            if isinstance(row, SampleError):  # the layout refused the row (missing_image, ...)
                raise row
            return process_parsed(self.processor, row, self.build_config, True, self.root)
        except SampleError as e:
            if self.strict:
                raise ValueError(f"row {row_index}: {e}") from e
            self.skips[e.reason] += 1  # counted skip; rows_ok + skips reconcile with rows read
            return None

    def _epoch_stream(self, epoch: int, start: int, buffered: list[int]) -> Iterator[Any]:
        """Yield (pack dict, next_row, buffered positions) for the epoch's global packs."""
        order = self._order(epoch)
        arrivals: list[tuple[int, Any]] = []  # arrival index -> (position in order, sample)
        live: dict[int, tuple[int, Any]] = {}
        progress = {"next": start}

        def lengths() -> Iterator[int]:
            # Replay the rows that sat in the packer's buffer at the saved state (they processed
            # fine then, they do now: deterministic), then continue with new rows.
            for pos in buffered:
                s = self._process(order[pos])
                if s is None:
                    raise RuntimeError(f"row {order[pos]} failed on replay; it succeeded before")
                arrivals.append((pos, s))
                live[len(arrivals) - 1] = (pos, s)
                yield int(s.input_ids.numel())
            for pos in range(start, self.num_rows):
                s = self._process(order[pos])
                progress["next"] = pos + 1
                if s is None:
                    continue
                self.rows_ok += 1
                arrivals.append((pos, s))
                live[len(arrivals) - 1] = (pos, s)
                yield int(s.input_ids.numel())

        pad_id = self.special_tokens["pad_id"]
        for pack in best_fit_packs(lengths(), self.seq_len, self.buffer_size):
            samples = [live.pop(i)[1] for i in pack]
            n = sum(int(s.input_ids.numel()) for s in samples)
            item = assemble_pack(samples, bucket_length(n, self.buckets), pad_id)
            still = [live[i][0] for i in sorted(live)]
            yield item, progress["next"], still

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if get_worker_info() is not None:
            raise RuntimeError("OnlineVLDataset runs in the training process (num_workers=0)")
        w, r = self.dp_world_size, self.dp_rank
        while True:
            epoch, anchor_packs = self._epoch, self._packs
            stream = self._epoch_stream(epoch, self._next_row, list(self._buffered))
            mine = None
            k = anchor_packs  # global pack index in the epoch
            for item, next_row, buffered in stream:
                rel = k - anchor_packs
                if rel % w == r:
                    mine = item
                k += 1
                if (k - anchor_packs) % w == 0:  # round complete: release this rank's pack
                    self._next_row, self._buffered, self._packs = next_row, buffered, k
                    if mine is None:  # every round holds one pack per rank
                        raise RuntimeError(f"rank {r} got no pack in round ending at {k}")
                    yield mine
                    mine = None
            # Epoch over (an incomplete last round is dropped on every rank alike).
            self._epoch, self._next_row, self._buffered, self._packs = epoch + 1, 0, [], 0
            if not self.infinite:
                return

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "next_row": self._next_row,
            "buffered": list(self._buffered),
            "packs": self._packs,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "rows_ok": self.rows_ok,
            "skips": dict(self.skips),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if int(state.get("version", _STATE_VERSION)) != _STATE_VERSION:
            raise ValueError(f"unknown OnlineVLDataset state version {state.get('version')}")
        if int(state["num_rows"]) != self.num_rows or int(state["seed"]) != self.seed:
            raise ValueError(
                f"OnlineVLDataset state is for {state['num_rows']} rows / seed {state['seed']}, "
                f"this dataset has {self.num_rows} rows / seed {self.seed}"
            )
        self._epoch, self._next_row = int(state["epoch"]), int(state["next_row"])
        self._buffered = [int(x) for x in state["buffered"]]
        self._packs = int(state["packs"])
        self.rows_ok = int(state.get("rows_ok", 0))
        self.skips = Counter({str(k): int(v) for k, v in dict(state.get("skips", {})).items()})
