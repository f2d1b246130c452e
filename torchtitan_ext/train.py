"""Launcher: run torchtitan 0.3.0's Trainer from a TOML train config.

    python -m torchtitan_ext.train --config-file train_configs/llama3_debug_cpu.toml [--section.key v ...]
    torchrun --nproc_per_node 2 -m torchtitan_ext.train --config-file ... (DP=2: gloo on CPU, NCCL on GPU)
    torchtitan-ext-train --config-file ...   (console script)

Without torchrun, a single-process job gets the rendezvous environment torchtitan expects
(``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and a free ``MASTER_PORT`` on localhost), so the plain
``python -m`` form works. ``--help`` lists every section, ours included, with their docs and the
values this config would use. ``--print-config`` prints the merged config as JSON on stdout (the
log goes to stderr) and exits.

Before the model is built, :mod:`torchtitan_ext.preflight` checks the data, tokenizer and
checkpoint the config points to. Exit codes: 0 trained (or nothing left to train: the checkpoint
already reached ``training.steps``, said in one line), 2 a config error (one line ``config error:
...`` naming the key and the fix, printed by rank 0), anything else a failure while training.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_single_process_env() -> None:
    """Give a non-torchrun process the env torchtitan's init_distributed reads."""
    if "LOCAL_RANK" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def parse_launcher_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config-file", "--config_file", dest="config_file", default=None)
    p.add_argument("--print-config", action="store_true")
    return p.parse_known_args(argv)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, rest = parse_launcher_args(argv)
    ensure_single_process_env()

    from torchtitan_ext import cpu_compat

    cpu_compat.apply()
    from torchtitan.tools.logging import init_logger, logger

    from torchtitan_ext import logs, preflight
    from torchtitan_ext.config import ConfigError, config_to_dict, load_config

    init_logger()
    if ns.print_config:  # stdout carries the JSON only
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler):
                h.setStream(sys.stderr)
    if "-h" in rest or "--help" in rest:
        # tyro prints every section (torchtitan's and ours) with field docstrings, then exits.
        load_config(ns.config_file, rest)
        return 0
    file = str(ns.config_file) if ns.config_file else "<no config file>"
    try:
        config = load_config(ns.config_file, rest)
        logs.configure(config)
        for change in cpu_compat.adapt_config(config):
            logger.info(f"cpu_compat: {change}")
        if ns.print_config:
            print(json.dumps(config_to_dict(config), indent=2))
            return 0
        logger.info("preflight: checking data, tokenizer and checkpoint before building the model")
        job = preflight.run(config, file)
    except ConfigError as e:
        if _is_rank0():
            print(f"config error: {e}", file=sys.stderr)
        return 2
    except preflight.JobComplete as e:
        if _is_rank0():
            print(f"nothing to do: {e}", file=sys.stderr)
        return 0
    for note in job.notes:
        logger.info(f"preflight: {note}")
    return run(config)


def build_trainer(config_file: str | None, argv: list[str], edit: Any = None) -> Any:
    """The trainer, built in this process from a config file and ``--section.key value``
    overrides the way :func:`main` builds it (rendezvous env, CPU shims, config layers,
    preflight), for benchmarks and probes that time or inspect its steps. ``edit(config)``, if
    given, changes the loaded config before the preflight. Raises ConfigError as main reports."""
    ensure_single_process_env()
    from torchtitan_ext import cpu_compat

    cpu_compat.apply()
    from torchtitan_ext import preflight
    from torchtitan_ext.config import load_config

    config = load_config(config_file, argv)
    if edit is not None:
        edit(config)
    cpu_compat.adapt_config(config)
    preflight.run(config, str(config_file))
    return config.build()


def run(config) -> int:
    import torch
    from torchtitan.tools.logging import logger

    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
