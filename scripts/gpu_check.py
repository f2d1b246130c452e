"""The GPU acceptance run: one command that says whether this checkout's CUDA paths work, and
how fast, on the first GPU it meets.

    make gpu-check                         # or: python scripts/gpu_check.py [--quick] [--flavor 2B]

Each check runs in its own process (a failure in one leaves the others' figures) and adds rows
to one table printed at the end; the rows are also written as JSON to
``outputs/gpu_check/results.json``. Exit 0 when every check passed, 1 otherwise. On a machine
without CUDA it says so and exits 0 (nothing to check).

1. **CUDA tests**: the suite's ``cuda``-marked tests (staging on a device, pinned buffers, GPU
   pixel normalisation, ...).
2. **Staging**: a small LM step fed by ``AsyncDeviceLoader`` vs the same step on batches already
   on the device (the ``staging`` benchmark's GPU case; target <= 1.02x).
3. **Tiny Qwen3-VL on the GPU**, through the launcher (``train_configs/qwen3_vl_tiny_cpu.toml``,
   fp32): eager SDPA (the reference), ``--compile.enable`` (inductor) and eager attention;
   the losses must agree with the reference, and for SDPA a pack's logits must equal
   its samples run alone (``packed == unpacked``: attention stays within each sample).
4. **Text job**: the llama3 demo (``parquet_prefetch``, torchtitan's whole-step CUDA graph on)
   20 steps with a checkpoint at 10, then resumed from it: steps 11-20 must give equal losses.
5. **Patch embedding**: transformers' Conv3d vs the equal matmul (``[model] patch_embed``) at the
   2B vision tower's size in bf16, forward + backward; the faster is the one to default to.
6. **A mid-size flavor** (``--flavor``, default 2B; random init, one GPU, bf16, 4096-token packs
   from the shipped sample set, staging with pixels normalised on the device): steady-state step
   time, MFU, the data-wait share of the step, peak memory and the frames dynamo compiled during
   the timed steps, eager and compiled. The flavor's
   image/video token ids are set to the embedded processor's (its vocabulary is small and fits).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "train_configs" / "qwen3_vl_tiny_cpu.toml"
TEXT = REPO / "train_configs" / "llama3_debug_cpu.toml"
OUT_DIR = REPO / "outputs" / "gpu_check"
BENCH_RESULTS = REPO / "benchmarks" / "results"
"""Also written there as gpu_check.json: ``python -m benchmarks --render-only`` puts the rows in
benchmarks/RESULTS.md."""


@dataclass
class Result:
    check: str
    ok: bool | None
    """True passed, False failed, None measured only (no pass/fail)."""
    value: str
    note: str = ""


# ------------------------------------------------------------------------------ helpers
def _env(work: Path) -> dict[str, str]:
    return dict(
        os.environ,
        # the checkout first, then whatever the caller put on the path (wheels carried to a
        # machine without a package index: ``PYTHONPATH=/tmp/site make gpu-check``)
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
        PYTHONUNBUFFERED="1",
        TORCHTITAN_EXT_CACHE=str(work / "home"),
        TOKENIZERS_PARALLELISM="false",
    )


def _run(cmd: list[str], work: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    """Run one check's process; its whole output is also kept under ``work/logs/`` (numbered
    in the order run), since a table row holds only the last line of a failure."""
    try:
        p = subprocess.run(
            cmd, cwd=REPO, env=_env(work), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        p = subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout} s")
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    n = len(list(logs.iterdir()))
    tag = re.sub(r"\W+", "_", " ".join(Path(c).name for c in cmd[1:6]))[:60]
    (logs / f"{n:02d}_{tag}.log").write_text(f"$ {' '.join(cmd)}\n{p.stdout}\n{p.stderr}")
    return p


def _tail(p: subprocess.CompletedProcess[str], n: int = 300) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", (p.stdout or "") + (p.stderr or "")).strip()
    last = text.splitlines()[-1] if text else ""
    return f"exit {p.returncode}: {last[-n:]}"


def _steps(text: str) -> dict[int, dict[str, float]]:
    """Step lines of torchtitan's log -> {step: {"loss": .., "tps": ..}}."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    out: dict[int, dict[str, float]] = {}
    for m in re.finditer(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)(.*)", text):
        d = {"loss": float(m.group(2))}
        tps = re.search(r"tps:\s*([0-9,]+)", m.group(3))
        if tps:
            d["tps"] = float(tps.group(1).replace(",", ""))
        out.setdefault(int(m.group(1)), d)
    return out


# ------------------------------------------------------------------------------ the checks
def check_cuda_tests(work: Path, quick: bool) -> list[Result]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:randomly", "tests"]
    p = _run(cmd, work, timeout=1200)
    summary = next(
        (ln for ln in reversed(p.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", ln)),
        _tail(p),
    )
    return [Result("CUDA-marked tests", p.returncode == 0, summary.strip("= "))]


def check_staging(work: Path, quick: bool) -> list[Result]:
    cmd = [sys.executable, "-m", "benchmarks", "staging", "--out-dir", str(work / "bench")]
    cmd += ["--quick"] if quick else []
    p = _run(cmd, work, timeout=1200)
    found = sorted((work / "bench").glob("staging*.json"))
    if p.returncode != 0 or not found:
        return [Result("staging: staged / resident step", False, _tail(p))]
    rows = json.loads(found[0].read_text())["rows"]
    out = []
    for r in rows:
        if r["case"].startswith("GPU step time"):
            v = r["value"]
            out.append(Result(r["case"], r.get("met"), f"{v:.3f}x (target {r.get('target')})"))
    return out or [Result("staging: staged / resident step", False, "no GPU rows produced")]


def _tiny(work: Path, name: str, args: list[str], steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torchtitan_ext.train", "--config-file", str(TINY)]
    cmd += ["--training.steps", str(steps), "--dataloader.max_samples", "48"]
    cmd += ["--checkpoint.no-enable", "--dump_folder", str(work / name)]
    cmd += ["--dataloader.cache_dir", str(work / "cache"), *args]
    return _run(cmd, work, timeout=900)


def check_tiny_vl(work: Path, quick: bool) -> list[Result]:
    steps = 6 if quick else 12
    variants = {
        "eager sdpa": [],
        "compiled sdpa (inductor)": ["--compile.enable", "--compile.backend", "inductor"],
        "eager attention (reference)": ["--model.attn_backend", "eager"],
    }
    out: list[Result] = []
    ref: dict[int, dict[str, float]] | None = None
    for name, args in variants.items():
        t0 = time.perf_counter()
        p = _tiny(work, re.sub(r"\W+", "_", name), args, steps)
        wall = time.perf_counter() - t0
        got = _steps(p.stdout + p.stderr)
        if p.returncode != 0 or len(got) != steps:
            out.append(Result(f"tiny qwen3_vl {name}", False, _tail(p)))
            continue
        ref = ref or got
        worst = max(abs(got[s]["loss"] - ref[s]["loss"]) / ref[s]["loss"] for s in ref)
        tps = statistics.median(
            got[s].get("tps", float("nan")) for s in range(steps // 2, steps + 1)
        )
        out.append(
            Result(
                f"tiny qwen3_vl {name}: losses vs eager sdpa",
                worst <= 2e-3,
                f"max rel diff {worst:.1e}; tps {tps:,.0f}; wall {wall:.0f} s",
                "steady-state tps: median of the second half of the steps",
            )
        )
    for backend in ("sdpa",):
        res = work / f"pack_{backend}.json"
        cmd = [sys.executable, "-m", "tests.support.qwen3_vl_probe", "pack", str(res)]
        cmd += ["--config-file", str(TINY), "--model.attn_backend", backend]
        cmd += ["--dataloader.max_samples", "24", "--checkpoint.no-enable"]
        cmd += ["--dataloader.cache_dir", str(work / "cache"), "--dump_folder", str(work / "probe")]
        p = _run(cmd, work, timeout=600)
        if p.returncode != 0 or not res.is_file():
            out.append(Result(f"packed == unpacked ({backend})", False, _tail(p)))
            continue
        r = json.loads(res.read_text())
        ok = r["max_abs_dlogit"] <= 1e-3 and r["samples"] >= 3
        out.append(
            Result(
                f"packed == unpacked ({backend})",
                ok,
                f"max |dlogit| {r['max_abs_dlogit']:.1e} over {r['samples']} samples, "
                f"{r['images']} images",
            )
        )
    return out


def check_text(work: Path, quick: bool) -> list[Result]:
    """The text demo (llama3 debugmodel, ``parquet_prefetch``) on the GPU: 20 steps with a
    checkpoint at 10, then a second job resumed from that checkpoint; steps 11-20 must give the
    same losses (torchtitan's CUDA graph of the step and our loader's state, on CUDA)."""
    steps, at = 20, 10
    runs = {}
    for name in ("straight", "resumed"):
        dump = work / f"text_{name}"
        if name == "resumed":
            (dump / "checkpoint").mkdir(parents=True)
            src = work / "text_straight" / "checkpoint" / f"step-{at}"
            subprocess.run(["cp", "-r", str(src), str(dump / "checkpoint")], check=True)
        cmd = [sys.executable, "-m", "torchtitan_ext.train", "--config-file", str(TEXT)]
        cmd += ["--training.steps", str(steps), "--checkpoint.interval", str(at)]
        p = _run(cmd + ["--dump_folder", str(dump)], work, timeout=600)
        runs[name] = (p, _steps(p.stdout + p.stderr))
        want = steps if name == "straight" else steps - at
        if p.returncode != 0 or len(runs[name][1]) != want:
            return [Result(f"text job on the GPU ({name})", False, _tail(p))]
    a, b = runs["straight"][1], runs["resumed"][1]
    diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in b)
    tps = statistics.median(a[s].get("tps", float("nan")) for s in range(at, steps + 1))
    return [
        Result(
            "text job on the GPU: resumed == straight",
            diff <= 1e-4,
            f"max |loss diff| steps {at + 1}-{steps}: {diff:.1e}; loss {a[1]['loss']:.3f} -> "
            f"{a[steps]['loss']:.3f}; tps {tps:,.0f}",
            "losses as the step line prints them (5 decimals)",
        )
    ]


def check_patch_embed(work: Path, quick: bool) -> list[Result]:
    res = work / "patch_embed.json"
    p = _run([sys.executable, str(Path(__file__)), "--worker", "patch_embed", str(res)], work, 600)
    if p.returncode != 0 or not res.is_file():
        return [Result("patch embedding conv vs matmul", False, _tail(p))]
    r = json.loads(res.read_text())
    pick = "matmul" if r["matmul_ms"] < r["conv_ms"] else "conv"
    return [
        Result(
            "patch embedding (2B vision, bf16, fwd+bwd)",
            r["max_abs_diff"] <= 5e-2,
            f"conv {r['conv_ms']:.2f} ms, matmul {r['matmul_ms']:.2f} ms -> faster: {pick}",
            f"{r['patches']} patches; max |out diff| {r['max_abs_diff']:.1e} (bf16)",
        )
    ]


def check_midsize(work: Path, quick: bool, flavor: str) -> list[Result]:
    out = []
    for name, args in {"eager": [], "compiled": ["--compile.enable"]}.items():
        res = work / f"mid_{name}.json"
        cmd = [sys.executable, str(Path(__file__)), "--worker", "midsize", str(res), flavor]
        cmd += ["--quick"] if quick else []
        p = _run(cmd + ["--", *args, "--dataloader.cache_dir", str(work / "cache")], work, 1500)
        if p.returncode != 0 or not res.is_file():
            out.append(Result(f"{flavor} random init, {name}", False, _tail(p)))
            continue
        r = json.loads(res.read_text())
        out.append(
            Result(
                f"{flavor} random init, {name}",
                None,
                f"{r['step_ms']:.0f} ms/step, MFU {r['mfu']:.1f} %, data wait "
                f"{r['wait_share']:.1f} %, peak {r['peak_gib']:.1f} GiB",
                f"{r['tokens']} tokens/step, {r['steps']} timed steps after {r['warmup']}; "
                f"first step {r['first_step_s']:.1f} s; frames compiled {r['frames_total']}, "
                f"{r['frames_after_warmup']} of them in the timed steps",
            )
        )
    return out


CHECKS = {
    "tests": check_cuda_tests,
    "staging": check_staging,
    "tiny": check_tiny_vl,
    "text": check_text,
    "patch_embed": check_patch_embed,
    "midsize": check_midsize,
}
"""``--only`` names, in the order they run."""


# ------------------------------------------------------------------------------ main
def _table(results: list[Result]) -> str:
    mark = {True: "ok", False: "FAIL", None: "--"}
    w = max(len(r.check) for r in results)
    lines = [f"{'check':<{w}}  {'':4}  result", f"{'-' * w}  ----  {'-' * 40}"]
    for r in results:
        lines.append(f"{r.check:<{w}}  {mark[r.ok]:4}  {r.value}")
        if r.note:
            lines.append(f"{'':<{w}}        ({r.note})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="GPU acceptance run: CUDA tests, staging, tiny Qwen3-VL (eager, compiled, "
        "attention backends), patch embedding, a mid-size flavor's step time / MFU / data wait / memory."
    )
    ap.add_argument("--quick", action="store_true", help="fewer steps (a smoke run)")
    ap.add_argument("--flavor", default="2B", help="mid-size flavor to time (default 2B)")
    ap.add_argument("--note", default="", help="a line for the RESULTS.md section (the host, ...)")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR,
                    help=f"where results.json and the work folder go (default {OUT_DIR})")  # fmt: skip
    ap.add_argument("--only", default="", help="comma-separated subset, run in the order "
                    "given: tests,staging,tiny,text,patch_embed,midsize")  # fmt: skip
    ns = ap.parse_args(argv)
    only = [c for c in ns.only.split(",") if c] or list(CHECKS)
    from torchtitan_ext.models.qwen3_vl.flavors import FLAVORS

    if set(only) - set(CHECKS) or ns.flavor not in FLAVORS:  # refused here too, not on the GPU
        bad = sorted(set(only) - set(CHECKS))
        ap.error(f"--only {bad}: expected some of {','.join(CHECKS)}" if bad else
                 f"--flavor {ns.flavor!r}: expected one of {', '.join(FLAVORS)}")  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; the GPU acceptance run needs one "
              "(nothing was run).")  # fmt: skip
        return 0
    print(f"gpu-check on {torch.cuda.get_device_name(0)} (torch {torch.__version__})", flush=True)
    checks = {**CHECKS, "midsize": lambda w, q: check_midsize(w, q, ns.flavor)}
    ns.out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_", dir=ns.out_dir))
    results: list[Result] = []
    import transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                            capture_output=True).stdout.strip() or "?"  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           text=True, capture_output=True).stdout.strip()  # fmt: skip
    head = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
            "commit": commit + (" + uncommitted changes" if dirty else ""),
            "command": "python scripts/gpu_check.py " + " ".join(argv or sys.argv[1:]),
            "note": ns.note}  # fmt: skip
    for name in only:
        t0 = time.perf_counter()
        print(f"==> {name} ...", flush=True)
        try:
            got = checks[name](work, ns.quick)
        except Exception as e:  # one check's crash is its row, the others still run
            got = [Result(name, False, f"{type(e).__name__}: {e}")]
        results.extend(got)
        print(_table(got), f"\n    ({time.perf_counter() - t0:.0f} s)", flush=True)
        # written after every check: a run stopped part-way keeps the rows it has
        doc = json.dumps({**head, "results": [asdict(r) for r in results]}, indent=2)
        (ns.out_dir / "results.json").write_text(doc)
        BENCH_RESULTS.mkdir(parents=True, exist_ok=True)  # its RESULTS.md section's source
        (BENCH_RESULTS / "gpu_check.json").write_text(doc)
    print("\n" + _table(results))
    print(f"\n(rows as JSON: {ns.out_dir / 'results.json'})")
    return 1 if any(r.ok is False for r in results) else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # one measurement, in its own process
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_check_workers import worker

        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
