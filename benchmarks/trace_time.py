"""Trace time of AdamW.step for N parameters on the CPU (issue: < 1 s for 1,000 params).

Usage: python benchmarks/trace_time.py [--sizes 10 100 1000] [--repeats 3]
    [--machine "CPU dev machine"]
Writes benchmarks/results/trace_time_cpu.md: median trace seconds, graph nodes and graph
inputs per size and foreach setting, and the median first call of a freshly compiled
optimizer (state init, trace, lowering, guard codegen and one run on the torch backend).
Sizes of 1,000 and more use at most 3 repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optcompile
import torch
from opttrace import trace_step

RESULTS = Path(__file__).parent / "results" / "trace_time_cpu.md"


def make_adamw(n: int, foreach: bool) -> torch.optim.AdamW:
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)


def time_first_call(n: int, foreach: bool, repeats: int) -> float:
    """Median seconds of the first ``step()`` of a freshly compiled optimizer."""
    times = []
    for _ in range(repeats):
        optcompile.reset()
        opt = optcompile.compile(make_adamw(n, foreach), backend="torch")
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_trace(n: int, foreach: bool, repeats: int) -> tuple[float, int, int]:
    """Median seconds of ``repeats`` traces, graph node count and graph input count."""
    opt = make_adamw(n, foreach)
    times, nodes, inputs = [], 0, 0
    for _ in range(repeats):
        start = time.perf_counter()
        traced = trace_step(opt)
        times.append(time.perf_counter() - start)
        nodes = len(traced.graph.nodes)
        inputs = len(traced.input_sources)
    return statistics.median(times), nodes, inputs


def source_revision() -> str:
    """The commit measured, and whether packages/ had uncommitted changes (or "unknown")."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "packages"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"
    if not head:
        return "unknown"
    return f"git {head}" + (" with uncommitted changes under packages/" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine", default="CPU dev machine", help="recorded in the file")
    args = parser.parse_args()
    load = os.getloadavg()[0]  # other jobs sharing the cores show up here
    revision = source_revision()
    time_trace(2, True, 1)  # warm-up: imports and first-use caches stay out of the numbers
    rows = []
    for n in args.sizes:
        for foreach in (True, False):
            repeats = min(args.repeats, 3) if n >= 1000 else args.repeats
            seconds, nodes, inputs = time_trace(n, foreach, repeats)
            first = time_first_call(n, foreach, repeats)
            rows.append(
                f"| {n} | {foreach} | {seconds:.3f} | {first:.3f} | {nodes} | {inputs} "
                f"| {repeats} |"
            )
            print(rows[-1], flush=True)
    python = os.path.relpath(sys.executable)
    if python.startswith(".."):  # an interpreter outside the repo: name it plainly
        python = "python"
    text = "\n".join(
        [
            "# Trace time: AdamW.step, 8x8 float32 params, CPU",
            "",
            f"Command: `{' '.join([python, 'benchmarks/trace_time.py', *sys.argv[1:]])}` "
            "(from the repo root)  ",
            f"Machine: {args.machine}; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
            f"1-min load average {load:.2f} at start  ",
            f"Versions: Python {platform.python_version()}, torch {torch.__version__}; "
            f"source {revision}  ",
            "Median over `repeats` traces of `opttrace.trace_step` (after one warm-up trace); "
            "graph inputs are tensors and symbolic float hyperparameters. "
            "Target: < 1 s at 1,000 params. First call: `step()` of a freshly compiled "
            "optimizer (state init, trace, lowering, guard codegen, one run; torch backend).",
            "",
            "| params | foreach | trace s | first call s | graph nodes | graph inputs | repeats |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
