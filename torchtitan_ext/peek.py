"""``peek``: see exactly what the model will see — dump, decode, resume and render batches.

    python -m torchtitan_ext.peek --config-file train_configs/X.toml [--section.key value ...]
        [--dp-rank R --dp-world-size W] [--num-workers K]
        [--batches N] [--out FILE.npz] [--pixels raw|sha256]
        [--save-state-after K STATE] [--load-state STATE]
        [--show] [--render FILE.png] [--render-batch I]
    torchtitan-ext-peek ...   (console script)

How a loader is built. Exactly like torchtitan's ``Trainer.__init__`` (trainer.py ~560-590): the
job config comes from :func:`torchtitan_ext.config.load_config` (defaults < TOML < command line,
same registry, same loader Config), the tokenizer from
``config.tokenizer.build(tokenizer_path=config.hf_assets_path)``, the loader from
``config.dataloader.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=config.training.seq_len,
local_batch_size=, snapshot_every_n_steps=)`` with the batch size and snapshot interval computed as
the trainer does, and ``[staging] enable`` wraps it like ``ExtTrainer`` (``--no-staging`` opts out).
No model, optimizer or process group is built. See
:func:`torchtitan_ext.loaders.integration.build_loader` (shared with any other tool).

Batch files (``--out``). One ``np.savez`` archive, readable with ``np.load(f, allow_pickle=False)``:
batch ``i``'s tensors under ``"{i}/{key}"``, where ``key`` flattens the batch generically — a
torchtitan ``(input_dict, labels)`` tuple gives ``input``, ``positions``, ... and ``labels``; a dict
batch (Qwen3-VL HF kwargs) gives its own keys (``input_ids``, ``position_ids``, ``labels``,
``image_grid_thw``, ``pixel_values``); nested containers join keys with ``"."``. Python scalars
become 0-d arrays; ``None``/strings are listed in the metadata. ``--pixels sha256`` replaces every
``*pixel_values*`` tensor with the SHA-256 of its bytes (``"{key}.sha256"``, 32 uint8) to keep files
small. Metadata (key ``"__meta__"``: UTF-8 JSON in a uint8 array; :func:`load_batches` decodes it):
the resolved config (``config_to_dict``), the loader name and rank, the loader's ``get_stats()``
after every batch, non-numpy dtypes (bfloat16 is stored as its raw uint16 bits).

Loader state (``--save-state-after K STATE`` / ``--load-state STATE``). ``loader.state_dict()``
after ``K`` batches — the object torchtitan's checkpointer saves — written without pickle by
:func:`save_state`: the nested structure as JSON (tagged for tuples, bytes, non-string dict keys,
non-finite floats) plus every tensor / numpy array / long int list as an array of one ``.npz``;
:func:`load_state` restores it with the same Python and array types and dtypes. The property this
tool exists to check: ``peek --batches 2K`` == ``peek --batches K --save-state-after K s`` followed
by ``peek --load-state s --batches K``, bitwise (tests/test_peek.py, every registered loader,
workers 0 and 2).

Errors: a config error (unknown loader or key, bad value, missing ``dataloader.dataset_path``,
``--num-workers`` for a loader without workers) prints ``config error: ...`` naming the key and exits
2; success exits 0; a loader failure exits 1 with its message.

Cost (measured on the 2-core dev box). peek adds little to the loader's own start-up: copying a
4x256 text batch to numpy ~0.02 ms, ``np.savez`` of 10 such batches ~1.2 ms. The first batch of
``train_configs/llama3_debug_cpu.toml`` (parquet_prefetch, embedded corpus) arrives after ~0.8 s,
streaming_text with 2 workers ~0.5 s, cached_vl from a built cache ~0.3 s (building the tiny sample
cache first: ~5 s). ``save_state`` / ``load_state`` of parquet_prefetch's state (a 229k-token packer
buffer): 46 ms / 13 ms, 1.8 MB; long int lists go to int64 arrays (encode 27 ms vs json.dumps
41 ms, decode 12 ms vs json.loads 31 ms on the same list).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_ext.loaders.integration import build_loader, build_tokenizer
from torchtitan_ext.peek_files import (
    batch_arrays,
    flatten_batch,
    load_state,
    save_state,
    write_batches,
)
from torchtitan_ext.peek_files import json_safe as _json_safe

logger = logging.getLogger("torchtitan_ext.peek")

EXIT_OK, EXIT_ERROR, EXIT_CONFIG = 0, 1, 2


class PeekConfigError(ValueError):
    """A peek option does not fit the config (exit code 2, like a ConfigError)."""


# =========================================================================== building the loader
def loader_name(loader_cfg: Any) -> str:
    """The registry name of a loader Config (its class name if unregistered)."""
    from torchtitan_ext.preflight import loader_name as name

    return name(loader_cfg)


def set_num_workers(loader_cfg: Any, num_workers: int, section: str = "dataloader") -> None:
    """Set the loader Config's ``num_workers``; PeekConfigError if the loader has no workers
    (0 is accepted for every loader: it asks for what a worker-less loader does)."""
    if num_workers < 0:
        raise PeekConfigError(f"--num-workers must be >= 0, got {num_workers}")
    if "num_workers" not in {f.name for f in fields(loader_cfg)}:
        if num_workers == 0:
            return  # "no worker processes" is what such a loader does anyway
        raise PeekConfigError(
            f"--num-workers {num_workers}: loader {loader_name(loader_cfg)!r} "
            f"({type(loader_cfg).__qualname__}) has no setting {section}.num_workers — it does "
            "not use DataLoader worker processes"
        )
    loader_cfg.num_workers = num_workers


def close_loader(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if callable(close):
        close()


# =========================================================================== CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtitan-ext-peek",
        description="Build a train config's dataloader exactly as training does and look at its "
        "batches: dump (--out), decode (--show), draw (--render), save/resume its state. "
        "Unknown --section.key value options override the config like the train launcher.",
    )
    p.add_argument("--config-file", "--config_file", dest="config_file", required=True)
    p.add_argument("--dp-rank", type=int, default=0, help="act as this data-parallel rank")
    p.add_argument("--dp-world-size", type=int, default=1, help="data-parallel degree")
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="set dataloader.num_workers (worker processes)",
    )
    p.add_argument("--batches", type=int, default=2, help="batches to read (default 2)")
    p.add_argument("--out", default=None, help="write the batches + stats + config to this .npz")
    p.add_argument(
        "--pixels",
        choices=("raw", "sha256"),
        default="raw",
        help="store pixel_values as is, or only their SHA-256 per batch (small files)",
    )
    p.add_argument(
        "--save-state-after",
        nargs=2,
        metavar=("K", "STATE"),
        default=None,
        help="write the loader state after K batches to STATE (pickle-free .npz)",
    )
    p.add_argument("--load-state", default=None, metavar="STATE", help="start from a saved state")
    p.add_argument("--show", action="store_true", help="print the batches decoded")
    p.add_argument("--max-chars", type=int, default=400, help="--show: characters per document")
    p.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="--show: ANSI colours"
    )
    p.add_argument("--render", default=None, metavar="PNG", help="draw one batch to this PNG")
    p.add_argument("--render-batch", type=int, default=0, help="which batch --render draws")
    p.add_argument(
        "--validator",
        action="store_true",
        help="peek the validation loader ([validator.dataloader]) as torchtitan's Validator builds it",
    )
    p.add_argument("--debug", action="store_true", help="raise loader errors with their traceback")
    p.add_argument(
        "--no-staging", action="store_true", help="do not wrap in AsyncDeviceLoader ([staging])"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    ns, rest = parser.parse_known_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from torchtitan_ext import cpu_compat

    cpu_compat.apply()
    from torchtitan_ext.config import ConfigError, config_to_dict, load_config
    from torchtitan_ext.preflight import run_data_checks
    from torchtitan_ext.preflight.paths import check_loader_paths

    save_after: int | None = None
    try:
        if ns.save_state_after is not None:
            try:
                save_after = int(ns.save_state_after[0])
            except ValueError:
                raise PeekConfigError(
                    f"--save-state-after K STATE: K must be an int, got {ns.save_state_after[0]!r}"
                ) from None
            if not 0 <= save_after <= ns.batches:
                raise PeekConfigError(
                    f"--save-state-after {save_after}: must be within [0, --batches {ns.batches}]"
                )
        if ns.batches < 0:
            raise PeekConfigError(f"--batches must be >= 0, got {ns.batches}")
        if ns.render and not 0 <= ns.render_batch < max(ns.batches, 1):
            raise PeekConfigError(
                f"--render-batch {ns.render_batch} not in [0, --batches {ns.batches})"
            )
        cfg = load_config(ns.config_file, rest)
        section = "validator.dataloader" if ns.validator else "dataloader"
        target = cfg.dataloader
        if ns.validator:
            target = getattr(cfg.validator, "dataloader", None)
            if target is None:
                raise PeekConfigError(f"{ns.config_file}: --validator: no [validator.dataloader]")
        if ns.num_workers is not None:
            set_num_workers(target, ns.num_workers, section)
        check_loader_paths(target, str(ns.config_file), section)
        run_data_checks(cfg, str(ns.config_file))  # a mixture's sources, video options
        if ns.load_state is not None and not Path(ns.load_state).is_file():
            raise PeekConfigError(f"--load-state {ns.load_state}: file not found")
        if not 0 <= ns.dp_rank < ns.dp_world_size:
            raise PeekConfigError(
                f"--dp-rank {ns.dp_rank} is not in [0, --dp-world-size {ns.dp_world_size})"
            )
    except (ConfigError, PeekConfigError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG

    from torchtitan_ext.loaders.integration import loader_stats, read_stats
    from torchtitan_ext.peek_view import mix_summary

    name = loader_name(target)
    loader = None
    try:
        tokenizer = build_tokenizer(cfg)
        loader = build_loader(
            cfg,
            ns.dp_rank,
            ns.dp_world_size,
            tokenizer=tokenizer,
            staging=False if ns.no_staging else None,
            validator=ns.validator,
        )
        if ns.load_state is not None:
            loader.load_state_dict(load_state(ns.load_state))
        shower = view = None
        # one header for --show and --render: which config, loader and rank the batches are
        header = (
            f"{ns.config_file}  [{section}] loader={name}  dp_rank={ns.dp_rank}/"
            f"{ns.dp_world_size}  seq_len={cfg.training.seq_len}  "
            f"local_batch_size={cfg.training.local_batch_size}"
        )
        if ns.show or ns.render:
            from torchtitan_ext.peek_view import BatchView, Shower

            view = BatchView.for_loader(loader, tokenizer)
            if ns.show:
                color = ns.color == "always" or (ns.color == "auto" and sys.stdout.isatty())
                shower = Shower(view, color=color, max_chars=ns.max_chars)
                print(f"peek: {header}")
        if save_after == 0:
            save_state(loader.state_dict(), ns.save_state_after[1])
        batches: list[dict[str, np.ndarray]] = []
        notes: list[dict[str, Any]] = []
        stats: list[dict[str, Any]] = []
        prev_stats: dict[str, float] = {}
        # Only a cached VL batch needs the state before it (to find its packs in the cache).
        want_state = ns.render_batch if ns.render and view.image_ids else None
        for i, (batch, state_before) in enumerate(
            iterate_with_state(loader, ns.batches, want_state)
        ):
            arrays, note = batch_arrays(batch, ns.pixels)
            batches.append(arrays)
            notes.append(note)
            cur = loader_stats(loader)
            stats.append(cur)
            if shower is not None:
                shower.show(i, flatten_batch(batch), cur, prev_stats)
            prev_stats = cur
            if ns.render and i == ns.render_batch:
                from torchtitan_ext.peek_render import render_batch

                out = render_batch(
                    view,
                    flatten_batch(batch),
                    ns.render,
                    index=i,
                    state_before=state_before,
                    header=header,
                )
                print(f"peek: rendered batch {i} -> {out}")
            if save_after is not None and save_after == i + 1:
                p = save_state(loader.state_dict(), ns.save_state_after[1])
                print(f"peek: loader state after {i + 1} batches -> {p}")
        if len(batches) < ns.batches:
            print(f"peek: the loader ended after {len(batches)} of {ns.batches} batches")
            if save_after is not None and save_after > len(batches):
                save_state(loader.state_dict(), ns.save_state_after[1])
        if ns.out:
            get_stats = getattr(loader, "get_stats", None)
            meta = {
                "config_file": str(ns.config_file),
                "overrides": rest,
                "loader": name,
                "loader_section": section,
                "loader_config_class": type(target).__qualname__,
                "dp_rank": ns.dp_rank,
                "dp_world_size": ns.dp_world_size,
                "num_workers": getattr(target, "num_workers", None),
                "load_state": ns.load_state,
                "pixels": ns.pixels,
                "num_batches": len(batches),
                "batch_notes": notes,
                "stats_per_batch": stats,
                "stats": _json_safe(get_stats()) if callable(get_stats) else {},
                "config": config_to_dict(cfg),
            }
            p = write_batches(ns.out, batches, meta)
            print(f"peek: {len(batches)} batches of {name} -> {p}")
        elif not ns.show:
            for i, b in enumerate(batches):
                shapes = ", ".join(f"{k} {list(a.shape)} {a.dtype}" for k, a in b.items())
                print(f"batch {i}: {shapes}")
        mix = mix_summary(read_stats(loader).sources)
        if mix is not None:
            print(f"peek: {mix} (after {len(batches)} batches)")
    except (ConfigError, PeekConfigError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as e:  # the CLI's top level: report the loader's failure, exit 1
        if ns.debug:
            raise
        print(f"peek: error: {type(e).__name__}: {e} (--debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR
    finally:
        if loader is not None:
            close_loader(loader)
    return EXIT_OK


def iterate_with_state(loader: Any, n: int, want_state_at: int | None) -> Iterator[tuple[Any, Any]]:
    """Yield (batch, loader state taken just before it — only for batch ``want_state_at``, which
    --render needs to find a VL batch's packs in the cache)."""
    it = iter(loader)
    for i in range(n):
        state = None
        if want_state_at == i:
            try:
                state = loader.state_dict()
            except (RuntimeError, ValueError):
                state = None  # render falls back to the batch's own tensors
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch, state


if __name__ == "__main__":
    sys.exit(main())
