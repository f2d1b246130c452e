"""CPU parameter dtype: float32 unless the CPU multiplies bf16 natively, as a default that the TOML
and the command line override, logged once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from torchtitan_ext import cpu_compat

MAIN = REPO / "train_configs" / "llama3_debug_cpu.toml"


@pytest.fixture
def flags(monkeypatch):
    def set_flags(found: set[str], machine: str = "x86_64", isa: str | None = None) -> None:
        cpu_compat.bf16_matmul_support.cache_clear()
        monkeypatch.setattr(cpu_compat, "_cpu_flags", lambda: set(found))
        monkeypatch.setattr(cpu_compat.platform, "machine", lambda: machine)
        monkeypatch.setattr(cpu_compat.torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
        if isa is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)

    yield set_flags
    cpu_compat.bf16_matmul_support.cache_clear()


@pytest.mark.parametrize(
    "found,machine,isa,dtype",
    [
        ({"avx2", "fma"}, "x86_64", None, "float32"),  # AVX2 only: emulated bf16
        ({"avx512f", "avx512bw"}, "x86_64", None, "float32"),  # AVX-512 without bf16
        ({"avx512f", "avx512_bf16"}, "x86_64", None, "bfloat16"),
        ({"amx_bf16", "amx_tile"}, "x86_64", None, "bfloat16"),
        ({"avx512_bf16"}, "x86_64", "AVX2", "float32"),  # oneDNN told not to use it
        ({"avx512_bf16"}, "x86_64", "AVX512_CORE_BF16", "bfloat16"),
        ({"asimd", "bf16"}, "aarch64", None, "bfloat16"),
        ({"asimd"}, "aarch64", None, "float32"),
    ],
)
def test_cpu_param_dtype_follows_native_bf16(flags, found, machine, isa, dtype):
    flags(found, machine, isa)
    assert cpu_compat.cpu_param_dtype() == dtype
    native, why = cpu_compat.bf16_matmul_support()
    assert native == (dtype == "bfloat16") and why


def print_config(*args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchtitan_ext.train",
            "--config-file",
            str(MAIN),
            "--print-config",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout), out.stderr  # stdout is the JSON alone


def test_no_native_bf16_trains_in_float32_and_says_so_once():
    # ONEDNN_MAX_CPU_ISA=AVX2 keeps torch off any native bf16 instructions, as on an AVX2-only CPU
    cfg, log = print_config(env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert cfg["training"]["mixed_precision_param"] == "float32"
    notes = [ln for ln in log.splitlines() if "cpu_compat: training in" in ln]
    assert len(notes) == 1 and "float32" in notes[0], log[-2000:]


def test_asking_for_bf16_wins_and_the_log_says_it_is_slower_here():
    cfg, log = print_config(
        "--training.mixed_precision_param", "bfloat16", env={"ONEDNN_MAX_CPU_ISA": "AVX2"}
    )
    assert cfg["training"]["mixed_precision_param"] == "bfloat16"
    assert "training in bfloat16 as configured" in log and "slower" in log


def test_cpu_dtype_benchmark_reads_step_times_from_the_log():
    from benchmarks.cpu_dtype import step_seconds

    log = (
        "[titan] 2026-11-22 15:12:45,000 - root - INFO - step:  1  loss: 8.1\n"
        "[titan] 2026-11-22 15:12:45,500 - root - INFO - step:  2  loss: 8.0\n"
        "[titan] 2026-11-22 15:12:46,250 - root - INFO - step:  3  loss: 7.9\n"
    )
    assert step_seconds(log) == pytest.approx([0.5, 0.75])
