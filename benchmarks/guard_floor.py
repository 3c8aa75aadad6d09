"""What a sound hit must check, each part alone: the floor under a compiled step's host time.

    python benchmarks/guard_floor.py [--set 200x64x64] [--device cuda|cpu] [--calls 3000]

200 tensors of 64x64, AdamW (lr 1e-3, weight_decay 0.01) with capturable=True, compiled by
optcompile (CUDA graphs on a GPU). Times (host microseconds, the median of 7 rounds of
``--calls`` calls, warm caches) the whole step, its cache lookup with the prologue, the
prologue's C++ guard tree, its Python residual, and alone the three native loops every hit
runs inside that tree: the params (identity, metadata, data pointer) with their grads
(metadata; read for their addresses), the pinned state tensors (metadata, data pointer:
``.data =``, ``t_()``, ``set_()`` or ``requires_grad_()`` on one changes them in place, and
nothing in torch signals it), and the state dicts' version tags; then one CUDA graph replay of one
kernel. On the CPU (``TRITON_INTERPRET=1``) neither the step nor a replay is timed. A
pure-Python anchor (a sum of 2,000 squares) gives the host's speed: machines of one kind
differ by up to 2x. The three loops are work no sound hit can skip: their sum is the floor
of a step's host time with the guards kept.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import step_time
from optcompile.api import _OPTIMIZERS
from optguard import native


def _median_us(fn: Callable[[], Any], calls: int) -> float:
    for _ in range(max(calls // 10, 1)):
        fn()
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="200x64x64")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    anchor = _median_us(lambda: sum(i * i for i in range(2000)), max(args.calls // 10, 1))
    print(f"{args.device}; torch {torch.__version__}; {args.set} AdamW capturable=True")
    print(f"pure-Python anchor (a sum of 2,000 squares): {anchor:.1f} µs")
    params = step_time.make_params(args.set, args.device)
    step = step_time.build("optcompile-capturable", "AdamW", params)
    for _ in range(30 if args.device == "cuda" else 3):  # (interpreted kernels on the CPU)
        step()
    opt = step.__self__  # type: ignore[attr-defined]
    compiled, L = _OPTIMIZERS[opt], {"opt": opt}
    entry = compiled.cache.entries[0].value
    fast = entry.prologue.fast
    module = native.module()
    if fast is None or module is None:
        raise SystemExit(f"no fast tier or native module: {entry.prologue.fast_note}")
    items = [p for group in opt.param_groups for p in group["params"]]
    grad_spec = module.spec([p.grad for p in items], False)
    item_spec = module.spec(items, True, True)
    states = [v for p in items for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    held = module.held(states, [s.data_ptr() for s in states])
    versions = module.versions(opt.state)
    tree_check, residual = fast._checks
    native_rows = {
        f"{len(items)} params + their grads (native)": lambda: module.match_both(
            grad_spec, item_spec, items
        ),
        f"{len(states)} state tensors (native)": lambda: module.held_match(held, None),
        f"{len(opt.state) + 1} dict versions (native)": lambda: module.versions_match(
            versions, opt.state
        ),
    }
    # (on the CPU the kernels run in Triton's interpreter: milliseconds, no step timed)
    whole: dict[str, Callable[[], Any]] = {"whole step": step} if args.device == "cuda" else {}
    rows: dict[str, Callable[[], Any]] = {
        **whole,
        "cache lookup + prologue": lambda: (compiled.cache.find(L), entry.prologue.release()),
        "C++ guard tree": lambda: tree_check(L),
        "Python residual": lambda: residual(L),
        **native_rows,
    }
    print("| part | host µs |\n| --- | ---: |")
    floor = 0.0
    for name, fn in rows.items():
        spent = _median_us(fn, args.calls)
        floor += spent if name in native_rows else 0.0
        print(f"| {name} | {spent:.2f} |")
    if args.device == "cuda":
        x = torch.zeros(1, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
        print(f"| graph replay (one kernel) | {_median_us(graph.replay, args.calls):.2f} |")
        torch.cuda.synchronize()
    print(f"| the three native loops together | {floor:.2f} |")


if __name__ == "__main__":
    main()
