"""Trace time of AdamW.step for N parameters on the CPU (issue: < 1 s for 1,000 params).

Usage: python benchmarks/trace_time.py [--sizes 10 100 1000] [--repeats 3]
Writes benchmarks/results/trace_time_cpu.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from opttrace import trace_step

RESULTS = Path(__file__).parent / "results" / "trace_time_cpu.md"


def time_trace(n: int, foreach: bool, repeats: int) -> tuple[float, int]:
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    times, nodes = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        traced = trace_step(opt)
        times.append(time.perf_counter() - start)
        nodes = len(traced.graph.nodes)
    return statistics.median(times), nodes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    time_trace(2, True, 1)  # warm-up: imports and first-use caches stay out of the numbers
    rows = []
    for n in args.sizes:
        for foreach in (True, False):
            repeats = 1 if n >= 1000 else args.repeats
            seconds, nodes = time_trace(n, foreach, repeats)
            rows.append(f"| {n} | {foreach} | {seconds:.3f} | {nodes} | {repeats} |")
            print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Trace time: AdamW.step, 8x8 float32 params, CPU",
            "",
            f"Command: `{' '.join(['python', 'benchmarks/trace_time.py', *sys.argv[1:]])}`  ",
            f"Machine: {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads; Python {platform.python_version()}, "
            f"torch {torch.__version__}  ",
            "Median over `repeats` traces (after one warm-up trace). Target: < 1 s at 1,000.",
            "",
            "| params | foreach | trace s | graph nodes | repeats |",
            "| --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
