"""Cold first call of a compiled optimizer, split into phases (issues 20 and 24).

Usage (from the repo root, PYTHONPATH naming packages/*/src):
    python benchmarks/first_call.py [--cases gpt2-adamw tiny-200-adamw ...] [--device cpu]
        [--machine "CPU dev machine"] [--out benchmarks/results/first_call_cpu.md]
        [--warm] [--repeat N] [--profile DIR] [--settle] [--native]
    python benchmarks/first_call.py --device cuda --cases gpt2-adamw --warm --repeat 3 \
        --machine "H100" --profile prof --out benchmarks/results/first_call_h100.md   # GPU

Each case runs in a fresh Python process whose caches are empty temporary directories
(``OPTCOMPILE_CACHE_DIR``, ``OPTKERNELS_CACHE_DIR``, ``OPTGUARD_CACHE_DIR``,
``TRITON_CACHE_DIR``), so nothing a
previous run compiled is reused: the optguard C++ module (an install-time build, ``python -m
optguard build``) is not found either, and the Python checks run; ``--native`` copies the
module this environment has built into the empty cache first (what a user who ran the
install-time build gets). The child builds the
optimizer, then times its first ``step()`` and, inside it, these phases (each exclusive of
the phases nested in it, so they add up to at most the total; "other" is the rest).
``--warm`` runs each case a second time in another fresh process on the first one's caches
(what a user's second run of the same script does); ``--repeat N`` runs each N times (a
table row per run); ``--profile DIR`` adds one more cold and warm run of each case under
cProfile and writes their statistics to ``DIR/first_call_<case>_<cold|warm>.txt``: the main
thread's, as its step starts once optkernels' background threads are done (from Python 3.12
on, cProfile records every thread's calls: the threads' loads of Triton's launchers showed
as the step's). ``--settle`` waits for them so in every run (a script's forward and
backward would, between ``compile()`` and the first step; "settled_s" in the JSON says how
long that took); without it the step overlaps them, as here. Each JSON line also gives
the background threads' spans (Triton's self-hash, its runtime modules' C builds; seconds
from the first step's start) and, as a phase, how long the first launch waited for them:

  state init      the optimizer's ``_init_group`` run for real before the trace
  trace           recording the step into an ATen graph (opttrace)
  audit           the side-effect audit of globals, cells and random generators
  guards          the prologue: guard and gather codegen and compile (optguard), and its
                  fast tier, armed after the first run
  families        finding the per-parameter lane programs / families (optkernels)
  kernel source   generating Triton or C source
  C compile       building (or loading) the C kernels (CPU backend)
  Triton compile  a kernel's first launch (compile, or load from the cache, and run)
  Triton wait     the first launch waiting for the background threads (self-hash, runtime)
  graph capture   CUDA graph recording (optcudagraph)
  replay codegen  the side-effect replay code (optsidefx)
  run             the plan's run and the replay, outside the phases above

Cases: ``gpt2-adamw`` (AdamW over the 148 tensors of GPT-2 124M, foreach as torch defaults
on the device; ``gpt2-adamw-foreach``: foreach=True on any device, CUDA's path on the CPU)
and ``tiny-N-OPT`` for N in 200, 2000, 10000 and OPT one of ``adamw``
(AdamW, torch's default: the for-loop on the CPU), ``sgd`` (SGD, momentum 0.9),
``adam-foreach`` and ``adam-forloop`` (Adam with foreach=True / False), ``radam``, ``rprop``
and ``asgd`` (torch's defaults; not among the default cases), over 4x4 params.
Writes a markdown table (``--out``) and prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from first_call_child import PHASES, run_case
from first_call_triton import _triton_table, triton_offline

OPTIMIZERS = ("adamw", "sgd", "adam-foreach", "adam-forloop", "radam", "rprop", "asgd")
DEFAULT_CASES = [
    "gpt2-adamw",
    *(f"tiny-{n}-{o}" for n in (200, 2000, 10000) for o in OPTIMIZERS[:4]),
]


# -- the parent: one fresh process per case ----------------------------------------------


def run_fresh(
    case: str,
    device: str,
    triton: str | None = None,
    warm: bool = False,
    profile: str | None = None,
    settle: bool = False,
    native: bool = False,
) -> list[dict[str, Any]]:
    """``case`` in a fresh process with empty caches (its result, labelled "cold"); with
    ``warm``, then in a second one on the caches the first left ("warm"). ``profile``: a
    folder for their cProfile statistics; ``settle``: see ``run_case``; ``native``: the
    optguard C++ module built here is copied into the empty cache."""
    results = []
    with tempfile.TemporaryDirectory(prefix="first_call_") as tmp:
        env = dict(os.environ)
        for var, sub in (
            ("OPTCOMPILE_CACHE_DIR", "optcompile"),
            ("OPTKERNELS_CACHE_DIR", "optkernels"),
            ("OPTGUARD_CACHE_DIR", "optguard"),
            ("TRITON_CACHE_DIR", "triton"),
        ):
            env[var] = os.path.join(tmp, sub)
        if native:
            _copy_native(os.path.join(tmp, "optcompile"))
        env.pop("OPTCOMPILE_NATIVE", None)  # never build the C++ checks inside the timing
        # Bytecode of the modules a first call imports (ours, Triton's): a pip install
        # writes it, the GPU machine's environment turns writing it off, and without it a
        # "warm" process compiles those sources again (as step_time.py's compile timing).
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        for caches in ("cold", "warm") if warm else ("cold",):
            command = [sys.executable, __file__, "--child", case, "--device", device]
            if profile is not None:
                path = os.path.join(profile, f"first_call_{case}_{caches}.txt")
                command += ["--profile", path]
            if settle:
                command += ["--settle"]
            if triton is not None:
                env.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter
                command = [sys.executable, __file__, "--triton-child", triton]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{case} ({caches}) failed:\n{done.stderr[-4000:]}")
            result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
            result["caches"] = caches
            results.append(result)
    return results


def _copy_native(cache: str) -> None:
    """Copy the optguard C++ module built for this environment into ``cache`` (an
    ``OPTCOMPILE_CACHE_DIR``), where the child finds it."""
    import shutil

    from optguard import native

    built = native.library_path()
    if not built.exists():
        raise SystemExit(f"--native: {built} is not built (run: {native.BUILD_COMMAND})")
    folder = Path(cache) / built.parent.name
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, folder / built.name)


def _phases_shown(results: list[dict[str, Any]], key: str) -> list[str]:
    """The phases (of ``key``: CPU or wall seconds) that took a millisecond in some case."""
    return [p for p in [*PHASES, "other"] if any(abs(r[key][p]) >= 0.0005 for r in results)]


def _markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = [head, ["---"] * len(head), *rows]
    return ["| " + " | ".join(cells) + " |" for cells in lines]


def _table(results: list[dict[str, Any]], args: argparse.Namespace, load: float) -> str:
    import torch
    from trace_time import source_revision

    shown = _phases_shown(results, "cpu_phases")
    head = [
        "case",
        "caches",
        "params",
        "first call s",
        "its CPU s",
        "CPU ms/param",
        *(f"{p} s" for p in shown),
        "of it gc s",
        "2nd call s",
        "its CPU s",
        "of it gc s",
    ]
    rows = []
    for r in results:
        cells = [
            r["case"],
            r["caches"],
            str(r["params"]),
            f"{r['first_s']:.3f}",
            f"{r['first_cpu_s']:.3f}",
            f"{1000 * r['first_cpu_s'] / r['params']:.3f}",
            *(f"{r['cpu_phases'][p]:.3f}" for p in shown),
            f"{r.get('gc_cpu_s', 0.0):.3f}",
            f"{r['second_s']:.4f}",
            f"{r.get('second_cpu_s', 0.0):.4f}",
            f"{r.get('second_gc_cpu_s', 0.0):.3f}",
        ]
        rows.append(cells)
    wall = _phases_shown(results, "phases")
    wall_head = ["case", "caches", "first call s", *(f"{p} s" for p in wall)]
    wall_rows = []
    for r in results:
        cells = [r["case"], r["caches"], f"{r['first_s']:.3f}"]
        cells += [f"{r['phases'][p]:.3f}" for p in wall]
        wall_rows.append(cells)
    versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    command = " ".join(["python", "benchmarks/first_call.py", *sys.argv[1:]])
    return "\n".join(
        [
            f"# First call of a compiled optimizer, cold ({args.device})",
            "",
            f"Command: `{command}` (from the repo root)  ",
            f"Machine: {args.machine}; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, 1-min load "
            f"average {load:.2f} at start  ",
            f"Versions: {versions}; source {source_revision()}  ",
            "Each case in a fresh process with empty optcompile/optkernels/Triton caches "
            '("cold"; "warm": another fresh process on the caches the cold one left, the '
            "bytecode of the modules the cold one imported included, as a pip install "
            "writes it) "
            + (
                "(the optguard C++ module built and loaded: --native); "
                if args.native
                else "(the optguard C++ module not built); "
            )
            + "phases are exclusive (see the script's "
            'docstring). Tiny params are 4x4 float32. "first call s" is wall time; "its CPU '
            's", the ms per param and the phases are CPU seconds (all threads, and the C '
            "compiler's; on a shared, loaded machine the steadier numbers; wall phases are "
            "below). The "
            "2nd call (wall, then CPU) is a hit of the guards' fast tier (armed at the end "
            "of the first), or retraces where the first step created state (SGD's momentum "
            'buffers). "of it gc s": CPU seconds of the cyclic garbage collector\'s '
            "collections within the call (in the phases they interrupted); what the first "
            "call built is in the collector's oldest generation, scanned by the process's "
            "next full collection (a training loop's own allocations start one, some steps "
            "later)."
            + (
                " Each first step started after optkernels' background threads were done "
                "(--settle)."
                if args.settle
                else ""
            ),
            "",
            *_markdown(head, rows),
            "",
            "The same runs' phases in wall seconds (the main thread's; background threads "
            'overlap them: the JSON lines give their spans, "Triton wait" what the first '
            "launch waited for them):",
            "",
            *_markdown(wall_head, wall_rows),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--machine", default="CPU dev machine")
    parser.add_argument("--out", default=None, help="markdown table (default: print only)")
    parser.add_argument(
        "--warm", action="store_true", help="also each case again on the caches it left"
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="one more run of each case under cProfile, its statistics written to DIR",
    )
    parser.add_argument(
        "--triton-offline",
        type=int,
        default=None,
        metavar="ARCH",
        help="also compile GPT-2's Triton kernels for sm_ARCH (e.g. 90) on this machine",
    )
    parser.add_argument(
        "--settle",
        action="store_true",
        help="time each first step after optkernels' background threads are done",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="the children load the optguard C++ module built here (python -m optguard build)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--triton-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_case(args.child, args.device, args.profile, args.settle)
        print(json.dumps(result), flush=True)
        return
    if args.triton_child is not None:
        arch, _, variant = args.triton_child.partition(":")
        print(json.dumps(triton_offline(int(arch), variant == "capturable")), flush=True)
        return
    load = os.getloadavg()[0]
    results = []
    for case in args.cases:
        for _ in range(args.repeat):
            runs = run_fresh(
                case, args.device, warm=args.warm, settle=args.settle, native=args.native
            )
            for result in runs:
                results.append(result)
                print(json.dumps(result), flush=True)
    if args.profile is not None:
        os.makedirs(args.profile, exist_ok=True)
        for case in args.cases:
            run_fresh(case, args.device, warm=args.warm, profile=args.profile, native=args.native)
    table = _table(results, args, load)
    if args.triton_offline is not None:
        offline = [
            result
            for variant in ("", ":capturable")
            for result in run_fresh("gpt2-adamw", "cpu", f"{args.triton_offline}{variant}")
        ]
        print(json.dumps(offline), flush=True)
        table += _triton_table(offline)
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
