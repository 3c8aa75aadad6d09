"""Demo: compile AdamW for a small model, check it against eager, time both.

Run with ``python -m optcompile.demo`` (or ``./nox -s demo``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

import optcompile


def _model(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def _set_grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _why_slower(backend: str) -> str:
    """Why a compiled step of ``backend`` can lose to eager on this demo's model."""
    if backend == "cpu":
        return (
            "Each compiled call pays a fixed cost before the generated C runs (the guard "
            "check, gathering the inputs, the step counts' arithmetic on the host, the "
            "threads' start): tens of microseconds, which a model this small does not win "
            "back; try a larger --width. A loaded machine (other processes on every core) "
            "slows the threaded loop more than eager's single-threaded ops."
        )
    if backend == "torch":
        return (
            "The torch backend runs the traced graph's ATen ops (batched over the "
            "parameters, in place); backend='auto' picks it on the CPU only where no C "
            "compiler builds the generated loops (explain() says why). The README's "
            "Limitations say more."
        )
    return (
        "On the GPU, a step this small is bound by host time per call; the README's "
        "benchmarks give the figures per model size."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="steps compared against eager")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--timing-steps", type=int, default=50)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = _model(args.width, args.depth)
    reference = copy.deepcopy(model)
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    eager = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)

    start = time.perf_counter()
    _set_grads(model, 0)
    opt.step()
    first_call = time.perf_counter() - start
    _set_grads(reference, 0)
    eager.step()
    for step in range(1, args.steps):
        for m, o in ((model, opt), (reference, eager)):
            _set_grads(m, step)
            o.step()

    max_diff = 0.0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        max_diff = max(max_diff, (p - q).abs().max().item())
        for key, value in eager.state[q].items():
            max_diff = max(max_diff, (opt.state[p][key] - value).abs().max().item())

    eager_ms = _median_ms(eager.step, args.timing_steps)
    compiled_ms = _median_ms(opt.step, args.timing_steps)
    report = optcompile.explain(opt)
    n_params = sum(p.numel() for p in model.parameters())
    device = next(model.parameters()).device
    print(f"AdamW over {len(list(model.parameters()))} tensors, {n_params:,} parameters, {device}")
    print(f"first call (trace + lower): {first_call * 1e3:.0f} ms; traces: {report.traces}")
    print(f"max |compiled - eager| over params and state after {args.steps} steps: {max_diff:.3g}")
    print(f"backend: {report.backend} ({report.backend_reason})")
    print(
        f"step time, median of {args.timing_steps}: eager {eager_ms:.3f} ms, "
        f"compiled ({report.backend} backend) {compiled_ms:.3f} ms"
    )
    speedup = round(eager_ms / compiled_ms, 2)  # (as printed)
    print(f"speed-up over eager: {speedup:.2f}x ({report.backend} backend)")
    slower = speedup < 1.0
    if slower:
        print(f"note: the compiled step is slower than eager here. {_why_slower(report.backend)}")
    ok = max_diff <= 1e-5 and report.traces == 1
    if not ok:
        print("MISMATCH")
    else:
        print("OK: results match eager" + (" (but slower: see the note)" if slower else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
