"""Host time of the step inside backward, by part, and whether a part waits for the device.

    python benchmarks/in_backward_host.py [--config gpt2] [--context 128] [--batch 1]
                                          [--iters 30] [--reps 200] [--sweep 1,4,40]
                                          [--profile ROWS] [--cprofile ROWS]

The model and optimizer of benchmarks/in_backward.py (GPT-2 124M, bf16 autocast, AdamW in two
param groups) compiled with ``in_backward=True`` (4 buckets at the default 128 MiB: 3 of the
matrices, 1 of the vectors; 13 mixed ones at 25 MiB before buckets held one group), and
a copy compiled to step after backward. Reported, host microseconds (medians):

- iterations: forward, backward and ``opt.step()`` of both, alternated iteration by
  iteration in one process (a drifting host hits both alike): each phase's host time (no
  synchronization inside) and the whole iteration's wall time (device synchronized); the
  cyclic garbage collector's pauses during them. ``--sweep`` adds in-backward copies with
  other bucket counts: the iteration's time against the count is what one bucket costs;
- inside backward: the in-backward iterations again, each hook timed where autograd calls
  it: the backward's host time, the time spent in hooks (updates included) and in bucket
  updates. Backward minus hooks, against the backward of the after-backward copy, is what
  the hooks cost the engine beyond their own time (thread switches, the GIL);
- Python's own speed inside backward: a fixed piece of pure Python timed in a hook during
  backward and on the main thread between iterations (the hooks and updates ran ~3x
  slower inside backward than alone on the H100 host: is it Python there, or our code?);
- per hook: one call of a bucket's last param's post-accumulate-grad hook that leaves its
  bucket alone, and of its body alone (once the buckets are learned only the first param
  and each bucket's last one keep a hook: 5 of GPT-2's 148 params at 4 buckets);
- per bucket update: the whole update (what the hook of a bucket's last gradient runs), the
  compiled step inside it (prologue, plan, replay) and the plan alone (on CUDA: the host
  preparation, also shown alone, and the graph launch); the rest is the update's own
  bookkeeping;
- on CUDA, which parts wait for the device: each probe queues ~20 ms of device work
  (``torch.cuda._sleep``), then times the part on the host; a part that returns only after
  that work is done synchronizes the host with the device ("WAITS"). Probed: a hook, each
  bucket update (with its parts timed in that call: compiled step, plan, its prepare; the
  plan less its prepare is the graph's launch), each phase of an iteration of both
  optimizers;
- ``--parts`` (``--only-parts``: this alone, after the warm-up): the bucket updates inside
  real backwards, each part timed where it runs, on the host (perf_counter) and on the
  device (CUDA events recorded on the current stream at the same points: the device time
  between them), with every bucket's host values sent ahead at the backward's first hook
  and without (each update computes and copies its own: the default), iterations
  alternated; a table at the end (medians per update; the stage-ahead per backward);
- ``--profile ROWS``: the in-backward iteration under torch.profiler (CPU and CUDA
  activities): every ``cuda*Synchronize`` call with its count per iteration and the rows with
  the most self CPU time; ``--cprofile ROWS``: cProfile of in-backward iterations.

GPU (from the repository root; under 3 minutes on an H100):
  PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') OPTCOMPILE_NATIVE=sync \\
      python benchmarks/in_backward_host.py --sweep 1,4,40 --profile 25
The iterations alone, both optimizers with capturable=True (``--capturable``: no host values
per update; ``--schedule``: an LR schedule stepped every iteration), alternated iteration by
iteration:
  ... python benchmarks/in_backward_host.py --only-iterations --capturable --iters 200
Only the parts inside backward (about a minute on an H100):
  PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') OPTCOMPILE_NATIVE=sync \\
      python benchmarks/in_backward_host.py --only-parts --iters 30
A CPU run (``--device cpu``: a narrow GPT-2 with the same 148 tensors, buckets of
1/``--buckets`` of its gradient bytes, 4 by default) times the same host-side parts, CPU
kernels in the plan.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path
from typing import Any

import optcompile
import torch
from optcompile import backward

sys.path.insert(0, str(Path(__file__).parent))
import in_backward
from in_backward_parts import parts_inside_backward, parts_report
from in_backward_probes import (
    PHASES,
    inside_backward,
    iterations,
    per_bucket,
    per_hook,
    phases,
    probe,
    python_speed,
    sync,
)

# GPT-2's 148 tensors at a width the CPU trains in milliseconds (layers, heads, width, vocab,
# context): the same hooks and buckets, smaller kernels.
CONFIGS = {**in_backward.CONFIGS, "gpt2-narrow": (12, 2, 64, 1024, 128)}


def build(args: argparse.Namespace) -> dict[str, Any]:
    """The in-backward optimizer and an after-backward copy, each with its own model (and
    one more in-backward copy per ``--sweep`` bucket count)."""
    layers, heads, width, vocab, context = CONFIGS[args.config]
    torch.manual_seed(0)
    model = in_backward.GPT(layers, heads, width, vocab, context).to(args.device)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kwargs: dict[str, Any] = {"lr": 6e-4, "betas": (0.9, 0.95), "capturable": args.capturable}

    def compiled(m: torch.nn.Module, buckets: int | None, in_backward_: bool) -> Any:
        options: dict[str, Any] = {"backend": args.backend, "in_backward": in_backward_}
        if buckets:
            options["bucket_bytes"] = -(-grad_bytes // buckets)
        opt = torch.optim.AdamW(in_backward.optimizer_groups(m), **kwargs)
        compiled_opt = optcompile.compile(opt, **options)
        if getattr(args, "schedule", False):  # a new lr every step (timed in the step phase)
            compiled_opt.bench_schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
                compiled_opt, T_max=100_000
            )
        return compiled_opt

    after_model = copy.deepcopy(model)
    variants = {"after": (after_model, compiled(after_model, None, False))}
    variants["in-backward"] = (model, compiled(model, args.buckets, True))
    for count in args.sweep:
        copied = copy.deepcopy(after_model)
        variants[f"in-backward, {count} bucket(s) asked"] = (copied, compiled(copied, count, True))
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, vocab, (args.batch, min(args.context, context) + 1), generator=gen)
    return {"variants": variants, "tokens": tokens.to(args.device)}


OUR_PACKAGES = ("optcompile/", "optguard/", "optkernels/", "optcudagraph/", "optsidefx/")


def torch_profile(setup: dict[str, Any], args: argparse.Namespace) -> str:
    """torch.profiler over in-backward iterations, with Python stacks: its tracer also sees
    the autograd device thread (it exists by now), where the hooks and updates run."""
    from torch.profiler import ProfilerActivity, profile

    model, opt = setup["variants"]["in-backward"]
    activities = [ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    iters = 5
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(iters):
            phases(model, opt, setup["tokens"], args.device)
        sync(args.device)
    events = prof.key_averages()
    syncs = [e for e in events if "Synchronize" in e.key]
    lines = [f"torch.profiler, {iters} in-backward iterations (Python stacks on):"]
    lines += [f"  {e.key}: {e.count / iters:.1f} per iteration" for e in syncs] or [
        "  no cuda*Synchronize call"
    ]
    ours = [e for e in events if any(name in e.key for name in OUR_PACKAGES)]
    ours.sort(key=lambda e: e.cpu_time_total, reverse=True)
    lines.append("optcompile's Python functions, per iteration (total, self, calls):")
    for e in ours[: args.profile]:
        lines.append(
            f"  {e.cpu_time_total / iters:10,.0f} µs {e.self_cpu_time_total / iters:10,.0f} µs "
            f"{e.count / iters:6.1f}  {e.key}"
        )
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=args.profile))
    return "\n".join(lines)


def c_profile(setup: dict[str, Any], args: argparse.Namespace) -> str:
    model, opt = setup["variants"]["in-backward"]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.iters):
        phases(model, opt, setup["tokens"], args.device)
    sync(args.device)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.cprofile)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=sorted(CONFIGS))
    parser.add_argument("--context", type=int, default=128, help="(at most the config's)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--buckets", type=int, help="split the grads into about this many")
    parser.add_argument(
        "--sweep",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[],
        help="more in-backward copies with about these many buckets each (e.g. 1,4,40): "
        "the iteration's time against the bucket count is the cost of one bucket",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--reps", type=int, default=200, help="calls per bucket timing")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS")
    parser.add_argument("--cprofile", type=int, default=0, metavar="ROWS")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="time each part of the bucket updates inside real backwards (CUDA events and "
        "perf_counter), values sent ahead and not; a table at the end",
    )
    parser.add_argument(
        "--only-parts", action="store_true", help="--parts, and skip the other measurements"
    )
    parser.add_argument(
        "--only-iterations",
        action="store_true",
        help="the iterations alone (both optimizers alternated iteration by iteration)",
    )
    parser.add_argument(
        "--capturable",
        action="store_true",
        help="AdamW(capturable=True) everywhere: step counts on the device, no host values",
    )
    parser.add_argument(
        "--schedule",
        action="store_true",
        help="a CosineAnnealingLR stepped after every step: a new lr each iteration",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.capturable and args.device != "cuda":
        parser.error("--capturable needs a CUDA device (torch's AdamW refuses it on the CPU)")
    if args.config is None:
        args.config = "gpt2" if args.device == "cuda" else "gpt2-narrow"
    if args.buckets is None and args.device != "cuda":
        args.buckets = 4  # about GPT-2's bytes per bucket on the GPU at the default 128 MiB
    from optguard import native

    native.start(wait=True)  # the steady state (it builds in the background otherwise)
    setup = build(args)
    result: dict[str, Any] = {"args": vars(args), "torch": torch.__version__}
    result["tokens"] = setup["tokens"].shape[1] - 1
    if args.only_parts:
        _, opt = setup["variants"]["in-backward"]
        state = backward._STATES[opt]
        for _ in range(args.warmup):  # (the buckets learned, their entries traced)
            for model, variant in setup["variants"].values():
                phases(model, variant, setup["tokens"], args.device)
        sync(args.device)
        result["parts"] = parts_inside_backward(setup, state, args)
        print(parts_report(result["parts"]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    result["iterations"] = iterations(setup, args)
    if args.only_iterations:
        for name, (_, variant) in setup["variants"].items():
            if name != "after":
                result.setdefault("direct", {})[name] = backward.direct_status(variant)
        print("\n".join(iterations_table(result)), flush=True)
        for name, lines in result.get("direct", {}).items():
            print(f"{name}: buckets replayed from their hooks:", *lines, sep="\n  ", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    _, opt = setup["variants"]["in-backward"]
    state = backward._STATES[opt]
    result["buckets"] = len(state.buckets)
    result["hooks"] = len(state.handles)  # kept once the buckets are learned
    result["inside_backward"] = inside_backward(setup, state, args)
    result["python_speed"] = python_speed(setup, args)
    result["per_hook"] = per_hook(state, args.reps * 10)
    result["per_bucket"] = per_bucket(state, args.reps, args.device)
    if args.device == "cuda":
        result["probe"] = probe(setup, state)
    if args.parts:
        result["parts"] = parts_inside_backward(setup, state, args)
    print(report(result), flush=True)
    if args.parts:
        print(parts_report(result["parts"]), flush=True)
    if args.profile:
        print(torch_profile(setup, args))
    if args.cprofile:
        print(c_profile(setup, args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def iterations_table(result: dict[str, Any]) -> list[str]:
    """The heading line and the iterations' table."""
    a = result["args"]
    device = torch.cuda.get_device_name() if a["device"] == "cuda" else "cpu"
    adamw = "AdamW(capturable=True)" if a.get("capturable") else "AdamW"
    if a.get("schedule"):
        adamw += " + CosineAnnealingLR stepped each iteration"
    buckets = f"{result['buckets']} buckets; " if "buckets" in result else ""
    lines = [
        f"{device}; torch {result['torch']}; {a['config']} batch {a['batch']} x {result['tokens']}"
        f" tokens; {adamw}; {buckets}backend {a['backend']}; medians of {a['iters']}",
        "",
        "| optimizer | buckets | forward | backward | step | iteration (wall) "
        "| wall - after's, paired: median [quartiles], share faster | GC pauses |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in result["iterations"].items():
        cells = " | ".join(f"{row[k]:,.0f} µs" for k in (*PHASES, "wall"))
        gcs = row["gc"]
        paired = row.get("paired_wall_us")
        vs = (
            f"{paired['median']:+,.0f} µs [{paired['q1']:+,.0f}, {paired['q3']:+,.0f}], "
            f"{paired['faster_share']:.0%}"
            if paired is not None and name != "after"
            else ""
        )
        lines.append(
            f"| {name} | {row['buckets']} | {cells} | {vs} "
            f"| {gcs['collections']} in {gcs['total_us']:,.0f} µs |"
        )
    return lines


def report(result: dict[str, Any]) -> str:
    lines = iterations_table(result)
    inside, after = result["inside_backward"], result["iterations"]["after"]
    rest = inside["backward_us"] - inside["hooks_us"]
    lines += [
        "",
        f"Inside backward (in-backward, hooks timed): backward {inside['backward_us']:,.0f} µs, "
        f"in {inside['hooks']:.0f} hooks {inside['hooks_us']:,.0f} µs, of which "
        f"{inside['updates']:.0f} bucket updates {inside['updates_us']:,.0f} µs; backward "
        f"without the hooks {rest:,.0f} µs (the after-backward copy's backward: "
        f"{after['backward']:,.0f} µs)",
    ]
    speed = result["python_speed"]
    lines.append(
        f"The same pure Python: {speed['inside_us']:.1f} µs in a hook inside backward, "
        f"{speed['outside_us']:.1f} µs on the main thread between iterations "
        f"({speed['inside_us'] / speed['outside_us']:.2f}x)"
    )
    hook = result["per_hook"]
    lines += [
        "",
        f"Per hook: {hook['hook']:.2f} µs (its body alone: {hook['hook body']:.2f} µs)",
        "",
        "| bucket | params | update | compiled step | plan (its prepare) | update's own "
        "| traces, fast hits |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["per_bucket"]:
        own = r["update"] - r.get("compiled step", 0.0)
        prepare = f" ({r['prepare']:.1f} µs)" if "prepare" in r else ""
        lines.append(
            f"| {r['bucket']} | {r['params']} | {r['update']:.1f} µs "
            f"| {r.get('compiled step', 0.0):.1f} µs | {r.get('plan', 0.0):.1f} µs{prepare} "
            f"| {own:.1f} µs | {r['traces']}, {r['fast_hits']} |"
        )
    total = sum(r["update"] for r in result["per_bucket"])
    lines.append(f"\nAll bucket updates, each timed alone: {total:,.0f} µs per iteration")
    stagings = [r["staging"] for r in result["per_bucket"] if "staging" in r]
    if stagings:
        rounds, queries, grown = (sum(column) for column in zip(*stagings, strict=True))
        lines.append(
            f"Staging (all buckets): {rounds:,} rounds, {queries:,} events queried, "
            f"{grown} pool doublings (the device that far behind; no round waits)"
        )
    for r in result.get("probe", []):
        verdict = "WAITS for the device" if r["waits"] else "does not wait"
        parts = ", ".join(f"{k} {v:,.0f} µs" for k, v in r.get("parts_us", {}).items())
        parts = f" (of which {parts})" if parts else ""
        lines.append(f"probe: {r['part']}: {r['host_us']:,.0f} µs host, {verdict}{parts}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
