"""Preflight of a ``cached_vl`` mixture: its own one-line errors before the model is built.

The mixture table itself (``pipeline.mix.check_sources``) and this loader's rules for it
(``vl.mix_reader.check_mixture``: no ``cache_path`` with sources, no ``text_column``). Finding
each source's cache is left to the loader, as for one source (``preflight/data.py``: a key lookup
fingerprints the source data, not a preflight's job), and so is comparing the caches'
processors, which needs the caches.
"""

from __future__ import annotations

from torchtitan_ext.pipeline.mix import MixtureError
from torchtitan_ext.pipeline.stage import options
from torchtitan_ext.preflight import Job, loader_name
from torchtitan_ext.toml_config import ConfigError
from torchtitan_ext.vl.mix_reader import check_mixture
from torchtitan_ext.vl.options import SourceOptions


def check_vl_mixture(job: Job) -> None:
    """ConfigError (one line: the file, the section, the source) for a ``cached_vl`` mixture
    the loader would refuse on its cheap checks."""
    for section, loader_cfg in job.loaders():
        if loader_name(loader_cfg) != "cached_vl" or not loader_cfg.sources:
            continue
        try:
            check_mixture(
                options(SourceOptions, loader_cfg),
                list(loader_cfg.sources),
                where=f"[[{section}.sources]]",
            )
        except MixtureError as e:
            raise ConfigError(f"{job.file}: {e}") from None
