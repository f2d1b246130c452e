"""The preflight of a mixture's sources' data: a cached_vl source whose data was moved away after
its sample store was built passes (the store trains it: a new plan only), a path with neither
data nor a store that records it is one line naming the source, and so is a streaming_text or
cached_vl source whose files hold no row (before the model, not when the loader is built)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtitan_ext.config import load_config
from torchtitan_ext.preflight import Job
from torchtitan_ext.preflight.mixture import check_mixture
from torchtitan_ext.toml_config import ConfigError
from torchtitan_ext.vl.format import MANIFEST

CONFIG = Path(__file__).resolve().parents[1] / "train_configs" / "qwen3_vl_mixture_tiny_cpu.toml"


def job(tmp_path: Path, gone: Path) -> Job:
    text = CONFIG.read_text()
    text = text.replace('cache_dir = "./outputs/vl_mix_cache"', f'cache_dir = "{tmp_path / "c"}"')
    old = next(ln for ln in text.splitlines() if ln.startswith('dataset = "sample" '))
    f = tmp_path / "mix.toml"
    f.write_text(text.replace(old, f'path = "{gone}"'))
    return Job(load_config(f), file=str(f))


def test_a_moved_source_with_its_store_passes_and_one_without_is_named(tmp_path):
    gone = tmp_path / "vqa_parquet_moved_away"
    with pytest.raises(ConfigError, match=r"source 'vqa': path = .* matches no data file"):
        check_mixture(job(tmp_path, gone))
    store = tmp_path / "c" / "sample_store_key"
    store.mkdir(parents=True)
    (store / MANIFEST).write_text(json.dumps({"config": {"dataset": str(gone)}}))
    check_mixture(job(tmp_path, gone))  # the loader picks the store recorded for it
    (store / MANIFEST).write_text(json.dumps({"config": {"dataset": str(gone) + "-other"}}))
    with pytest.raises(ConfigError, match="source 'vqa'"):
        check_mixture(job(tmp_path, gone))


STREAM = CONFIG.parent / "streaming_text_mixture_cpu.toml"


def test_an_empty_streaming_or_vl_source_is_named_before_the_model(tmp_path):
    """Files that hold no row (blank JSON Lines; a Parquet file of 0 rows) are an empty source,
    named by the preflight: the loader, which would find it too, is built after the model."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    f = tmp_path / "stream.toml"
    f.write_text(
        STREAM.read_text().replace('path = "embedded:shakespeare"', f'path = "{blank}"', 1)
    )
    with pytest.raises(ConfigError, match=r"source 'shakespeare': path = .* is an empty source"):
        check_mixture(Job(load_config(f), file=str(f)))
    blank.write_text('{"text": "a row"}\n')
    check_mixture(Job(load_config(f), file=str(f)))

    empty = tmp_path / "vqa"
    empty.mkdir()
    pq.write_table(pa.table({"image": pa.array([], pa.binary())}), empty / "train.parquet")
    with pytest.raises(ConfigError, match=r"source 'vqa': path = .* is an empty source"):
        check_mixture(job(tmp_path, empty))
