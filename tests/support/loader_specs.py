"""The loaders of the resume matrix (``tests/test_resume_matrix.py``): one builder per loader.

A builder takes a :class:`Variant` (device staging on/off, worker processes) and a scratch
directory for its data, and returns the :class:`~tests.support.resume.LoaderSpec` that builds
that loader at any DP rank / degree; or raises :class:`Unsupported` (one line: why) for a
combination the loader does not have, which the matrix reports as a skip. Adding a loader to the
matrix is adding one function here, decorated with ``@builder("name")``.

Rules for a builder: small data (the whole matrix runs in seconds), a finite pass small enough to
read to its end, ``doc_ids`` naming the documents that *start* in a batch, and ``epoch_docs`` the
documents of one pass.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.support.resume import LoaderSpec
from torchtitan_ext.pipeline import checkpoint


@dataclass(frozen=True)
class Variant:
    """One combination of the matrix besides the loader and the degree path."""

    staging: bool
    """Device staging (``device.staging.wrap_for_device``, CPU device, mode "staged") on top."""
    workers: int
    """Worker processes reading the data (0: the loader's own thread only)."""

    def __str__(self) -> str:
        return f"staging-{'on' if self.staging else 'off'}-w{self.workers}"


class Unsupported(Exception):
    """This loader does not have this combination (the message says why; the matrix skips)."""


Builder = Callable[[Variant, Path], LoaderSpec]
"""``(variant, scratch directory) -> spec``; a builder whose data needs a context (an
environment variable, a built cache) enters it on :data:`CONTEXTS`, closed after the module."""

CONTEXTS = contextlib.ExitStack()
_SHARED: dict[str, Any] = {}  # data several variants of one builder share (built once)
BUILDERS: dict[str, Builder] = {}


def builder(name: str) -> Callable[[Builder], Builder]:
    """Register ``fn`` as the matrix's builder of loader ``name``."""

    def register(fn: Builder) -> Builder:
        BUILDERS[name] = fn
        return fn

    return register


def staged(build: Callable[[int, int, bool], Any]) -> Callable[[int, int, bool], Any]:
    """``build`` with device staging (CPU device) on top of every loader it makes;
    :class:`Unsupported` while staging lacks the harness's contract (``rank_state()``), which it
    gains when it moves onto ``Prefetch``."""
    try:
        from torchtitan_ext.device.staging import wrap_for_device
    except ImportError as e:
        raise Unsupported(f"device staging not importable: {e}") from e

    def build_staged(rank: int, world: int, infinite: bool) -> Any:
        loader = build(rank, world, infinite)
        return wrap_for_device(loader, torch.device("cpu"), enabled=True, mode="staged")

    probe = build_staged(0, 1, True)
    try:
        if not callable(getattr(type(probe), "rank_state", None)):
            raise Unsupported(f"device staging ({type(probe).__name__}) has no rank_state() yet")
    finally:
        probe.close()
    return build_staged


def write_jsonl_corpus(root: Path, files: int = 3, docs: int = 37, seed: int = 0) -> list[Path]:
    """``files`` JSONL files of ``docs`` documents of 1-60 words each (deterministic); document
    ``i`` of the epoch is line ``i`` of the files in order."""
    rng, out = np.random.default_rng(seed), []
    for f in range(files):
        p = Path(root) / f"part-{f}.jsonl"
        words = [" ".join(f"w{f}.{d}.{k}" for k in range(rng.integers(1, 60))) for d in range(docs)]
        p.write_text("".join(json.dumps({"text": w}) + "\n" for w in words))
        out.append(p)
    return out


@builder("toy_jsonl")
def toy_jsonl(variant: Variant, root: Path) -> LoaderSpec:
    from tests.support.toy_source import ToyJsonlLoader

    if variant.workers:
        raise Unsupported("thread-only loader (one Prefetch thread, no worker processes)")
    files = write_jsonl_corpus(root)
    ndocs = sum(len(f.read_text().splitlines()) for f in files)

    def build(rank: int, world: int, infinite: bool) -> Any:
        return ToyJsonlLoader(files, rank, world, infinite=infinite)

    return LoaderSpec(
        "toy_jsonl",
        staged(build) if variant.staging else build,
        doc_ids=lambda batch: batch[0]["doc_starts"].tolist(),
        doc_ends=lambda batch: batch[0]["doc_ends"].tolist(),
        epoch_docs=set(range(ndocs)),
    )


# ------------------------------------------------------------------------------ parquet_prefetch
PQ_FILES, PQ_GROUPS, PQ_ROWS = 3, 10, 10  # 30 row groups of 10 documents
PQ_SEQ_LEN = 24  # rows of 25 tokens; every document is 10 tokens (BOS + 9 times its word)


def parquet_id_corpus(root: Path) -> tuple[Path, Path, dict[int, int]]:
    """Parquet shards of documents whose id is recoverable from any of their tokens: document
    ``i`` is one single-token word, nine times. Returns (data dir, tokenizer dir, token -> id).

    With 10-token documents in 25-token rows a document starts at a multiple of 5 in its row
    (also after an elastic re-deal of concat-split runs, whose heads are 5-token rests), so the
    token after its BOS is always in the same row: a batch names every document starting in it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from torchtitan_ext.data.embedded import ensure_embedded_data
    from torchtitan_ext.text.tokenize import TextTokenizer

    tok_dir = ensure_embedded_data() / "tokenizer"
    tok = TextTokenizer.from_path(tok_dir)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(w for w in vocab if w.startswith("Ġ") and w[1:].isascii() and w[1:].isalpha())
    n = PQ_FILES * PQ_GROUPS * PQ_ROWS
    texts, token_of = [], {}
    for w in words:
        text = (" " + w[1:]) * 9
        if tok.encode_arrays([text], add_bos=False)[0].tolist() == [vocab[w]] * 9:
            token_of[len(texts)] = vocab[w]
            texts.append(text)
        if len(texts) == n:
            break
    assert len(texts) == n
    per_file = PQ_GROUPS * PQ_ROWS
    for f in range(PQ_FILES):
        table = pa.table({"text": texts[f * per_file : (f + 1) * per_file]})
        pq.write_table(table, root / f"train-{f}.parquet", row_group_size=PQ_ROWS)
    return root, tok_dir, {t: i for i, t in token_of.items()}


def doc_ids_of(id_of: dict[int, int]) -> Callable[[Any], list[int]]:
    """Documents starting in a batch of the ``parquet_id_corpus`` (the token after each BOS)."""

    def doc_ids(batch: Any) -> list[int]:
        inputs, labels = batch
        rows = torch.cat([inputs["input"], labels[:, -1:]], 1)
        out = []
        for row in rows.tolist():
            out += [id_of[row[p + 1]] for p in range(len(row) - 1) if row[p] == 0]  # BOS id 0
        return out

    return doc_ids


@builder("parquet_prefetch")
def parquet_prefetch(variant: Variant, root: Path) -> LoaderSpec:

    if variant.workers:
        raise Unsupported("thread-only loader (one Prefetch thread, no worker processes)")
    data, tok_dir, id_of = parquet_id_corpus(root)
    build = _parquet_build(tok_dir, dataset_path=str(data))
    return LoaderSpec(
        "parquet_prefetch",
        staged(build) if variant.staging else build,
        doc_ids_of(id_of),
        set(id_of.values()),
    )


def _parquet_build(tok_dir: Path, **data: Any) -> Callable[[int, int, bool], Any]:
    """``build(rank, world, infinite)`` of the Parquet loader over ``data`` (``dataset_path`` or
    ``sources``), with the small settings both Parquet builders share."""
    from torchtitan_ext.loaders.parquet import PrefetchingParquetDataLoader

    def build(rank: int, world: int, infinite: bool) -> Any:
        cfg = PrefetchingParquetDataLoader.Config(
            **data, tokenizer_path=str(tok_dir), val_files="none", infinite=infinite,
            packing="concat_split", buffer_docs=4, chunk_rows=4, queue_size=2, seed=3,
        )  # fmt: skip
        return cfg.build(
            dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=PQ_SEQ_LEN,
            local_batch_size=2,
        )  # fmt: skip

    return build


@builder("parquet_mix")
def parquet_mix(variant: Variant, root: Path) -> LoaderSpec:
    """``parquet_prefetch`` over a two-source mixture of the ``parquet_id_corpus`` (weights 2:1;
    source ``a``: files 0-1, ``b``: file 2), so a document id names its source too."""
    from torchtitan_ext.pipeline.mix import SourceSpec

    if variant.workers:
        raise Unsupported("thread-only loader (one Prefetch thread, no worker processes)")
    data, tok_dir, id_of = parquet_id_corpus(root)
    for name, files in (("a", (0, 1)), ("b", (2,))):
        (data / name).mkdir()
        for f in files:
            (data / f"train-{f}.parquet").rename(data / name / f"train-{f}.parquet")
    sources = [
        SourceSpec(name="a", weight=2.0, path=str(data / "a")),
        SourceSpec(name="b", weight=1.0, path=str(data / "b")),
    ]

    build = _parquet_build(tok_dir, sources=sources)

    def state(loaders: Any) -> Any:  # the envelope names the loader, parquet_prefetch
        return checkpoint.envelope("parquet_prefetch", [ld.rank_state() for ld in loaders], "any")

    return LoaderSpec(
        "parquet_mix",
        staged(build) if variant.staging else build,
        doc_ids_of(id_of),
        set(id_of.values()),
        state=state,
    )


# ------------------------------------------------------------------------------ streaming_text
def streaming_doc_starts(batch: Any) -> list[int]:
    """Documents starting in a ``emit_doc_ids`` batch: offset 0, or offset 1 at a row's first
    input token (it began on the previous row's label-only last token)."""
    x, _ = batch
    ids, offs = x["doc_ids"], x["doc_offsets"]
    start = offs == 0
    start[:, 0] |= offs[:, 0] == 1
    return ids[start & (ids >= 0)].tolist()


@builder("streaming_text")
def streaming_text(variant: Variant, root: Path) -> LoaderSpec:
    from tests.test_streaming import make_docs, write_parquet
    from torchtitan_ext.data.embedded import ensure_embedded_data
    from torchtitan_ext.loaders.streaming import StreamingTextDataLoader

    tok_dir = ensure_embedded_data() / "tokenizer"
    src = write_parquet(root / "data", make_docs(96, seed=1), 4)

    def build(rank: int, world: int, infinite: bool) -> Any:
        cfg = StreamingTextDataLoader.Config(
            dataset_path=src, tokenizer_path=str(tok_dir), num_workers=variant.workers,
            shuffle_buffer=8, emit_doc_ids=True, infinite=infinite,
        )  # fmt: skip
        return cfg.build(dp_rank=rank, dp_world_size=world, seq_len=16, local_batch_size=4)

    return LoaderSpec(
        "streaming_text",
        staged(build) if variant.staging else build,
        streaming_doc_starts,
        set(range(96)),
    )


# ------------------------------------------------------------------------------ cached_vl
@builder("cached_vl")
def cached_vl(variant: Variant, root: Path) -> LoaderSpec:
    from tests.support.vl_sample import sample_cache
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions

    class _Root:  # sample_cache's tmp_path_factory: one directory under ``root``
        @staticmethod
        def mktemp(name: str) -> Path:
            (root / name).mkdir()
            return root / name

    if "vl" not in _SHARED:  # one cache for every variant
        before = os.environ.get("TORCHTITAN_EXT_CACHE")
        env = CONTEXTS.enter_context(
            sample_cache(_Root, "vl", n=48, buckets=(512, 768), store=True)
        )  # a sample store: the loader reads the plan of its seq_len / buffer / buckets
        env["home"] = os.environ["TORCHTITAN_EXT_CACHE"]
        _set_env("TORCHTITAN_EXT_CACHE", before)  # set again only while a loader is built
        _SHARED["vl"] = env
    env = _SHARED["vl"]
    home = env["home"]
    cache = PlannedStore.open(env["path"], PlanOptions.make(1024, 8, [512, 768]))
    pad = int(cache.special_tokens["pad_id"])

    def key(row: list[int]) -> tuple[int, ...]:  # a pack: its tokens without trailing padding
        n = len(row)
        while n and row[n - 1] == pad:
            n -= 1
        return tuple(row[:n])

    ids = {key(cache.pack(i)["input_ids"].tolist()): i for i in range(len(cache))}
    assert len(ids) == len(cache), "the sample packs are distinct"

    def build(rank: int, world: int, infinite: bool) -> Any:
        cfg = CachedVLDataLoader.Config(
            dataset_path=str(env["data"]), cache_dir=str(env["cache_dir"]), buffer_size=8,
            buckets=[512, 768], queue_size=3, num_workers=variant.workers, infinite=infinite,
        )  # fmt: skip
        with _env("TORCHTITAN_EXT_CACHE", home):
            return cfg.build(
                dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=1024,
                local_batch_size=1,
            )  # fmt: skip

    def doc_ids(batch: Any) -> list[int]:
        inp, _ = batch
        return [ids[key(row.tolist())] for row in inp["input"]]

    return LoaderSpec(
        "cached_vl",
        staged(build) if variant.staging else build,
        doc_ids,
        set(ids.values()),
        steps=1,  # ~10 packs of 1 per batch: every phase of 2 -> 3 -> 1 stays inside the epoch
    )


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Any:
    """``name=value`` while the block runs; afterwards what it was (``value`` None: unset)."""
    old = os.environ.get(name)
    _set_env(name, value)
    try:
        yield
    finally:
        _set_env(name, old)


# ------------------------------------------------------------------------------ cached_vl_mix
@builder("cached_vl_mix")
def cached_vl_mix(variant: Variant, root: Path) -> LoaderSpec:
    """``cached_vl`` over a mixture (``[[dataloader.sources]]``): the VQA sample cache of
    ``cached_vl`` (weight 2) and a chat sample cache (weight 1). With ``infinite=False`` a pass
    reads one epoch of each source, so ``epoch_docs`` is every pack of both caches."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.pipeline.mix import SourceSpec
    from torchtitan_ext.vl.sample_chat import chat_sample_path

    cached_vl(Variant(staging=False, workers=0), root)  # the shared VQA cache (built once)
    env = _SHARED["vl"]
    home = env["home"]
    if "vl_mix_chat" not in _SHARED:
        with _env("TORCHTITAN_EXT_CACHE", home):
            _SHARED["vl_mix_chat"] = chat_sample_path(n=16, root=Path(env["root"]) / "chat")

    def config(infinite: bool, build: bool = False) -> Any:
        sources = [
            SourceSpec(name="vqa", weight=2, path=str(env["data"])),
            SourceSpec(name="chat", weight=1, path=str(_SHARED["vl_mix_chat"]), format="messages"),
        ]
        return CachedVLDataLoader.Config(
            sources=sources, cache_dir=str(env["cache_dir"]), buffer_size=8, buckets=[512, 768],
            queue_size=3, num_workers=variant.workers, infinite=infinite, build_if_missing=build,
        )  # fmt: skip

    def build(rank: int, world: int, infinite: bool) -> Any:
        with _env("TORCHTITAN_EXT_CACHE", home):
            return config(infinite).build(
                dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=1024,
                local_batch_size=1,
            )  # fmt: skip

    if "vl_mix_ids" not in _SHARED:  # build the chat cache once; name every pack of both
        with _env("TORCHTITAN_EXT_CACHE", home):
            probe = config(True, build=True).build(
                dp_rank=0, dp_world_size=1, tokenizer=None, seq_len=1024, local_batch_size=1
            )
        caches = list(probe.reader.caches)  # what the loader reads (a store: by its plan)
        probe.close()
        pad = int(caches[0].special_tokens["pad_id"])
        ids = {}
        for c in caches:
            for i in range(len(c)):
                ids[_unpadded(c.pack(i)["input_ids"].tolist(), pad)] = len(ids)
        assert len(ids) == sum(map(len, caches)), "the packs of both sources are distinct"
        _SHARED["vl_mix_ids"] = (ids, pad)
    ids, pad = _SHARED["vl_mix_ids"]

    def doc_ids(batch: Any) -> list[int]:
        inp, _ = batch
        return [ids[_unpadded(row.tolist(), pad)] for row in inp["input"]]

    def state(loaders: Any) -> Any:  # the envelope names the loader, cached_vl
        from torchtitan_ext.pipeline import checkpoint

        return checkpoint.envelope("cached_vl", [ld.rank_state() for ld in loaders], "any")

    return LoaderSpec(
        "cached_vl_mix",
        staged(build) if variant.staging else build,
        doc_ids,
        set(ids.values()),
        steps=1,  # ~14 packs of 1 per batch: every phase of 2 -> 3 -> 1 stays inside the pass
        state=state,
    )


def _unpadded(row: list[int], pad: int) -> tuple[int, ...]:
    """A pack's tokens without its trailing padding (names the pack)."""
    n = len(row)
    while n and row[n - 1] == pad:
        n -= 1
    return tuple(row[:n])


# ------------------------------------------------------------------------------ streaming_text mixture
MIX_SOURCE_STRIDE = 1 << 42  # a mixture's document key: source index * 2**42 + id in the source


def streaming_mix_doc_starts(batch: Any) -> list[int]:
    """Documents starting in a mixture batch, as ``source * 2**42 + id`` (ids are numbered
    within each source, ``shard << 40 | row`` for JSON Lines; ``doc_sources`` says whose)."""
    x, _ = batch
    ids, offs, src = x["doc_ids"], x["doc_offsets"], x["doc_sources"]
    start = offs == 0
    start[:, 0] |= offs[:, 0] == 1
    keep = start & (ids >= 0)
    return (src[keep] * MIX_SOURCE_STRIDE + ids[keep]).tolist()


@builder("streaming_mix")
def streaming_mix(variant: Variant, root: Path) -> LoaderSpec:
    """``streaming_text`` with ``[[dataloader.sources]]``: a Parquet source (48 documents, 4
    files) at weight 2 and a JSON Lines one (40 documents, 2 files) at weight 1; a finite pass
    is one epoch of each."""
    from tests.test_streaming import make_docs, write_jsonl, write_parquet
    from torchtitan_ext.data.embedded import ensure_embedded_data
    from torchtitan_ext.loaders.streaming import StreamingTextDataLoader
    from torchtitan_ext.pipeline import checkpoint
    from torchtitan_ext.pipeline.mix import SourceSpec

    tok_dir = ensure_embedded_data() / "tokenizer"
    a = write_parquet(root / "a", make_docs(48, seed=1), 4)
    b = write_jsonl(root / "b", make_docs(40, seed=2), 2)
    sources = [
        SourceSpec(name="pq", path=a, weight=2.0),
        SourceSpec(name="jsonl", path=b, weight=1.0),
    ]

    def build(rank: int, world: int, infinite: bool) -> Any:
        cfg = StreamingTextDataLoader.Config(
            tokenizer_path=str(tok_dir), num_workers=variant.workers, shuffle_buffer=8,
            emit_doc_ids=True, infinite=infinite, sources=sources,
        )  # fmt: skip
        return cfg.build(dp_rank=rank, dp_world_size=world, seq_len=16, local_batch_size=4)

    def state(loaders: Any) -> Any:  # the envelope names the registered loader, streaming_text
        return checkpoint.envelope("streaming_text", [ld.rank_state() for ld in loaders], "any")

    return LoaderSpec(
        "streaming_mix",
        staged(build) if variant.staging else build,
        streaming_mix_doc_starts,
        set(range(48)) | {MIX_SOURCE_STRIDE + (f << 40) + r for f in (0, 1) for r in range(20)},
        state=state,
    )


# ---------------------------------------------------------------------------- cached_vl_video
@builder("cached_vl_video")
def cached_vl_video(variant: Variant, root: Path) -> LoaderSpec:
    """``cached_vl`` over a sample store of the generated video sample (``vl/sample_video.py``:
    videos, an image and a video together, two videos, text-only rows), in the ``qwen3_vl``
    batch format. Packs hold ``video_u8``."""
    from torchtitan_ext.loaders.vl import CachedVLDataLoader
    from torchtitan_ext.vl.build import build_cache
    from torchtitan_ext.vl.plan import PlannedStore, PlanOptions
    from torchtitan_ext.vl.sample_video import video_sample_path

    seq = 512
    if "vl_video" not in _SHARED:  # one store for every variant
        data = video_sample_path(n=32, root=root / "data")
        _SHARED["vl_video"] = build_cache(data, "train", root / "cache", seq, 8, store=True,
                                          show_progress=False)  # fmt: skip
    store = _SHARED["vl_video"]
    cache = PlannedStore.open(store, PlanOptions.make(seq, 8, None))
    ids = {tuple(cache.pack(i)["input_ids"].tolist()): i for i in range(len(cache))}
    assert len(ids) == len(cache) >= 8, "the video packs are distinct and enough for 2 -> 3 -> 1"
    assert any("video_u8" in cache.pack(i) for i in range(len(cache)))

    def build(rank: int, world: int, infinite: bool) -> Any:
        cfg = CachedVLDataLoader.Config(
            cache_path=str(store), buffer_size=8, queue_size=3, num_workers=variant.workers,
            infinite=infinite, batch_format="qwen3_vl",
        )  # fmt: skip
        return cfg.build(dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=seq,
                         local_batch_size=1)  # fmt: skip

    def doc_ids(batch: Any) -> list[int]:
        inp, _ = batch
        return [ids[tuple(row.tolist())] for row in inp["input"]]

    def state(loaders: Any) -> Any:  # the envelope names the loader, cached_vl
        return checkpoint.envelope("cached_vl", [ld.rank_state() for ld in loaders], "any")

    return LoaderSpec(
        "cached_vl_video", staged(build) if variant.staging else build, doc_ids,
        set(ids.values()), steps=1, state=state,
    )  # fmt: skip
