"""Host cost of a compiled AdamW call over GPT-2 124M's 148 parameter tensors.

Usage: python benchmarks/guard_check.py [--device cpu|cuda] [--repeats 2000] [--torch-compile]
Writes benchmarks/results/guard_check_<device>.md.

Measured, median over ``repeats`` calls after warm-up:
- check: what every compiled call runs first (the fast tier; goal < 30 us on the CPU dev
  machine), and the full generated Python check it replaces on a hit;
- gather: fetching the graph's inputs;
- compiled call: host time of ``opt.step()`` (guards, gather, the torch backend's launches,
  replay); on CUDA the device is synchronized before each call and not after, so this is
  the time until the call returns with its work queued;
- anchors in the same process: eager foreach, ``fused=True`` (CUDA), and with
  ``--torch-compile`` ``torch.compile(opt.step)`` (its compile takes about a minute).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optcompile
import torch
from optcompile.api import _OPTIMIZERS

RESULTS = Path(__file__).parent / "results"


def gpt2_shapes() -> list[tuple[int, ...]]:
    """The 148 parameter tensors of GPT-2 124M (tied embeddings counted once)."""
    shapes: list[tuple[int, ...]] = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
        shapes += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    return [*shapes, (768,), (768,)]


def make_params(device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in gpt2_shapes():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return params


def median_us(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--torch-compile", action="store_true")
    args = parser.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # Whole steps are slower: fewer of them (on the CPU they are the arithmetic itself).
    steps = max(args.repeats // 10, 20) if device.startswith("cuda") else 5

    params = make_params(device)
    opt = optcompile.compile(torch.optim.AdamW(params, lr=1e-3, foreach=True), backend="torch")
    opt.step()
    opt.step()  # the first hit arms the fast tier
    compiled = _OPTIMIZERS[opt]
    entry = compiled.cache.entries[0]
    L = {"opt": opt}
    prologue = entry.prologue
    fast = prologue.fast
    assert prologue(L) is not None and fast is not None, prologue.fast_note
    prologue.release()
    rows = [
        ("check (fast tier, every call)", median_us(lambda: fast(L), args.repeats, sync)),
        (
            "full generated check (replaced on a hit)",
            median_us(lambda: prologue.check(L), 200, sync),
        ),
        ("gather inputs", median_us(lambda: entry.value.gather(L), args.repeats, sync)),
        ("compiled opt.step() host time (torch backend)", median_us(opt.step, steps, sync)),
    ]
    assert compiled.stats.traces == 1, compiled.stats.retrace_reasons

    eager = torch.optim.AdamW(make_params(device), lr=1e-3, foreach=True)
    rows.append(("eager foreach opt.step() host time", median_us(eager.step, steps, sync)))
    if device.startswith("cuda"):
        fused = torch.optim.AdamW(make_params(device), lr=1e-3, fused=True)
        rows.append(("fused=True opt.step() host time", median_us(fused.step, steps, sync)))
    if args.torch_compile:
        inductor = torch.optim.AdamW(make_params(device), lr=1e-3, foreach=True)
        step = torch.compile(inductor.step)
        start = time.perf_counter()
        step()
        sync()
        compile_s = time.perf_counter() - start
        rows.append(("torch.compile(opt.step) host time", median_us(step, steps, sync)))
        rows.append(("torch.compile first call (compile) s", compile_s * 1e6))

    for name, value in rows:
        print(f"{name:50s} {value:12.1f} us", flush=True)
    write(args, device, rows)


def write(args: argparse.Namespace, device: str, rows: list[tuple[str, float]]) -> None:
    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.machine()
    lines = [
        f"# Host cost of a compiled AdamW call, GPT-2 124M shapes (148 tensors), {device}",
        "",
        f"Command: `{' '.join(['python benchmarks/guard_check.py', *sys.argv[1:]])}` (repo root)  ",
        f"Device: {name}; {os.cpu_count()} CPU cores; load {os.getloadavg()[0]:.2f} at end  ",
        f"Versions: Python {platform.python_version()}, torch {torch.__version__}  ",
        "Medians after warm-up; on CUDA the device is synchronized before each timed call. "
        "On the CPU a whole step is the arithmetic itself (5 steps timed), not host overhead.",
        "Goal for the check: < 30 us on the CPU dev machine.",
        "",
        "| what | median |",
        "| --- | --- |",
    ]
    for what, value in rows:
        shown = f"{value / 1e6:.1f} s" if what.endswith(" s") else f"{value:.1f} us"
        lines.append(f"| {what.removesuffix(' s')} | {shown} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"guard_check_{device.split(':')[0]}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
