"""CPU step time against the memory-bandwidth floor: the generated C backend vs the anchors.

Usage: OPTCOMPILE_NATIVE=sync python benchmarks/cpu_backend.py [--sets gpt2,mlp,tiny]
       [--optimizers AdamW,SGD momentum,Adagrad,Adafactor] [--tiny-optimizers AdamW,RAdam,
       Rprop,ASGD] [--torch-compile AdamW] [--rounds 7] [--out FILE]
Writes benchmarks/results/cpu_backend.md (or FILE).

For each parameter set ("gpt2": GPT-2 124M's 148 tensors in float32; "mlp": a 2.1M-value MLP,
2x1024x1024 + 1024x1; "tiny": 2,000 tensors of shape (4,)) and optimizer (default options:
eager takes its for-loop path on the CPU), these step the same parameters and grads, each
with its own state:

- ``eager for-loop`` and ``eager foreach`` (``foreach=True``): torch.optim;
- ``torch.compile``: ``torch.compile(opt.step)`` of the for-loop optimizer (Inductor's C++;
  for the optimizers named by ``--torch-compile`` only: its compile takes minutes here);
- ``optcompile torch``: ``backend="torch"`` (the batched, in-place torch plan);
- ``optcompile cpu``: ``backend="cpu"``, what ``"auto"`` picks where a C compiler is found.

The floor is the bytes the step must move (AdamW: read p, g, m, v, write p, m, v: 28 bytes
per float32 value; SGD momentum and Adagrad: 20; Adafactor: p, g read, p written, its
factored state negligible: 12; RAdam, Rprop 28; ASGD 20) over the copy bandwidth measured in
the same run, with all cores (a 256 Mi-value float32 ``copy_``, read + write counted, median
of 15). A copy's destination is also read into the cache before it is written (write
allocate), so a copy moves 3 bytes for every 2 counted, which an in-place step (its written
tensors were read anyway) does not: the step can beat this floor. The in-place bandwidth
(``x.add_(y)`` over the same size: 12 bytes per value counted, none uncounted) is reported
too, and the ratio to the floor it gives. Times are medians
of ``rounds`` rounds of one step each, the variants interleaved within a round (load from
other processes hits them alike), all with ``torch.get_num_threads()`` = every core; the
first steps (trace, state init, compile) are not timed but the first call of each compiled
variant is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optcompile
import torch

sys.path.insert(0, str(Path(__file__).parent))
from guard_check import gpt2_shapes

RESULTS = Path(__file__).parent / "results"
OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], dict[str, Any], int]] = {
    # name: (class, options, bytes moved per float32 value)
    "AdamW": (torch.optim.AdamW, {}, 28),
    "SGD momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, 20),
    "Adagrad": (torch.optim.Adagrad, {}, 20),
    "Adafactor": (torch.optim.Adafactor, {}, 12),
    "RAdam": (torch.optim.RAdam, {}, 28),
    "Rprop": (torch.optim.Rprop, {}, 28),
    "ASGD": (torch.optim.ASGD, {}, 20),
}
SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "gpt2": gpt2_shapes,
    "mlp": lambda: [(1024, 1024), (1024,), (1024, 1024), (1024,), (1, 1024), (1,)],
    "tiny": lambda: [(4,)] * 2000,
}
LABELS = {
    "gpt2": "GPT-2 124M (148 tensors, 124M values)",
    "mlp": "MLP 2x1024x1024 (6 tensors, 2.1M values)",
    "tiny": "2000 x (4,)",
}
VARIANTS = [
    "eager for-loop",
    "eager foreach",
    "torch.compile",
    "optcompile torch",
    "optcompile cpu",
]


def copy_bandwidth() -> float:
    """Bytes per second of a large float32 copy on all cores (read + write counted)."""
    src = torch.randn(256 * 1024 * 1024)
    dst = torch.empty_like(src)
    times = []
    for _ in range(17):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * 256 * 1024 * 1024 * 4 / statistics.median(times[2:])


def inplace_bandwidth() -> float:
    """Bytes per second of ``x.add_(y)`` over 256 Mi float32 values (read x, y; write x)."""
    x = torch.randn(256 * 1024 * 1024)
    y = torch.randn(256 * 1024 * 1024)
    times = []
    for _ in range(17):
        start = time.perf_counter()
        x.add_(y)
        times.append(time.perf_counter() - start)
    del x, y
    return 3 * 256 * 1024 * 1024 * 4 / statistics.median(times[2:])


def _params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen) * 1e-3
        params.append(p)
    return params


def _build(variant: str, opt_name: str, params: list[torch.nn.Parameter]) -> Callable[[], Any]:
    cls, options, _ = OPTIMIZERS[opt_name]
    if variant == "eager foreach":
        return cls(params, foreach=True, **options).step
    opt = cls(params, foreach=False, **options)
    if variant == "torch.compile":
        return torch.compile(opt.step)  # type: ignore[no-any-return]
    if variant.startswith("optcompile"):
        return optcompile.compile(opt, backend=variant.split()[1]).step
    return opt.step


def run_case(
    set_name: str, opt_name: str, rounds: int, variants: list[str], floor_s: float
) -> dict[str, Any]:
    params = _params(SETS[set_name]())
    steps: dict[str, Callable[[], Any]] = {}
    first: dict[str, float] = {}
    for variant in variants:
        start = time.perf_counter()
        steps[variant] = _build(variant, opt_name, params)
        steps[variant]()
        first[variant] = time.perf_counter() - start
        for _ in range(2):
            steps[variant]()
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            start = time.perf_counter()
            steps[variant]()
            times[variant].append(time.perf_counter() - start)
    medians = {v: statistics.median(t) for v, t in times.items()}
    backend = ""
    if "optcompile cpu" in steps:
        step = steps["optcompile cpu"]
        report = optcompile.explain(step.__self__)  # type: ignore[attr-defined]
        notes = [ln[2:] for ln in report.graph_code.splitlines()[:2] if ln.startswith("# ")]
        backend = notes[0] if notes else ""
    return {
        "set": set_name,
        "optimizer": opt_name,
        "floor_s": floor_s,
        "median_s": medians,
        "first_call_s": first,
        "cpu_plan": backend,
    }


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sets", default="gpt2,mlp,tiny")
    parser.add_argument("--optimizers", default="AdamW,SGD momentum,Adagrad,Adafactor")
    parser.add_argument("--tiny-optimizers", default="AdamW,RAdam,Rprop,ASGD")
    parser.add_argument("--torch-compile", default="AdamW", help="optimizers to torch.compile")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS / "cpu_backend.md"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    load_before = _load()
    bandwidth = copy_bandwidth()
    inplace = inplace_bandwidth()
    compiled = set(args.torch_compile.split(",")) if args.torch_compile else set()
    variants = [v for v in VARIANTS if v != "torch.compile" or compiled]
    rows = []
    for set_name in args.sets.split(","):
        values = sum(torch.Size(s).numel() for s in SETS[set_name]())
        names = args.tiny_optimizers if set_name == "tiny" else args.optimizers
        for opt_name in names.split(","):
            floor_s = values * OPTIMIZERS[opt_name][2] / bandwidth
            case_variants = [
                v
                for v in variants
                if v != "torch.compile" or (set_name != "tiny" and opt_name in compiled)
            ]
            row = run_case(set_name, opt_name, args.rounds, case_variants, floor_s)
            row["inplace_floor_s"] = values * OPTIMIZERS[opt_name][2] / inplace
            rows.append(row)
            print(
                set_name,
                opt_name,
                {v: f"{t * 1e3:.2f} ms" for v, t in row["median_s"].items()},
                f"floor {floor_s * 1e3:.2f} ms",
                flush=True,
            )
            torch._dynamo.reset()
    write(args, rows, (bandwidth, inplace), cores, load_before, variants)


def write(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    bandwidths: tuple[float, float],
    cores: int,
    load_before: float,
    variants: list[str],
) -> None:
    bandwidth, inplace = bandwidths
    try:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout
        compiler = cc.splitlines()[0]
    except OSError:
        compiler = "none"
    lines = [
        "# CPU step time against the memory-bandwidth floor: generated C vs the anchors",
        "",
        f"Command: `OPTCOMPILE_NATIVE=sync python benchmarks/cpu_backend.py --sets {args.sets} "
        f"--optimizers {args.optimizers!r} --tiny-optimizers {args.tiny_optimizers} "
        f"--torch-compile {args.torch_compile!r} --rounds {args.rounds}` (repo root)  ",
        f"Device: {platform.machine()}, {platform.processor() or 'cpu'}; **{cores} cores** "
        f"(torch threads: {torch.get_num_threads()}), shared with other processes (load "
        f"{load_before:.2f} at start, {_load():.2f} at end)  ",
        f"Versions: Python {platform.python_version()}, torch {torch.__version__}; C compiler: "
        f"{compiler}  ",
        f"Bandwidth measured in this run (all cores): copy {bandwidth / 1e9:.2f} GB/s (the "
        f"floor's), in place (`x.add_(y)`) {inplace / 1e9:.2f} GB/s  ",
        "",
        "Milliseconds per `opt.step()` (median of interleaved rounds); in brackets: step time "
        "/ floor. Default options (eager's for-loop path; `torch.compile` compiles that step).",
        "",
        "| set | optimizer | floor | "
        + " | ".join(variants)
        + " | cpu / foreach | cpu / in-place floor |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in variants) + " | ---: | ---: |",
    ]
    for row in rows:
        floor = row["floor_s"]
        cells = []
        for v in variants:
            t = row["median_s"].get(v)
            cells.append("n/a" if t is None else f"{t * 1e3:.2f} ({t / floor:.2f}x)")
        cpu = row["median_s"]["optcompile cpu"]
        ratio = cpu / row["median_s"]["eager foreach"]
        lines.append(
            f"| {LABELS[row['set']]} | {row['optimizer']} | {floor * 1e3:.2f} | "
            + " | ".join(cells)
            + f" | {ratio:.2f} | {cpu / row['inplace_floor_s']:.2f} |"
        )
    lines += [
        "",
        "First call (s: state init + trace + lowering/compile + one step):",
        "",
        "| set | optimizer | " + " | ".join(variants) + " | cpu plan |",
        "| --- | --- | " + " | ".join("---:" for _ in variants) + " | --- |",
    ]
    for row in rows:
        cells = [
            f"{row['first_call_s'][v]:.2f}" if v in row["first_call_s"] else "n/a" for v in variants
        ]
        lines.append(
            f"| {LABELS[row['set']]} | {row['optimizer']} | "
            + " | ".join(cells)
            + f" | {row['cpu_plan']} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
