"""FSDP2 training on several GPUs (issue 28): optcompile's sharded AdamW step per rank against
fused=True, eager foreach and the floor; whole training steps; compiled-vs-eager parity over 20
training steps; a DCP checkpoint written by the compiled run loaded into an eager one.

Launched by torchrun, one process per GPU, NCCL (gloo on the CPU). Models from gpt.py (GPT-2
124M and GPT 1.3B shapes), ``fully_shard`` per block and at the root with a bf16
``MixedPrecisionPolicy`` (bf16 compute, fp32 gradient reduction) over fp32 sharded params, so
the optimizer steps fp32 shards, grads and state. Per model:

1. Parity: a compiled AdamW (``optcompile.compile``, the defaults) and an eager foreach AdamW
   over twin models (same seed); each of ``--parity-steps`` steps runs both forwards on the
   rank's batch, the compiled model's backward, and gives the eager twin those gradients
   (the twins are compared on the optimizer alone: reductions need not give two models the
   same bits). Losses, every param shard and every state shard must agree within eager's own
   foreach-vs-for-loop tolerance (``torch.testing.assert_close``'s fp32 defaults); one trace.
2. Checkpoint: the compiled run's model and optimizer saved with ``torch.distributed.checkpoint``
   and loaded into a fresh eager model and optimizer: equal to the compiled run's, bitwise;
   both then take two more steps on the same gradients and stay equal.
3. Time, per variant (optcompile, fused, foreach; an optimizer each over one model): the
   whole training step (forward, backward, step, zero_grad), the variants taking turns
   iteration by iteration, its synchronized wall time and the host time of its phases; then
   the optimizer step alone (gradients kept), CUDA events around each step; medians over
   ``--steps``. The floor is the bytes the step moves over the rank's shards (28 per fp32
   parameter element) over the copy bandwidth measured on that rank in the same run.

Rank 0 gathers every rank's figures, prints a markdown table, writes it and the JSON.

Usage (a machine with 2 GPUs):
  torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_train.py \
      --json benchmarks/results/fsdp_train_h200x2.json --out benchmarks/results/fsdp_train_h200x2.md
CPU smoke run (gloo; what integration_tests/test_benchmark_scripts.py runs):
  torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_train.py --device cpu --smoke \
      --json /tmp/t.json --out /tmp/t.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import gpt
from sharded_step import OPTIMIZERS, copy_bandwidth, device_name, local, step_times, sync

OPTIONS = {"lr": 1e-3, "weight_decay": 0.01}
VARIANTS = ["optcompile", "fused", "foreach"]


def sharded_model(args: argparse.Namespace, seed: int = 0) -> gpt.GPT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # (named: FSDP2's default mesh is on the accelerator even for a CPU run)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh}
    if args.bf16:
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    return gpt.shard(gpt.build(args.model, args.device, seed), **options)


def optimizer(variant: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    import optcompile

    if variant == "optcompile":
        compiled: torch.optim.Optimizer = optcompile.compile(
            torch.optim.AdamW(model.parameters(), **OPTIONS)
        )
        return compiled
    if variant == "fused":
        return torch.optim.AdamW(model.parameters(), fused=True, **OPTIONS)
    return torch.optim.AdamW(model.parameters(), foreach=True, **OPTIONS)


def tokens(args: argparse.Namespace, step: int) -> torch.Tensor:
    seed = 1000 * step + dist.get_rank()
    return gpt.batch(args.model, args.batch, args.length, args.device, seed)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    """Forward, backward, step (no read of the loss: the host does not wait for the device)."""
    gpt.loss(model, batch).backward()
    opt.step()
    opt.zero_grad()


def assert_same(a: torch.nn.Module, oa: Any, b: torch.nn.Module, ob: Any, **tol: Any) -> None:
    """Every param shard and state shard of ``a``/``oa`` equal to ``b``/``ob``'s."""
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(local(p), local(q), **tol)
        assert set(oa.state[p]) == set(ob.state[q]), (set(oa.state[p]), set(ob.state[q]))
        for key, value in ob.state[q].items():
            torch.testing.assert_close(local(oa.state[p][key]), local(value), **tol)


def parity(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Compiled vs eager over ``--parity-steps`` steps, then the checkpoint round trip."""
    import optcompile
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, ref = sharded_model(args), sharded_model(args)
    opt, eager = optimizer("optcompile", model), optimizer("foreach", ref)
    losses: list[tuple[float, float]] = []

    def step_both(step: int) -> None:
        batch = tokens(args, step)
        mine = gpt.loss(model, batch)
        mine.backward()
        with torch.no_grad():
            theirs = gpt.loss(ref, batch)
        ref.reshard()  # (the root stays unsharded after a forward with no backward)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = None if p.grad is None else p.grad.detach().clone()
        losses.append((float(mine.detach()), float(theirs)))
        for o in (opt, eager):
            o.step()
            o.zero_grad()

    for step in range(args.parity_steps):
        step_both(step)
    assert_same(model, opt, ref, eager)
    for mine, theirs in losses:
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-5)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and report.traces == 1, report.retrace_reasons

    path = os.path.join(workdir, f"ckpt-{args.model}")
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=path,
    )
    loaded = sharded_model(args, seed=7)
    loaded_opt = optimizer("foreach", loaded)
    target = {
        "model": get_model_state_dict(loaded),
        "optim": get_optimizer_state_dict(loaded, loaded_opt),
    }
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(loaded, target["model"])
    set_optimizer_state_dict(loaded, loaded_opt, target["optim"])
    assert_same(loaded, loaded_opt, model, opt, rtol=0, atol=0)
    # Both continue on the compiled model's gradients.
    ref, eager = loaded, loaded_opt
    for step in range(args.parity_steps, args.parity_steps + 2):
        step_both(step)
    assert_same(model, opt, ref, eager)
    gaps = [abs(a - b) for a, b in losses]
    return {"parity_steps": args.parity_steps, "losses": losses, "max_loss_gap": max(gaps)}


def timings(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant's optimizer over one model: the whole training steps alternated variant
    by variant (``alternated``), then each variant's step alone (``time_variant``)."""
    import optcompile

    model = sharded_model(args)
    variants = args.variants.split(",")
    opts: dict[str, torch.optim.Optimizer] = {}
    rows = {v: {"variant": v} for v in variants}
    for variant in variants:
        try:
            start = time.perf_counter()
            opts[variant] = optimizer(variant, model)
            train_step(model, opts[variant], tokens(args, 0))
            sync(args.device)
            rows[variant]["first_call_s"] = time.perf_counter() - start
        except Exception as exc:
            if args.smoke:
                raise
            rows[variant]["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    for variant, row in alternated(model, opts, args).items():
        rows[variant].update(row)
    for variant, opt in opts.items():
        rows[variant].update(time_variant(variant, model, opt, args))
    optcompile.reset()
    return [rows[v] for v in variants]


def alternated(
    model: torch.nn.Module, opts: dict[str, torch.optim.Optimizer], args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """Whole training steps, the variants taking turns iteration by iteration (fresh
    processes and back-to-back steps of one variant at a time spread more than the
    variants differ): per variant the medians of the synchronized wall time of a step and of
    the host time of its phases (forward and backward; ``opt.step()``; ``zero_grad()``)."""
    phases: dict[str, dict[str, list[float]]] = {
        v: {"train_step_s": [], "host_fwd_bwd_s": [], "host_step_s": [], "host_zero_s": []}
        for v in opts
    }
    counter = 1
    for iteration in range(args.warmup + args.steps):
        for variant, opt in opts.items():
            counter += 1
            sync(args.device)
            t0 = time.perf_counter()
            gpt.loss(model, tokens(args, counter)).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad()
            t3 = time.perf_counter()
            sync(args.device)
            t4 = time.perf_counter()
            if iteration >= args.warmup:
                got = phases[variant]
                got["train_step_s"].append(t4 - t0)
                got["host_fwd_bwd_s"].append(t1 - t0)
                got["host_step_s"].append(t2 - t1)
                got["host_zero_s"].append(t3 - t2)
    return {v: {k: statistics.median(x) for k, x in got.items()} for v, got in phases.items()}


def time_variant(
    variant: str, model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace
) -> dict[str, Any]:
    """Seconds of the optimizer step alone (median; gradients kept)."""
    import optcompile

    row: dict[str, Any] = {}
    gpt.loss(model, tokens(args, 0)).backward()  # gradients kept for the step alone
    for _ in range(args.warmup):
        opt.step()
    row["opt_step_s"] = statistics.median(step_times(opt.step, args.device, args.steps, False))
    if variant == "optcompile":
        report = optcompile.explain(opt)
        row.update(launches=report.kernel_launches_per_step, traces=report.traces)
        row["fallback"] = report.fallback_reason
    opt.zero_grad()
    return row


def run_model(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    result: dict[str, Any] = {"model": args.model, "rank": dist.get_rank()}
    probe = sharded_model(args)
    numel = sum(local(p).numel() for p in probe.parameters())
    del probe
    result["local_numel"] = numel
    result["bandwidth"] = copy_bandwidth(args.device, min(numel, 64 * 1024 * 1024))
    result["floor_s"] = numel * OPTIMIZERS["adamw"].bytes_per_element / result["bandwidth"]
    result["parity"] = parity(args, workdir)
    result["rows"] = timings(args)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def table(runs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# FSDP2 training, optimizer step per rank against the floor",
        "",
        f"Produced by `{meta['command']}` ({meta['world_size']} ranks) on {meta['device']}; "
        f"Python {meta['python']}, torch {meta['torch']}, triton {meta['triton']}. bf16 "
        f"MixedPrecisionPolicy: {meta['bf16']}; batch {meta['batch']} x {meta['length']} "
        "tokens per rank.",
        "",
        "Floor = 28 bytes per fp32 element of the rank's shards / the copy bandwidth measured on "
        f"that rank. Optimizer step: median over the steps of {meta['timer']} around each step "
        "alone (gradients kept). Training step: forward, backward, step, zero_grad, the "
        "variants taking turns iteration by iteration over one model; the median of its "
        "synchronized wall time, and of the host time of its step and of forward + backward "
        "(no synchronization inside). Parity: the largest loss gap between the compiled and "
        "the eager twin over the parity steps (params and state equal within fp32 tolerance; "
        "checkpoint round trip bitwise).",
        "",
        "| model | rank | variant | optimizer step µs | x floor | training step ms | "
        "host: its step ms | host: fwd + bwd ms | launches | first call (s) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in runs:
        lines.append(
            f"| {r['model']} | {r['rank']} | floor ({r['local_numel']:,} elements) | "
            f"{r['floor_s'] * 1e6:,.0f} | 1.00 | | | | | |"
        )
        for row in r["rows"]:
            if "error" in row:
                error = f"n/a ({row['error']})"
                lines.append(
                    f"| {r['model']} | {r['rank']} | {row['variant']} | {error} | | | | | | |"
                )
                continue
            lines.append(
                f"| {r['model']} | {r['rank']} | {row['variant']} | "
                f"{row['opt_step_s'] * 1e6:,.0f} | "
                f"{row['opt_step_s'] / r['floor_s']:.2f} | {row['train_step_s'] * 1e3:,.2f} | "
                f"{row['host_step_s'] * 1e3:,.2f} | {row['host_fwd_bwd_s'] * 1e3:,.2f} | "
                f"{row.get('launches', '')} | {row['first_call_s']:.2f} |"
            )
    lines += [
        "",
        "| model | rank | parity steps | largest loss gap |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in runs:
        p = r["parity"]
        lines.append(
            f"| {r['model']} | {r['rank']} | {p['parity_steps']} | {p['max_loss_gap']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="gpt2,1.3b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--parity-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--no-bf16", dest="bf16", action="store_false")
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few steps, raise")
    parser.add_argument("--json", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.smoke:
        args.models, args.steps, args.warmup, args.parity_steps = "tiny", 2, 1, 3
        args.batch, args.length = 2, 8
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=600))
    try:
        shared = [tempfile.mkdtemp(prefix="fsdp_train_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared)
        runs = []
        for name in args.models.split(","):
            args.model = name
            mine = run_model(args, str(shared[0]))
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            runs += gathered
        if dist.get_rank() == 0:
            import triton

            meta = {
                "command": "torchrun ... benchmarks/fsdp_train.py " + " ".join(sys.argv[1:]),
                "world_size": dist.get_world_size(),
                "device": device_name(args.device),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "triton": triton.__version__,
                "bf16": args.bf16,
                "batch": args.batch,
                "length": args.length,
                "timer": "CUDA events" if args.device == "cuda" else "perf_counter",
            }
            Path(args.json).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
            text = table(runs, meta)
            Path(args.out).write_text(text)
            print(text)
        # every rank leaves together: a rank that tore gloo's pairs down while rank 0 was
        # still writing aborted ("terminate called without an active exception", seen in CI)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization: a rank that finished (outputs written,
    # process group destroyed) still aborted now and then in CI in gloo's teardown as its
    # objects were freed at exit ("terminate called without an active exception", after the
    # barrier above); nothing this script made needs finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
