"""Step time of AdamW, Adam, SGD(momentum) and Adagrad against the memory-bandwidth floor.

For each parameter set ("200x64x64", "gpt2" = GPT-2 124M shapes, "gpt2-bf16" = the same in
bfloat16, "1.3b" = GPT 1.3B shapes) and optimizer, every variant is timed: eager for-loop,
eager foreach, fused=True (where torch has it for the device), torch.compile (inductor, the
optimizer-step recipe from torch's docs) and optcompile (backend="triton", the user's default
options: capturable=False). Reported: median time per step, its ratio to the floor, device
operations per step (kernels and copies seen by the profiler in one step), and the first-call
(compile) time. optcompile's compile time is measured in fresh processes: cold (empty Triton,
optkernels and optguard caches) and warm (the same caches, filled by the cold process).

The floor: the bytes the optimizer must move (AdamW/Adam read p, g, m, v and write p, m, v;
SGD with momentum and Adagrad read p, g, one state and write p and the state; every tensor in
the params' dtype, as eager keeps state) over the copy bandwidth measured in the same run
(a 1 GiB device-to-device copy, bytes read plus written, median of do_bench).
Timing: CUDA events around ``steps`` consecutive steps (chosen so a run lasts ~100 ms, at
least 10 steps), after 5 warm-up steps; the median of 7 runs, per step. Grads stay fixed
(random, never zeros), so the params keep changing.

Usage (GPU machine):
  python benchmarks/step_time.py run --sets gpt2,1.3b --json /tmp/a.json
  python benchmarks/step_time.py report /tmp/a.json [/tmp/b.json ...] \
      --out benchmarks/results/step_time_h200.md --readme README.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from guard_check import gpt2_shapes

Shapes = list[tuple[int, ...]]


def gpt_1_3b_shapes() -> Shapes:
    """GPT 1.3B (24 layers, width 2048, 2048 positions): 292 parameter tensors."""
    d = 2048
    shapes: Shapes = [(50257, d), (2048, d)]
    for _ in range(24):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [*shapes, (d,), (d,)]


SETS: dict[str, tuple[Callable[[], Shapes], torch.dtype]] = {
    "200x64x64": (lambda: [(64, 64)] * 200, torch.float32),
    "gpt2": (gpt2_shapes, torch.float32),
    "gpt2-bf16": (gpt2_shapes, torch.bfloat16),
    "1.3b": (gpt_1_3b_shapes, torch.float32),
    "1.3b-bf16": (gpt_1_3b_shapes, torch.bfloat16),
    "gpt2-fp16": (gpt2_shapes, torch.float16),
    "1.3b-fp16": (gpt_1_3b_shapes, torch.float16),
    "tiny": (lambda: [(33,), (7, 5), ()] * 3, torch.float32),  # smoke test on the CPU
    # Host-time slope (host_time.py --slope): many tensors of 16 elements.
    "200x4x4": (lambda: [(4, 4)] * 200, torch.float32),
    "2000x4x4": (lambda: [(4, 4)] * 2000, torch.float32),
    "20000x4x4": (lambda: [(4, 4)] * 20000, torch.float32),
}
# name -> (class, options, tensors read, tensors written) per parameter element
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], int, int]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}, 4, 3),
    "Adam": (torch.optim.Adam, {"lr": 1e-3}, 4, 3),
    "SGD": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}, 3, 2),
    "Adagrad": (torch.optim.Adagrad, {"lr": 1e-2}, 3, 2),
}
VARIANTS = ["for-loop", "foreach", "fused", "torch.compile", "optcompile-nograph", "optcompile"]
# Not in the default run: optcompile with capturable=True (step counts on the device; what
# torch requires for its own CUDA-graph capture of an optimizer).
EXTRA_VARIANTS = ["optcompile-capturable"]


def make_params(set_name: str, device: str) -> list[torch.nn.Parameter]:
    shapes, dtype = SETS[set_name]
    gen = torch.Generator(device=device).manual_seed(0)
    # float16 grads of unit scale (as a GradScaler's scaled grads are): at 1e-2, eager's
    # float16 Adam step rounds (1 - beta2) * g * g and eps to 0 for most elements and turns
    # the params into NaNs at once (0 / 0), and every later step times NaN arithmetic (the
    # division's slow path) instead of a training step. params_are_finite checks a run.
    scale = 1.0 if dtype is torch.float16 else 1e-2
    params = []
    for shape in shapes():
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device).to(dtype))
        p.grad = torch.randn(shape, generator=gen, device=device).to(dtype) * scale
        params.append(p)
    return params


def floor_bytes(set_name: str, opt_name: str) -> int:
    shapes, dtype = SETS[set_name]
    _, _, reads, writes = OPTIMIZERS[opt_name]
    numel = sum(torch.Size(s).numel() for s in shapes())
    return numel * (reads + writes) * dtype.itemsize


def build(variant: str, opt_name: str, params: list[torch.nn.Parameter]) -> Callable[[], Any]:
    """A fresh optimizer over copies of ``params`` (sharing their grads); its step function."""
    return build_over_copies(variant, opt_name, params)[0]


def params_are_finite(copies: list[torch.nn.Parameter]) -> bool:
    """Whether the params a timed run stepped are all finite (a run that turned them into
    NaNs timed NaN arithmetic, not a training step)."""
    return all(bool(torch.isfinite(q).all()) for q in copies)


def build_over_copies(
    variant: str, opt_name: str, params: list[torch.nn.Parameter]
) -> tuple[Callable[[], Any], list[torch.nn.Parameter]]:
    """``build``'s step function and the copies of ``params`` it steps."""
    copies = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad
        copies.append(q)
    return _build(variant, opt_name, copies), copies


def _build(variant: str, opt_name: str, copies: list[torch.nn.Parameter]) -> Callable[[], Any]:
    import optcompile

    cls, options, _, _ = OPTIMIZERS[opt_name]
    if variant == "for-loop":
        return cls(copies, foreach=False, **options).step
    if variant == "foreach":
        return cls(copies, foreach=True, **options).step
    if variant == "fused":
        opt = cls(copies, fused=True, **options)  # raises where torch has no fused kernel
        opt.step()
        return opt.step
    if variant == "torch.compile":
        eager = cls(copies, **options)

        @torch.compile(fullgraph=False)
        def step() -> None:
            eager.step()

        return step
    if variant == "optcompile":  # the defaults: CUDA graphs where possible ("auto")
        return optcompile.compile(cls(copies, **options), backend="triton").step
    if variant == "optcompile-nograph":
        return optcompile.compile(cls(copies, **options), backend="triton", cudagraphs=False).step
    if variant == "optcompile-capturable":
        return optcompile.compile(cls(copies, capturable=True, **options), backend="triton").step
    raise ValueError(variant)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_per_step(step: Callable[[], Any], device: str, runs: int = 7) -> float:
    """Median seconds per step."""
    for _ in range(5):
        step()
    sync(device)

    def timed(n: int) -> float:
        if device != "cuda":
            start = time.perf_counter()
            for _ in range(n):
                step()
            return (time.perf_counter() - start) / n
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(n):
            step()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e-3 / n

    steps = max(10, min(500, int(0.1 / max(timed(3), 1e-7))))
    return statistics.median(timed(steps) for _ in range(runs))


def device_ops_per_step(step: Callable[[], Any], device: str) -> int | None:
    """Kernels and memory copies the profiler sees on the device during one step."""
    if device != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    if device != "cuda":
        return float("nan")
    import triton

    src = torch.randn(256 * 1024 * 1024, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=500, return_mode="median")
    return 2 * 256 * 1024 * 1024 * 4 / (ms * 1e-3)


def probe(set_name: str, opt_name: str, device: str) -> None:
    """Child process: seconds from compile to the end of the first optcompile step; then the
    same for a second optimizer of the same structure in this process (warm in-process)."""
    out = []
    for _ in range(2):
        params = make_params(set_name, device)
        sync(device)
        start = time.perf_counter()
        step = build("optcompile", opt_name, params)
        step()
        sync(device)
        out.append(time.perf_counter() - start)
    print(json.dumps({"first_call_s": out[0], "again_s": out[1]}))


def compile_times(set_name: str, opt_name: str, device: str) -> tuple[float, float, float]:
    """optcompile's first-call seconds: cold (fresh process, empty Triton and optkernels
    caches), warm (fresh process, caches filled) and in-process (a second optimizer)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(
            os.environ,
            TRITON_CACHE_DIR=os.path.join(cache, "triton"),
            OPTKERNELS_CACHE_DIR=os.path.join(cache, "src"),
            OPTGUARD_CACHE_DIR=os.path.join(cache, "guards"),
            # Bytecode of the modules Triton imports on a first launch: a pip install
            # writes it; the GPU machine's site-packages has none (and the environment
            # turns bytecode writing off), which would add 0.1 s of Python compiling
            # Triton's sources to every "warm" process.
            PYTHONPYCACHEPREFIX=os.path.join(cache, "pycache"),
        )
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        out = []
        for _ in range(2):  # cold, then warm
            done = subprocess.run(
                [sys.executable, __file__, "probe", set_name, opt_name, "--device", device],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-2000:])
            out.append(json.loads(done.stdout.strip().splitlines()[-1]))
        again = min(o["again_s"] for o in out)
        return out[0]["first_call_s"], out[1]["first_call_s"], again


def run(args: argparse.Namespace) -> None:
    import triton

    device = args.device
    bandwidth = copy_bandwidth(device)
    rows: list[dict[str, Any]] = []
    for set_name in args.sets.split(","):
        params = make_params(set_name, device)
        for opt_name in args.optimizers.split(","):
            nbytes = floor_bytes(set_name, opt_name)
            base = {"set": set_name, "optimizer": opt_name, "floor_s": nbytes / bandwidth}
            base["bytes"] = nbytes
            for variant in args.variants.split(","):
                row = {**base, "variant": variant}
                step = None
                try:
                    sync(device)
                    start = time.perf_counter()
                    step = build(variant, opt_name, params)
                    step()
                    sync(device)
                    row["first_call_s"] = time.perf_counter() - start
                    if variant.startswith("optcompile"):
                        # Steady state: with optguard's native checks, which users get from
                        # the first seconds on (they build in the background, once).
                        from optguard import native

                        native.start(wait=True)
                    row["step_s"] = time_per_step(step, device)
                    row["device_ops"] = device_ops_per_step(step, device)
                    if variant.startswith("optcompile"):
                        import optcompile

                        report = optcompile.explain(step.__self__)  # type: ignore[attr-defined]
                        row["launches"] = report.kernel_launches_per_step
                        row["fallback"] = report.fallback_reason
                        row["cudagraphs"] = report.cudagraphs
                        row["cudagraph_recordings"] = report.cudagraph_recordings
                        row["native_checks"] = report.native_checks
                    if variant == "optcompile" and not args.no_probe:
                        row["cold_s"], row["warm_s"], row["again_s"] = compile_times(
                            set_name, opt_name, device
                        )
                except Exception as exc:  # recorded as "n/a (why)"
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                del step
                if device == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
        del params
    meta = {
        "command": "python benchmarks/step_time.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bandwidth": bandwidth,
    }
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _us(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e6:,.0f}"


def report(args: argparse.Namespace) -> None:
    runs = [json.loads(Path(p).read_text()) for p in args.json]
    rows = [row for r in runs for row in r["rows"]]
    lines = [
        "# Optimizer step time against the memory-bandwidth floor",
        "",
        "Produced by (each on the GPU machine, then `report` here):",
        *(f"- `{r['meta']['command']}`" for r in runs),
        "",
    ]
    for r in runs:
        m = r["meta"]
        lines.append(
            f"Device {m['device']}; Python {m['python']}, torch {m['torch']}, triton "
            f"{m['triton']}; copy bandwidth measured in that run: "
            f"{m['bandwidth'] / 1e9:,.0f} GB/s  "
        )
    lines += [
        "",
        "Floor = bytes the optimizer must move / copy bandwidth. Step = median of 7 runs of "
        "consecutive steps timed with CUDA events. Device ops = kernels + copies the profiler "
        "sees in one step. First call = building the optimizer and its first step (compile for "
        "torch.compile and optcompile). optcompile cold / warm = first call in a fresh process "
        "with empty / filled Triton and optkernels disk caches; in-process = a second optimizer "
        "of the same structure compiled in the same process (trace and lowering; kernels "
        "already loaded). 200x64x64 fits in L2 (the floor "
        "there is nominal; those steps are launch-bound).",
        "",
        "| set | optimizer | variant | µs / step | x floor | device ops / step | "
        "first call (s) | optcompile cold / warm / in-process (s) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    previous = None
    for row in rows:
        if (row["set"], row["optimizer"]) != previous:
            previous = (row["set"], row["optimizer"])
            lines.append(
                f"| {row['set']} | {row['optimizer']} | floor ({row['bytes'] / 1e6:,.1f} MB) | "
                f"{_us(row['floor_s'])} | 1.00 | | | |"
            )
        if "error" in row:
            lines.append(
                f"| {row['set']} | {row['optimizer']} | {row['variant']} | n/a ({row['error']}) "
                "| | | | |"
            )
            continue
        ratio = row["step_s"] / row["floor_s"]
        cold = ""
        if "cold_s" in row:
            cold = f"{row['cold_s']:.2f} / {row['warm_s']:.2f} / {row['again_s']:.2f}"
        ops = "" if row.get("device_ops") is None else str(row["device_ops"])
        lines.append(
            f"| {row['set']} | {row['optimizer']} | {row['variant']} | {_us(row['step_s'])} | "
            f"{ratio:.2f} | {ops} | {row['first_call_s']:.2f} | {cold} |"
        )
    text = "\n".join(lines) + "\n\n## Summary (x floor)\n\n" + summary(rows) + "\n"
    Path(args.out).write_text(text)
    if args.readme:
        readme = Path(args.readme).read_text()
        start, end = "<!-- step_time table -->", "<!-- /step_time table -->"
        head, _, rest = readme.partition(start)
        _, _, tail = rest.partition(end)
        if not rest:
            raise SystemExit(f"{args.readme} has no '{start}' marker")
        Path(args.readme).write_text(f"{head}{start}\n{summary(rows)}\n{end}{tail}")


def summary(rows: list[dict[str, Any]]) -> str:
    """One line per (set, optimizer): each variant's x floor, optcompile's launches."""
    keys = list(dict.fromkeys((r["set"], r["optimizer"]) for r in rows))
    present = {r["variant"] for r in rows}
    variants = [v for v in [*VARIANTS, *EXTRA_VARIANTS] if v in present]
    head = "| set | optimizer | floor µs | " + " | ".join(variants) + " | optcompile launches |"
    lines = [head, "| --- | --- | ---: | " + " | ".join("---:" for _ in variants) + " | ---: |"]
    for key in keys:
        mine = {r["variant"]: r for r in rows if (r["set"], r["optimizer"]) == key}
        cells = []
        for v in variants:
            r = mine.get(v)
            if r is None or "error" in r:
                cells.append("n/a")
            else:
                cell = f"{r['step_s'] / r['floor_s']:.2f}"
                cells.append(f"**{cell}**" if v == "optcompile" else cell)
        floor = next(iter(mine.values()))["floor_s"]
        launches = mine.get("optcompile", {}).get("launches", "")
        lines.append(f"| {key[0]} | {key[1]} | {_us(floor)} | {' | '.join(cells)} | {launches} |")
    return "\n".join(lines)


def compile_report(args: argparse.Namespace) -> None:
    """Cold / warm / in-process compile seconds of optcompile, ``--repeats`` fresh cache
    folders per (set, optimizer): the median of each, and the range."""
    import triton

    lines = [
        "# optcompile compile time (first call: trace, guards, lowering, kernels, first step)",
        "",
        f"Produced by `{' '.join(['python', *sys.argv])}` on "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}; Python "
        f"{sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}.",
        "",
        "Cold = a fresh process with empty Triton, optkernels and optguard disk caches; warm = "
        "a fresh process after the cold one (caches filled); in-process = a second optimizer "
        "of the same structure in the warm process. Each figure: the median over "
        f"{args.repeats} cache folders (range in brackets). The process's imports are not "
        "counted (``import torch`` alone is seconds there).",
        "",
        "| set | optimizer | cold (s) | warm (s) | in-process (s) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for set_name in args.sets.split(","):
        for opt_name in args.optimizers.split(","):
            samples = [compile_times(set_name, opt_name, args.device) for _ in range(args.repeats)]
            cells = []
            for column in zip(*samples, strict=True):
                ordered = sorted(column)
                cells.append(
                    f"{statistics.median(ordered):.2f} [{ordered[0]:.2f} to {ordered[-1]:.2f}]"
                )
            lines.append(f"| {set_name} | {opt_name} | {' | '.join(cells)} |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--sets", default="200x64x64,gpt2,gpt2-bf16,1.3b")
    r.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    r.add_argument("--variants", default=",".join(VARIANTS))
    r.add_argument("--device", default="cuda")
    r.add_argument("--json", required=True)
    r.add_argument("--no-probe", action="store_true", help="skip the cold/warm processes")
    p = sub.add_parser("probe")
    p.add_argument("set")
    p.add_argument("optimizer")
    p.add_argument("--device", default="cuda")
    c = sub.add_parser("compile", help="cold / warm / in-process compile time only")
    c.add_argument("--sets", default="gpt2,1.3b")
    c.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    c.add_argument("--device", default="cuda")
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--out", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("json", nargs="+")
    rep.add_argument("--out", required=True)
    rep.add_argument("--readme")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    elif args.command == "probe":
        probe(args.set, args.optimizer, args.device)
    elif args.command == "compile":
        compile_report(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
