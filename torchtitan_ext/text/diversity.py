"""Data-diversity checks for token loaders (the logic behind scripts/verify_data_diversity.py).

:class:`DiversityMeter` watches batches ``({"input", ...}, labels)`` and measures

* **window duplicates** — an 8-byte BLAKE2 hash of every full row (``input`` + the last label,
  i.e. the ``seq_len + 1`` window). A window seen twice *within one data epoch* is a duplicate;
  a repeat across epochs is reported separately (a long document that lands on the same row
  offset in two epochs repeats its inner windows legitimately).
* **document duplicates and coverage** — when the loader emits per-token ``doc_ids`` /
  ``doc_epochs`` / ``doc_offsets`` (``StreamingTextDataset(emit_doc_ids=True)``): a document
  *starts* where its offset is 0 (or 1 at a row's first input token: it began on the previous
  row's label-only last token); a document starting twice in the same epoch is a duplicate, and
  the distinct documents started in epoch ``e`` over the source size is that epoch's coverage.
  A loader with no notion of epochs reports epoch 0 forever, so its replays count as duplicates —
  which is exactly the ``take(N)`` replay bug.
* **epochs without document ids** — a loader that emits no ``doc_epochs`` but reports its
  ``epoch`` in ``get_stats()`` (``parquet_prefetch``) has each batch's rows tagged with that
  epoch (:func:`run_check`), so its next epoch's windows are repeats across epochs, not
  duplicates: BOS-aligned packing starts every document on a row, so a document's first window
  recurs in every epoch by design. (Before this, a multi-epoch run of that loader reported ~77 %
  "duplicates"; one pass at DP 2 reports none.) The tag is as exact as the loader's packer
  buffer: rows emitted after the source wrapped but made of documents read before count in the
  new epoch, so a multi-epoch run can still show a few duplicate windows (0.38 % over 3 epochs at
  DP 2 on the embedded corpus, whose 1,000-document best-fit buffer holds most of its ~1,300
  documents); one pass (``--set infinite=false``) is exact.

:class:`BuggyTakeDataset` reproduces a ``take(N)``-style loader (``take(N)`` rebuilt on every
``__iter__``, seed-per-worker shuffle, manual worker filtering, token buffer): a demonstration
that the checks catch it, not something to train with.

Cost: hashing is ~1 µs per row of 2k tokens; the meter keeps one 8-byte hash per row and one
counter per (epoch, document).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


@dataclass
class DiversityReport:
    batches: int = 0
    rows: int = 0
    window_duplicates: int = 0
    """Rows whose seq_len+1 window was already seen in the same data epoch."""
    window_repeats_across_epochs: int = 0
    """Rows whose window was seen in an earlier epoch (informational)."""
    doc_starts: int = 0
    doc_duplicates: int = 0
    """Document starts of a document already started in the same epoch."""
    num_documents: int | None = None
    epochs_seen: list[int] = field(default_factory=list)
    coverage: dict[int, float] = field(default_factory=dict)
    """Epoch -> distinct documents started / num_documents."""
    complete_epochs: list[int] = field(default_factory=list)
    first_duplicate: dict[str, Any] | None = None

    @property
    def window_dup_rate(self) -> float:
        return self.window_duplicates / self.rows if self.rows else 0.0

    @property
    def doc_dup_rate(self) -> float:
        return self.doc_duplicates / self.doc_starts if self.doc_starts else 0.0

    def failures(self, max_dup_rate: float = 0.0, min_coverage: float = 1.0) -> list[str]:
        """Reasons this run fails the thresholds (empty = pass)."""
        out = []
        if self.window_dup_rate > max_dup_rate:
            out.append(f"window duplicate rate {self.window_dup_rate:.2%} > {max_dup_rate:.2%}")
        if self.doc_dup_rate > max_dup_rate:
            out.append(f"document duplicate rate {self.doc_dup_rate:.2%} > {max_dup_rate:.2%}")
        for e in self.complete_epochs:
            cov = self.coverage.get(e, 0.0)
            if cov < min_coverage:
                out.append(f"epoch {e} coverage {cov:.2%} < {min_coverage:.2%}")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["coverage"] = {str(k): v for k, v in self.coverage.items()}
        d["window_dup_rate"] = self.window_dup_rate
        d["doc_dup_rate"] = self.doc_dup_rate
        return d

    def format(self) -> str:
        lines = [
            f"batches {self.batches}, rows {self.rows}",
            f"token-window duplicates within an epoch: {self.window_duplicates} "
            f"({self.window_dup_rate:.3%}); repeats across epochs: "
            f"{self.window_repeats_across_epochs}",
        ]
        if self.doc_starts:
            lines.append(
                f"document starts {self.doc_starts}, duplicates within an epoch: "
                f"{self.doc_duplicates} ({self.doc_dup_rate:.3%})"
            )
            for e in self.epochs_seen:
                tag = "complete" if e in self.complete_epochs else "partial"
                cov = self.coverage.get(e)
                lines.append(
                    f"  epoch {e} ({tag}): coverage "
                    + (f"{cov:.2%} of {self.num_documents} documents" if cov is not None else "n/a")
                )
        else:
            lines.append("document ids: not emitted by this loader (window hashes only)")
        lines.append(f"first duplicate: {self.first_duplicate or 'none'}")
        return "\n".join(lines)


def _hash_row(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(
        np.ascontiguousarray(tokens, dtype=np.int64).tobytes(), digest_size=8
    ).digest()


class DiversityMeter:
    """Accumulates duplicate / coverage statistics over batches from any number of ranks."""

    def __init__(self, num_documents: int | None = None) -> None:
        self.num_documents = num_documents
        self._windows: dict[bytes, tuple[int, int]] = {}  # hash -> (epoch, first batch)
        self._starts: Counter[tuple[int, int]] = Counter()
        self._last_epoch: dict[tuple[int, int], int] = {}  # (rank, worker) -> latest epoch
        self.r = DiversityReport(num_documents=num_documents)

    def add_batch(
        self, batch: Any, rank: int = 0, worker: int = 0, epoch: int | None = None
    ) -> None:
        """Account one batch of rank ``rank`` produced by its DataLoader worker ``worker``;
        ``epoch``: the loader's data epoch as of this batch, for a loader without document ids
        (ignored when the batch carries ``doc_epochs``)."""
        inputs, labels = batch
        inp = inputs["input"].numpy()
        lab = labels.numpy()
        has_ids = "doc_ids" in inputs
        if has_ids:
            ids = inputs["doc_ids"].numpy()
            eps = inputs["doc_epochs"].numpy()
            offs = inputs["doc_offsets"].numpy()
        self.r.batches += 1
        for b in range(inp.shape[0]):
            self.r.rows += 1
            row_epoch = int(eps[b, 0]) if has_ids else int(epoch or 0)
            h = _hash_row(np.append(inp[b], lab[b, -1]))
            seen = self._windows.get(h)
            if seen is None:
                self._windows[h] = (row_epoch, self.r.batches)
            elif seen[0] == row_epoch:
                self.r.window_duplicates += 1
                self._first(
                    kind="token window",
                    epoch=row_epoch,
                    batch=self.r.batches,
                    rank=rank,
                    first_seen_batch=seen[1],
                )
            else:
                self.r.window_repeats_across_epochs += 1
            if has_ids:
                starts = np.flatnonzero(offs[b] == 0).tolist()
                if offs[b, 0] == 1:
                    # The document started on the previous row's last token, which is only a
                    # label (rows don't overlap), so its offset-0 token never shows as input.
                    starts.insert(0, 0)
                for j in starts:
                    key = (int(eps[b, j]), int(ids[b, j]))
                    self._starts[key] += 1
                    self.r.doc_starts += 1
                    if self._starts[key] > 1:
                        self.r.doc_duplicates += 1
                        self._first(
                            kind="document",
                            epoch=key[0],
                            doc_id=key[1],
                            batch=self.r.batches,
                            rank=rank,
                        )
                valid = eps[b][eps[b] >= 0]
                if valid.size:
                    self._last_epoch[(rank, worker)] = int(valid[-1])
            elif epoch is not None:
                self._last_epoch[(rank, worker)] = int(epoch)

    def _first(self, **info: Any) -> None:
        if self.r.first_duplicate is None:
            self.r.first_duplicate = info

    def min_slot_epoch(self, expected_slots: int) -> int:
        """The lowest latest-epoch over all rank x worker streams (-1 until all were seen)."""
        if len(self._last_epoch) < expected_slots:
            return -1
        return min(self._last_epoch.values())

    def state(self) -> dict[str, Any]:
        """JSON-able raw data, for merging meters of several processes (torchrun)."""
        return {
            "windows": [[h.hex(), e, b] for h, (e, b) in self._windows.items()],
            "starts": [[e, i, n] for (e, i), n in self._starts.items()],
            "last": [[r, w, e] for (r, w), e in self._last_epoch.items()],
            "report": self.r.to_dict(),
        }

    @classmethod
    def merged(cls, states: list[dict[str, Any]], num_documents: int | None) -> DiversityMeter:
        """One meter from several processes' :meth:`state` (duplicates across ranks included)."""
        m = cls(num_documents)
        for st in states:
            rep = st["report"]
            m.r.batches += rep["batches"]
            m.r.rows += rep["rows"]
            m.r.window_duplicates += rep["window_duplicates"]
            m.r.window_repeats_across_epochs += rep["window_repeats_across_epochs"]
            if m.r.first_duplicate is None and rep["first_duplicate"]:
                m.r.first_duplicate = rep["first_duplicate"]
            for hx, e, b in st["windows"]:
                h = bytes.fromhex(hx)
                if h in m._windows:  # the same window on two ranks
                    if m._windows[h][0] == e:
                        m.r.window_duplicates += 1
                        m._first(kind="token window (across ranks)", epoch=e, batch=b)
                    else:
                        m.r.window_repeats_across_epochs += 1
                else:
                    m._windows[h] = (e, b)
            for e, i, n in st["starts"]:
                m._starts[(e, i)] += n
                m.r.doc_starts += n
            for r, w, e in st["last"]:
                m._last_epoch[(r, w)] = e
        m.r.doc_duplicates = sum(n - 1 for n in m._starts.values() if n > 1)
        dup = next(((e, i) for (e, i), n in m._starts.items() if n > 1), None)
        if dup is not None and m.r.first_duplicate is None:
            m._first(kind="document", epoch=dup[0], doc_id=dup[1])
        return m

    def report(self) -> DiversityReport:
        """Finalize. Epoch ``e`` is *complete* when every rank x worker stream has moved past
        it (its latest rows belong to a later epoch)."""
        r = self.r
        per_epoch: dict[int, set[int]] = {}
        for e, i in self._starts:
            per_epoch.setdefault(e, set()).add(i)
        r.epochs_seen = sorted(per_epoch)
        if self.num_documents:
            r.coverage = {e: len(s) / self.num_documents for e, s in sorted(per_epoch.items())}
        last = list(self._last_epoch.values())
        done_below = min(last) if last else 0
        if not per_epoch and last:  # no document ids: the epochs the loader reported
            r.epochs_seen = list(range(max(last) + 1))
        r.complete_epochs = [e for e in r.epochs_seen if e < done_below]
        return r


class BuggyTakeDataset(IterableDataset):
    """A ``take(N)``-style loader, bug included — for demonstrating the checks, never for training.

    Every ``__iter__`` rebuilds ``load_dataset(...).take(N).shuffle(seed + worker_id)``, keeps
    every ``num_workers``-th document, and joins documents with EOS into ``seq_len + 1`` windows.
    With persistent workers each new DataLoader epoch replays the same N documents; it has no
    epoch notion (it believes it is an endless stream), so it reports epoch 0 forever.
    """

    def __init__(
        self,
        data_files: list[str],
        tokenizer: Any,
        seq_len: int,
        take: int = 100,
        seed: int = 42,
        buffer_size: int = 100,
    ) -> None:
        from torchtitan_ext.text.tokenize import TextTokenizer

        self.data_files = list(data_files)
        self.tokenizer = TextTokenizer.coerce(tokenizer)
        self.seq_len = seq_len
        self.take_n = take
        self.seed = seed
        self.buffer_size = buffer_size

    def __iter__(self):
        from datasets import load_dataset

        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        ds = load_dataset("parquet", data_files=self.data_files, split="train", streaming=True)
        ds = ds.map(lambda ex, i: {"doc_id": i}, with_indices=True)
        dataset = ds.take(self.take_n)  # take the first N docs -- again, on every __iter__
        dataset = dataset.shuffle(seed=self.seed + worker_id, buffer_size=self.buffer_size)
        buf: list[tuple[int, int, int]] = []  # (token, doc_id, offset)
        items_processed = 0
        R = self.seq_len + 1
        # .iter() instead of __iter__: datasets would otherwise also re-shard by worker itself.
        for batch in dataset.iter(batch_size=1):
            if num_workers > 1 and items_processed % num_workers != worker_id:
                items_processed += 1
                continue
            items_processed += 1
            text, did = batch["text"][0], batch["doc_id"][0]
            toks = self.tokenizer.encode(text, add_bos=False) + [self.tokenizer.eos_id]
            buf += [(t, did, k) for k, t in enumerate(toks)]
            while len(buf) >= R:
                chunk, buf = buf[:R], buf[R:]
                arr = torch.tensor(chunk, dtype=torch.long)
                yield (
                    {
                        "input": arr[:-1, 0],
                        "positions": torch.zeros(self.seq_len, dtype=torch.long),
                        "doc_ids": arr[:-1, 1],
                        "doc_epochs": torch.zeros(self.seq_len, dtype=torch.long),
                        "doc_offsets": arr[:-1, 2],
                    },
                    arr[1:, 0],
                )


def _epoch_of(loader: Any) -> int | None:
    """The loader's data epoch from ``get_stats()['epoch']`` (as of its last batch), if any."""
    get = getattr(loader, "get_stats", None)
    if get is None:
        return None
    epoch = get().get("epoch")
    return int(epoch) if isinstance(epoch, int | float) else None


def run_check(
    make_loader: Callable[[int], Iterable[Any]],
    ranks: int,
    workers: int,
    *,
    batches: int | None = None,
    epochs: int | None = None,
    num_documents: int | None = None,
    rank_ids: Sequence[int] | None = None,
    max_batches: int = 200_000,
) -> DiversityMeter:
    """Drive ``make_loader(rank)`` for each rank in ``rank_ids`` (default: all ``ranks``, in one
    process, one batch per rank per step like data-parallel training) until each rank produced
    ``batches`` batches, or until every rank x worker stream has finished ``epochs`` data epochs.
    A loader that ends (a DataLoader "epoch") is iterated again, as a training loop would —
    which is how persistent workers re-run ``__iter__``. Batch ``k`` of a DataLoader pass is
    attributed to worker ``k % workers`` (DataLoader's in-order round robin restarts at worker 0
    each pass)."""
    if (batches is None) == (epochs is None):
        raise ValueError("give exactly one of batches / epochs")
    rank_ids = list(range(ranks)) if rank_ids is None else list(rank_ids)
    meter = DiversityMeter(num_documents)
    loaders = {r: make_loader(r) for r in rank_ids}
    iters = {r: iter(loaders[r]) for r in rank_ids}
    count = dict.fromkeys(rank_ids, 0)
    in_pass = dict.fromkeys(rank_ids, 0)  # batch index within the current DataLoader pass
    empty_passes = dict.fromkeys(rank_ids, 0)
    nw = max(1, workers)
    while True:
        active = [r for r in rank_ids if batches is None or count[r] < batches]
        if epochs is not None and meter.min_slot_epoch(len(rank_ids) * nw) >= epochs:
            break
        if not active or sum(count.values()) >= max_batches:
            break
        for r in active:
            try:
                b = next(iters[r])
            except StopIteration:
                empty_passes[r] += 1
                if empty_passes[r] > 1:
                    raise RuntimeError(f"rank {r}: the loader yields nothing any more") from None
                iters[r] = iter(loaders[r])  # the next "epoch" of the DataLoader
                in_pass[r] = 0
                continue
            empty_passes[r] = 0
            meter.add_batch(b, rank=r, worker=in_pass[r] % nw, epoch=_epoch_of(loaders[r]))
            count[r] += 1
            in_pass[r] += 1
    return meter
