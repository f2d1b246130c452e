"""AsyncDeviceLoader: per-batch overhead vs direct iteration, load/step overlap, H2D bytes uint8 vs float32, GPU step time vs resident data.

Cases (each baseline measured in the same run):

* overhead: an in-memory loader of torchtitan-like batches (B=8, T=2048: input, positions,
  labels) and of VL-like batches (8192 tokens + 4096 uint8 patch rows of 768), iterated directly
  vs through ``AsyncDeviceLoader(device="cpu")`` by a consumer that steps 2 ms between batches;
  the difference in time spent inside ``next()`` per batch is the wrapper's cost to the training
  loop (hand-off, state snapshot of a stateful loader). A drain with no step is reported as
  info: it measures the producer's refill sleep instead (``_overhead_rows``).
* overlap: a loader that waits 3 ms per batch (I/O-like, releases the GIL) and a consumer step of
  3 ms: direct iteration pays both, the wrapper hides the load.
* snapshot: cost of one ``state_dict()`` + deepcopy for an int-counter loader and for torchdata's
  ``StatefulDataLoader`` (what torchtitan wraps), i.e. the per-batch cost of exact resume.
* H2D bytes per VL batch: uint8 [N, 768] pixels vs the float32 [N, 1536] the processor emits
  (computed from tensor sizes; no GPU needed).
* GPU (CUDA only, else "skipped: no CUDA"): step time of a small LM-like step fed by the wrapper
  vs the same step on batches already resident on the device (target <= 1.02x).

Options (``--set key=value``): ``batches`` per timed pass (default 200; quick 20).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import BenchArgs, Row, call, compare, interleave, row_from
from torchtitan_ext.device.normalize import normalize_pixels
from torchtitan_ext.device.staging import AsyncDeviceLoader

B, T = 8, 2048
VL_TOKENS, VL_PATCHES = 8192, 4096


def text_batch(i: int, b: int = B, t: int = T) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 32000, (b, t), generator=g)
    return {"input": x, "positions": torch.arange(t).repeat(b, 1)}, torch.roll(x, -1, 1)


def vl_batch(
    i: int, tokens: int = VL_TOKENS, patches: int = VL_PATCHES, uint8: bool = True
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 32000, (1, tokens), generator=g)
    px = torch.randint(0, 256, (patches, 768), dtype=torch.uint8, generator=g)
    if not uint8:
        px = normalize_pixels(px)  # what the HF processor hands over: float32 [N, 1536]
    d = {
        "input": x,
        "positions": torch.arange(tokens).view(1, -1),
        "pixel_values": px,
        "grid_thw": torch.tensor([[1, 64, 64]] * (patches // 4096 or 1)),
    }
    return d, torch.roll(x, -1, 1)


class ListLoader:
    """In-memory stateful loader (state = next index): isolates the wrapper's own cost."""

    def __init__(self, batches: list) -> None:
        self.batches, self.i = batches, 0

    def __iter__(self):
        self.i = 0
        return self

    def __next__(self):
        if self.i >= len(self.batches):
            raise StopIteration
        self.i += 1
        return self.batches[self.i - 1]

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.i = sd["i"]


class SleepLoader(ListLoader):
    def __init__(self, batches: list, load_s: float) -> None:
        super().__init__(batches)
        self.load_s = load_s

    def __next__(self):
        time.sleep(self.load_s)  # I/O-like: releases the GIL
        return super().__next__()


def _drain(it) -> int:
    n = 0
    for _ in it:
        n += 1
    return n


STEP_S = 0.002
"""The consumer's stand-in for a training step in the overhead rows (a sleep: like a GPU step,
it leaves the CPU and the GIL to the loader's thread)."""


def _in_next(it, step_s: float) -> float:
    """Seconds spent inside ``next()`` over one pass, a ``step_s`` step after each batch."""
    it = iter(it)
    spent = 0.0
    while True:
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            return spent
        spent += time.perf_counter() - t0
        time.sleep(step_s)


def _overhead_rows(args: BenchArgs, name: str, batches: list, rows: list[Row]) -> None:
    """The wrapper's cost to the training loop: time inside ``next()`` per batch under a consumer
    that steps (``STEP_S``) between batches, wrapped minus direct. A drain with no step at all is
    reported too (info only): there the consumer empties the queue at once and then waits for the
    producer, which refills a full queue after a timed sleep (>= 0.5 ms, ``pipeline/handoff.py``:
    the training loop never wakes it), so that row shows the refill sleep, not a cost a loop
    with a step pays."""
    n = len(batches)
    loader = ListLoader(batches)
    w = AsyncDeviceLoader(loader, "cpu", num_buffers=2)
    w2 = AsyncDeviceLoader(loader, "cpu", num_buffers=2, snapshot_state=False)
    w3 = AsyncDeviceLoader(loader, "cpu", num_buffers=2, mode="staged", device_buffers="pool")
    stepping = {f"step_{k}": (lambda it=it: _in_next(it, STEP_S))
                for k, it in (("direct", loader), ("wrapped", w), ("nosnap", w2))}  # fmt: skip
    t = interleave(stepping, args.repeats, args.warmup, args.guard())
    drain = {k: call(_drain, it) for k, it in
             (("direct", loader), ("wrapped", w), ("staged", w3))}  # fmt: skip
    d = interleave(drain, args.repeats, args.warmup, args.guard())
    for x in (w, w2, w3):
        x.close()
    us = 1e6 / n
    g = f"overhead {name}"
    step = f"{STEP_S * 1e3:.0f} ms step"
    rows.append(row_from(f"{name}: in next(), direct iteration, {step}", t["step_direct"],
                         "us/batch", us, group=g))  # fmt: skip
    rows.append(row_from(f"{name}: in next(), AsyncDeviceLoader(cpu), {step}", t["step_wrapped"],
                         "us/batch", us, group=g))  # fmt: skip
    paired = [(a - b) * us for a, b in
              zip(t["step_wrapped"].samples, t["step_direct"].samples, strict=True)]  # fmt: skip
    ovh = statistics.median(paired)
    rows.append(Row(f"{name}: wrapper overhead", ovh, "us/batch", higher_is_better=False,
                    samples=paired, target="<= 200 us", met=ovh <= 200,
                    note=f"per round: time in next() wrapped minus direct, a {step} between "
                         "batches; target chosen here: <= 0.2% of a 100 ms training step"))  # fmt: skip
    nosnap = [(a - b) * us for a, b in
              zip(t["step_nosnap"].samples, t["step_direct"].samples, strict=True)]  # fmt: skip
    rows.append(Row(f"{name}: overhead without snapshots", statistics.median(nosnap), "us/batch",
                    higher_is_better=False, samples=nosnap))  # fmt: skip
    rows.append(row_from(f"{name}: drain with no step, direct", d["direct"], "us/batch", us,
                         group=g))  # fmt: skip
    rows.append(row_from(f"{name}: drain with no step, AsyncDeviceLoader(cpu)", d["wrapped"],
                         "us/batch", us, group=g,
                         note="the producer's refill sleep (>= 0.5 ms per refill of a full "
                              "queue), which a loop with a step never waits for"))  # fmt: skip
    rows.append(row_from(f"{name}: drain with no step, mode=staged (CPU copies)", d["staged"],
                         "us/batch", us, group=g,
                         note="copies every tensor into pooled buffers; exercises the CUDA "
                              "path's logic"))  # fmt: skip


def _overlap_rows(args: BenchArgs, n: int, rows: list[Row]) -> None:
    load_s = step_s = 0.003
    batches = [text_batch(i, 1, 16) for i in range(n)]
    loader = SleepLoader(batches, load_s)

    def consume(it) -> None:
        for _ in it:
            time.sleep(step_s)  # the "training step"

    w = AsyncDeviceLoader(loader, "cpu", num_buffers=2)
    t = interleave({"direct": lambda: consume(loader), "wrapped": lambda: consume(w)},
                   args.repeats, args.warmup, args.guard())  # fmt: skip
    w.close()
    ms = 1e3 / n
    base = "overlap: direct (3 ms load + 3 ms step)"
    rows.append(row_from(base, t["direct"], "ms/step", ms, group="overlap"))
    rows.append(
        row_from("overlap: AsyncDeviceLoader", t["wrapped"], "ms/step", ms, group="overlap")
    )
    r = compare(rows, "overlap: AsyncDeviceLoader", base)
    r.target, r.met = ">= 1.7x", r.ratio is not None and r.ratio >= 1.7


def _snapshot_rows(args: BenchArgs, rows: list[Row]) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    reps = 20 if args.quick else 2000
    counter = ListLoader([0])
    ds = list(range(10_000))
    sdl = StatefulDataLoader(ds, batch_size=8, num_workers=0)
    it = iter(sdl)
    for _ in range(10):
        next(it)
    objs = {"int counter": counter, "torchdata StatefulDataLoader(workers=0)": sdl}

    def snap(obj) -> Callable[[], None]:
        def go() -> None:
            for _ in range(reps):
                copy.deepcopy(obj.state_dict())

        return go

    t = interleave({k: snap(o) for k, o in objs.items()}, args.repeats, args.warmup, args.guard())
    for name in objs:
        rows.append(row_from(f"snapshot: {name}", t[name], "us/batch", 1e6 / reps, group="snap"))


def _bytes_rows(rows: list[Row]) -> None:
    def nbytes(batch) -> int:
        d, lab = batch
        return lab.numel() * lab.element_size() + sum(
            v.numel() * v.element_size() for v in d.values()
        )

    u8 = nbytes(vl_batch(0, uint8=True)) / 2**20
    f32 = nbytes(vl_batch(0, uint8=False)) / 2**20
    info = {"tokens": VL_TOKENS, "patch_rows": VL_PATCHES}
    rows.append(
        Row(
            "H2D bytes/VL batch: float32 [N,1536] pixels",
            f32,
            "MiB",
            higher_is_better=False,
            info=info,
        )
    )
    rows.append(
        Row(
            "H2D bytes/VL batch: uint8 [N,768] pixels", u8, "MiB", higher_is_better=False, info=info
        )
    )
    compare(rows, "H2D bytes/VL batch: uint8 [N,768] pixels", rows[-2].case)


def _gpu_rows(args: BenchArgs, n: int, rows: list[Row]) -> None:
    target = "<= 1.02x"
    if not torch.cuda.is_available():
        for what in ("text", "VL"):
            rows.append(
                Row(
                    f"GPU step time {what}: staged / resident",
                    float("nan"),
                    "x",
                    higher_is_better=False,
                    target=target,
                    info={"skipped": "no CUDA"},
                    note="not measured: no CUDA device on this machine",
                )
            )
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    d_model, vocab = 1024, 8192
    emb = torch.nn.Embedding(32000, d_model).to(dev)
    pix = torch.nn.Linear(1536, d_model).to(dev)
    body = torch.nn.Sequential(
        *[
            m
            for _ in range(6)
            for m in (
                torch.nn.Linear(d_model, 4 * d_model),
                torch.nn.GELU(),
                torch.nn.Linear(4 * d_model, d_model),
            )
        ]
    ).to(dev)
    head = torch.nn.Linear(d_model, vocab).to(dev)
    params = [*emb.parameters(), *pix.parameters(), *body.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step(batch) -> None:
        d, lab = batch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = emb(d["input"])
            if "pixel_values" in d:
                h = h + pix(d["pixel_values"]).mean(0)
            logits = head(body(h)).float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), (lab % vocab).view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cases = {
        "text": [text_batch(i) for i in range(n)],
        "VL": [vl_batch(i, tokens=4096, patches=4096) for i in range(n)],
    }
    for what, batches in cases.items():
        norm = what == "VL"

        def resident_batches(batches=batches, norm=norm):
            out = []
            for d, lab in batches:
                dd = {k: v.to(dev) for k, v in d.items()}
                if norm:
                    dd["pixel_values"] = normalize_pixels(dd["pixel_values"])
                out.append((dd, lab.to(dev)))
            return out

        res = resident_batches()

        def run_resident(res=res) -> None:
            for b in res:
                step(b)
            torch.cuda.synchronize()

        w = AsyncDeviceLoader(ListLoader(batches), dev, num_buffers=2, normalize=norm)

        def run_staged(w=w) -> None:
            for b in w:
                step(b)
            torch.cuda.synchronize()

        def run_naive(batches=batches, norm=norm) -> None:  # torchtitan 0.3.0: plain .to()
            for d, lab in batches:
                dd = {k: v.to(dev) for k, v in d.items()}
                if norm:
                    dd["pixel_values"] = normalize_pixels(dd["pixel_values"])
                step((dd, lab.to(dev)))
            torch.cuda.synchronize()

        t = interleave({"resident": run_resident, "staged": run_staged, "naive": run_naive},
                       args.repeats, args.warmup, args.guard())  # fmt: skip
        w.close()
        ms = 1e3 / n
        g = f"gpu {what}"
        rows.append(row_from(f"GPU {what}: resident data", t["resident"], "ms/step", ms, group=g))
        rows.append(row_from(f"GPU {what}: naive .to(device)", t["naive"], "ms/step", ms, group=g))
        compare(rows, f"GPU {what}: naive .to(device)", f"GPU {what}: resident data")
        rows.append(row_from(f"GPU {what}: AsyncDeviceLoader", t["staged"], "ms/step", ms,
                             group=g))  # fmt: skip
        compare(rows, f"GPU {what}: AsyncDeviceLoader", f"GPU {what}: resident data")
        tr = statistics.median(t["resident"].samples)
        ts = statistics.median(t["staged"].samples)
        ratio = ts / tr
        rows.append(
            Row(
                f"GPU step time {what}: staged / resident",
                ratio,
                "x",
                higher_is_better=False,
                target=target,
                met=ratio <= 1.02,
                info={"device": torch.cuda.get_device_name(dev)},
            )
        )


def run(args: BenchArgs) -> list[Row]:
    n = int(args.extra.get("batches", 20 if args.quick else 200))
    rows: list[Row] = []
    _overhead_rows(
        args,
        "text B=8 T=2048",
        [text_batch(i) for i in range(min(n, 50))] * (n // min(n, 50)),
        rows,
    )
    nvl = max(4, n // 4)
    vl = [vl_batch(i) for i in range(min(nvl, 16))]
    _overhead_rows(args, "VL 8k tok + 4k uint8 rows", vl * (nvl // len(vl)), rows)
    out = torch.empty(VL_PATCHES, 1536)
    px = vl[0][0]["pixel_values"]
    t = interleave({"new": call(normalize_pixels, px), "out": call(normalize_pixels, px, out=out)},
                   args.repeats, 1, args.guard())  # fmt: skip
    rows.append(row_from("normalize_pixels CPU 4096x768 -> new tensor", t["new"], "ms/batch",
                         1e3, group="norm"))  # fmt: skip
    rows.append(row_from("normalize_pixels CPU 4096x768 -> out= buffer", t["out"], "ms/batch",
                         1e3, group="norm",
                         note="difference to the row above: page faults of a fresh 24 MiB "
                              "output"))  # fmt: skip
    _overlap_rows(args, max(10, n // 4), rows)
    _snapshot_rows(args, rows)
    _bytes_rows(rows)
    _gpu_rows(args, 10 if args.quick else 50, rows)
    return rows
