"""``--triton-offline`` of benchmarks/first_call.py: the Triton compile of GPT-2's AdamW
kernels for a GPU target, on this CPU (no GPU needed), timed by stage; and its table.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from first_call_child import _params

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
