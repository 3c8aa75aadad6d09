"""AdamW step time with low-precision state (``state_dtype=``) against its floor (GPU).

GPT-2 124M parameter shapes (148 tensors, float32 params), AdamW (lr 1e-3, weight decay
0.01). Variants, each on fresh copies of the same params and grads:
- ``fp32``: optcompile with full-precision state (the fused Triton step, CUDA graph);
- ``bf16``, ``int8``: optcompile with ``state_dtype=torch.bfloat16`` / ``"int8"``;
- ``fused``: torch's ``AdamW(fused=True)`` with fp32 state;
- ``torchao-8bit``: ``torchao.optim.AdamW8bit`` (blockwise 8-bit, block 256) when
  torchao is importable;
- ``bf16-before``, ``int8-before``: the same with the kernels' conversions as they were
  before the int8 rework (``state_dtype_before.py``), measured in the same run;
- ``int8@BxW``: today's int8 kernel launched B elements by W warps (default 256x1; 1024x4
  was the launch shape before).

The floor of each: the bytes it must move over the copy bandwidth measured in the same run
(step_time.copy_bandwidth). Per parameter element AdamW reads p, g, m, v and writes p, m, v:
p and g are 4 bytes each way; m and v are 4 bytes each (fp32), 2 (bf16) or 1 + 4/256
(int8: a code and a share of a float32 scale per block), read and written. Compressed state
applies to tensors of at least 4096 elements; the others (biases, layer norms) stay fp32 and
are counted so. Reported per variant: median step time, its floor, the ratio, state bytes
(explain().state_bytes for optcompile; measured from the optimizer's state for the rest),
kernel launches per step (explain()) and what explain() says about fusion. The issue's
targets: int8 <= 1.10x its floor and faster than the fp32 step.

Then, on fresh copies, 20 steps of fp32, bf16 and int8 (the same grads every step; the first
when built): the largest difference of a compressed run's params from the fp32 run's.

Usage (GPU machine, from the repository root; about a minute):
  PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python benchmarks/state_dtype_gpu.py \\
      [--json /tmp/state_dtype.json] [--variants fp32,int8-before,int8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from guard_check import gpt2_shapes
from state_dtype_before import kernels_before, launch_shape
from step_time import copy_bandwidth, time_per_step

MIN_NUMEL = 4096
STATE_BYTES = {
    "fp32": 4.0,
    "fused": 4.0,
    "bf16": 2.0,
    "int8": 1 + 4 / 256,
    "torchao-8bit": 1 + 4 / 256,
}
VARIANTS = "fp32,bf16-before,bf16,int8-before,int8,int8@1024x4,fused,torchao-8bit"


def _format(variant: str) -> str:
    """The state format of a variant: ``int8-before`` and ``int8@512x1`` are int8."""
    return variant.split("@")[0].removesuffix("-before")


def make_params(device: str, tiny: bool = False) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in [(64, 128), (128,), (256, 64)] * 2 if tiny else gpt2_shapes():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device))
        p.grad = torch.randn(shape, generator=gen, device=device) * 1e-2
        params.append(p)
    return params


def floor_bytes(variant: str, params: list[torch.nn.Parameter]) -> float:
    total = 0.0
    for p in params:
        n = p.numel()
        state = STATE_BYTES[_format(variant)] if n >= MIN_NUMEL else 4.0
        total += n * (3 * 4 + 2 * 2 * state)  # p read+write, g read; m, v read+write
    return total


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
            elif hasattr(t, "__tensor_flatten__"):  # torchao's quantized tensor subclasses
                names, _ = t.__tensor_flatten__()
                total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
    return total


def build(
    variant: str, params: list[torch.nn.Parameter]
) -> tuple[torch.optim.Optimizer, Callable[[], Any]]:
    import optcompile

    copies = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad
        copies.append(q)
    options = {"lr": 1e-3, "weight_decay": 0.01}
    if variant == "fused":
        opt: torch.optim.Optimizer = torch.optim.AdamW(copies, fused=True, **options)
    elif variant == "torchao-8bit":
        try:
            from torchao.optim import AdamW8bit  # type: ignore[import-not-found]
        except ImportError:  # torchao before 0.11
            from torchao.prototype.low_bit_optim import AdamW8bit  # type: ignore[import-not-found]

        opt = AdamW8bit(copies, **options)
    else:
        dtype = {"fp32": None, "bf16": torch.bfloat16, "int8": "int8"}[_format(variant)]
        opt = optcompile.compile(torch.optim.AdamW(copies, **options), state_dtype=dtype)
        if variant.endswith("-before"):
            context = kernels_before()
        elif "@" in variant:
            block, warps = variant.split("@")[1].split("x")
            context = launch_shape(int(block), int(warps))
        else:
            context = contextlib.nullcontext()
        with context:  # the step compiles its kernels when it first runs
            opt.step()
    return opt, opt.step


DRIFT_STEPS = 20


def _params_after(opt: torch.optim.Optimizer, steps: int) -> list[torch.Tensor]:
    for _ in range(steps):
        opt.step()
    return [p.detach().clone() for p in opt.param_groups[0]["params"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here too")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (--tiny shapes)")
    parser.add_argument("--tiny", action="store_true", help="six small tensors, not GPT-2")
    args = parser.parse_args()
    import optcompile

    device = args.device
    bandwidth = copy_bandwidth(device)
    params = make_params(device, args.tiny)
    rows = []
    for variant in args.variants.split(","):
        try:
            opt, step = build(variant, params)
        except ImportError as exc:
            print(f"{variant}: skipped ({exc})")
            continue
        seconds = time_per_step(step, device)
        floor = floor_bytes(variant, params) / bandwidth
        row: dict[str, Any] = {
            "variant": variant,
            "step_us": seconds * 1e6,
            "floor_us": floor * 1e6,
            "ratio": seconds / floor,
            "state_MiB": state_bytes(opt) / 2**20,
        }
        if _format(variant) in ("fp32", "bf16", "int8"):
            explanation = optcompile.explain(opt)
            row["launches"] = explanation.kernel_launches_per_step
            row["cudagraphs"] = explanation.cudagraphs
            row["fusion"] = next(
                (ln[2:] for ln in explanation.graph_code.splitlines() if ln.startswith("# ")), ""
            )[:120]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del opt, step
        if device == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; {name}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )
    print(f"{'variant':<14}{'step us':>10}{'floor us':>10}{'ratio':>8}{'state MiB':>11}  launches")
    for r in rows:
        print(
            f"{r['variant']:<14}{r['step_us']:>10.1f}{r['floor_us']:>10.1f}{r['ratio']:>8.2f}"
            f"{r['state_MiB']:>11.1f}  {r.get('launches', '')} {r.get('fusion', '')}"
        )
    for new in ("bf16", "int8"):
        by_variant = {r["variant"]: r for r in rows}
        if new in by_variant and f"{new}-before" in by_variant:
            a, b = by_variant[f"{new}-before"], by_variant[new]
            print(
                f"{new} state: {a['step_us']:.1f} us ({a['ratio']:.2f}x its floor) before, "
                f"{b['step_us']:.1f} us ({b['ratio']:.2f}x) now; floor {b['floor_us']:.1f} us"
            )
    reference = _params_after(build("fp32", params)[0], DRIFT_STEPS - 1)
    for variant in ("bf16", "int8"):
        got = _params_after(build(variant, params)[0], DRIFT_STEPS - 1)
        diff = max((a - b).abs().max().item() for a, b in zip(got, reference, strict=True))
        print(f"{variant}: max |param - fp32 state's param| after {DRIFT_STEPS} steps: {diff:.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
