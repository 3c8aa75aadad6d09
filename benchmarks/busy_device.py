"""Host time of single CUDA calls and of whole compiled steps with the device idle and busy.

    python benchmarks/busy_device.py

A call whose host time grows while the device has work queued ahead waits on the device (or
pays for being that far ahead). Each row: the median host time of 300 calls after 20 warm-up
calls, first with the device idle, then with ~400 ms of device work (``torch.cuda._sleep``,
calibrated with CUDA events) queued ahead of them; "device still busy after" says whether
that work was still running when the 300 calls returned (if not, the calls waited for it or
outlasted it). The steps: 200 x 64x64 AdamW (lr 1e-3, weight_decay 0.01), optcompile with
the defaults (CPU step counts: each step stages host values through pinned memory) and with
capturable=True, and fused=True, as ``step_time.build`` makes them.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import step_time


def _cycles_per_ms() -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(10_000_000 / start.elapsed_time(end))


def _median_us(fn: Callable[[], Any], calls: int, busy_cycles: int) -> tuple[float, bool]:
    torch.cuda.synchronize()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    if busy_cycles:
        torch.cuda._sleep(busy_cycles)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    still_busy = bool(busy_cycles) and not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3, still_busy


def _row(name: str, fn: Callable[[], Any], busy_cycles: int, calls: int = 300) -> None:
    idle, _ = _median_us(fn, calls, 0)
    busy, still_busy = _median_us(fn, calls, busy_cycles)
    print(
        f"| {name} | {idle:.1f} | {busy:.1f} | {busy / idle:.2f}x | "
        f"{'yes' if still_busy else 'no'} |",
        flush=True,
    )


def main() -> None:
    import triton

    busy_cycles = 400 * _cycles_per_ms()
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}"
        f", Python {sys.version.split()[0]}; {len(os.sched_getaffinity(0))} CPUs"
    )
    print("| call | idle µs | busy µs | ratio | device still busy after |")
    print("| --- | ---: | ---: | ---: | --- |")
    x = torch.zeros(1, device="cuda")
    _row("kernel launch (x.add_(1))", lambda: x.add_(1), busy_cycles)
    pinned, dst = torch.zeros(1024, pin_memory=True), torch.zeros(1024, device="cuda")
    _row(
        "4 KiB pinned copy_, non_blocking",
        lambda: dst.copy_(pinned, non_blocking=True),
        busy_cycles,
    )
    event = torch.cuda.Event()
    _row("event record", lambda: event.record(), busy_cycles)
    _row("event query", lambda: event.query(), busy_cycles)
    _row("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(), busy_cycles)
    tensors = [torch.zeros(64, 64, device="cuda") for _ in range(200)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch._foreach_add_(tensors, 1.0)  # (warm-up outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch._foreach_add_(tensors, 1.0)
    _row("graph replay (one foreach add over 200 tensors)", graph.replay, busy_cycles)
    _row("pure Python (sum of 2,000 squares)", lambda: sum(i * i for i in range(2000)), busy_cycles)
    for variant in ["optcompile", "optcompile-capturable", "fused"]:
        params = step_time.make_params("200x64x64", "cuda")
        step = step_time.build(variant, "AdamW", params)
        for _ in range(30):
            step()
        _row(f"{variant} step, 200 x 64x64 AdamW", step, busy_cycles)
        del step, params


if __name__ == "__main__":
    main()
