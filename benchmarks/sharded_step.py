"""Per-step time of an FSDP2 (``fully_shard``) AdamW or Muon step against the floor, on one device.

One process, world size 1 (NCCL on CUDA, gloo on the CPU) over a FileStore, a 1-device mesh,
``fully_shard`` on a GPT model built from torch.nn layers (gpt.py: GPT-2 124M shapes by
default). One forward and backward makes the gradients (DTensors); they stay fixed, so the
params keep changing. Variants, each a fresh AdamW (lr 1e-3, weight decay 0.01):

- optcompile: ``optcompile.compile(opt)`` with the defaults (backend "auto": Triton and CUDA
  graphs on CUDA, the torch backend on the CPU) over the DTensor params;
- fused: ``fused=True`` over the same DTensors; foreach: eager ``foreach=True``;
- plain optcompile: the same compile over plain tensors of the local shards' sizes and values
  (the issue's target: the sharded step within 1.1x of this one).

With ``--optimizer muon``: torch.optim.Muon (defaults, lr 1e-2) over the blocks' matrices
(tall, wide and square; the embeddings stay out, as Muon's docs advise), variants optcompile,
eager, plain optcompile and plain eager (Muon has neither ``fused`` nor ``foreach``), and
plain optcompile with ``cudagraphs=False`` ("no graph": the per-op host path). Its
Newton-Schulz matmuls run on the torch backend (the same ATen ops as eager, with DTensor's
collectives: none at world size 1), recorded with the kernels in the step's CUDA graph
where no collective runs, and its elementwise tail in one kernel; its floor counts
the tail's bytes only (read p, g, momentum; write p, momentum: 20 bytes a parameter), the
matmuls are compute.

Timing: after warm-up (the first call compiles), CUDA events around each step, one pair per
step, steps enqueued back to back (``step``: device time; the host runs ahead), and again
with a synchronize before each step (``synced``: the step's host time shows when the device
waits for it); the median over ``--steps``. The floor: the bytes the step moves over its
local shards (AdamW fp32: read p, g, m, v; write p, m, v: 28 bytes a parameter) over the copy
bandwidth measured in the same run (step_time.copy_bandwidth on CUDA).

Usage (GPU machine; prints a markdown table, writes it and the JSON):
  python benchmarks/sharded_step.py --json benchmarks/results/sharded_step_h100.json \
      --out benchmarks/results/sharded_step_h100.md
Muon, plain vs sharded vs eager (GPU machine):
  python benchmarks/sharded_step.py --optimizer muon \
      --json benchmarks/results/sharded_muon_h100.json --out benchmarks/results/sharded_muon_h100.md
CPU smoke run (what integration_tests/test_benchmark_scripts.py runs; raises if optcompile
falls back or retraces):
  python benchmarks/sharded_step.py --device cpu --smoke --json /tmp/s.json --out /tmp/s.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import gpt


class Optimizer(NamedTuple):
    """What one ``--optimizer`` times: how to make it, over which params, its variants and
    the bytes per parameter of its floor."""

    make: Callable[..., torch.optim.Optimizer]
    params: Callable[[torch.nn.Module], list[torch.nn.Parameter]]
    variants: list[str]
    bytes_per_element: int


OPTIMIZERS = {
    "adamw": Optimizer(
        lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw),
        lambda m: [p for p in m.parameters() if p.grad is not None],
        ["optcompile", "fused", "foreach", "plain optcompile"],
        7 * 4,  # AdamW fp32: p, g, m, v read; p, m, v written
    ),
    "muon": Optimizer(
        lambda ps, **kw: torch.optim.Muon(ps, lr=1e-2, **kw),
        lambda m: [p for b in m.blocks for p in b.parameters() if p.dim() == 2],
        ["optcompile", "eager", "plain optcompile", "plain eager", "plain optcompile no graph"],
        5 * 4,  # its elementwise tail: p, g, momentum read; p, momentum written
    ),
}


def init_world(device: str, store_dir: str) -> Any:
    """World size 1 in this process; a 1-device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return init_device_mesh(device, (1,))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def make_step(variant: str, params: list[torch.nn.Parameter], optimizer: str) -> Callable[[], Any]:
    import optcompile

    make = OPTIMIZERS[optimizer].make
    if variant.startswith("plain "):  # plain tensors of the local shards' sizes and values
        plain = []
        for p in params:
            q = torch.nn.Parameter(local(p).detach().clone())
            q.grad = local(p.grad).detach().clone()  # type: ignore[arg-type]
            plain.append(q)
        variant, params = variant[len("plain ") :], plain
    if variant == "optcompile":
        return optcompile.compile(make(params)).step
    if variant == "optcompile no graph":  # the host path a graph saves (cudagraphs=False)
        return optcompile.compile(make(params), cudagraphs=False).step
    if variant == "fused":
        return make(params, fused=True).step
    if variant == "foreach":
        return make(params, foreach=True).step
    if variant == "eager":
        return make(params).step
    raise ValueError(variant)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_times(step: Callable[[], Any], device: str, steps: int, synced: bool) -> list[float]:
    """Seconds of each of ``steps`` steps: CUDA events around each (perf_counter on CPU)."""
    if device != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return times
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(steps)
    ]
    torch.cuda.synchronize()
    for begin, end in events:
        if synced:
            torch.cuda.synchronize()
        begin.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [begin.elapsed_time(end) * 1e-3 for begin, end in events]


def copy_bandwidth(device: str, numel: int) -> float:
    """Bytes per second of a device copy (read + write counted)."""
    if device == "cuda":
        from step_time import copy_bandwidth as cuda_copy_bandwidth

        return cuda_copy_bandwidth(device)
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    seconds = statistics.median(step_times(lambda: dst.copy_(src), device, 20, synced=False))
    return 2 * numel * src.element_size() / seconds


def measure(variant: str, params: list[torch.nn.Parameter], args: argparse.Namespace) -> dict:
    import optcompile

    row: dict[str, Any] = {"variant": variant}
    try:
        sync(args.device)
        start = time.perf_counter()
        step = make_step(variant, params, args.optimizer)
        step()
        sync(args.device)
        row["first_call_s"] = time.perf_counter() - start
        if "optcompile" in variant:
            from optguard import native

            native.start(wait=True)  # the steady state users get (checks built in the background)
        for _ in range(args.warmup):
            step()
        row["step_s"] = statistics.median(step_times(step, args.device, args.steps, False))
        row["synced_s"] = statistics.median(step_times(step, args.device, args.steps, True))
        if "optcompile" in variant:
            report = optcompile.explain(step.__self__)  # type: ignore[attr-defined]
            row.update(
                launches=report.kernel_launches_per_step,
                traces=report.traces,
                fallback=report.fallback_reason,
                cudagraphs=report.cudagraphs,
                collectives=list(report.collectives),
            )
            if args.smoke and (report.fallback_reason or report.traces != 1):
                raise RuntimeError(f"{variant}: {report.fallback_reason or report.retrace_reasons}")
        del step
    except Exception as exc:
        if args.smoke:
            raise
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    optcompile.reset()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as store_dir:
        mesh = init_world(args.device, store_dir)
        try:
            model = gpt.shard(gpt.build(args.model, args.device), mesh=mesh)
            tokens = gpt.batch(args.model, args.batch, args.length, args.device, seed=0)
            gpt.loss(model, tokens).backward()
            optimizer = OPTIMIZERS[args.optimizer]
            params = optimizer.params(model)
            numel = sum(local(p).numel() for p in params)
            bandwidth = copy_bandwidth(args.device, min(numel, 64 * 1024 * 1024))
            floor_bytes = numel * optimizer.bytes_per_element
            floor_s = floor_bytes / bandwidth
            variants = args.variants.split(",") if args.variants else optimizer.variants
            rows = [measure(v, params, args) for v in variants]
        finally:
            dist.destroy_process_group()
    import triton

    meta = {
        "command": "python benchmarks/sharded_step.py " + " ".join(sys.argv[1:]),
        "device": device_name(args.device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "optimizer": args.optimizer,
        "model": args.model,
        "tensors": len(params),
        "placements": str(params[0].placements) if hasattr(params[0], "placements") else "",
        "local_numel": numel,
        "floor_bytes": floor_bytes,
        "bandwidth": bandwidth,
        "floor_s": floor_s,
        "steps": args.steps,
        "timer": "CUDA events" if args.device == "cuda" else "perf_counter",
    }
    return {"meta": meta, "rows": rows}


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def table(result: dict[str, Any]) -> str:
    meta, rows = result["meta"], result["rows"]
    plain = next((r for r in rows if r["variant"] == "plain optcompile" and "step_s" in r), None)
    name = {"adamw": "AdamW", "muon": "Muon"}[meta["optimizer"]]
    lines = [
        f"# Sharded (FSDP2) {name} step against the floor, world size 1",
        "",
        f"Produced by `{meta['command']}` on {meta['device']}; Python {meta['python']}, torch "
        f"{meta['torch']}, triton {meta['triton']}.",
        "",
        f"Model {meta['model']}: {meta['tensors']} parameter DTensors ({meta['placements']}), "
        f"{meta['local_numel']:,} local elements; floor = {meta['floor_bytes'] / 1e6:,.1f} MB "
        f"moved / {meta['bandwidth'] / 1e9:,.0f} GB/s copy bandwidth (measured in this run) = "
        f"{meta['floor_s'] * 1e6:,.0f} µs. Step: median of {meta['steps']} steps, "
        f"{meta['timer']} around each, enqueued back to back; synced: the same with a "
        "synchronize before each step (host time included).",
        "",
        "| variant | µs / step | x floor | x plain optcompile | synced µs | launches | traces | "
        "first call (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | n/a ({r['error']}) | | | | | | |")
            continue
        vs_plain = f"{r['step_s'] / plain['step_s']:.2f}" if plain else ""
        lines.append(
            f"| {r['variant']} | {r['step_s'] * 1e6:,.0f} | {r['step_s'] / meta['floor_s']:.2f} | "
            f"{vs_plain} | {r['synced_s'] * 1e6:,.0f} | {r.get('launches', '')} | "
            f"{r.get('traces', '')} | {r['first_call_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="gpt2", choices=sorted(gpt.CONFIGS))
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS))
    parser.add_argument("--variants", default="", help="comma-separated (default: all)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny model, 5 steps, raise on errors")
    parser.add_argument("--json", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.steps, args.warmup, args.length = "tiny", 5, 2, 8
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=1))
    text = table(result)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
