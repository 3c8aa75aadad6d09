"""Cold first call of a compiled optimizer, split into phases (issues 20 and 24).

Usage (from the repo root, PYTHONPATH naming packages/*/src):
    python benchmarks/first_call.py [--cases gpt2-adamw tiny-200-adamw ...] [--device cpu]
        [--machine "CPU dev machine"] [--out benchmarks/results/first_call_cpu.md]
        [--warm] [--repeat N] [--profile DIR] [--settle] [--native]
    python benchmarks/first_call.py --device cuda --cases gpt2-adamw --warm --repeat 3 \
        --machine "H100" --profile prof --out benchmarks/results/first_call_h100.md   # GPU

Each case runs in a fresh Python process whose caches are empty temporary directories
(``OPTCOMPILE_CACHE_DIR``, ``OPTKERNELS_CACHE_DIR``, ``OPTGUARD_CACHE_DIR``,
``TRITON_CACHE_DIR``), so nothing a
previous run compiled is reused: the optguard C++ module (an install-time build, ``python -m
optguard build``) is not found either, and the Python checks run; ``--native`` copies the
module this environment has built into the empty cache first (what a user who ran the
install-time build gets). The child builds the
optimizer, then times its first ``step()`` and, inside it, these phases (each exclusive of
the phases nested in it, so they add up to at most the total; "other" is the rest).
``--warm`` runs each case a second time in another fresh process on the first one's caches
(what a user's second run of the same script does); ``--repeat N`` runs each N times (a
table row per run); ``--profile DIR`` adds one more cold and warm run of each case under
cProfile and writes their statistics to ``DIR/first_call_<case>_<cold|warm>.txt``: the main
thread's, as its step starts once optkernels' background threads are done (from Python 3.12
on, cProfile records every thread's calls: the threads' loads of Triton's launchers showed
as the step's). ``--settle`` waits for them so in every run (a script's forward and
backward would, between ``compile()`` and the first step; "settled_s" in the JSON says how
long that took); without it the step overlaps them, as here. Each JSON line also gives
the background threads' spans (Triton's self-hash, its runtime modules' C builds; seconds
from the first step's start) and, as a phase, how long the first launch waited for them:

  state init      the optimizer's ``_init_group`` run for real before the trace
  trace           recording the step into an ATen graph (opttrace)
  audit           the side-effect audit of globals, cells and random generators
  guards          the prologue: guard and gather codegen and compile (optguard), and its
                  fast tier, armed after the first run
  families        finding the per-parameter lane programs / families (optkernels)
  kernel source   generating Triton or C source
  C compile       building (or loading) the C kernels (CPU backend)
  Triton compile  a kernel's first launch (compile, or load from the cache, and run)
  Triton wait     the first launch waiting for the background threads (self-hash, runtime)
  graph capture   CUDA graph recording (optcudagraph)
  replay codegen  the side-effect replay code (optsidefx)
  run             the plan's run and the replay, outside the phases above

Cases: ``gpt2-adamw`` (AdamW over the 148 tensors of GPT-2 124M, foreach as torch defaults
on the device; ``gpt2-adamw-foreach``: foreach=True on any device, CUDA's path on the CPU)
and ``tiny-N-OPT`` for N in 200, 2000, 10000 and OPT one of ``adamw``
(AdamW, torch's default: the for-loop on the CPU), ``sgd`` (SGD, momentum 0.9),
``adam-foreach`` and ``adam-forloop`` (Adam with foreach=True / False), ``radam``, ``rprop``
and ``asgd`` (torch's defaults; not among the default cases), over 4x4 params.
Writes a markdown table (``--out``) and prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OPTIMIZERS = ("adamw", "sgd", "adam-foreach", "adam-forloop", "radam", "rprop", "asgd")
DEFAULT_CASES = [
    "gpt2-adamw",
    *(f"tiny-{n}-{o}" for n in (200, 2000, 10000) for o in OPTIMIZERS[:4]),
]
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


# -- the Triton compile of GPT-2's kernels, offline (no GPU needed) -------------------------


def triton_offline(arch: int, capturable: bool) -> dict[str, Any]:
    """What the GPU's first call does before its first launch, on this CPU: trace AdamW
    (foreach; the Triton backend traces its capturable path) over GPT-2 124M's shapes,
    build the prologue, lower to Triton kernels; then compile each generated kernel for an
    ``sm_<arch>`` target, timing each and its ptxas stage, as a first launch on a cold cache
    compiles it: through Triton's stages without Triton's cache, so without its self-hash
    (``_triton_compat.stages._compile``). ``capturable=False`` (``gpt2-adamw``: torch's
    default) keeps the step counts on the CPU: on a GPU the plan then computes what depends on
    them on the host, with its own kernel (``_Part.check_devices``), which is the one compiled
    here."""
    import optguard
    import torch
    import triton
    from optkernels._triton_compat.stages import _run_stages
    from optkernels.triton_backend import LAUNCH_SIGNATURES, TritonPlan
    from opttrace import trace_step
    from opttrace.optimizer import init_state
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    params, _ = _params("gpt2-adamw", "cpu")
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True, capturable=capturable)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    init_state(opt)  # (the state's allocation, as eager's first step: not timed below)
    seconds["state init (as eager's first step)"] = time.perf_counter() - start
    start = time.perf_counter()
    traced = trace_step(opt, capturable=True)
    seconds["trace"] = time.perf_counter() - start
    start = time.perf_counter()
    optguard.Prologue(traced.guards, traced.input_sources, pin=True)
    seconds["guards"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = TritonPlan(traced.graph_module, host_small=not capturable)  # (no GPU needed)
    for part in plan.parts:
        if part.host_small and not part.host:  # (what check_devices does on the GPU)
            part._build(host=True)
    seconds["lowering and kernel source"] = time.perf_counter() - start
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    folder = Path(tempfile.mkdtemp(prefix="first-call-offline-"))
    stages = _time_stages()
    kernels = []
    for part in plan.parts:
        for group in part.groups:
            launches = [
                (group.kernel.fn, LAUNCH_SIGNATURES[0], group.block, group.num_warps, group.maxnreg)
            ]
            if group.small_kernel is not None:
                launches.append((group.small_kernel.fn, LAUNCH_SIGNATURES[1], 256, 4, None))
            for fn, types, block, warps, maxnreg in launches:
                signature = dict(zip(fn.arg_names, types, strict=True))
                source = ASTSource(fn=fn, signature=signature, constexprs={"BLOCK": block})
                stages.clear()
                start = time.perf_counter()
                given = {"num_warps": warps} | ({"maxnreg": maxnreg} if maxnreg else {})
                options = backend.parse_options(given)
                compiled = _run_stages(
                    source, target, backend, options, str(folder / fn.__name__), fn.__name__
                )
                spent = time.perf_counter() - start
                ptx = compiled.asm["ptx"]
                kernels.append(
                    {
                        "name": fn.__name__,
                        "source_lines": len(fn.src.splitlines()),
                        "compile_s": round(spent, 4),
                        "ptxas_s": round(stages.get("cubin", float("nan")), 4),
                        "stages_s": {k: round(v, 4) for k, v in stages.items()},
                        "ptx_lines": len(ptx.splitlines()),
                        "vector_loads": ptx.count("ld.global.v4"),
                        "block": block,
                        "num_warps": warps,
                    }
                )
    return {
        "arch": arch,
        "capturable": capturable,
        "params": len(params),
        "graph_ops": sum(1 for n in traced.graph.nodes if n.op == "call_function"),
        "phases": {k: round(v, 4) for k, v in seconds.items()},
        "kernels": kernels,
        "triton": triton.__version__,
    }


def _time_stages() -> dict[str, float]:
    """Seconds of each stage (ttir, ttgir, llir, ptx, cubin: ptxas) of the CUDA backend's
    next compiles, by stage name (the AST's code generation comes before them)."""
    from triton.backends.nvidia.compiler import CUDABackend

    seconds: dict[str, float] = {}
    add_stages = CUDABackend.add_stages

    def timed_stages(self: Any, stages: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        add_stages(self, stages, *args, **kwargs)
        for name, stage in list(stages.items()):
            stages[name] = _timed_stage(stage, name, seconds)

    CUDABackend.add_stages = timed_stages
    return seconds


def _timed_stage(stage: Any, name: str, seconds: dict[str, float]) -> Any:
    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return stage(*args)
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start

    return timed


def _triton_table(results: list[dict[str, Any]]) -> str:
    result = results[0]
    lines = [
        "",
        f"## GPT-2 124M AdamW (foreach): Triton compile for sm_{result['arch']}, offline",
        "",
        f"Command: `python benchmarks/first_call.py --triton-offline {result['arch']}` "
        f"(Triton {result['triton']}, on this CPU: the compile to PTX and cubin needs no "
        "GPU). The same trace, prologue and lowering the GPU's first call runs, on CPU "
        f"tensors of GPT-2's shapes ({result['params']} tensors, {result['graph_ops']} graph "
        "ops), then the compile of each generated kernel as its first launch does on a "
        "cold cache (Triton's stages, not its cache: no self-hash). capturable=False "
        "(torch's default, `gpt2-adamw`): "
        "the step counts stay on the CPU, the host computes what depends on them and the "
        "GPU runs one kernel. Not here: the C compiler's builds of Triton's runtime "
        "modules (they need libcuda; on a GPU they run in background threads).",
        "",
        "| phase | " + " | ".join(_variant(r) for r in results) + " |",
        "| --- |" + " --- |" * len(results),
        *(
            f"| {k} | " + " | ".join(f"{r['phases'][k]:.3f}" for r in results) + " |"
            for k in result["phases"]
        ),
        "| Triton compile, its kernels | "
        + " | ".join(f"{sum(k['compile_s'] for k in r['kernels']):.3f}" for r in results)
        + " |",
        "| total after the state init | "
        + " | ".join(f"{_after_init(r):.3f}" for r in results)
        + " |",
        "",
        "| variant | kernel | source lines | BLOCK | warps | compile s | of which ptxas s "
        "| PTX lines | ld.global.v4 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {_variant(r)} | {k['name']} | {k['source_lines']} | {k['block']} "
            f"| {k['num_warps']} | {k['compile_s']:.3f} | {k['ptxas_s']:.3f} "
            f"| {k['ptx_lines']} | {k['vector_loads']} |"
            for r in results
            for k in r["kernels"]
        ),
        "",
    ]
    return "\n".join(lines)


def _variant(result: dict[str, Any]) -> str:
    return f"capturable={result['capturable']}"


def _after_init(result: dict[str, Any]) -> float:
    phases = dict(result["phases"])
    phases.pop("state init (as eager's first step)")
    return sum(phases.values()) + sum(k["compile_s"] for k in result["kernels"])


# -- the parent: one fresh process per case ----------------------------------------------


def run_fresh(
    case: str,
    device: str,
    triton: str | None = None,
    warm: bool = False,
    profile: str | None = None,
    settle: bool = False,
    native: bool = False,
) -> list[dict[str, Any]]:
    """``case`` in a fresh process with empty caches (its result, labelled "cold"); with
    ``warm``, then in a second one on the caches the first left ("warm"). ``profile``: a
    folder for their cProfile statistics; ``settle``: see ``run_case``; ``native``: the
    optguard C++ module built here is copied into the empty cache."""
    results = []
    with tempfile.TemporaryDirectory(prefix="first_call_") as tmp:
        env = dict(os.environ)
        for var, sub in (
            ("OPTCOMPILE_CACHE_DIR", "optcompile"),
            ("OPTKERNELS_CACHE_DIR", "optkernels"),
            ("OPTGUARD_CACHE_DIR", "optguard"),
            ("TRITON_CACHE_DIR", "triton"),
        ):
            env[var] = os.path.join(tmp, sub)
        if native:
            _copy_native(os.path.join(tmp, "optcompile"))
        env.pop("OPTCOMPILE_NATIVE", None)  # never build the C++ checks inside the timing
        # Bytecode of the modules a first call imports (ours, Triton's): a pip install
        # writes it, the GPU machine's environment turns writing it off, and without it a
        # "warm" process compiles those sources again (as step_time.py's compile timing).
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        for caches in ("cold", "warm") if warm else ("cold",):
            command = [sys.executable, __file__, "--child", case, "--device", device]
            if profile is not None:
                path = os.path.join(profile, f"first_call_{case}_{caches}.txt")
                command += ["--profile", path]
            if settle:
                command += ["--settle"]
            if triton is not None:
                env.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter
                command = [sys.executable, __file__, "--triton-child", triton]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{case} ({caches}) failed:\n{done.stderr[-4000:]}")
            result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
            result["caches"] = caches
            results.append(result)
    return results


def _copy_native(cache: str) -> None:
    """Copy the optguard C++ module built for this environment into ``cache`` (an
    ``OPTCOMPILE_CACHE_DIR``), where the child finds it."""
    import shutil

    from optguard import native

    built = native.library_path()
    if not built.exists():
        raise SystemExit(f"--native: {built} is not built (run: {native.BUILD_COMMAND})")
    folder = Path(cache) / built.parent.name
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, folder / built.name)


def _phases_shown(results: list[dict[str, Any]], key: str) -> list[str]:
    """The phases (of ``key``: CPU or wall seconds) that took a millisecond in some case."""
    return [p for p in [*PHASES, "other"] if any(abs(r[key][p]) >= 0.0005 for r in results)]


def _markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = [head, ["---"] * len(head), *rows]
    return ["| " + " | ".join(cells) + " |" for cells in lines]


def _table(results: list[dict[str, Any]], args: argparse.Namespace, load: float) -> str:
    import torch
    from trace_time import source_revision

    shown = _phases_shown(results, "cpu_phases")
    head = [
        "case",
        "caches",
        "params",
        "first call s",
        "its CPU s",
        "CPU ms/param",
        *(f"{p} s" for p in shown),
        "of it gc s",
        "2nd call s",
        "its CPU s",
        "of it gc s",
    ]
    rows = []
    for r in results:
        cells = [
            r["case"],
            r["caches"],
            str(r["params"]),
            f"{r['first_s']:.3f}",
            f"{r['first_cpu_s']:.3f}",
            f"{1000 * r['first_cpu_s'] / r['params']:.3f}",
            *(f"{r['cpu_phases'][p]:.3f}" for p in shown),
            f"{r.get('gc_cpu_s', 0.0):.3f}",
            f"{r['second_s']:.4f}",
            f"{r.get('second_cpu_s', 0.0):.4f}",
            f"{r.get('second_gc_cpu_s', 0.0):.3f}",
        ]
        rows.append(cells)
    wall = _phases_shown(results, "phases")
    wall_head = ["case", "caches", "first call s", *(f"{p} s" for p in wall)]
    wall_rows = []
    for r in results:
        cells = [r["case"], r["caches"], f"{r['first_s']:.3f}"]
        cells += [f"{r['phases'][p]:.3f}" for p in wall]
        wall_rows.append(cells)
    versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    command = " ".join(["python", "benchmarks/first_call.py", *sys.argv[1:]])
    return "\n".join(
        [
            f"# First call of a compiled optimizer, cold ({args.device})",
            "",
            f"Command: `{command}` (from the repo root)  ",
            f"Machine: {args.machine}; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, 1-min load "
            f"average {load:.2f} at start  ",
            f"Versions: {versions}; source {source_revision()}  ",
            "Each case in a fresh process with empty optcompile/optkernels/Triton caches "
            '("cold"; "warm": another fresh process on the caches the cold one left, the '
            "bytecode of the modules the cold one imported included, as a pip install "
            "writes it) "
            + (
                "(the optguard C++ module built and loaded: --native); "
                if args.native
                else "(the optguard C++ module not built); "
            )
            + "phases are exclusive (see the script's "
            'docstring). Tiny params are 4x4 float32. "first call s" is wall time; "its CPU '
            's", the ms per param and the phases are CPU seconds (all threads, and the C '
            "compiler's; on a shared, loaded machine the steadier numbers; wall phases are "
            "below). The "
            "2nd call (wall, then CPU) is a hit of the guards' fast tier (armed at the end "
            "of the first), or retraces where the first step created state (SGD's momentum "
            'buffers). "of it gc s": CPU seconds of the cyclic garbage collector\'s '
            "collections within the call (in the phases they interrupted); what the first "
            "call built is in the collector's oldest generation, scanned by the process's "
            "next full collection (a training loop's own allocations start one, some steps "
            "later)."
            + (
                " Each first step started after optkernels' background threads were done "
                "(--settle)."
                if args.settle
                else ""
            ),
            "",
            *_markdown(head, rows),
            "",
            "The same runs' phases in wall seconds (the main thread's; background threads "
            'overlap them: the JSON lines give their spans, "Triton wait" what the first '
            "launch waited for them):",
            "",
            *_markdown(wall_head, wall_rows),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--machine", default="CPU dev machine")
    parser.add_argument("--out", default=None, help="markdown table (default: print only)")
    parser.add_argument(
        "--warm", action="store_true", help="also each case again on the caches it left"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="one more run of each case under cProfile, its statistics written to DIR",
    )
    parser.add_argument(
        "--triton-offline",
        type=int,
        default=None,
        metavar="ARCH",
        help="also compile GPT-2's Triton kernels for sm_ARCH (e.g. 90) on this machine",
    )
    parser.add_argument(
        "--settle",
        action="store_true",
        help="time each first step after optkernels' background threads are done",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="the children load the optguard C++ module built here (python -m optguard build)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--triton-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_case(args.child, args.device, args.profile, args.settle)
        print(json.dumps(result), flush=True)
        return
    if args.triton_child is not None:
        arch, _, variant = args.triton_child.partition(":")
        print(json.dumps(triton_offline(int(arch), variant == "capturable")), flush=True)
        return
    load = os.getloadavg()[0]
    results = []
    for case in args.cases:
        for _ in range(args.repeat):
            runs = run_fresh(
                case, args.device, warm=args.warm, settle=args.settle, native=args.native
            )
            for result in runs:
                results.append(result)
                print(json.dumps(result), flush=True)
    if args.profile is not None:
        os.makedirs(args.profile, exist_ok=True)
        for case in args.cases:
            run_fresh(case, args.device, warm=args.warm, profile=args.profile, native=args.native)
    table = _table(results, args, load)
    if args.triton_offline is not None:
        offline = [
            result
            for variant in ("", ":capturable")
            for result in run_fresh("gpt2-adamw", "cpu", f"{args.triton_offline}{variant}")
        ]
        print(json.dumps(offline), flush=True)
        table += _triton_table(offline)
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
