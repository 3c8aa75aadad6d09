"""Why a compiled step's host time can exceed the sum of its parts: the launch queue.

    python benchmarks/host_queue.py [--set gpt2] [--variant optcompile-capturable]
                                    [--calls 1000] [--json PATH]

``host_time.py`` times ``opt.step()`` back to back with no synchronize: a step whose device
work (GPT-2's AdamW: ~1.2 ms) outlasts its host work (~25 µs) queues its graph replays
faster than the device runs them. This probe tells whether that queue is what the host
pays for (GPU only). For one variant it prints:

- ``step, back to back``: host µs per call over ``--calls`` calls without a synchronize
  (host_time.py's "step"), and the same at 10 and 100 calls;
- per-call host times of the back-to-back run at its start, middle and end (median of
  50 calls each) with the queue depth then: how many of the steps queued so far the device
  has not finished (one CUDA event per call, queried; a query does not wait);
- ``step, synchronized``: host µs of each call timed alone on an idle device
  (``synchronize()`` after each, outside the timed span);
- ``replay, back to back`` / ``replay, synchronized``: the CUDA graph replay alone
  (``graphed(buffers)``, as a step replays), both ways;
- ``device``: CUDA-event time per step (one step at a time);
- the same two ways for an empty CUDA graph (the launch floor of this host).

If ``step, back to back`` exceeds ``step, synchronized`` by about what the queue depth
predicts, the host time at GPT-2 is the launch queue blocking (``cudaGraphLaunch`` waits for
a free slot once ~1,000 launches are pending), not the host parts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import step_time
from host_time import _hit


def _back_to_back(fn: Callable[[], Any], calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    per_call = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return per_call


def _synchronized(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _traced_run(fn: Callable[[], Any], calls: int) -> list[tuple[float, int]]:
    """Per call of a back-to-back run: its host µs and the queue depth after it (steps
    queued and not yet done by the device, found by querying one event per call)."""
    torch.cuda.synchronize()
    events = [torch.cuda.Event() for _ in range(calls)]
    done = 0
    out = []
    for i in range(calls):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        events[i].record()
        while done <= i and events[done].query():
            done += 1
        out.append((elapsed * 1e6, i + 1 - done))
    torch.cuda.synchronize()
    return out


def _device(fn: Callable[[], Any], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _empty_graph() -> Callable[[], Any]:
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)  # (warm-up outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="gpt2")
    parser.add_argument("--optimizer", default="AdamW")
    parser.add_argument("--variant", default="optcompile-capturable")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from optguard import native

    native.start(wait=True)
    params = step_time.make_params(args.set, "cuda")
    step = step_time.build(args.variant, args.optimizer, params)
    _, entry, _, _ = _hit(step, warmup=20)
    plan, graphed = entry.plan.plan, entry.plan.graphed
    buffers = plan.buffers()

    def replay() -> None:
        graphed(buffers, same=plan.buffers_version is not None)

    empty = _empty_graph()
    rows: dict[str, float] = {}
    for calls in (10, 100, args.calls):
        rows[f"step, back to back, {calls} calls"] = _back_to_back(step, calls)
    rows["step, synchronized"] = _synchronized(step, 200)
    rows[f"replay, back to back, {args.calls} calls"] = _back_to_back(replay, args.calls)
    rows["replay, synchronized"] = _synchronized(replay, 200)
    rows["device per step"] = _device(step, 50)
    rows[f"empty graph, back to back, {args.calls} calls"] = _back_to_back(empty, args.calls)
    rows["empty graph, synchronized"] = _synchronized(empty, 200)
    trace = _traced_run(step, args.calls)
    n = len(trace)
    windows = {"start": trace[:50], "middle": trace[n // 2 : n // 2 + 50], "end": trace[-50:]}
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.set} "
        f"{args.optimizer} {args.variant}; native checks: {native.status()}"
    )
    print("| what | host µs per call |\n| --- | ---: |")
    for what, us in rows.items():
        print(f"| {what} | {us:.1f} |")
    print("\n| back-to-back run, calls | median host µs | queue depth (steps) |")
    print("| --- | ---: | ---: |")
    for where, part in windows.items():
        us = statistics.median(t for t, _ in part)
        depth = statistics.median(d for _, d in part)
        print(f"| {where} | {us:.1f} | {depth:.0f} |")
    if args.json is not None:
        out = {"rows": rows, "trace": trace, "variant": args.variant, "set": args.set}
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
