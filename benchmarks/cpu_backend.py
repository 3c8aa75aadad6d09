"""CPU step time against the memory-bandwidth floor: the generated C backend vs the anchors.

Usage: OPTCOMPILE_NATIVE=sync python benchmarks/cpu_backend.py [--sets gpt2,mlp,tiny]
       [--optimizers AdamW,SGD momentum,Adagrad,Adafactor] [--tiny-optimizers AdamW,RAdam,
       Rprop,ASGD] [--torch-compile AdamW] [--rounds 7] [--bandwidth-runs 25] [--out FILE]
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
factored state negligible: 12; RAdam, Rprop 28; ASGD 20) over the best rate, in the same
run, of a generated C loop moving those bytes with no math: the step's own streams (AdamW:
4 tensors of the step's size read, 3 of them written in place), all cores,
``--bandwidth-runs`` timed runs just before and just after each row (best, as STREAM
reports, since load from other processes only ever slows a run). A copy (``dst.copy_``)
and STREAM's triad (``a = b + 3c``) over 1 GiB arrays are measured too, at the start and the
end, and the last columns divide by their best: fewer streams than an optimizer's, and
their destination is read into the cache before it is written (write allocate) without
being counted, which an in-place step's is not, so a step can beat those floors (on 2 cores
a core's outstanding misses, not the memory, bound a stream's rate: more streams move more).
The 1-minute load average before and after each row
is reported with it. Times are medians
of ``rounds`` rounds of one step each, the variants interleaved within a round (load from
other processes hits them alike), all with ``torch.get_num_threads()`` = every core; the
first steps (trace, state init, compile) are not timed but the first call of each compiled
variant is reported.
"""

from __future__ import annotations

import argparse
import ctypes
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
from first_call_child import PHASES, Timer, _cpu, _patch_phases
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
# Bytes per value -> (tensors read, tensors of those written): the step's memory streams.
STREAMS = {28: (4, 3), 20: (3, 2), 12: (2, 1)}
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


VALUES = 256 * 1024 * 1024  # float32 values per array of the bandwidth kernels (1 GiB)


def _rates(kernel: Callable[[], Any], nbytes: int, runs: int) -> tuple[float, float]:
    """(best, median) bytes per second of ``kernel`` over ``runs`` timed calls (2 untimed)."""
    for _ in range(2):
        kernel()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        kernel()
        times.append(time.perf_counter() - start)
    return nbytes / min(times), nbytes / statistics.median(times)


def bandwidths(runs: int) -> dict[str, tuple[float, float]]:
    """(best, median) bytes per second, all cores, over 1 GiB float32 arrays, of: a copy
    (``dst.copy_(src)``: 8 bytes per value counted), STREAM's triad (``a = b + 3 c``:
    12 counted; neither counts the read of the destination before it is written), and an
    in-place add (``x.add_(y)``: 12 counted, nothing uncounted)."""
    b = torch.randn(VALUES)
    c = torch.randn(VALUES)
    a = torch.empty_like(b)
    found = {
        "copy": _rates(lambda: a.copy_(b), 8 * VALUES, runs),
        "triad": _rates(lambda: torch.add(b, c, alpha=3.0, out=a), 12 * VALUES, runs),
        "in place": _rates(lambda: b.add_(c, alpha=1e-9), 12 * VALUES, runs),
    }
    return found


def _streams_kernel(reads: int, writes: int) -> Callable[..., Any]:
    """A generated C loop over ``reads`` float32 arrays writing the first ``writes`` of them
    in place (each ``a_k[i] = a_0[i] + ... + a_{reads-1}[i]``): a step's memory traffic with
    no math, in work items of 32,768 values over OpenMP threads (one thread for fewer
    values: waking another costs more), as the CPU backend's."""
    from optkernels.c_kernel import build, find_compiler

    compiler = find_compiler()
    assert not isinstance(compiler, str), compiler
    total = " + ".join(f"a{k}[i]" for k in range(reads))
    stores = " ".join(f"a{k}[i] = s;" for k in range(writes))
    loads = "\n".join(
        f"    float *restrict a{k} = (float *)(intptr_t)ptrs[{k}];" for k in range(reads)
    )
    source = f"""#include <stdint.h>
void streams(const int64_t *ptrs, int64_t n, int threads) {{
{loads}
    #pragma omp parallel for if(n > 32768) num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < n; b += 32768) {{
        const int64_t end = b + 32768 < n ? b + 32768 : n;
        #pragma omp simd
        for (int64_t i = b; i < end; ++i) {{ const float s = {total}; {stores} }}
    }}
}}
"""
    fn = build(compiler, source).streams
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    fn.restype = None
    return fn  # type: ignore[no-any-return]


def streams_rate(values: int, nbytes: int, runs: int) -> tuple[float, float]:
    """(best, median) bytes per second of the step's streams (``STREAMS``) over ``values``
    float32 values each: the bytes the step moves, moved with no math, all cores."""
    reads, writes = STREAMS[nbytes]
    arrays = [torch.full((values,), 1e-3 * (k + 1)) for k in range(reads)]
    ptrs = torch.tensor([a.data_ptr() for a in arrays], dtype=torch.int64)
    fn = _streams_kernel(reads, writes)
    threads = torch.get_num_threads()
    return _rates(lambda: fn(ptrs.data_ptr(), values, threads), values * nbytes, runs)


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


# Times the phases of the compiled variants' first calls (off otherwise: the steps run untimed).
TIMER = Timer()
TIMER.active = False


def _first_call(variant: str, opt_name: str, params: list[Any]) -> tuple[Callable[[], Any], Any]:
    """The variant's step, after its first call: (wall s, CPU s of the process and the
    compilers it waited for, wall phases, CPU phases) of that call."""
    TIMER.seconds, TIMER.cpu = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
    TIMER.active = variant.startswith("optcompile")
    start, cpu_start = time.perf_counter(), _cpu()
    try:
        step = _build(variant, opt_name, params)
        step()
    finally:
        TIMER.active = False
    wall, cpu = time.perf_counter() - start, _cpu() - cpu_start
    seconds, cpu_seconds = dict(TIMER.seconds), dict(TIMER.cpu)
    seconds["other"] = wall - sum(seconds.values())
    cpu_seconds["other"] = cpu - sum(cpu_seconds.values())
    return step, (wall, cpu, seconds, cpu_seconds)


def run_case(set_name: str, opt_name: str, rounds: int, variants: list[str]) -> dict[str, Any]:
    params = _params(SETS[set_name]())
    steps: dict[str, Callable[[], Any]] = {}
    first: dict[str, float] = {}
    first_cpu: dict[str, float] = {}
    phases: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    for variant in variants:
        steps[variant], (first[variant], first_cpu[variant], wall, cpu) = _first_call(
            variant, opt_name, params
        )
        if variant.startswith("optcompile"):
            phases[variant] = (wall, cpu)
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
        "median_s": medians,
        "first_call_s": first,
        "first_call_cpu_s": first_cpu,
        "first_call_phases": phases,
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
    parser.add_argument("--bandwidth-runs", type=int, default=25)
    parser.add_argument("--out", default=str(RESULTS / "cpu_backend.md"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    _patch_phases(TIMER)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    loads = [_load()]
    measured = [bandwidths(args.bandwidth_runs)]
    compiled = set(args.torch_compile.split(",")) if args.torch_compile else set()
    variants = [v for v in VARIANTS if v != "torch.compile" or compiled]
    rows = []
    for set_name in args.sets.split(","):
        values = sum(torch.Size(s).numel() for s in SETS[set_name]())
        names = args.tiny_optimizers if set_name == "tiny" else args.optimizers
        for opt_name in names.split(","):
            case_variants = [
                v
                for v in variants
                if v != "torch.compile" or (set_name != "tiny" and opt_name in compiled)
            ]
            load = _load()
            nbytes = OPTIMIZERS[opt_name][2]
            streams = streams_rate(values, nbytes, args.bandwidth_runs)
            row = run_case(set_name, opt_name, args.rounds, case_variants)
            row["bytes"] = values * nbytes
            row["streams"] = (streams, streams_rate(values, nbytes, args.bandwidth_runs))
            row["load"] = (load, _load())
            loads.append(_load())
            rows.append(row)
            print(
                set_name,
                opt_name,
                {v: f"{t * 1e3:.2f} ms" for v, t in row["median_s"].items()},
                f"load {row['load'][0]:.1f}-{row['load'][1]:.1f}",
                flush=True,
            )
            torch._dynamo.reset()
    measured.append(bandwidths(args.bandwidth_runs))
    loads.append(_load())
    write(args, rows, measured, cores, loads, variants)


def _gbs(rate: float) -> str:
    return f"{rate / 1e9:.2f}"


def write(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    measured: list[dict[str, tuple[float, float]]],
    cores: int,
    loads: list[float],
    variants: list[str],
) -> None:
    try:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout
        compiler = cc.splitlines()[0]
    except OSError:
        compiler = "none"
    # The floor: the best copy rate of the run (the fastest the memory moved: the floor is
    # then the least time, whatever load slowed the other measurements).
    copy = max(m["copy"][0] for m in measured)
    triad = max(m["triad"][0] for m in measured)
    lines = [
        "# CPU step time against the memory-bandwidth floor: generated C vs the anchors",
        "",
        f"Command: `OPTCOMPILE_NATIVE=sync python benchmarks/cpu_backend.py --sets {args.sets} "
        f"--optimizers {args.optimizers!r} --tiny-optimizers {args.tiny_optimizers} "
        f"--torch-compile {args.torch_compile!r} --rounds {args.rounds} --bandwidth-runs "
        f"{args.bandwidth_runs}` (repo root)  ",
        f"Device: {platform.machine()}, {platform.processor() or 'cpu'}; **{cores} cores** "
        f"(torch threads: {torch.get_num_threads()}), shared with other processes: 1-minute "
        f"load average {loads[0]:.2f} at start, {loads[-1]:.2f} at end, {min(loads):.2f}-"
        f"{max(loads):.2f} over the run (per row below)  ",
        f"Versions: Python {platform.python_version()}, torch {torch.__version__}; C compiler: "
        f"{compiler}  ",
        "",
        f"Bandwidth, all cores, 1 GiB float32 arrays, {args.bandwidth_runs} timed runs each, "
        "at the start and at the end of the run (GB/s, best / median):",
        "",
        "| kernel | bytes counted per value | start | end |",
        "| --- | ---: | ---: | ---: |",
    ]
    counted = {
        "copy": "8 (`dst.copy_(src)`)",
        "triad": "12 (`a = b + 3c`)",
        "in place": "12 (`x.add_(y)`)",
    }
    for kernel, what in counted.items():
        cells = [f"{_gbs(m[kernel][0])} / {_gbs(m[kernel][1])}" for m in measured]
        lines.append(f"| {kernel} | {what} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Floor (per row): the bytes the step moves over the best rate of a generated C loop "
        "with the step's own memory streams and no math (AdamW: 4 tensors read, 3 of them "
        "written in place; SGD momentum, Adagrad: 3 and 2; Adafactor: 2 and 1), over as many "
        f"values as the step, all cores, {args.bandwidth_runs} timed runs just before and "
        "again just after the row; its best rate in brackets (GB/s). Milliseconds per "
        "`opt.step()` (median of interleaved rounds); in brackets: step time / floor. The "
        f"last two columns divide optcompile cpu by the floors of the best copy ({_gbs(copy)} "
        f"GB/s) and triad ({_gbs(triad)} GB/s) rates above instead. Default options (eager's "
        "for-loop path; `torch.compile` compiles that step).",
        "",
        "| set | optimizer | load | floor | "
        + " | ".join(variants)
        + " | cpu / foreach | cpu / copy floor | cpu / triad floor |",
        "| --- | --- | ---: | ---: | "
        + " | ".join("---:" for _ in variants)
        + " | ---: | ---: | ---: |",
    ]
    for row in rows:
        rate = max(r[0] for r in row["streams"])
        floor = row["bytes"] / rate
        cells = []
        for v in variants:
            t = row["median_s"].get(v)
            cells.append("n/a" if t is None else f"{t * 1e3:.2f} ({t / floor:.2f}x)")
        cpu = row["median_s"]["optcompile cpu"]
        ratio = cpu / row["median_s"]["eager foreach"]
        lines.append(
            f"| {LABELS[row['set']]} | {row['optimizer']} | {row['load'][0]:.1f}-"
            f"{row['load'][1]:.1f} | {floor * 1e3:.2f} ({_gbs(rate)}) | "
            + " | ".join(cells)
            + f" | {ratio:.2f} | {cpu / (row['bytes'] / copy):.2f} | "
            f"{cpu / (row['bytes'] / triad):.2f} |"
        )
    lines += [
        "",
        "First call (s: state init + trace + lowering/compile + one step; wall, and in "
        "brackets CPU seconds of the process, all its threads, and of the C compiler it "
        "waited for: wall well above CPU is waiting, for cores or a lock; each variant's "
        "first call runs in this process after the variants left of it):",
        "",
        "| set | optimizer | " + " | ".join(variants) + " | cpu plan |",
        "| --- | --- | " + " | ".join("---:" for _ in variants) + " | --- |",
    ]
    for row in rows:
        cells = [
            f"{row['first_call_s'][v]:.2f} ({row['first_call_cpu_s'][v]:.2f})"
            if v in row["first_call_s"]
            else "n/a"
            for v in variants
        ]
        lines.append(
            f"| {LABELS[row['set']]} | {row['optimizer']} | "
            + " | ".join(cells)
            + f" | {row['cpu_plan']} |"
        )
    lines += [
        "",
        "The compiled variants' first calls by phase (first_call.py's phases, exclusive; wall "
        "s / CPU s; phases under 5 ms left out):",
        "",
    ]
    for row in rows:
        for variant, (wall, cpu) in row["first_call_phases"].items():
            parts = [f"{k} {wall[k]:.2f}/{cpu[k]:.2f}" for k in wall if wall[k] >= 0.005]
            lines.append(
                f"- {LABELS[row['set']]} {row['optimizer']}, {variant}: " + ", ".join(parts)
            )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
