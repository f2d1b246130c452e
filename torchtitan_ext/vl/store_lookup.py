"""Finding a sample store when its source is gone: the store records its source's identity (the
dataset path, split, ``max_samples``, image and chat options: its manifest's ``config``) and its
processor's fingerprint, so a loader whose local dataset path no longer exists picks the store
recorded for it instead of fingerprinting files that are not there (and says so, once)."""

from __future__ import annotations

import glob
import json
import logging
from pathlib import Path

from torchtitan_ext.vl.build_config import BuildConfig, store_fields
from torchtitan_ext.vl.format import MANIFEST

logger = logging.getLogger(__name__)


def source_absent(dataset: str) -> bool:
    """A local dataset path (absolute, relative or a glob) that names no file now."""
    s = str(dataset)
    if any(ch in s for ch in "*?["):
        return not glob.glob(s)
    return s.startswith((".", "/", "~")) and not Path(s).expanduser().exists()


def find_store_by_identity(config: BuildConfig, cache_dir: str | Path) -> Path | None:
    """The newest complete store under ``cache_dir`` whose manifest records this config's store
    fields (dataset path, split, max_samples, image and chat options) and this processor's
    fingerprint; the source itself is not read (it is absent), so its fingerprint is not
    re-checked, and one line says so."""
    from torchtitan_ext.vl.processor import load_processor, processor_fingerprint

    want = store_fields(config)
    proc_fp = processor_fingerprint(load_processor(config.model_path))
    found = []
    for mf in Path(cache_dir).glob(f"*/{MANIFEST}"):
        try:
            meta = json.loads(mf.read_text())
        except (OSError, ValueError):
            continue  # not ours to judge here: opening a chosen store checks it fully
        if meta.get("config") == want and meta.get("processor") == proc_fp:
            found.append((mf.stat().st_mtime, mf.parent))
    if not found:
        return None
    path = max(found)[1]
    logger.warning(
        "VL source %s is absent: using the sample store %s recorded for it (its fingerprint "
        "could not be re-checked)", config.dataset, path,
    )  # fmt: skip
    return path
