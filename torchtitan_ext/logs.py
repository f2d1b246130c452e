"""A quiet log: every message a torchtitan_ext job used to print that says nothing to its user,
where it comes from, and what is done about it — in one place.

* ``initial_load_model_only=True has no effect without an initial_load_path`` (torchtitan
  ``checkpointer/base.py:336``; 2-3 times per run, even for ``--help``): dropped. It is about
  torchtitan's own default for that field, warned by ``__post_init__`` of every Config built.
* ``model.safetensors.index.json not found at hf_assets_path`` (``protocols/state_dict_adapter.py:97``):
  dropped unless the job reads or writes HF checkpoints (``checkpoint.initial_load_in_hf`` /
  ``last_save_in_hf``), the only case it affects (:func:`configure`).
* ``Error running lspci`` and ``Peak flops undefined for: cpu, fallback to A100``: fixed at the
  source on a CPU (``cpu_compat`` shim 8); the following ``Peak FLOPS used for computing MFU:
  nan`` (``trainer.py:540``) is reworded, and the step line shows ``mfu: N/A``.
* NCCL variable override notices under torchrun on a CPU: fixed at the source (``cpu_compat``
  shim 9).
* ``UserWarning: DTensor random operators may not have complete support on cpu device mesh``
  (``torch/distributed/tensor/_dispatch.py``): ignored on a CPU only. It says DTensor's
  random-number tracker does not cover a CPU mesh, which only changes *which* random values a
  sharded weight's initialisation draws (each shard from the rank's own generator), not whether
  training works; it is printed on every CPU run, whatever the user does.
* ``UserWarning: To get the last learning rate computed by the scheduler, please use
  get_last_lr()`` on resume: silenced inside torchtitan's ``LRSchedulersContainer.
  load_state_dict`` only, which calls ``get_lr()`` on purpose to recompute the restored rate.
* ``UserWarning: 'set_vital' is deprecated`` (torchdata's ``StatefulDataLoader`` calls
  ``torch.set_vital``, deprecated in torch 2.13; once per loader, e.g. ``streaming_text``):
  ignored; it is about torchdata's code, not the job.
* ANSI colour codes in redirected logs: ``metrics.disable_color_printing`` defaults to true
  when stdout is not a terminal (``config.machine_defaults``).
* Log lines mixed into ``--print-config``'s JSON: the launcher logs to stderr for that option.

Every filter matches one message by its text; nothing else is hidden. :func:`install` is
idempotent and is called by :mod:`torchtitan_ext.config` at import (before torchtitan builds its
first Config, which is when the first of these is logged).

:data:`NOISE` holds one pattern per message above (plus tracebacks); ``python -m
torchtitan_ext.logs LOG...`` reports every line of a log that matches one and exits 1 — the check
run on a fresh clone's ``make demo`` log.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import warnings
from typing import Any

# name -> a pattern that matches the message in a log (what tests/test_quiet_log.py checks)
NOISE: dict[str, re.Pattern[str]] = {
    name: re.compile(p)
    for name, p in {
        "initial_load_model_only": r"initial_load_model_only=True has no effect",
        "lspci": r"Error running lspci",
        "peak flops fallback": r"Peak flops undefined for|fallback to A100",
        "mfu on a CPU": r"mfu: (?!N/A)",
        "DTensor CPU mesh": r"DTensor random operators may not have complete support",
        "safetensors index": r"model\.safetensors\.index\.json not found",
        "get_last_lr": r"please use `get_last_lr\(\)`",
        "NCCL variables": r"ENV\[TORCH_(NCCL|FR)_\w+\] = .* will be overridden",
        "setuptools install boxes": r"`project\.license` as a TOML table is deprecated"
        r"|BuildBackendWarning",
        "ANSI colour": r"\x1b\[[0-9;]*m",
        "set_vital": r"'set_vital' is deprecated",
        "traceback": r"Traceback \(most recent call last\)",
    }.items()
}


def noisy_lines(text: str) -> list[tuple[str, str]]:
    """(noise name, line) for every line of a log that matches one of :data:`NOISE`."""
    return [
        (name, line)
        for line in text.splitlines()
        for name, pat in NOISE.items()
        if pat.search(line)
    ]


_installed = False
_keep_hf_index_note = False

_DROP = ("initial_load_model_only=True has no effect without an initial_load_path",)
_HF_INDEX = "model.safetensors.index.json not found at hf_assets_path"
_NAN_PEAK = "Peak FLOPS used for computing MFU: nan"


class _QuietFilter(logging.Filter):
    """On torchtitan's logger (the root logger): drops or rewords the records listed above."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith(_DROP):
            return False
        if msg.startswith(_HF_INDEX):
            return _keep_hf_index_note
        if msg.startswith(_NAN_PEAK):
            record.msg, record.args = "Peak FLOPS: unknown for a CPU; the mfu column shows N/A", ()
        return True


def _quiet_lr_scheduler_load() -> None:
    """torchtitan recomputes the restored learning rate with ``get_lr()``, which torch warns
    about when called outside ``step()``; the call is intended there, so only that call is
    silenced."""
    try:
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    except ImportError:  # another torchtitan layout: nothing to quiet
        return
    original = LRSchedulersContainer.load_state_dict
    if getattr(original, "__quiet__", False):
        return

    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="To get the last learning rate computed")
            original(self, state_dict)

    load_state_dict.__quiet__ = True  # type: ignore[attr-defined]
    LRSchedulersContainer.load_state_dict = load_state_dict  # type: ignore[method-assign]


def install() -> None:
    """Install the filters above (idempotent)."""
    global _installed
    if _installed:
        return
    from torchtitan_ext import cpu_compat

    logging.getLogger().addFilter(_QuietFilter())
    if cpu_compat.needed():
        warnings.filterwarnings(
            "ignore", message="DTensor random operators may not have complete support on cpu"
        )
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    _quiet_lr_scheduler_load()
    _installed = True


def configure(config: Any) -> None:
    """Settings of the job that decide whether a message matters (HF checkpoint formats)."""
    global _keep_hf_index_note
    ck = getattr(config, "checkpoint", None)
    _keep_hf_index_note = bool(
        getattr(ck, "initial_load_in_hf", False) or getattr(ck, "last_save_in_hf", False)
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m torchtitan_ext.logs LOG...``: exit 1 listing each noisy line, else 0."""
    paths = sys.argv[1:] if argv is None else argv
    found = 0
    for path in paths:
        with open(path, errors="replace") as f:
            for name, line in noisy_lines(f.read()):
                print(f"{path}: {name}: {line.strip()[:160]!r}")
                found += 1
    print(f"{found} noisy line(s) in {len(paths)} log(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
