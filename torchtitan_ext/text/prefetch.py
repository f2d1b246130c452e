"""PrefetchingParquetLoader: Parquet row groups -> tokenize + pack -> background hand-off, as one
chain of stages (:mod:`torchtitan_ext.pipeline.stage`):

==================================================  ============================================
stage                                               job (and where its contract is written)
==================================================  ============================================
:class:`~.parquet_source.ParquetSource`             chunks of one row group; global epoch order
                                                    dealt to the DP ranks; read-ahead threads;
                                                    elastic position
:class:`~.pack_stage.PackedBatches`                 tokenize (Rust, GIL released), BOS-aligned
                                                    packing, ``[B, T]`` batches, counters
:class:`~torchtitan_ext.pipeline.prefetch.Prefetch`  the one background thread and hand-off:
                                                    one state snapshot per batch, errors relayed
                                                    as the same object, end of a finite pass,
                                                    thread policy, shutdown
==================================================  ============================================

Why a thread (not processes): tokenization and pyarrow reads release the GIL, so one background
thread overlaps them with the training loop, on another core, without pickling documents across
processes. **One core**: by default the loader sets ``TOKENIZERS_PARALLELISM=false`` (unless the
user set it): the Rust tokenizer's pool otherwise spans every core, and the training loop, waking
from a step, then waits for a time slice (measured: p99 ``next()`` 8-17 ms instead of <1 ms on 2
cores, same tokens/s). ``tokenizer_parallelism=True`` opts out.

Exact resume: the loader's state is the state of the last batch ``next()`` returned (what is
still queued is made again after a resume): :meth:`PrefetchingParquetLoader.rank_state` (compact,
for a checkpoint), :meth:`~PrefetchingParquetLoader.state_dict` (the same, pickle-free encoded),
:meth:`~PrefetchingParquetLoader.reset` / ``load_state_dict``. At another DP degree the torchtitan
adapter merges every old rank's state (:mod:`torchtitan_ext.text.parquet_resume`).

Measured (tokens per CPU-second against torchtitan's loader, data-wait share, ``next()`` p50/p99,
slow storage, thread policies): ``python -m benchmarks text_loaders``, figures in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan_ext.pipeline.loader import PrefetchedLoader
from torchtitan_ext.pipeline.prefetch import Prefetch, PrefetchOptions
from torchtitan_ext.pipeline.stage import State
from torchtitan_ext.text.pack_stage import PackedBatches, PackOptions
from torchtitan_ext.text.parquet_source import ParquetOptions, ParquetSource

_OPTIONS = (ParquetOptions, PackOptions, PrefetchOptions)


def split_options(
    flat: dict[str, Any], *given: Any
) -> tuple[ParquetOptions, PackOptions, PrefetchOptions]:
    """The three stages' options: ``given`` ones (or defaults) with the ``flat`` keywords set by
    field name; an unknown keyword is a ``TypeError`` naming it."""
    out = [g if g is not None else cls() for cls, g in zip(_OPTIONS, given, strict=True)]
    left = dict(flat)
    for i, o in enumerate(out):
        mine = {f.name for f in dataclasses.fields(o)} & left.keys()
        out[i] = dataclasses.replace(o, **{k: left.pop(k) for k in mine})
    if left:
        raise TypeError(f"PrefetchingParquetLoader got unexpected keyword(s): {sorted(left)}")
    return out[0], out[1], out[2]  # type: ignore[return-value]


class PrefetchingParquetLoader(PrefetchedLoader):
    """Iterator of packed batches from Parquet shards, read, tokenized and packed in a
    background thread.

    Each ``next()`` returns ``({"input": LongTensor[B, T], "positions": LongTensor[B, T]},
    labels LongTensor[B, T])`` with labels shifted by one and ``-100`` on padding. Infinite by
    default; with ``infinite=False`` it makes one pass (the last batch is padded to ``B`` rows with
    ignored labels, so shapes never change) and then raises ``StopIteration``.

    Args:
        path: a directory, glob or list of Parquet shards (see :mod:`torchtitan_ext.text.parquet`).
        tokenizer: a :class:`TextTokenizer` or anything ``TextTokenizer.coerce`` accepts.
        seq_len: tokens per row fed to the model (rows are packed to ``seq_len + 1``).
        batch_size: rows per batch (torchtitan's ``local_batch_size``).
        dp_rank / dp_world_size: this rank's share (each epoch's row groups dealt round-robin).
        read_delay_s: sleep this long per row-group read (simulates slow storage; benchmarks).
        source / pack / prefetch: the stages' options (:class:`ParquetOptions`,
            :class:`PackOptions`, :class:`PrefetchOptions`, where each knob is documented);
        **options: any of their fields as flat keywords (``seed=3, queue_size=4``), set on top.
    """

    def __init__(
        self,
        path: Any,
        tokenizer: Any,
        *,
        seq_len: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        read_delay_s: float = 0.0,
        source: ParquetOptions | None = None,
        pack: PackOptions | None = None,
        prefetch: PrefetchOptions | None = None,
        **options: Any,
    ) -> None:
        src_o, pack_o, pre_o = split_options(options, source, pack, prefetch)
        self.source = ParquetSource(
            path, src_o, dp_rank=dp_rank, dp_world_size=dp_world_size, read_delay_s=read_delay_s
        )
        self.packed = PackedBatches(
            self.source, tokenizer, pack_o, seq_len=seq_len, batch_size=batch_size
        )
        self.pipeline = Prefetch(
            self.packed, pre_o, name=f"parquet-prefetch-{src_o.split}-dp{dp_rank}"
        )
        self.tokenizer = self.packed.tokenizer
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

    # ------------------------------------------------------------------ stats
    @property
    def skip_counts(self) -> dict[str, int]:
        """Skipped records per reason, as of the last batch returned."""
        return dict(self.pipeline.state()["skips"])

    @property
    def skip_examples(self) -> dict[str, list[str]]:
        """The first few locations per skip reason seen by this process (informational)."""
        out = {k: list(v) for k, v in self.packed.skips.examples.items()}
        if self.source.unreadable_files:
            out["unreadable_file"] = list(self.source.unreadable_files)
        return out

    # ------------------------------------------------------------------ state
    def rank_state(self) -> State:
        """This rank's state as of the last batch returned, packer compact (what a checkpoint
        holds; :func:`torchtitan_ext.pipeline.checkpoint.encode` makes it pickle-free)."""
        return self.packed.checkpoint_state(self.pipeline.state())
