"""Median AdamW step time on the GPU against the memory-bandwidth floor (first cut of the
step-time suite: AdamW, float32, GPT-2 124M or GPT 1.3B shapes).

Usage (GPU machine): python benchmarks/step_time.py [--model gpt2|1.3b] [--steps 200]
Writes benchmarks/results/step_time_cuda_<model>.md.

The floor: AdamW reads p, g, m, v and writes p, m, v: 28 bytes per float32 parameter, over
the copy bandwidth measured in the same run (a 1 GiB device-to-device copy, bytes read plus
written). Every variant is timed with CUDA events over ``steps`` steps after warm-up; the
median of 5 such runs is reported, per step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import optcompile
import torch
import triton
from optcompile.api import _OPTIMIZERS

sys.path.insert(0, str(Path(__file__).parent))
from guard_check import gpt2_shapes

RESULTS = Path(__file__).parent / "results"


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.randn(256 * 1024 * 1024, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=500, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def gpt_1_3b_shapes() -> list[tuple[int, ...]]:
    """GPT 1.3B (24 layers, width 2048, 2048 positions): 292 parameter tensors."""
    d = 2048
    shapes: list[tuple[int, ...]] = [(50257, d), (2048, d)]
    for _ in range(24):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [*shapes, (d,), (d,)]


SHAPES = {"gpt2": gpt2_shapes, "1.3b": gpt_1_3b_shapes}


def make(kind: str, model: str) -> torch.optim.Optimizer:
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = []
    for shape in SHAPES[model]():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device="cuda"))
        p.grad = torch.randn(shape, generator=gen, device="cuda")
        params.append(p)
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    # "triton": capturable=True (step counts on the device); "triton-default": the user's
    # default capturable=False (counts on the CPU, computed there, the kernel reads them).
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True, capturable=kind == "triton")
    return optcompile.compile(opt, backend="triton")


def time_steps(opt: torch.optim.Optimizer, steps: int) -> float:
    for _ in range(5):
        opt.step()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            opt.step()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / steps)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt2")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    n = sum(torch.Size(s).numel() for s in SHAPES[args.model]())
    floor_ms = 28 * n / bandwidth * 1e3
    rows = [("floor (28 B/param over copy bandwidth)", floor_ms, "", "")]
    for kind in ("fused", "foreach", "triton", "triton-default"):
        start = time.perf_counter()
        opt = make(kind, args.model)
        opt.step()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ms = time_steps(opt, args.steps)
        launches = ""
        if kind.startswith("triton"):
            plan = _OPTIMIZERS[opt].cache.entries[0].value.plan
            launches = str(plan.kernel_launches_per_step)
            assert plan.program is not None, plan.reason
        rows.append((f"AdamW {kind}", ms, launches, f"{first:.2f} s"))
        print(f"{kind:10s} {ms:.3f} ms  x{ms / floor_ms:.2f} floor  first call {first:.2f} s")
        del opt
        torch.cuda.empty_cache()
    lines = [
        f"# AdamW step time, float32, {args.model} shapes "
        f"({len(SHAPES[args.model]())} tensors), CUDA",
        "",
        f"Command: `python benchmarks/step_time.py {' '.join(sys.argv[1:])}`  ",
        f"Device: {torch.cuda.get_device_name()}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, triton {triton.__version__}  ",
        f"Copy bandwidth measured: {bandwidth / 1e9:.0f} GB/s; {n / 1e6:.1f} M parameters; "
        f"floor {floor_ms:.3f} ms  ",
        "triton: optcompile with capturable=True (step counts on the device); triton-default: "
        "capturable=False (counts on the CPU, updated there each call).",
        "",
        "| variant | ms / step | x floor | launches / step | first call |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {name} | {ms:.3f} | {ms / floor_ms:.2f} | {launches} | {first} |"
            for name, ms, launches, first in rows
        ),
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"step_time_cuda_{args.model}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
