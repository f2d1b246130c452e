"""CachedVLDataset: the training side of the offline Qwen3-VL pack cache.

Algorithm
---------
The cache (``torchtitan_ext.vl.cache.VLCache``) holds ``N`` packs; each pack is already tokenised,
packed, padded to a bucket length and carries uint8 pixel patches. Or the packs are the ``N``
packs of a plan over a sample store (``vl/plan.py``'s ``PlannedStore``, gathered from the
store's samples when read): everything below works over plan indices the same way, since it
uses only ``len`` and ``pack(i)``. This dataset only decides *which*
pack each data-parallel rank (and each DataLoader worker) reads next, and remembers where it is:

* **Global order.** Epoch ``e`` visits the packs in ``perm_e = randperm(N, seed + e)`` (or
  ``arange(N)`` with ``shuffle=False``). The order is consumed in *rounds* of ``W`` packs
  (``W`` = DP world size): in round ``k`` starting at global cursor ``c``, rank ``r`` reads
  ``perm_e[c + k*W + r]``. The state is ``(epoch, cursor)`` where ``cursor`` counts the packs that
  **all ranks together** have consumed in this epoch, so it means the same thing at every DP degree:
  a state saved at DP=2 resumes at DP=1 (or 1 -> 2) with no pack repeated or skipped in the epoch.
* **Equal steps per rank.** From cursor ``c`` an epoch has ``floor((N - c) / W)`` rounds
  (``remainder="drop"``, the default: the last ``(N - c) mod W`` packs of that epoch's permutation
  are not read *in that epoch*; the next epoch reshuffles, so no pack is dropped for good) or
  ``ceil((N - c) / W)`` rounds (``remainder="wrap"``: the last round is completed with packs from the
  start of the permutation, so every pack is read and a few twice). Either way every rank yields the
  same number of packs per epoch, so no collective waits forever on a rank that ran dry. ``drop``
  with ``N < W`` would give every rank zero packs: that is refused with an error naming ``wrap``.
  A *state* taken right after an epoch's last round keeps the packs no round reached
  (:func:`position`): resumed at a smaller degree, they are read in that epoch (every pack once
  across DP degree changes); at the same or a larger degree, loading moves on to the next epoch.
* **Workers.** With ``num_workers = n`` DataLoader workers, worker ``w`` takes the rank's packs in
  blocks of ``block_size`` (= the DataLoader batch size) round-robin: blocks ``w, w+n, w+2n, ...``.
  The DataLoader returns batches from workers round-robin, so the consumer sees exactly the same
  sequence as with ``num_workers=0`` — the data order does not depend on the worker count.
* **Resume without replay.** Every position is computed by arithmetic (``locate``), never by
  re-reading packs, so resuming at any step costs one ``randperm``. In the main process
  ``state_dict()`` returns the global ``(epoch, cursor)`` (elastic). Inside a worker
  (torchdata's ``StatefulDataLoader`` stores one state per worker) it returns the iteration's
  anchor plus the number of packs this worker yielded, which restores bitwise-exactly with the
  same DP degree and worker count. The loader's stages (``vl/stages.py``) keep the global state
  in the main process, so it resumes exactly *and* elastically with workers.
* **Lazy.** The cache is opened by path; ``VLCache.open`` reads and checks ``metadata.json`` and
  the file sizes, reading no token or pixel data (a damaged cache is an error here, naming the
  file). Each worker process re-opens it lazily after fork/spawn.

State is plain ints (no pickle).

Cost: choosing the next pack is O(1) (one cached ``randperm`` per epoch). ``next()`` + collate of
an ~8k-token pack costs a few ms (torchtitan's per-image padded layout copies the pixels once);
the ``python -m benchmarks vl_dataset`` tables in ``benchmarks/RESULTS.md`` compare it with online
preprocessing of the same rows, with a materialised float32 pack, and cache opening with one
directory per pack.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_ext.vl.cache import resolve_cache_dir

logger = logging.getLogger(__name__)

Remainder = Literal["drop", "wrap"]

_STATE_VERSION = 1


class PackSource(Protocol):
    """What the dataset needs from a cache (``VLCache`` satisfies it; tests may pass fakes)."""

    def __len__(self) -> int: ...

    def pack(self, i: int) -> dict[str, torch.Tensor]: ...


# --------------------------------------------------------------------------------------------
# Global-order arithmetic (pure functions, shared with the torchtitan loader and the tests)
# --------------------------------------------------------------------------------------------


def rounds_left(num_packs: int, world_size: int, cursor: int, remainder: Remainder) -> int:
    """Packs each rank still reads in the current epoch when ``cursor`` packs are consumed."""
    left = max(0, num_packs - cursor)
    if remainder == "drop":
        return left // world_size
    if remainder == "wrap":
        return -(-left // world_size)
    raise ValueError(f"remainder must be 'drop' or 'wrap', got {remainder!r}")


def advance(
    num_packs: int, world_size: int, epoch: int, cursor: int, n: int, remainder: Remainder
) -> tuple[int, int]:
    """Global ``(epoch, cursor)`` after every rank read ``n`` more packs from ``(epoch, cursor)``.

    The result is normalised: an epoch with no full round left becomes ``(epoch + 1, 0)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    first = rounds_left(num_packs, world_size, cursor, remainder)
    if n < first:
        return epoch, cursor + n * world_size
    n -= first
    per_epoch = rounds_left(num_packs, world_size, 0, remainder)
    if per_epoch == 0:
        raise ValueError(
            f"{num_packs} packs cannot feed {world_size} ranks with remainder='drop'; "
            "use remainder='wrap' or a bigger cache"
        )
    return epoch + 1 + n // per_epoch, (n % per_epoch) * world_size


def position(
    num_packs: int, world_size: int, epoch: int, cursor: int, n: int, remainder: Remainder
) -> tuple[int, int]:
    """The ``(epoch, cursor)`` a *state* records after every rank read ``n`` more packs: as
    :func:`advance`, except right after the epoch's last full round, where the packs the rounds
    left unread (``remainder="drop"``: ``(N - c) mod W``) stay in the epoch — ``cursor`` counts
    the packs consumed — so that the state, loaded at a smaller DP degree, reads them (exactly
    once per epoch across degrees). Loading at a degree with no round left moves on to the next
    epoch (``CachedVLDataset.load_state_dict``), so the batches that follow are the same."""
    first = rounds_left(num_packs, world_size, cursor, remainder)
    if n == first and cursor + n * world_size < num_packs:
        return epoch, cursor + n * world_size
    return advance(num_packs, world_size, epoch, cursor, n, remainder)


def locate(
    num_packs: int,
    world_size: int,
    rank: int,
    epoch: int,
    cursor: int,
    k: int,
    remainder: Remainder,
) -> tuple[int, int]:
    """``(epoch, position in that epoch's permutation)`` of rank ``rank``'s ``k``-th pack
    counted from global state ``(epoch, cursor)``."""
    first = rounds_left(num_packs, world_size, cursor, remainder)
    if k < first:
        return epoch, (cursor + k * world_size + rank) % num_packs
    k -= first
    per_epoch = rounds_left(num_packs, world_size, 0, remainder)
    if per_epoch == 0:
        raise ValueError(
            f"{num_packs} packs cannot feed {world_size} ranks with remainder='drop'; "
            "use remainder='wrap' or a bigger cache"
        )
    # `% num_packs` implements "wrap": positions past the end continue at the permutation start.
    return epoch + 1 + k // per_epoch, ((k % per_epoch) * world_size + rank) % num_packs


def epoch_permutation(num_packs: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The global visiting order of epoch ``epoch`` (int64 [num_packs])."""
    if not shuffle:
        return torch.arange(num_packs, dtype=torch.int64)
    g = torch.Generator()
    g.manual_seed(int(seed) + int(epoch))
    return torch.randperm(num_packs, generator=g, dtype=torch.int64)


def worker_item_index(j: int, worker_id: int, num_workers: int, block_size: int) -> int:
    """Index in the rank's stream of worker ``worker_id``'s ``j``-th pack.

    Worker ``w`` owns blocks ``w, w + n, w + 2n, ...`` of ``block_size`` consecutive packs; with
    the DataLoader's round-robin over workers this reproduces the single-process order.
    """
    block, within = divmod(j, block_size)
    return (block * num_workers + worker_id) * block_size + within


class _EpochOrders:
    """Caches the permutation of the epoch in use (one ``randperm`` per epoch, ~0.3 ms at 10k)."""

    def __init__(self, num_packs: int, seed: int, shuffle: bool) -> None:
        self.num_packs, self.seed, self.shuffle = num_packs, seed, shuffle
        self._epoch: int | None = None
        self._perm: list[int] = []

    def pack_index(self, epoch: int, position: int) -> int:
        if epoch != self._epoch:
            self._perm = epoch_permutation(self.num_packs, self.seed, epoch, self.shuffle).tolist()
            self._epoch = epoch
        return self._perm[position]


def fetch_pack(cache: PackSource, index: int, copy_pixels: bool = True) -> dict:
    """Pack ``index`` of ``cache`` as a new dict; ``copy_pixels=False`` asks the cache for
    pixels viewing its mapping (only then is the keyword passed: any ``pack(i)`` source works)."""
    return dict(cache.pack(index) if copy_pixels else cache.pack(index, copy_pixels=False))


# --------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------


class CachedVLDataset(IterableDataset):
    """Iterate the packs of an offline Qwen3-VL cache for one data-parallel rank.

    Yields one dict per pack: the tensors of ``VLCache.pack(i)`` (``input_ids``, ``labels``,
    ``position_ids``, ``seq_lens``, ``pixel_u8``, ``image_grid_thw``, ``num_tokens``) plus
    ``pack_index`` (int64 scalar). Batch them with ``torchtitan_ext.vl.collate``.

    Implements ``state_dict`` / ``load_state_dict`` (torch.distributed.checkpoint ``Stateful``);
    see the module docstring for the sharding and the state semantics.
    """

    def __init__(
        self,
        cache_dir: str | Path | PackSource,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        *,
        seed: int = 0,
        shuffle: bool = True,
        remainder: Remainder = "drop",
        block_size: int = 1,
        copy_pixels: bool = True,
    ) -> None:
        """
        Args:
            cache_dir: a cache key directory (as returned by ``build_cache`` / ``find_cache``), a
                cache root holding exactly one key directory, or an already opened ``VLCache``
                (or any object with ``__len__`` and ``pack(i)``).
            dp_rank / dp_world_size: this rank and the DP degree.
            infinite: loop over epochs forever (reshuffling each); else stop after the epoch.
            seed: permutation seed; epoch ``e`` uses ``seed + e``. Must match on every rank.
            shuffle: ``False`` visits packs in cache order (``arange``) every epoch.
            remainder: ``"drop"`` or ``"wrap"`` — how an epoch whose pack count is not a multiple of
                ``dp_world_size`` is made equal for all ranks (module docstring).
            block_size: packs per worker block; set it to the DataLoader batch size so that the
                order with workers equals the order without.
            copy_pixels: ``False`` yields ``pixel_u8`` as a view of the cache's mapping (from
                a planned sample store: a ``PixelRows``, views of the store's maps), for a
                collate that copies or normalises the pixels into a new tensor anyway
                (``PackCollator.copies_pixels``): one 20 MB copy fewer per 8k-token pack.
        """
        super().__init__()
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"need 0 <= dp_rank < dp_world_size, got {dp_rank}, {dp_world_size}")
        if remainder not in ("drop", "wrap"):
            raise ValueError(f"remainder must be 'drop' or 'wrap', got {remainder!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if isinstance(cache_dir, (str, Path)):
            self._cache_path: Path | None = resolve_cache_dir(cache_dir)
            self._cache: PackSource | None = _open_cache(self._cache_path)
        else:
            self._cache_path = None
            self._cache = cache_dir
        self.num_packs = len(self._cache)
        if self.num_packs == 0:
            raise ValueError(f"cache {cache_dir} holds no packs")
        if remainder == "drop" and self.num_packs < dp_world_size:
            raise ValueError(
                f"cache {cache_dir} holds {self.num_packs} packs, fewer than dp_world_size="
                f"{dp_world_size}: with remainder='drop' every rank would get none; "
                "use remainder='wrap' (packs repeat) or a bigger cache"
            )
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.infinite, self.seed, self.shuffle = infinite, int(seed), shuffle
        self.remainder: Remainder = remainder
        self.block_size = block_size
        self.copy_pixels = copy_pixels
        # Anchor = global state where the current/next iteration starts; `_yielded` = packs this
        # process (worker) has yielded since the anchor.
        self._epoch = 0
        self._cursor = 0
        self._yielded = 0
        self._orders = _EpochOrders(self.num_packs, self.seed, self.shuffle)

    # -- cache access ---------------------------------------------------------------------------
    @property
    def cache(self) -> PackSource:
        if self._cache is None:  # after unpickling in a spawned worker
            if self._cache_path is None:
                raise RuntimeError("CachedVLDataset has neither a cache nor a cache path")
            self._cache = _open_cache(self._cache_path)
        return self._cache

    def __getstate__(self) -> dict[str, Any]:
        # Workers re-open the memory maps themselves: never ship mmap handles through pickle.
        d = self.__dict__.copy()
        if self._cache_path is not None:
            d["_cache"] = None
        return d

    # -- order ----------------------------------------------------------------------------------
    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def pack_index_of(self, k: int) -> tuple[int, int]:
        """(epoch, cache pack index) of this rank's ``k``-th pack from the current anchor."""
        epoch, pos = locate(
            self.num_packs,
            self.dp_world_size,
            self.dp_rank,
            self._epoch,
            self._cursor,
            k,
            self.remainder,
        )
        return epoch, self._orders.pack_index(epoch, pos)

    def packs_per_epoch(self) -> int:
        """Packs each rank reads in a full epoch (the same on every rank)."""
        return rounds_left(self.num_packs, self.dp_world_size, 0, self.remainder)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker_id, num_workers = self._worker()
        limit = None
        if not self.infinite:
            limit = rounds_left(self.num_packs, self.dp_world_size, self._cursor, self.remainder)
        cache = self.cache
        while True:
            k = worker_item_index(self._yielded, worker_id, num_workers, self.block_size)
            if limit is not None and k >= limit:
                break
            _, index = self.pack_index_of(k)
            item = fetch_pack(cache, index, self.copy_pixels)
            item["pack_index"] = torch.tensor(index, dtype=torch.int64)
            self._yielded += 1
            yield item
        # A finite pass is over (every worker computes the same new anchor): the next iter()
        # starts the next epoch.
        self._epoch, self._cursor = advance(
            self.num_packs,
            self.dp_world_size,
            self._epoch,
            self._cursor,
            limit or 0,
            self.remainder,
        )
        self._yielded = 0

    # -- state ----------------------------------------------------------------------------------
    def global_state(self) -> tuple[int, int]:
        """Global ``(epoch, cursor)`` after the packs yielded so far (single process only)."""
        _, num_workers = self._worker()
        if num_workers != 1:
            raise RuntimeError("global_state() is only meaningful outside DataLoader workers")
        return advance(
            self.num_packs,
            self.dp_world_size,
            self._epoch,
            self._cursor,
            self._yielded,
            self.remainder,
        )

    def state_dict(self) -> dict[str, int]:
        """Plain-int state. Main process: the global ``epoch``/``cursor`` (loads at any DP degree).
        Inside a worker: the anchor plus this worker's ``yielded`` count (exact, same layout)."""
        worker_id, num_workers = self._worker()
        if num_workers == 1:
            return self.position_state(*self.global_state())
        return self.position_state(
            self._epoch, self._cursor, self._yielded, worker=(worker_id, num_workers)
        )

    def position_state(
        self, epoch: int, cursor: int, yielded: int = 0, worker: tuple[int, int] = (0, 1)
    ) -> dict[str, int]:
        """The :meth:`state_dict` of global position ``(epoch, cursor)`` (a fresh dict of plain
        ints; the pipeline stages take one per batch). ``yielded`` / ``worker``: a worker's."""
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "cursor": cursor,
            "yielded": yielded,
            "world_size": self.dp_world_size,
            "num_packs": self.num_packs,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "remainder_wrap": int(self.remainder == "wrap"),
            "worker_id": worker[0],
            "num_workers": worker[1],
            "block_size": self.block_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``. A main-process (global) state loads at any DP degree; a
        per-worker state needs the same DP degree, worker count and block size."""
        if not state:
            return
        _check_compatible(state, self.num_packs, self.seed, self.shuffle, self.remainder)
        epoch, cursor, yielded = int(state["epoch"]), int(state["cursor"]), int(state["yielded"])
        saved_workers = int(state.get("num_workers", 1))
        worker_id, num_workers = self._worker()
        if saved_workers != 1 or yielded:
            layout_now = (self.dp_world_size, num_workers, worker_id, self.block_size)
            layout_then = (
                int(state["world_size"]),
                saved_workers,
                int(state["worker_id"]),
                int(state["block_size"]),
            )
            if layout_now != layout_then:
                raise ValueError(
                    "per-worker CachedVLDataset state (dp_world_size, num_workers, worker_id, "
                    f"block_size)={layout_then} cannot load into {layout_now}; resume elastically "
                    "from a main-process (global) state instead (the torchtitan loader keeps one)"
                )
        self._epoch, self._cursor, self._yielded = epoch, cursor, yielded
        # A cursor saved at another DP degree may leave less than one round: move on.
        if rounds_left(self.num_packs, self.dp_world_size, cursor, self.remainder) == 0:
            self._epoch, self._cursor = epoch + 1, 0


def _check_compatible(
    state: dict[str, Any], num_packs: int, seed: int, shuffle: bool, remainder: str
) -> None:
    if int(state.get("version", _STATE_VERSION)) != _STATE_VERSION:
        raise ValueError(f"unknown CachedVLDataset state version {state.get('version')}")
    problems = []
    if int(state["num_packs"]) != num_packs:
        problems.append(f"num_packs {state['num_packs']} != {num_packs} (a different cache?)")
    if int(state["seed"]) != seed:
        problems.append(f"seed {state['seed']} != {seed}")
    if bool(int(state["shuffle"])) != shuffle:
        problems.append(f"shuffle {bool(int(state['shuffle']))} != {shuffle}")
    if ("wrap" if int(state["remainder_wrap"]) else "drop") != remainder:
        problems.append(f"remainder differs (now {remainder!r})")
    if problems:
        raise ValueError(
            "CachedVLDataset state does not match this dataset: " + "; ".join(problems)
        )


def _open_cache(path: Path) -> PackSource:
    from torchtitan_ext.vl.cache import VLCache

    return VLCache.open(path)
