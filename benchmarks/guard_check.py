"""Host cost of a compiled AdamW call over GPT-2 124M's 148 parameter tensors.

Usage: python benchmarks/guard_check.py [--device cpu|cuda] [--repeats 2000] [--torch-compile]
    [--dtensor]
Writes benchmarks/results/guard_check_<device>.md (with --dtensor: guard_check_dtensor_<device>.md:
the params and grads are DTensors, Shard(0) over a 1-device mesh, world size 1 over gloo/NCCL in
this process; the fast tier's C++ tree and its Python residual are timed apart, and the
EqualGuards on each DTensor's mesh and placements as the Python residual ran them before they
moved into the tree).

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


def make_params(device: str, mesh: Any = None) -> list[torch.nn.Parameter]:
    """GPT-2's parameters with random grads; DTensors (Shard(0) over ``mesh``) if given."""
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in gpt2_shapes():
        p = torch.nn.Parameter(_on(torch.randn(shape, generator=gen).to(device), mesh))
        p.grad = _on(torch.randn(shape, generator=gen).to(device), mesh)
        params.append(p)
    return params


def _on(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    if mesh is None:
        return t
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t, mesh, [Shard(0)])


def world_of_one(device: str) -> Any:
    """World size 1 in this process (gloo, or NCCL on CUDA); its 1-device mesh."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return init_device_mesh(device.split(":")[0], (1,))


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
    parser.add_argument("--dtensor", action="store_true", help="params and grads as DTensors")
    args = parser.parse_args()
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # Whole steps are slower: fewer of them (on the CPU they are the arithmetic itself).
    steps = max(args.repeats // 10, 20) if device.startswith("cuda") else 5

    mesh = world_of_one(device) if args.dtensor else None
    params = make_params(device, mesh)
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
    if args.dtensor:
        from optguard.check import GuardSet, compile_check
        from optguard.guards import EqualGuard
        from optguard.sources import KeyedSource, ancestors

        # (those inside the optimizer's state never ran on a hit: its dict versions cover them)
        equal = [
            g
            for g in prologue.guards.guards
            if isinstance(g, EqualGuard)
            and not any(isinstance(s, KeyedSource) for s in ancestors(g.source))
        ]
        in_python = compile_check(GuardSet(tuple(equal)))
        assert in_python(L) and not any(
            isinstance(g, EqualGuard) for g in fast.residual.guards.guards
        )
        rows[1:1] = [
            (
                "  of which the C++ guard tree",
                median_us(lambda: fast.tree.check(L), args.repeats, sync),
            ),
            (
                "  of which the Python residual",
                median_us(lambda: fast.residual(L), args.repeats, sync),
            ),
            (
                f"the {len(equal)} mesh/placements EqualGuards as Python (before: in the residual)",
                median_us(lambda: in_python(L), args.repeats, sync),
            ),
        ]

    eager = torch.optim.AdamW(make_params(device, mesh), lr=1e-3, foreach=True)
    rows.append(("eager foreach opt.step() host time", median_us(eager.step, steps, sync)))
    if device.startswith("cuda"):
        fused = torch.optim.AdamW(make_params(device, mesh), lr=1e-3, fused=True)
        rows.append(("fused=True opt.step() host time", median_us(fused.step, steps, sync)))
    if args.torch_compile:
        inductor = torch.optim.AdamW(make_params(device, mesh), lr=1e-3, foreach=True)
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
    kind = "DTensors, Shard(0) over a 1-device mesh" if args.dtensor else "tensors"
    lines = [
        f"# Host cost of a compiled AdamW call, GPT-2 124M shapes (148 {kind}), {device}",
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
    stem = "guard_check_dtensor" if args.dtensor else "guard_check"
    (RESULTS / f"{stem}_{device.split(':')[0]}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
