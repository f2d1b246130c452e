"""``[model] freeze``: Qwen3-VL components whose weights stay fixed while the rest trains.

A frozen component's parameters get ``requires_grad = False`` when the model is built
(:func:`apply_freeze`, called by ``Qwen3VLModel.__init__``), and that one flag is the whole
mechanism; every later stage already keys on it, so nothing else is filtered or wrapped:

- **autograd** computes no weight gradient for them (activations still flow *through* a frozen
  component to a trainable one before it: a frozen language model still back-propagates into a
  trainable vision tower);
- **materialisation and loading** keep it: ``nn.Module.to_empty`` re-creates each parameter with
  its ``requires_grad``, ``init_states`` and the checkpointer's HF load write data in place, and
  FSDP2's ``fully_shard`` copies the flag onto the sharded and unsharded parameters;
- **optimizer**: torchtitan's ``OptimizersContainer._build_param_groups`` takes only parameters
  with ``requires_grad`` into its ``[optimizer] param_groups`` (and ``_validate_params`` expects
  exactly those), so frozen parameters get no optimizer and no state. That is the thinnest place
  to filter, and it is torchtitan's own (it refuses a ``param_groups`` pattern left with only
  frozen parameters, "matched no parameters": the preflight says so first, see below);
- **gradient norm and clipping**: ``torchtitan.distributed.utils.clip_grad_norm_`` takes the norm
  over the gradients that exist (``p.grad is not None``): frozen parameters have none;
- **FSDP2**: ``FSDPParamGroup.post_backward`` reduce-scatters only the parameters of a unit that
  hold a gradient, and returns without any collective when none does; a unit that mixes frozen
  and trainable parameters (e.g. the vision tower's root unit: patch and position embeddings
  with the mergers) reduce-scatters the trainable ones only.

Before anything is built, the qwen3_vl preflight refuses what cannot train: an unknown name,
everything frozen, half of a tied embedding, an ``[optimizer] param_groups`` pattern left with
only frozen parameters (:func:`frozen_only_patterns`), and only ``lm_head`` trainable under the
chunked loss (``[loss] num_chunks``: it back-propagates from the hidden states, which would then
need no gradient, so no gradient would reach ``lm_head`` and backward fails).

Tied embeddings (``tie_word_embeddings``, the published 2B / 4B): ``lm_head`` *is* the input
embedding (one tensor), so a job must freeze both ``embeddings`` and ``lm_head`` or neither;
either other reading would silently do the opposite of one of the two requests.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.tools.logging import logger

from torchtitan_ext.models.qwen3_vl.model import COMPONENTS

# Parameter-name prefixes (the HF checkpoint keys, which Qwen3VLModel's names are) per component;
# the first match wins, so the mergers are taken out of the vision tower before it.
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.visual.merger.", "merger"),
    ("model.visual.deepstack_merger_list.", "merger"),
    ("model.visual.", "vision"),
    ("model.language_model.embed_tokens.", "embeddings"),
    ("model.language_model.", "language_model"),
    ("lm_head.", "lm_head"),
)


def component_of(name: str) -> str:
    """The :data:`COMPONENTS` entry a parameter of ``Qwen3VLModel`` belongs to.

    ``name`` is the parameter's name in the model (= its HF checkpoint key); wrapper segments of
    activation checkpointing / ``torch.compile`` (``_checkpoint_wrapped_module``, ``_orig_mod``)
    are ignored. A name outside every component is a ValueError, so a parameter a future
    transformers adds cannot silently escape ``[model] freeze``. Tied embeddings: the shared
    tensor is named (and counted) once, as ``model.language_model.embed_tokens.weight``.
    """
    key = canonical_fqn(name)
    for prefix, component in _PREFIXES:
        if key.startswith(prefix):
            return component
    raise ValueError(
        f"qwen3_vl: parameter {name!r} belongs to none of the freeze components "
        f"{', '.join(COMPONENTS)}"
    )


def freeze_problem(freeze: Iterable[str], *, tied: bool) -> str | None:
    """Why ``freeze`` cannot be applied (one sentence naming the valid names), or None.

    Refused: a name not in :data:`COMPONENTS`; everything frozen (nothing would train: no
    gradient, no optimizer); with tied embeddings, one of ``embeddings`` / ``lm_head`` without
    the other (module docstring).
    """
    names = list(freeze)
    valid = ", ".join(COMPONENTS)
    unknown = [n for n in names if n not in COMPONENTS]
    if unknown:
        return f"unknown component(s) {', '.join(map(repr, unknown))}; valid: {valid}"
    if set(names) >= set(COMPONENTS):
        return f"every component is frozen, nothing would train; leave at least one of {valid}"
    if tied and ("embeddings" in names) != ("lm_head" in names):
        return (
            "this flavor ties lm_head to the input embeddings (tie_word_embeddings: one weight), "
            "so 'embeddings' and 'lm_head' must be frozen together or not at all"
        )
    return None


def frozen_only_patterns(
    names: Sequence[str], freeze: Iterable[str], patterns: list[str]
) -> list[str]:
    """The ``[optimizer] param_groups`` patterns that would get only frozen parameters.

    Replays torchtitan's ``OptimizersContainer._build_param_groups`` on ``names`` (the model's
    parameter names): patterns in order, first match wins, frozen parameters skipped. A pattern
    that then claims nothing but does match a frozen parameter is returned: torchtitan would
    refuse its group ("matched no parameters") once the model is built. A pattern matching no
    name at all is left to torchtitan's own error.
    """
    frozen = set(freeze)
    claimed: set[str] = set()
    out = []
    for pattern in patterns:
        rx = re.compile(pattern)
        free = [n for n in names if n not in claimed and rx.search(n)]
        mine = [n for n in free if component_of(n) not in frozen]
        claimed.update(mine)
        if free and not mine:
            out.append(pattern)
    return out


def parameter_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{component: (trainable, frozen) element counts} over ``model.named_parameters()`` (a tied
    weight counts once, under ``embeddings``); works on the meta device."""
    counts = {c: [0, 0] for c in COMPONENTS}
    for name, p in model.named_parameters():
        counts[component_of(name)][0 if p.requires_grad else 1] += p.numel()
    return {c: (t, f) for c, (t, f) in counts.items()}


def apply_freeze(model: nn.Module, freeze: Iterable[str], *, tied: bool) -> None:
    """Set ``requires_grad = False`` on every parameter of the ``freeze`` components of ``model``
    (a ``Qwen3VLModel`` being built; ``Qwen3VLModel.__init__`` has checked ``freeze`` with
    :func:`freeze_problem` before building). Silent: the model is also built on the meta device
    by preflight checks; the trainer's build logs the counts (:func:`log_counts`, called from
    ``parallelize_qwen3_vl``)."""
    freeze = list(freeze)
    for name, p in model.named_parameters():
        if component_of(name) in freeze:
            p.requires_grad_(False)


def log_counts(model: nn.Module, freeze: list[str], *, tied: bool) -> None:
    """One log line per component (trainable / frozen parameters), then the totals."""
    counts = parameter_counts(model)
    width = max(len(c) for c in counts)
    for c, (t, f) in counts.items():
        note = " (tied: counted under embeddings)" if tied and c == "lm_head" else ""
        state = "frozen" if c in freeze else "trainable"
        logger.info(
            f"qwen3_vl parameters: {c:<{width}}  {state:<9}  {t:>13,} trainable  "
            f"{f:>13,} frozen{note}"
        )
    trainable = sum(t for t, _ in counts.values())
    frozen = sum(f for _, f in counts.values())
    logger.info(
        f"qwen3_vl parameters: {'total':<{width}}  {'':<9}  {trainable:>13,} trainable  "
        f"{frozen:>13,} frozen"
    )
