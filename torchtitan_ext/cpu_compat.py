"""Shims that let torchtitan 0.3.0's own Trainer run on a machine without CUDA.

torchtitan 0.3.0 assumes a GPU in a handful of places. Each workaround below names the torchtitan
line it addresses. All of them are **inert when CUDA is present**: :func:`apply` returns at once
(and :func:`adapt_config` changes nothing) if ``torch.cuda.is_available()``, so a GPU user runs
exactly upstream torchtitan. Everything here must run *before* the first import of
``torchtitan.trainer`` (several modules copy ``device_type`` by name at import time).

What each shim does (in the order the failures appear on a CPU box):

1. ``torchtitan/distributed/minimal_async_ep/kernels.py:10`` does ``import triton``
   unconditionally (reached from ``trainer.py`` via ``models/common/token_dispatcher.py``).
   PyPI triton is ~1 GB and useless without a GPU, so when it is not installed we pre-register
   *that kernels module* with stubs that raise if anything ever calls them (only expert-parallel
   GPU paths do). ``triton`` itself is not faked: torch checks for it to pick inductor backends.
2. ``torchtitan/tools/utils.py:55`` sets ``device_type = _get_available_device_type() or "cuda"``
   — "cuda" on a CPU box, so ``trainer.py:301`` ``device_module.set_device`` fails with
   ``torch._C has no _cuda_setDevice``. We set ``device_type = "cpu"`` and a small CPU
   ``device_module`` (set_device, device_count, memory stats ...) before anyone copies them.
3. (``torch.distributed.set_timeout``, missing from torch 2.13, is fixed on every device, GPU
   included: :mod:`torchtitan_ext.torch_compat`, which :func:`apply` runs first.)
4. ``FlexAttention`` (``models/common/attention.py:243``) has no backward on CPU: the model's
   inner attention configs are swapped for ``ScaledDotProductAttention.Config()`` (plain causal
   attention; per-document masking needs Flex/varlen, i.e. a GPU — RoPE still uses our
   per-document ``positions``).
5. DP >= 2 on CPU (gloo): the default ``spmd_backend="spmd_types"`` raises "all parameters must be
   DTensors", so we use ``partial_dtensor``; and gloo has no ``ReduceOp.PREMUL_SUM``, which FSDP
   uses to divide gradients — ``trainer.py`` disables FSDP's division anyway
   (``distributed/fsdp.py:27``), so we force plain SUM reductions
   (``FSDPModule.set_force_sum_reduction_for_comms``), which is numerically the same thing.
6. ``training.disable_cuda_graphs`` is forced on (CUDA graphs need CUDA).
7. ``torchtitan/models/qwen3_5/model.py:15-21`` imports flash-linear-attention (``fla``: Triton
   kernels, GPU only) and ``hf_datasets/multimodal/utils/image.py:20-22`` (reached from the
   ``qwen3_5`` config registry through ``mm_datasets``) imports torchvision, whose PyPI wheel does
   not load beside the CPU torch build. Neither is needed to build a ``qwen3_5`` job config, its
   vision encoder or its image-token merge, so when either is missing the ``qwen3_5`` package is
   imported once with *import-only* stand-ins for exactly the names those lines import; the
   stand-ins are taken out of ``sys.modules`` again right after, so a later ``find_spec`` or
   ``import`` anywhere else sees the truth. Calling one raises (the GatedDeltaNet layers, and
   torchtitan's own image decoding), naming the missing package.
8. Parameter dtype. torchtitan trains in bfloat16 by default (``training.mixed_precision_param``,
   ``configs.py:85``; FSDP casts the parameters, ``llama3/parallelize.py:83``). A CPU without
   native bf16 matrix instructions (AVX2-only x86) runs bf16 matmuls on a slow emulated path:
   measured 2x slower than float32 for the debug model, 5-70x slower than a native-bf16 CPU.
   :func:`cpu_param_dtype` picks ``"bfloat16"`` only where the CPU has them (x86
   ``avx512_bf16`` / ``amx_bf16``, aarch64 ``bf16``) and torch may use them, else
   ``"float32"``. It is a *default* (set in the config's defaults layer), so
   ``training.mixed_precision_param`` in the TOML or on the command line still wins;
   :func:`adapt_config` logs the decision once.
9. ``torchtitan/tools/utils.py:141`` ``get_peak_flops`` runs ``lspci`` (absent on most CPU
   hosts: a warning) and falls back to an A100's 312 TFLOPS for an unknown device (another
   warning, and an MFU column that means nothing on a CPU). There is no published peak for a
   CPU, so it returns NaN here without either warning; ``ExtTrainer`` then shows ``mfu: N/A``.
10. Under torchrun, torchtitan's ``init_distributed`` (``distributed/utils.py:505``) warns that
   it overrides each NCCL flight-recorder variable torchrun already set
   (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` ...). No NCCL runs on a CPU, so they are dropped first.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import platform
import sys
import types
from typing import Any

import torch

log = logging.getLogger(__name__)
_applied = False


def needed() -> bool:
    """True when shims are required: no CUDA device available."""
    return not torch.cuda.is_available()


# ---------------------------------------------------------------------------------------- 1. triton
_TRITON_KERNEL_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


def _stub_triton_kernels() -> None:
    """Pre-register torchtitan's triton kernel module (not ``triton`` itself: torch probes
    ``import triton`` to decide whether inductor can use it, and a fake would mislead it).
    Its kernels are only launched by expert-parallel GPU paths; calling one here raises."""
    if _TRITON_KERNEL_MODULE in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    mod = types.ModuleType(_TRITON_KERNEL_MODULE)
    mod.__dict__["__cpu_compat_stub__"] = True

    def __getattr__(item: str) -> Any:
        # Dunders stay missing: inspect.getmodule() probes every module's __file__.
        if item.startswith("__"):
            raise AttributeError(item)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{_TRITON_KERNEL_MODULE}.{item} needs triton and CUDA; torchtitan_ext.cpu_compat "
                "stubbed it so the Trainer can be imported on a CPU-only machine"
            )

        kernel.__name__ = item
        return kernel

    mod.__dict__["__getattr__"] = __getattr__
    sys.modules[_TRITON_KERNEL_MODULE] = mod


# ------------------------------------------------------------------------------ 2. device_type/module
class _CPUDeviceModule(types.ModuleType):
    """The subset of ``torch.cuda``'s API that torchtitan's Trainer and metrics call."""

    def __init__(self) -> None:
        super().__init__("torchtitan_ext_cpu_device")

    def set_device(self, device: Any) -> None:  # nothing to select on CPU
        return None

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def is_available(self) -> bool:
        return True

    def synchronize(self, device: Any = None) -> None:
        return None

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total, major=0, minor=0)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        # The step log line's "memory:" shows this process's peak RSS on CPU (never reset:
        # getrusage has no reset, so it is the peak since start).
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def max_memory_allocated(self, device: Any = None) -> int:
        return 0

    def max_memory_reserved(self, device: Any = None) -> int:
        return 0

    def memory_allocated(self, device: Any = None) -> int:
        return 0

    def memory_reserved(self, device: Any = None) -> int:
        return 0


def _patch_device() -> None:
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _CPUDeviceModule()
    # Modules that already copied the names by value (only if imported before us).
    for name in (
        "torchtitan.components.metrics",
        "torchtitan.models.common.token_dispatcher",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.distributed.utils",
        "torchtitan.tools.profiler",
    ):
        mod = sys.modules.get(name)
        if mod is not None:
            if hasattr(mod, "device_type"):
                mod.device_type = "cpu"
            if hasattr(mod, "device_module"):
                mod.device_module = tt_utils.device_module


# ------------------------------------------------------------------------------------ 5. gloo SUM
def _patch_fsdp_sum_reduction() -> None:
    import torchtitan.distributed.fsdp as tt_fsdp

    original = tt_fsdp.disable_fsdp_gradient_division
    if getattr(original, "__cpu_compat__", False):
        return

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                # gloo lacks ReduceOp.PREMUL_SUM / AVG for reduce-scatter; with the divide
                # factor already 1.0 a plain SUM is the same arithmetic.
                module.set_force_sum_reduction_for_comms(True)

    disable_fsdp_gradient_division.__cpu_compat__ = True  # type: ignore[attr-defined]
    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    for name, mod in list(sys.modules.items()):
        if (
            name.startswith("torchtitan")
            and getattr(mod, "disable_fsdp_gradient_division", None) is original
        ):
            mod.disable_fsdp_gradient_division = disable_fsdp_gradient_division


# ---------------------------------------------------------------- 7. qwen3_5 without fla/torchvision
_QWEN3_5 = "torchtitan.models.qwen3_5.config_registry"
# Module -> the names torchtitan imports from it (model.py:15-21, multimodal/utils/image.py:20-22,
# utils/video.py:12). Their parents are stubbed too, so `import a.b.c as x` resolves.
_IMPORT_ONLY: dict[str, tuple[str, ...]] = {
    "fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
    "fla.ops.gated_delta_rule": (
        "chunk_gated_delta_rule",
        "fused_recurrent_gated_delta_rule",
    ),
    "fla.ops.gated_delta_rule.chunk": ("ChunkGatedDeltaRuleFunction",),
    "fla.ops.gated_delta_rule.fused_recurrent": ("FusedRecurrentFunction",),
    "torchvision.io": ("decode_image", "ImageReadMode"),
    "torchvision.transforms.v2.functional": (),
}
_WHY = {
    "fla": "flash-linear-attention (Triton kernels: the qwen3_5 GatedDeltaNet layers need a GPU)",
    "torchvision": "torchvision (torchtitan's own image decoding; the cached_vl loader does not use it)",
}


def _unavailable(root: str) -> bool:
    """True when ``root`` cannot be imported here (absent, or present but broken, like PyPI's
    torchvision beside the CPU torch wheel). A failed import leaves no half-module behind."""
    if importlib.util.find_spec(root) is None:
        return True
    try:
        importlib.import_module(root)
        return False
    except Exception:  # broken install: treat as absent, and forget what it half-imported
        for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
            del sys.modules[name]
        return True


def _missing_callable(module: str, item: str) -> type:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{module}.{item} is not available: {_WHY[module.split('.')[0]]} is not installed "
            "(torchtitan_ext.cpu_compat let the qwen3_5 package import without it)"
        )

    # A class, so it serves both as a function (calling it raises) and as an autograd.Function
    # that spmd_types.register_local_autograd_function can register (model.py:53-55).
    return type(item, (), {"__init__": fail, "apply": staticmethod(fail)})


def _import_only_modules(roots: set[str]) -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}
    for dotted, names in _IMPORT_ONLY.items():
        if dotted.split(".")[0] not in roots:
            continue
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in mods:
                mod = types.ModuleType(name)
                mod.__path__ = []  # a package, so submodules resolve
                mod.__dict__["__cpu_compat_stub__"] = True
                mods[name] = mod
                if i > 1:
                    setattr(mods[".".join(parts[: i - 1])], parts[i - 1], mod)
        for item in names:
            setattr(mods[dotted], item, _missing_callable(dotted, item))
    return mods


def _import_qwen3_5() -> None:
    """Import torchtitan's qwen3_5 package (and its config registry) with stand-ins for fla /
    torchvision when those are missing; no-op when they import or qwen3_5 is already loaded."""
    if _QWEN3_5 in sys.modules:
        return
    roots = {r for r in ("fla", "torchvision") if _unavailable(r)}
    if not roots:
        return
    # datasets.config probes find_spec("torchvision") at import (mm_datasets imports it): load it
    # before the stand-ins exist, so it records the truth (and find_spec does not trip on them).
    import datasets  # noqa: F401

    stubs = _import_only_modules(roots)
    sys.modules.update(stubs)
    try:
        importlib.import_module(_QWEN3_5)
    except ImportError as e:  # a torchtitan without qwen3_5, or one that imports more: report
        log.warning("cpu_compat: torchtitan's qwen3_5 package does not import on CPU: %s", e)
    finally:
        for name, mod in stubs.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]


# ------------------------------------------------------------------------------ 8. parameter dtype
_X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpu_flags() -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (x86 "flags", aarch64 "Features")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(val.split())
    except OSError:  # not Linux: no flags known, so no native bf16 is assumed
        pass
    return set()


@functools.cache
def bf16_matmul_support() -> tuple[bool, str]:
    """(whether this CPU multiplies bf16 matrices natively, the reason in words)."""
    flags = _cpu_flags()
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        found = ["bf16"] if "bf16" in flags else []
    else:
        found = [f for f in _X86_BF16_FLAGS if f in flags]
    if not found:
        return False, f"this CPU has no native bf16 matmul (no {'/'.join(_X86_BF16_FLAGS)} flag)"
    # torch can be told not to use them: oneDNN (CPU matmuls) by ONEDNN_MAX_CPU_ISA, its own
    # kernels by ATEN_CPU_CAPABILITY; mkldnn_bf16 support reflects the oneDNN limit.
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if isa != "ALL" and "BF16" not in isa and "AMX" not in isa:
        return False, f"native bf16 ({', '.join(found)}) disabled by ONEDNN_MAX_CPU_ISA={isa}"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, f"native bf16 ({', '.join(found)}) not usable by this torch build"
    return True, f"this CPU has native bf16 matmul ({', '.join(found)})"


def cpu_param_dtype() -> str:
    """``"bfloat16"`` where bf16 matmuls are native, else ``"float32"`` (the CPU default)."""
    return "bfloat16" if bf16_matmul_support()[0] else "float32"


def _dtype_note(config: Any) -> str:
    chosen = config.training.mixed_precision_param
    native, why = bf16_matmul_support()
    if chosen == cpu_param_dtype():
        return f"training in {chosen}: {why}"
    if chosen == "bfloat16":
        return (
            f"training in bfloat16 as configured, although {why}: steps are slower than in "
            "float32 (the default here)"
        )
    return f"training in {chosen} as configured ({why}; bfloat16 is the default here)"


# ------------------------------------------------------------------------------- 9. peak flops
def _patch_peak_flops() -> None:
    import torchtitan.tools.utils as tt_utils

    if getattr(tt_utils.get_peak_flops, "__cpu_compat__", False):
        return

    def get_peak_flops(device_name: str) -> float:
        return math.nan  # no published peak for a CPU: MFU is reported as N/A

    get_peak_flops.__cpu_compat__ = True  # type: ignore[attr-defined]
    tt_utils.get_peak_flops = get_peak_flops


# ----------------------------------------------------------------------------- 10. NCCL variables
_NCCL_ENV = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE",
)


def _drop_nccl_env() -> None:
    for name in _NCCL_ENV:
        os.environ.pop(name, None)


def apply() -> bool:
    """Install every import-time shim if CUDA is absent. Idempotent. Returns whether applied.
    :mod:`torchtitan_ext.torch_compat`'s fixes are installed first, on every device."""
    global _applied
    from torchtitan_ext import torch_compat

    torch_compat.apply()
    if not needed():
        return False
    if _applied:
        return True
    _stub_triton_kernels()
    _patch_device()
    _patch_fsdp_sum_reduction()
    _import_qwen3_5()
    _patch_peak_flops()
    _drop_nccl_env()
    _applied = True
    log.info("torchtitan_ext.cpu_compat: CPU shims applied (no CUDA device)")
    return True


def adapt_config(config: Any) -> list[str]:
    """Config-level shims (4-7) for a ``Trainer.Config`` about to run on CPU. Returns a list of
    human-readable changes and decisions (logged once by the launcher). No-op with CUDA."""
    if not needed():
        return []
    changes: list[str] = []
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    try:
        from torchtitan.models.common.attention import VarlenAttention

        masked: tuple[type, ...] = (FlexAttention.Config, VarlenAttention.Config)
    except ImportError:  # older layouts have no varlen backend; Flex is the one that matters
        masked = (FlexAttention.Config,)
    if config.model_spec is not None:
        swapped = 0
        for cls in masked:
            for _fqn, _cfg, parent, attr in list(config.model_spec.model.traverse(cls)):
                if isinstance(parent, list):
                    parent[attr] = ScaledDotProductAttention.Config()
                elif parent is not None:
                    setattr(parent, attr, ScaledDotProductAttention.Config())
                else:
                    continue
                swapped += 1
        if swapped:
            changes.append(f"attention: {swapped} FlexAttention/Varlen -> SDPA (no CPU backward)")
    if config.parallelism.spmd_backend == "spmd_types":
        config.parallelism.spmd_backend = "partial_dtensor"
        changes.append("parallelism.spmd_backend: spmd_types -> partial_dtensor")
    if not config.training.disable_cuda_graphs:
        config.training.disable_cuda_graphs = True
        changes.append("training.disable_cuda_graphs: True")
    changes.append(_dtype_note(config))
    if config.comm.init_timeout_seconds < 600:
        # gloo start-up on a loaded 2-core box can be slow; a generous timeout avoids flakes.
        config.comm.init_timeout_seconds = 600
    return changes
