"""The child process of benchmarks/first_call.py (see its docstring): one case's first
and second step, timed by phase (the phases, the timer that patches the functions each
phase runs, the garbage collector's share), and the case's params and optimizer.
"""

from __future__ import annotations

import cProfile
import functools
import gc
import io
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PHASES = [
    "state init",
    "trace",
    "audit",
    "guards",
    "families",
    "kernel source",
    "C compile",
    "Triton compile",
    "Triton wait",
    "graph capture",
    "replay codegen",
    "run",
]


# -- the child: one case, timed ------------------------------------------------------------


def _cpu() -> float:
    """CPU seconds of this process (all threads) and of the children it waited for (the C
    compiler, ptxas)."""
    children = os.times()  # (in clock ticks: fine for compilers, too coarse for the rest)
    return time.process_time() + children.children_user + children.children_system


class Timer:
    """Exclusive seconds per phase, wall and process CPU: time spent in a nested timed
    function is its own."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self._stack: list[list[Any]] = []  # [phase, start, cpu start, nested, nested cpu]
        self.active = True  # (off: the patched functions run untimed, e.g. between first calls)

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            self._stack.append([phase, time.perf_counter(), _cpu(), 0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                _, start, cpu_start, nested, nested_cpu = self._stack.pop()
                spent = time.perf_counter() - start
                spent_cpu = _cpu() - cpu_start
                self.seconds[phase] += spent - nested
                self.cpu[phase] += spent_cpu - nested_cpu
                if self._stack:
                    self._stack[-1][3] += spent
                    self._stack[-1][4] += spent_cpu

        return timed

    def patch(self, owner: Any, name: str, phase: str) -> None:
        """Time ``owner.name`` everywhere it is reachable: on ``owner`` and in every loaded
        module that imported it by name."""
        original = getattr(owner, name)
        timed = self.wrap(original, phase)
        setattr(owner, name, timed)
        for module in list(sys.modules.values()):
            if module is not owner and getattr(module, name, None) is original:
                setattr(module, name, timed)


class GcClock:
    """CPU seconds spent in the cyclic garbage collector's collections (a part of whatever
    phase they interrupt), and how many collections of the oldest generation ran."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._start = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.process_time()
            return
        self.seconds += time.process_time() - self._start
        self.full += info["generation"] == 2

    def read(self) -> tuple[float, int]:
        """(seconds, full collections) since the last read."""
        out = (self.seconds, self.full)
        self.seconds, self.full = 0.0, 0
        return out


def _patch_phases(timer: Timer) -> None:
    import optcompile.driver
    import optguard.prologue
    import optkernels.c_kernel
    import optkernels.families
    import optkernels.foreach_kernel
    import optkernels.lanes
    import optsidefx
    import optsidefx.replay
    import opttrace.audit
    import opttrace.optimizer
    import opttrace.tracer

    timer.patch(opttrace.optimizer, "init_state", "state init")
    timer.patch(opttrace.tracer, "_record", "trace")
    for name in ("user_functions", "snapshot", "constant_globals", "check_and_restore"):
        timer.patch(opttrace.audit, name, "audit")
    timer.patch(optguard.prologue.Prologue, "__init__", "guards")
    timer.patch(optguard.prologue.Prologue, "arm", "guards")
    timer.patch(optkernels.lanes, "analyze_parts", "families")
    timer.patch(optkernels.families, "families", "families")
    timer.patch(optkernels.foreach_kernel, "kernel_source", "kernel source")
    timer.patch(optkernels.c_kernel, "kernel_source", "kernel source")
    timer.patch(optkernels.c_kernel, "build", "C compile")
    timer.patch(optsidefx.replay, "generate_replay", "replay codegen")
    timer.patch(optcompile.driver.CompiledEntry, "run", "run")
    try:
        import optcudagraph.tree
        import optkernels._triton_compat.prefetch
    except ImportError:
        return
    timer.patch(optkernels._triton_compat.Kernel, "_first", "Triton compile")
    timer.patch(optkernels._triton_compat.prefetch, "_await_runtime", "Triton wait")
    timer.patch(optkernels._triton_compat.prefetch, "_await_driver", "Triton wait")
    timer.patch(optkernels._triton_compat.prefetch, "_await_triton_key", "Triton wait")
    timer.patch(optcudagraph.tree.Graphed, "_record", "graph capture")


def _params(case: str, device: str) -> tuple[list[Any], str]:
    import torch

    if case.startswith("gpt2"):
        sys.path.insert(0, str(HERE))
        import gpt

        model = gpt.build("gpt2", device)
        params = [p for p in model.parameters() if p.requires_grad]
        del model
    else:
        n = int(case.split("-")[1])
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 4, device=device)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params, case.split("-", 2)[-1] if case.startswith("tiny") else case.split("-", 1)[1]


def _optimizer(kind: str, params: list[Any]) -> Any:
    import torch

    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    if kind == "adam-foreach":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    if kind == "adam-forloop":
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    loops = {"radam": torch.optim.RAdam, "rprop": torch.optim.Rprop, "asgd": torch.optim.ASGD}
    if kind in loops:  # (torch's defaults: the for-loop on the CPU)
        return loops[kind](params, lr=1e-3)
    raise SystemExit(f"unknown optimizer {kind!r}")


def _record_background() -> dict[str, list[float]]:
    """Wall-clock spans of optkernels' background threads (started by ``compile()``), as
    perf_counter values by thread name; to be called before the optimizer is compiled."""
    spans: dict[str, list[float]] = {}
    try:
        from optkernels._triton_compat import prefetch
    except ImportError:
        return spans
    quietly = prefetch._quietly

    def timed(fn: Callable[[], Any]) -> None:
        import threading

        span = spans[threading.current_thread().name] = [time.perf_counter(), float("nan")]
        try:
            quietly(fn)
        finally:
            span[1] = time.perf_counter()

    prefetch._quietly = timed  # type: ignore[assignment]
    return spans


def _settle() -> float:
    """Wait for optkernels' background threads (started by ``compile()``); seconds waited."""
    start = time.perf_counter()
    try:
        from optkernels._triton_compat import prefetch
    except ImportError:
        return 0.0
    prefetch._await_runtime()
    prefetch._await_triton_key()
    return time.perf_counter() - start


def run_case(
    case: str, device: str, profile: str | None = None, settle: bool = False
) -> dict[str, Any]:
    """Time the first and second step of ``case`` in this (fresh) process; ``profile``: a
    file to write the first step's cProfile statistics to (main thread: the background
    threads are waited for first, since from Python 3.12 on cProfile, built on
    sys.monitoring, records every thread's calls); ``settle``: wait for them before the
    step (as a script's forward and backward would, between ``compile()`` and its step)."""
    import optcompile
    import torch

    params, kind = _params(case, device)
    background = _record_background()
    opt = optcompile.compile(_optimizer(kind, params))
    settled = _settle() if settle or profile else None
    timer = Timer()
    _patch_phases(timer)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    profiler = cProfile.Profile() if profile else None
    collector = GcClock()
    start, cpu = time.perf_counter(), _cpu()
    if profiler is not None:
        profiler.enable()
    opt.step()
    sync()
    first, first_cpu = time.perf_counter() - start, _cpu() - cpu
    first_gc, first_full = collector.read()
    if profiler is not None:
        profiler.disable()
        _write_profile(profiler, profile, f"{case}: first step {first:.3f} s under cProfile")
    phases = {k: round(v, 4) for k, v in timer.seconds.items()}
    phases["other"] = round(first - sum(timer.seconds.values()), 4)
    cpu_phases = {k: round(v, 4) for k, v in timer.cpu.items()}
    cpu_phases["other"] = round(first_cpu - sum(timer.cpu.values()), 4)
    # (the generated check alone: the fast tier, armed by the first call, follows it)
    check_code = optcompile.explain(opt).check_code.split("\n# fast tier")[0]
    collector.read()
    second_start, cpu = time.perf_counter(), _cpu()
    opt.step()
    sync()
    second, second_cpu = time.perf_counter() - second_start, _cpu() - cpu
    second_gc, second_full = collector.read()
    report = optcompile.explain(opt)
    return {
        "case": case,
        "params": len(params),
        "settled_s": None if settled is None else round(settled, 4),
        "first_s": round(first, 4),
        "first_cpu_s": round(first_cpu, 4),
        "second_s": round(second, 4),
        "second_cpu_s": round(second_cpu, 4),
        "gc_cpu_s": round(first_gc, 4),
        "second_gc_cpu_s": round(second_gc, 4),
        "full_collections": [first_full, second_full],
        "phases": phases,
        "cpu_phases": cpu_phases,
        "background": {
            name: [round(a - start, 4), round(b - start, 4)] for name, (a, b) in background.items()
        },
        "traces": report.traces,
        "backend": report.backend,
        "graph_ops": report.graph_ops,
        "check_code_lines": check_code.count("\n") + 1,
        "fallback": report.fallback_reason,
        "native": _native_status(),
    }


def _native_status() -> str:
    from optguard import native

    return native.status()


def _write_profile(profiler: cProfile.Profile, path: str | None, title: str) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(80)
    stats.sort_stats("tottime").print_stats(40)
    Path(str(path)).write_text(f"# {title}\n{text.getvalue()}")
