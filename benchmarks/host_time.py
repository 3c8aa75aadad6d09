"""Where the host time of one compiled step goes (200 tensors of 64x64, CUDA graphs on).

    python benchmarks/host_time.py [--set 200x64x64] [--optimizer AdamW] [--calls 1000]
                                   [--profile ROWS] [--slope]

For optcompile with the defaults and with capturable=True, times (host microseconds per call,
mean over ``--calls`` after warm-up) the whole ``opt.step()`` and each part of it: the guard
check (the prologue's C++ fast tier), the fast gather of the inputs, the whole prologue (both,
as a step runs them), the plan's host preparation (scalars, host-side step counts,
address-table checks, staging copies) and the graph replay. With
``--profile ROWS``, also a cProfile of ``--calls`` steps per variant, sorted by own time.
``fused=True`` (torch's fused kernel, same run) is timed as a whole step beside them. With
``--slope``, the whole step's host time at 200, 2,000 and 20,000 tensors of 4x4 and the
slope per 1,000 tensors (what each guarded tensor costs per call).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import step_time


def _time(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="200x64x64")
    parser.add_argument("--optimizer", default="AdamW")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS")
    parser.add_argument("--slope", action="store_true")
    args = parser.parse_args()
    from optguard import native

    native.start(wait=True)  # the steady state (it builds in the background otherwise)
    params = step_time.make_params(args.set, "cuda")
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.set} "
        f"{args.optimizer}; native checks: {native.status()}"
    )
    print("| variant | step | guard check | fast gather | prologue | prepare | graph replay |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    steps = {
        v: step_time.build(v, args.optimizer, params)
        for v in ["optcompile", "optcompile-capturable"]
    }
    for variant, step in steps.items():
        row = _row(step, args.calls)
        print(f"| {variant} | " + " | ".join(f"{v:.1f} µs" for v in row) + " |")
    copies = "; ".join(f"{v} {_driver_copies(step)}" for v, step in steps.items())
    fused = step_time.build("fused", args.optimizer, params)
    print(f"| fused=True | {_time(fused, args.calls):.1f} µs | | | | | |")
    print(f"\nHost-to-device copies of the plans' staged values through the CUDA driver: {copies}")
    if args.slope:
        _slope(args.optimizer, args.calls)
    if args.profile:
        for variant, step in steps.items():
            _profile(variant, step, args.calls, args.profile)


def _slope(optimizer: str, calls: int) -> None:
    sizes = [200, 2000, 20000]
    print("\n| variant | " + " | ".join(f"{n} x 4x4" for n in sizes) + " | µs per 1,000 |")
    print("| --- | " + " | ".join("---:" for _ in sizes) + " | ---: |")
    for variant in ["optcompile", "optcompile-capturable", "fused"]:
        times = []
        for n in sizes:
            params = step_time.make_params(f"{n}x4x4", "cuda")
            step = step_time.build(variant, optimizer, params)
            for _ in range(20):
                step()
            times.append(_time(step, max(calls // (n // 200), 20)))
            del step, params
        slope = (times[-1] - times[0]) / ((sizes[-1] - sizes[0]) / 1000)
        cells = " | ".join(f"{t:.1f} µs" for t in times)
        print(f"| {variant} | {cells} | {slope:.1f} µs |")


def _profile(variant: str, step: Callable[[], Any], calls: int, rows: int) -> None:
    print(f"\n{variant}: cProfile of {calls} steps")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(rows)


def _driver_copies(step: Callable[[], Any]) -> str:
    """How many of the plan's host-to-device copies went through the CUDA driver so far."""
    from optcompile.api import _OPTIMIZERS

    plan = _OPTIMIZERS[step.__self__].cache.entries[0].value.plan.plan  # type: ignore[attr-defined]
    stagings = [part.staging for part in plan.parts]
    return f"{sum(s.native_sends for s in stagings)} of {sum(s.sends for s in stagings)}"


def _row(step: Callable[[], Any], calls: int) -> list[float]:
    from optcompile.api import _OPTIMIZERS

    for _ in range(20):
        step()
    opt = step.__self__  # type: ignore[attr-defined]
    compiled, L = _OPTIMIZERS[opt], {"opt": opt}
    entry = compiled.cache.entries[0].value
    prologue, fast = entry.prologue, entry.prologue.fast
    assert fast is not None and fast.gather is not None, prologue.fast_note
    hits = prologue.fast_hits
    found = compiled.cache.find(L)
    assert found is not None and prologue.fast_hits == hits + 1  # the fast tier answered
    inputs = list(found[1])  # its list is reused and released by each step
    prologue.release()
    plan, graphed = entry.plan.plan, entry.plan.graphed

    def prologue_alone() -> None:
        prologue(L)
        prologue.release()

    return [
        _time(step, calls),
        _time(lambda: fast(L), calls),
        _time(lambda: fast.gather(L) if fast.gather is not None else None, calls),
        _time(prologue_alone, calls),
        _time(lambda: plan.prepare(inputs), calls),
        _time(lambda: graphed(plan.buffers()), calls),
    ]


if __name__ == "__main__":
    main()
