"""Where the host time of one compiled step goes (200 tensors of 64x64, CUDA graphs on).

    python benchmarks/host_time.py [--set 200x64x64] [--optimizer AdamW] [--calls 1000]
                                   [--profile ROWS] [--slope] [--device cuda|cpu]

For optcompile with the defaults and with capturable=True, times (host microseconds per call,
mean over ``--calls`` after warm-up) the whole ``opt.step()`` and each part of it: the guard
check (the prologue's C++ fast tier), the fast gather of the inputs (timed alone: it reads
the grads itself where no check ran before it; a step's gather takes what its check read,
or with the grads handed to the plan by address reads none), the whole prologue (both, as a
step runs them), the plan's host preparation (scalars, host-side step counts, address-table
checks, staging copies), the whole hit (the cache lookup with its prologue, then prepare and
release: every host part before the replay, as a step runs them) and the graph replay (as a
step replays: the plan's buffers compared only when it replaced one,
``buffers_version``). A second table splits the step as it runs (its phases timed in
one loop with ``perf_counter_ns`` between them, each step's replay interleaved with the next
step's host work): the lookup with its prologue, prepare, the graph replay, the release with
the side effects' replay, and the glue (the whole ``opt.step()`` timed alone, less those
phases: the step's dispatch, the driver's lock). A part slower here than alone pays for
the interleaving (a copy queued behind a replay, cold caches). With
``--profile ROWS``, also a cProfile of ``--calls`` steps per variant, sorted by own time.
``fused=True`` (torch's fused kernel, same run) is timed as a whole step beside them. With
``--slope``, the whole step's host time at 200, 2,000 and 20,000 tensors of 4x4 and the
slope per 1,000 tensors (what each guarded tensor costs per call). Also printed: how many
host-to-device copies of the plans' staged values went through the CUDA driver, and how the
staging rounds checked the device (events queried, times a pool of pinned slots doubled; a
round never waits).

``--device cpu`` (``TRITON_INTERPRET=1``, no GPU): the same parts but the step and the graph
replay (the interpreted kernels take milliseconds, and there is no graph): every part the
host runs before the launch, measured where no GPU is at hand (the numbers in commit
messages); min over 5 rounds of ``--calls`` each, the machine being shared.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import step_time


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn: Callable[[], Any], calls: int, rounds: int = 1) -> float:
    for _ in range(10):
        fn()
    _sync()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
        _sync()
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="200x64x64")
    parser.add_argument("--optimizer", default="AdamW")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS")
    parser.add_argument("--slope", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    from optguard import native

    native.start(wait=True)  # the steady state (it builds in the background otherwise)
    if args.device == "cpu":
        _cpu_parts(args.set, args.optimizer, args.calls)
        return
    params = step_time.make_params(args.set, "cuda")
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.set} "
        f"{args.optimizer}; native checks: {native.status()}"
    )
    print(
        "| variant | step | guard check | fast gather | prologue | prepare | hit | graph replay |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    steps = {
        v: step_time.build(v, args.optimizer, params)
        for v in ["optcompile", "optcompile-capturable"]
    }
    for variant, step in steps.items():
        row = _row(step, args.calls)
        print(f"| {variant} | " + " | ".join(f"{v:.1f} µs" for v in row) + " |")
    print("\nThe step as it runs (its phases in one loop; see the module docstring):\n")
    print(
        "| variant | step | lookup + prologue | prepare | graph replay | release + effects | glue |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for variant, step in steps.items():
        row = _in_situ(step, args.calls)
        print(f"| {variant} | " + " | ".join(f"{v:.1f} µs" for v in row) + " |")
    copies = "; ".join(f"{v} {_driver_copies(step)}" for v, step in steps.items())
    waits = "; ".join(f"{v} {_staging_waits(step)}" for v, step in steps.items())
    fused = step_time.build("fused", args.optimizer, params)
    print(f"| fused=True | {_time(fused, args.calls):.1f} µs | | | | | | |")
    print(f"\nHost-to-device copies of the plans' staged values through the CUDA driver: {copies}")
    print(f"Staging rounds (none waits for the device): {waits}")
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


def _stagings(step: Callable[[], Any]) -> list[Any]:
    from optcompile.api import _OPTIMIZERS

    plan = _OPTIMIZERS[step.__self__].cache.entries[0].value.plan  # type: ignore[attr-defined]
    plan = getattr(plan, "plan", plan)  # (behind its CUDA graph on a GPU)
    return [plan.staging]  # (one for all its parts)


def _driver_copies(step: Callable[[], Any]) -> str:
    """How many of the plan's host-to-device copies went through the CUDA driver so far."""
    stagings = _stagings(step)
    return f"{sum(s.native_sends for s in stagings)} of {sum(s.sends for s in stagings)}"


def _staging_waits(step: Callable[[], Any]) -> str:
    """The plan's staging rounds so far: events queried (a round never waits; one query per
    event when the device keeps up) and the times its slot pool doubled (the device that far
    behind), against the rounds and the events recorded."""
    stagings = _stagings(step)
    rounds, queries = sum(s.round for s in stagings), sum(s.queries for s in stagings)
    events, grown = sum(s.events_recorded for s in stagings), sum(s.grown for s in stagings)
    return f"{queries} events queried, {grown} pool doublings in {rounds} rounds ({events} events)"


def _cpu_parts(set_name: str, optimizer: str, calls: int) -> None:
    """``--device cpu``: the host parts before the launch (see the module docstring)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the Triton backend's host side: set TRITON_INTERPRET=1")
    from optguard import native

    params = step_time.make_params(set_name, "cpu")
    print(f"CPU; torch {torch.__version__}; {set_name} {optimizer}; native: {native.status()}")
    print("| variant | guard check | fast gather | prologue | prepare | hit |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for variant in ["optcompile", "optcompile-capturable"]:
        row = _cpu_row(step_time.build(variant, optimizer, params), calls)
        print(f"| {variant} | " + " | ".join(f"{v:.1f} µs" for v in row) + " |")


def _whole_hit(step: Callable[[], Any], plan: Any) -> Callable[[], None]:
    """The host parts of a step before its replay: lookup (prologue), prepare, release."""
    from optcompile.api import _OPTIMIZERS

    compiled, L = _OPTIMIZERS[step.__self__], {"opt": step.__self__}  # type: ignore[attr-defined]

    def hit() -> None:
        entry, inputs = compiled.cache.find(L)
        plan.prepare(inputs)
        entry.prologue.release()

    return hit


def _hit(step: Callable[[], Any], warmup: int) -> tuple[dict[str, Any], Any, list[Any], int]:
    """After ``warmup`` steps: the step's locals, its first entry, the inputs one hit of the
    cache gathers (released again) and how many fast-tier hits that lookup made."""
    from optcompile.api import _OPTIMIZERS

    for _ in range(warmup):
        step()
    opt = step.__self__  # type: ignore[attr-defined]
    compiled, L = _OPTIMIZERS[opt], {"opt": opt}
    entry = compiled.cache.entries[0].value
    prologue = entry.prologue
    assert prologue.fast is not None and prologue.fast.gather is not None, prologue.fast_note
    hits = prologue.fast_hits
    found = compiled.cache.find(L)
    assert found is not None
    inputs = list(found[1])  # its list is reused and released by each step
    prologue.release()
    return L, entry, inputs, prologue.fast_hits - hits


def _cpu_row(step: Callable[[], Any], calls: int) -> list[float]:
    L, entry, inputs, _ = _hit(step, warmup=3)
    prologue, fast = entry.prologue, entry.prologue.fast
    gather = fast.gather
    plan = getattr(entry.plan, "plan", entry.plan)

    def prologue_alone() -> None:
        prologue(L)
        prologue.release()

    def gather_alone() -> None:
        gather(L)
        gather.release()

    return [
        _time(lambda: fast(L), calls, rounds=5),
        _time(gather_alone, calls, rounds=5),
        _time(prologue_alone, calls, rounds=5),
        _time(lambda: plan.prepare(inputs), calls, rounds=5),
        _time(_whole_hit(step, plan), calls, rounds=5),
    ]


def _in_situ(step: Callable[[], Any], calls: int) -> list[float]:
    """The step's phases as a step runs them, in one loop: the whole step (timed alone), the
    lookup with its prologue, prepare, the graph replay, the release with the side effects'
    replay, and the rest (the whole step less the four: the glue around them)."""
    from optcompile.api import _OPTIMIZERS

    opt = step.__self__  # type: ignore[attr-defined]
    compiled, L = _OPTIMIZERS[opt], {"opt": opt}
    graphed_plan = compiled.cache.entries[0].value.plan
    plan, graphed = graphed_plan.plan, graphed_plan.graphed
    buffers = plan.buffers()
    clock = time.perf_counter_ns
    spent = [0, 0, 0, 0]
    for n in (20, calls):  # (warm-up, then the timed calls)
        spent = [0, 0, 0, 0]
        for _ in range(n):
            t0 = clock()
            entry, inputs = compiled.cache.find(L)
            t1 = clock()
            plan.prepare(inputs)
            t2 = clock()
            graphed(buffers, same=plan.buffers_version is not None)
            t3 = clock()
            entry.prologue.release()
            entry.value.replay(L, ())
            t4 = clock()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[2] += t3 - t2
            spent[3] += t4 - t3
        _sync()
    parts = [s / calls / 1e3 for s in spent]
    whole = _time(step, calls)
    return [whole, *parts, whole - sum(parts)]


def _row(step: Callable[[], Any], calls: int) -> list[float]:
    L, entry, inputs, fast_hits = _hit(step, warmup=20)
    assert fast_hits == 1  # the fast tier answered
    prologue, fast = entry.prologue, entry.prologue.fast
    plan, graphed = entry.plan.plan, entry.plan.graphed
    buffers = plan.buffers()

    def prologue_alone() -> None:
        prologue(L)
        prologue.release()

    def replay() -> None:  # as a step replays (its buffers listed and compared once)
        graphed(buffers, same=plan.buffers_version is not None)

    return [
        _time(step, calls),
        _time(lambda: fast(L), calls),
        _time(lambda: fast.gather(L) if fast.gather is not None else None, calls),
        _time(prologue_alone, calls),
        _time(lambda: plan.prepare(inputs), calls),
        _time(_whole_hit(step, plan), calls),
        _time(replay, calls),
    ]


if __name__ == "__main__":
    main()
