"""The worker pool of :func:`~torchtitan_ext.tokenizer.pretokenize.count_file_pretoken_bytes`:
a reader thread cuts the file (on a read-only memory map) and queues ``(start, end)`` byte ranges
through a bounded queue; each worker process reads its ranges itself, counts them into one
counter with the ``count_chunk`` it is given, and ships that counter back once, on its sentinel,
through its own result pipe. The reader's hand-off and error relay are
:mod:`torchtitan_ext.threads`'; a worker's failure or death is a RuntimeError naming the file.

The counting itself is the caller's (``count_chunk``, a module-level function, so that it
pickles under any start method): this module knows nothing about pre-tokens.
"""

from __future__ import annotations

import collections
import mmap
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from torchtitan_ext import threads
from torchtitan_ext.tokenizer.chunks import iter_chunk_bounds
from torchtitan_ext.tokenizer.scanner import new_sink, sink_as_bytes

CountChunk = Callable[[bytes, int, str, list[str], Any], None]
"""``count_chunk(chunk, offset, path, special_tokens, sink)``: count one chunk into ``sink``."""


def count_in_pool(
    path: str,
    size: int,
    special_tokens: list[str],
    chunk_bytes: int,
    num_workers: int,
    count_chunk: CountChunk,
    stats: Any,
    progress: Callable[[int], None] | None = None,
    mp_context: str | None = None,
    native: bool = False,
) -> collections.Counter:
    """Count ``path`` in ``num_workers`` processes: the summed counts (bytes keys). ``stats``
    (a ``BPEStats``) gets ``chunks``, ``bytes_read`` and the workers' CPU seconds."""
    ctx = mp.get_context(mp_context)
    tasks = ctx.Queue(maxsize=2 * num_workers)  # bounded: the reader never runs far ahead
    readers, procs = _start_workers(
        ctx, tasks, num_workers, special_tokens, path, count_chunk, native
    )
    stop = threading.Event()
    feeder, feed_error = _start_reader(
        path, size, special_tokens, chunk_bytes, tasks, stop, len(procs), progress, stats
    )
    ok = False
    total = new_sink(native)
    try:
        cpu = _collect(readers, procs, path, total)
        feeder.join()
        if feed_error:
            raise threads.relay(
                feed_error[0], f"the thread {feeder.name!r}", "count_file_pretokens"
            )
        stats.extra["worker_cpu_s_sum"] = sum(cpu)
        stats.extra["worker_cpu_s_max"] = max(cpu)
        ok = True
    finally:
        stop.set()
        for p in procs:
            if not ok:
                p.terminate()  # blocked on an empty queue with no sentinel coming
            p.join()
        if not ok:
            # undelivered chunks would otherwise block interpreter exit in the queue's thread
            tasks.cancel_join_thread()
        feeder.join()
        tasks.close()
        for r in readers:
            r.close()
    return collections.Counter(sink_as_bytes(total))


def _worker(
    tasks, result_conn, special_tokens: list[str], path: str, count_chunk: CountChunk, native: bool
) -> None:
    """Pool worker: read and count every byte range it gets into one counter; send it (bytes
    keys) on the sentinel. Reading its own ranges (seek + read) keeps file data off the pipes."""
    counter = new_sink(native)
    cpu0 = time.process_time()
    try:
        with open(path, "rb") as f:
            while True:
                item = tasks.get()
                if item is None:
                    break
                start, end = item
                f.seek(start)
                chunk = f.read(end - start)
                if len(chunk) != end - start:
                    raise OSError(
                        f"{path}: short read at byte {start} ({len(chunk)} of {end - start} "
                        "bytes; was the file truncated while training?)"
                    )
                count_chunk(chunk, start, path, special_tokens, counter)
        # the C counter ships as one buffer (pickling a dict of ~10^5 keys and adding it key by
        # key in the parent was the serial tail of a 100 MB run)
        counts = counter if isinstance(counter, collections.Counter) else counter.dump()
        msg = ("ok", (counts, time.process_time() - cpu0))
    except BaseException as e:  # relayed to the parent, which re-raises it with the traceback
        msg = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    result_conn.send(msg)
    result_conn.close()


def _start_workers(
    ctx,
    tasks,
    num_workers: int,
    special_tokens: list[str],
    path: str,
    count_chunk: CountChunk,
    native: bool,
):
    """Start the pool: ``(result pipe readers, processes)``. One result pipe per worker: the
    worker sends its counter synchronously (no queue thread), and a worker that dies closes its
    end, which the parent sees at once (EOF). A failed start terminates those already started."""
    readers: list = []
    procs: list = []
    try:
        for _ in range(num_workers):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                args=(tasks, w, special_tokens, path, count_chunk, native),
                daemon=True,
            )
            p.start()
            w.close()  # before the next fork, so only worker i holds pipe i's write end
            readers.append(r)
            procs.append(p)
    except BaseException:
        for p in procs:
            p.terminate()
            p.join()
        raise
    return readers, procs


def _start_reader(
    path: str,
    size: int,
    special_tokens: list[str],
    chunk_bytes: int,
    tasks,
    stop: threading.Event,
    num_sentinels: int,
    progress: Callable[[int], None] | None,
    stats: Any,
) -> tuple[threading.Thread, list[BaseException]]:
    """Start the reader thread ``bpe-reader``: it cuts the file and queues ``(start, end)``
    ranges, then one sentinel per worker (which flushes that worker's counter). Its exception,
    if any, lands in the returned list for the caller to relay; it gives up once ``stop`` is
    set (a worker died or failed)."""
    feed_error: list[BaseException] = []

    def put(item) -> bool:
        return threads.put(tasks, item, stop, poll_s=0.2)

    def feed() -> None:
        try:
            if size == 0:
                return
            # The cut points are found on a read-only map of the file (page cache, no copies);
            # only (start, end) offsets cross the bounded queue, each worker reads its ranges.
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for start, end in iter_chunk_bounds(mm, special_tokens, chunk_bytes):
                    if not put((start, end)):
                        return
                    stats.chunks += 1
                    stats.bytes_read = end
                    if progress:
                        progress(end - start)
        except BaseException as e:  # re-raised by the main thread
            feed_error.append(e)
        finally:
            for _ in range(num_sentinels):
                put(None)

    feeder = threading.Thread(target=feed, name="bpe-reader", daemon=True)
    feeder.start()
    return feeder, feed_error


def _collect(readers: list, procs: list, path: str, total) -> list[float]:
    """Add each worker's counts into ``total`` (a ``Counter`` of str, or the C counter, which
    takes the workers' ``dump()`` buffers) as they arrive; the CPU seconds each worker spent
    (diagnoses a loaded machine). A worker that died or failed is a RuntimeError naming ``path``."""
    cpu: list[float] = []
    pending = dict(zip(readers, procs, strict=True))
    while pending:
        for r in mp_connection.wait(list(pending)):
            proc = pending.pop(r)
            try:
                kind, payload = r.recv()
            except EOFError:
                proc.join()
                raise RuntimeError(
                    f"BPE pre-tokenization worker died (exit code {proc.exitcode}) "
                    f"while reading {path}"
                ) from None
            if kind == "error":
                raise RuntimeError(f"BPE pre-tokenization worker failed on {path}: {payload}")
            # Counter of str (regex path): the first one is adopted as is (Counter.update's
            # fast path for an empty self), later ones add key by key
            counts, cpu_s = payload
            if isinstance(counts, bytes):
                total.merge(counts)
            else:
                total.update(counts)
            cpu.append(cpu_s)
    return cpu
