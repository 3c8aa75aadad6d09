"""Step time of the torch backend on the CPU: batched over lanes vs node by node vs eager.

Usage: python benchmarks/cpu_torch_backend.py [--sizes 2000 10000] [--rounds 7]
       [--mlp-rounds 101 | --all] [--out FILE]
Writes benchmarks/results/cpu_torch_backend.md (or FILE).

For each case (N parameters of shape (4,), or a small MLP) and optimizer (AdamW, SGD with
momentum 0.9, Adagrad; default options, so eager takes its for-loop path on the CPU and the
trace records it), five optimizers step copies of the same parameters with the same grads:

- ``batched``: ``optcompile.compile(opt, backend="torch")``: the torch backend's batched plan;
- ``node by node``: the same with the torch backend forced to its node-by-node plan, the
  writes eager made in place run in place (``reference.node_by_node``: what every graph ran
  before the batched plan);
- ``functional``: forced to the node-by-node plan of the functional graph (``TorchPlan``:
  what every graph ran before ``reinplace.py``);
- ``eager for-loop`` and ``eager foreach`` (``foreach=True``): the anchors.

Times are medians over ``rounds`` (for the MLP ``mlp-rounds``) rounds of one ``opt.step()``
each, the five variants interleaved within a round so that load from other processes hits
them alike, with one torch thread; the first three steps (trace, state init, guard build)
are not timed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optcompile
import optkernels.reference
import torch
from optkernels import TorchPlan
from optkernels.reference import node_by_node

RESULTS = Path(__file__).parent / "results"
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {}),
    "SGD momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {}),
}
# With --all: the other eight of torch.optim's eleven, default options.
OTHERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    name: (getattr(torch.optim, name), {"lr": 0.5} if name == "Adadelta" else {})
    for name in ("Adam", "NAdam", "RAdam", "Adamax", "Adadelta", "RMSprop", "Rprop", "ASGD")
}


def tiny_params(n: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, generator=gen)) for _ in range(n)]


def mlp_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(256, 256), torch.nn.GELU()]
    return list(torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).parameters())


def with_grads(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    gen = torch.Generator().manual_seed(1)
    for p in copies:
        p.grad = torch.randn(p.shape, generator=gen)
    return copies


PLANS: dict[str, Callable[[Any], Any]] = {
    "functional": lambda gm: TorchPlan(gm, reason="forced by the benchmark"),
    "node by node": lambda gm: node_by_node(gm, reason="forced by the benchmark"),
}


def forced(make: Callable[[], torch.optim.Optimizer], plan: Callable[[Any], Any]) -> Any:
    """``make()`` compiled on the torch backend with its plan forced to ``plan``."""
    original = optkernels.reference.TorchBackend.compile
    optkernels.reference.TorchBackend.compile = lambda self, gm: plan(gm)  # type: ignore[method-assign]
    try:
        opt = optcompile.compile(make(), backend="torch")
        for _ in range(3):  # traces (and retraces) while the plan is forced
            opt.step()
    finally:
        optkernels.reference.TorchBackend.compile = original  # type: ignore[method-assign]
    return opt


def build(params: list[torch.nn.Parameter], name: str) -> dict[str, Callable[[], Any]]:
    cls, options = OPTIMIZERS[name]
    steps: dict[str, Callable[[], Any]] = {}
    batched = optcompile.compile(cls(with_grads(params), **options), backend="torch")
    steps["batched"] = batched.step
    for label, plan in PLANS.items():
        steps[label] = forced(lambda: cls(with_grads(params), **options), plan).step
    steps["eager for-loop"] = cls(with_grads(params), **options).step
    steps["eager foreach"] = cls(with_grads(params), foreach=True, **options).step
    for step in steps.values():
        for _ in range(3):
            step()
    assert "batched over lanes" in optcompile.explain(batched).graph_code
    return steps


def measure(steps: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mlp-rounds", type=int, default=101)  # steps of about 1 ms
    parser.add_argument("--all", action="store_true", help="all eleven optimizers, no MLP")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_torch_backend.md")
    args = parser.parse_args()
    warnings.simplefilter("ignore", optcompile.FallbackWarning)
    # Two OpenMP threads on two cores that other processes also use wait on each other:
    # an op over 0.4M values took 1 ms or 70 ms depending on the load. One thread is steady.
    torch.set_num_threads(1)
    cases = [(f"{n} x (4,)", lambda n=n: tiny_params(n), args.rounds) for n in args.sizes]
    if args.all:
        OPTIMIZERS.update(OTHERS)
    else:
        cases.append(("MLP 6x256x256 (14 tensors, 0.4M values)", mlp_params, args.mlp_rounds))
    load_start = os.getloadavg()[0]
    rows = []
    for label, make, rounds in cases:
        params = make()
        for name in OPTIMIZERS:
            ms = measure(build(params, name), rounds)
            rows.append((label, name, ms))
            print(label, name, {k: round(v, 2) for k, v in ms.items()}, flush=True)
    load_end = os.getloadavg()[0]
    lines = [
        "# Torch backend on the CPU: batched over lanes vs node by node vs eager",
        "",
        f"Command: `OPTCOMPILE_NATIVE=sync python benchmarks/cpu_torch_backend.py "
        f"--sizes {' '.join(map(str, args.sizes))} --rounds {args.rounds} "
        + ("--all" if args.all else f"--mlp-rounds {args.mlp_rounds}")
        + "` (repo root)  ",
        f"Device: {platform.machine()}; {os.cpu_count()} CPU cores shared with other "
        f"processes (load {load_start:.2f} at start, {load_end:.2f} at end); "
        f"Versions: Python {sys.version.split()[0]}, torch {torch.__version__}  ",
        "Milliseconds per `opt.step()`, median of interleaved rounds (see the script's "
        "docstring). Before: `functional` is the node-by-node plan of the functional graph, "
        "`node by node` the same with eager's in-place writes run in place (reinplace.py); "
        "after: `batched`, the plan the torch backend picks for these steps. Default "
        "options: eager takes its for-loop path on the CPU, and so does the trace.",
        "",
        "| params | optimizer | functional | node by node | batched | eager for-loop "
        "| eager foreach | batched / for-loop | batched / foreach |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, name, ms in rows:
        lines.append(
            f"| {label} | {name} | {ms['functional']:.2f} | {ms['node by node']:.2f} "
            f"| **{ms['batched']:.2f}** "
            f"| {ms['eager for-loop']:.2f} | {ms['eager foreach']:.2f} "
            f"| {ms['batched'] / ms['eager for-loop']:.2f} "
            f"| {ms['batched'] / ms['eager foreach']:.2f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
