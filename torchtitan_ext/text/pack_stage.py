"""The tokenize + pack + batch stage of the Parquet loader: text chunks in, ``[B, T]`` batches out.

Each ``next()`` reads chunks from its upstream (:class:`~torchtitan_ext.text.parquet_source.
ParquetSource`) until the packer (:mod:`torchtitan_ext.text.packing`) has ``batch_size`` rows,
encoding each chunk in one call with BOS prefixed as an id (never a formatted ``"<|bos|>"``
string) and EOS appended with ``add_eos``, and returns ``({"input": [B, T], "positions": [B, T]},
labels [B, T])`` int64 tensors, labels shifted by one and ``-100`` on padding. At the end of a
finite pass the packer is flushed and the last batch is padded to ``B`` rows with ignored labels,
so shapes never change; then ``StopIteration``.

State (``state()``, after every batch, in the loader's thread):

================  ==================================================================
``source``        the upstream's position after the last chunk fed
``packer``        the packer's live snapshot (:mod:`~torchtitan_ext.text.packer_state`;
                  :meth:`PackedBatches.checkpoint_state` makes it compact)
``counters``      ``rows_read``, ``docs_read``, ``tokens_read``, ``batches``
``skips``         skipped records per reason
``seq_len`` ...   ``seq_len``, ``batch_size``: a resumed stream cannot change its shape
================  ==================================================================

Invariant: counts include every row read, so ``rows_read == docs_read + docs_skipped`` after
every batch, also after a resume; :meth:`PackedBatches.state_after_error` keeps the counts up to
an error where the error came between two batches (no row of the next batch taken yet).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from torchtitan_ext.constants import IGNORE_INDEX
from torchtitan_ext.pipeline.stage import Stage, State
from torchtitan_ext.text import packer_state
from torchtitan_ext.text.errors import SkipLog
from torchtitan_ext.text.packing import PACKING_MODES, BestFitPacker, ConcatSplitPacker, make_packer
from torchtitan_ext.text.parquet_source import ParquetSource
from torchtitan_ext.text.tokenize import TextTokenizer

# The public module's name: users configure (and filter) the loader's logging under it.
logger = logging.getLogger("torchtitan_ext.text.prefetch")

# Releases the GIL and offers the CPU (no-op where the OS has no sched_yield); see _feed.
_yield_cpu = getattr(os, "sched_yield", lambda: None)

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]
_COUNTERS = ("rows_read", "docs_read", "tokens_read", "batches")


@dataclass(kw_only=True)
class PackOptions:
    """Options of :class:`PackedBatches` (a loader Config inherits them; TOML ``[dataloader]``)."""

    packing: Literal["best_fit", "zero_discard", "concat_split"] = "best_fit"
    """``"best_fit"`` (BOS-aligned, the crop that loses least), ``"zero_discard"`` (cropped tails
    re-enter with their own BOS) or ``"concat_split"`` (plain concatenation)."""

    buffer_docs: int = 1000
    """Documents the best-fit packer holds to choose from (more: less crop, more memory)."""

    add_eos: bool = False
    """Also append EOS to each document (BOS is always prefixed)."""

    tokenizer_parallelism: bool = False
    """``False``: set ``TOKENIZERS_PARALLELISM=false`` for the process (unless already set) so
    tokenization stays on the loader's one thread instead of a pool spanning every core that
    the training loop then waits on (p99 next() 8-17 ms vs <1 ms measured on 2 cores)."""


def to_batch(tokens: np.ndarray, positions: np.ndarray, valid: list[int]) -> Batch:
    """[B, T+1] packed rows -> torchtitan's (inputs, labels), contiguous int64 tensors."""
    R = tokens.shape[1]
    labels = tokens[:, 1:].copy()
    for i, v in enumerate(valid):
        if v < R:
            # label j predicts token j+1, which is padding once j+1 >= valid
            labels[i, max(v - 1, 0) :] = IGNORE_INDEX
    inputs = {
        "input": torch.from_numpy(tokens[:, :-1].copy()),
        "positions": torch.from_numpy(positions[:, :-1].copy()),
    }
    return inputs, torch.from_numpy(labels)


def pad_rows(
    tokens: np.ndarray, positions: np.ndarray, valid: list[int], n: int, pad_id: int
) -> None:
    """Rows ``n:`` of a batch become padding: ``pad_id`` tokens, positions 0, no valid token
    (so :func:`to_batch` gives them only ignored labels)."""
    tokens[n:] = pad_id
    positions[n:] = 0
    valid[n:] = [0] * (len(valid) - n)


class PackedBatches(Stage[Batch]):
    """Tokenize ``upstream``'s chunks, pack rows of ``seq_len + 1`` tokens, emit batches of
    ``batch_size`` rows (see the module docstring)."""

    def __init__(
        self,
        upstream: ParquetSource,
        tokenizer: Any,
        options: PackOptions | None = None,
        *,
        seq_len: int,
        batch_size: int,
    ) -> None:
        self.options = o = options or PackOptions()
        if o.packing not in PACKING_MODES:
            raise ValueError(f"packing must be one of {PACKING_MODES}, got {o.packing!r}")
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        # Process-wide on purpose (the library has no per-call switch); an explicit user setting
        # wins. Measured on 2 cores: with the pool, the training loop's next() waited 2-4 % of
        # the time with p99 8-17 ms (pool threads occupying both cores when it woke up); on the
        # loader's thread alone, 0.2-0.4 % and p99 0.1-0.4 ms, at the same tokens/s.
        os.environ.setdefault(
            "TOKENIZERS_PARALLELISM", "true" if o.tokenizer_parallelism else "false"
        )
        self.tokenizer = TextTokenizer.coerce(tokenizer)
        if self.tokenizer.bos_id is None:
            raise ValueError(
                f"{self.tokenizer.source}: the tokenizer has no BOS token; BOS-aligned packing "
                "needs one (pass bos_token when loading it)"
            )
        self.upstream: ParquetSource = upstream
        self.seq_len, self.batch_size = seq_len, batch_size
        self._start()

    def _new_packer(self) -> BestFitPacker | ConcatSplitPacker:
        t = self.tokenizer
        return make_packer(
            self.options.packing,
            self.seq_len,
            t.bos_id,
            buffer_docs=self.options.buffer_docs,
            pad_id=t.pad_id if t.pad_id is not None else t.bos_id,
            boundary_id=None,  # add_eos already appends EOS in the tokenizer call
        )

    def _start(self, packer: BestFitPacker | ConcatSplitPacker | None = None) -> None:
        self.packer = packer or self._new_packer()
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.skips = SkipLog()  # counts are state; examples are informational
        self._ended = False  # the (finite) source is exhausted
        self._between = False  # fetching a chunk with no row of the next batch taken

    # ------------------------------------------------------------------ contract
    def next(self) -> Batch:
        B, R = self.batch_size, self.packer.row_len
        tokens = np.empty((B, R), dtype=np.int64)
        positions = np.empty((B, R), dtype=np.int64)
        valid = [R] * B
        n = self._fill(tokens, positions, valid)
        if n == 0:
            self._end()
        if n < B:
            # End of a finite pass: the missing rows are all padding (labels ignored), so batch
            # shapes never change (torch.compile, fixed-shape buffers).
            pad_rows(tokens, positions, valid, n, self.packer.pad_id)
        self.counters["batches"] += 1
        return to_batch(tokens, positions, valid)

    def _end(self) -> None:
        """The pass ended with no row to give: say so if it never had a usable document."""
        if self.counters["docs_read"] == 0:
            logger.warning(
                "%s: the pass ended without a usable document (%d rows read, skipped: %s)",
                self.upstream.describe(),
                self.counters["rows_read"],
                self.skips.as_dict(),
            )
        raise StopIteration

    def _fill(self, tokens: np.ndarray, positions: np.ndarray, valid: list[int]) -> int:
        """Pack rows into ``tokens``/``positions``, reading and feeding chunks as needed; the
        number of rows filled (fewer than the batch only at the end of a finite pass)."""
        packer, n = self.packer, 0
        while n < len(valid):
            if packer.ready() or (self._ended and packer.has_pending()):
                valid[n] = packer.pop_row_into(tokens[n], positions[n], final=self._ended)
                n += 1
            elif self._ended:
                break
            else:
                self._between = n == 0  # stays set if next() raises: see state_after_error
                try:
                    chunk = self.upstream.next()
                except StopIteration:
                    self._ended = True
                    continue
                self._between = False
                self._feed(chunk)
        return n

    def _feed(self, chunk: Any) -> None:
        c = self.counters
        if chunk.texts:
            # Before each Rust call: a training thread that woke up while we held the GIL, and
            # that the kernel queued on *our* CPU when we let go of it, runs now rather than
            # after our time slice (up to a 4 ms tick). Measured at the normal thread policy on
            # 2 cores: worst next() 0.1-1.1 ms instead of 2-4.4 ms, and the loop's time lost
            # outside next() 0.7 % instead of 1.3-2.4 %, at the same tokens/s.
            _yield_cpu()
            encoded = self.tokenizer.encode_arrays(
                chunk.texts, add_bos=True, add_eos=self.options.add_eos
            )
            add, ntok = self.packer.add, 0
            for arr in encoded:
                ntok += arr.size
                add(arr)
            c["docs_read"] += len(encoded)
            c["tokens_read"] += ntok
        c["rows_read"] += chunk.rows_read
        for reason, loc, k in chunk.skips:
            self.skips.skip(reason, loc, k)

    def state(self) -> State:
        return {
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "source": self.upstream.state(),
            "packer": packer_state.live(self.packer),
            "counters": dict(self.counters),
            "skips": self.skips.as_dict(),
        }

    def state_after_error(self) -> State | None:
        """The state when an error was raised, where it is one a batch boundary could have had
        (between chunks, no row of the next batch taken): its counts include the rows read up to
        the error. None otherwise."""
        return self.state() if self._between else None

    def checkpoint_state(self, state: State) -> State:
        """``state`` with its packer in the compact form (what a checkpoint holds)."""
        return {**state, "packer": packer_state.compact(state["packer"])}

    def reset(self, state: State | None = None) -> None:
        if state is None:
            self.upstream.reset(None)
            self._start()
            return
        for key, mine in (("seq_len", self.seq_len), ("batch_size", self.batch_size)):
            if int(state[key]) != mine:
                raise ValueError(
                    f"loader state has {key}={int(state[key])}, this loader has {key}={mine}: "
                    "a resumed data stream cannot change it"
                )
        packer = self._new_packer()
        packer.load_state_dict(packer_state.compact(state["packer"]))  # checks kind / row length
        self.upstream.reset(state["source"])  # checks the DP slot
        self._start(packer)
        self.counters.update({k: int(state["counters"][k]) for k in _COUNTERS})
        self.skips.load_state_dict({"counts": dict(state["skips"]), "examples": {}})

    def stats(self, state: State) -> dict[str, Any]:
        c, pc = state["counters"], state["packer"]["counters"]
        return {
            "rows_read": c["rows_read"],
            "docs_read": c["docs_read"],
            "tokens_read": c["tokens_read"],
            "docs_skipped": sum(state["skips"].values()),
            "files_skipped": len(self.upstream.unreadable_files),  # on_bad_input="skip" only
            "tokens_cropped": pc["tokens_cropped"],
            "crop_pct": 100.0 * pc["tokens_cropped"] / max(pc["tokens_in"], 1),
            "fill_pct": 100.0 * pc["tokens_out"] / max(pc["rows"] * (self.seq_len + 1), 1),
            "batches": c["batches"],
            "epoch": int(state["source"]["epoch"]),
        }


@dataclass(frozen=True, slots=True)
class PackedRow:
    """One packed row of ``seq_len + 1`` tokens, before the shift into inputs and labels:
    ``tokens`` and ``positions`` ``int64 [seq_len + 1]``, ``valid`` tokens (the rest padding)."""

    tokens: np.ndarray
    positions: np.ndarray
    valid: int


class PackedRows(PackedBatches):
    """:class:`PackedBatches` one row per ``next()``, as a :class:`PackedRow` of numpy arrays:
    a mixture's per-source chain (``text/parquet_mix.py``), whose batcher stacks rows of several
    sources and makes the tensors once per batch. (As one-row torch batches, each row cost ~5
    tensor operations and each batch a stack per key; the mixture then ran at 0.96x the single
    source's tokens/s in ``benchmarks/text_mixture.py``.) State,
    counters and resume are :class:`PackedBatches`' with ``batch_size = 1``: ``batches`` counts
    rows."""

    def __init__(self, *args: Any, seq_len: int, **kwargs: Any) -> None:
        """:class:`PackedBatches`' arguments but ``batch_size``, which is 1."""
        super().__init__(*args, seq_len=seq_len, batch_size=1, **kwargs)

    def next(self) -> PackedRow:  # type: ignore[override]
        R = self.packer.row_len
        tokens = np.empty((1, R), dtype=np.int64)
        positions = np.empty((1, R), dtype=np.int64)
        valid = [R]
        if self._fill(tokens, positions, valid) == 0:
            self._end()
        self.counters["batches"] += 1
        return PackedRow(tokens[0], positions[0], valid[0])
