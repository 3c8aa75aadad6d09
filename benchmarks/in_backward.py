"""A GPT-2 124M training iteration (bf16 autocast, AdamW): the step after backward or inside it.

Variants, each in a fresh process (so peak memory counts only its own tensors):
  eager                   torch.optim.AdamW (foreach) stepped after backward, zero_grad()
  eager-fused             the same with fused=True
  eager-hooks             eager AdamW inside backward: one optimizer per parameter, stepped in
                          its post-accumulate-grad hook (torch's "optimizer in backward" recipe)
  optcompile              optcompile.compile(AdamW) stepped after backward
  optcompile-in-backward  optcompile.compile(AdamW, in_backward=True): the update runs inside
                          backward in buckets, each gradient freed after its update
                          (``optcompile-in-backward@25``: buckets of 25 MiB, not the default;
                          ``optcompile-in-backward-ahead``: every bucket's host values sent
                          ahead at the first hook, ``send_ahead(opt, True)``; ``-own``, as
                          in earlier results: each update its own, now the default)
  <variant>+capturable    the same with AdamW(capturable=True): step counts on the device, no
                          host values to compute and copy per step (or per bucket update)

Reported per variant: median iteration time (forward + backward + step, CUDA-synchronized,
after warm-up iterations), peak allocated memory over the timed iterations
(torch.cuda.max_memory_allocated; on the CPU the process's peak resident set, VmHWM reset
after warm-up, with glibc's malloc returning each freed tensor's memory at once), the first
iteration's time (includes compiling), and the
loss of each timed iteration (the same data in every variant: the losses agree to bf16
rounding when the updates agree). The target of issue 26: the in-backward peak lower than
the after-backward ones by at least the gradients' size, its time no worse than
optcompile's after backward.

Usage (GPU machine, from the repository root):
  PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') OPTCOMPILE_NATIVE=sync \\
      python benchmarks/in_backward.py --json benchmarks/results/in_backward_h100.json \\
      --out benchmarks/results/in_backward_h100.md
A CPU smoke run: python benchmarks/in_backward.py --config tiny --device cpu --iters 2 --batches 2
The peaks on the CPU (GPT-2 124M, a few seconds per iteration):
  python benchmarks/in_backward.py --device cpu --context 128 --batches 1 --warmup 2 --iters 2 \
      --variants optcompile,optcompile-in-backward,optcompile-in-backward@25
``--rounds N`` runs each variant N times, interleaved (a host's speed drifts between processes
by several ms at these sizes); ``benchmarks/in_backward_host.py`` takes the in-backward
iteration apart on the host, in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VARIANTS = "eager,eager-fused,eager-hooks,optcompile,optcompile-in-backward"
CONFIGS = {  # layers, heads, width, vocab, context
    "gpt2": (12, 12, 768, 50257, 1024),
    "tiny": (2, 2, 32, 101, 16),
}


class Block(torch.nn.Module):
    def __init__(self, heads: int, width: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(width)
        self.c_attn = torch.nn.Linear(width, 3 * width)
        self.attn_proj = torch.nn.Linear(width, width)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.c_fc = torch.nn.Linear(width, 4 * width)
        self.mlp_proj = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    """GPT-2 (124M with the "gpt2" config): token embedding tied to the output head."""

    def __init__(self, layers: int, heads: int, width: int, vocab: int, context: int) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(heads, width) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                torch.nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def optimizer_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_step(variant: str, model: torch.nn.Module, device: str) -> Any:
    """What runs after backward each iteration (for in-backward variants: nothing but
    ``opt.step()``'s hooks), having set up what runs inside backward."""
    import optcompile

    kwargs: dict[str, Any] = {"lr": 6e-4, "betas": (0.9, 0.95)}
    variant, _, option = variant.partition("+")
    if option not in ("", "capturable"):
        raise SystemExit(f"unknown option +{option}; the one known: +capturable")
    if option and device != "cuda":
        raise SystemExit("+capturable needs a CUDA device (torch's AdamW refuses it on the CPU)")
    if option:
        kwargs["capturable"] = True
    if variant == "eager-hooks":
        per_param = {}
        for group in optimizer_groups(model):
            for p in group["params"]:
                per_param[p] = torch.optim.AdamW([p], weight_decay=group["weight_decay"], **kwargs)

        def hook(p: torch.Tensor) -> None:
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in per_param:
            p.register_post_accumulate_grad_hook(hook)
        return lambda: None
    if variant == "eager-fused":
        kwargs["fused"] = True
    opt = torch.optim.AdamW(optimizer_groups(model), **kwargs)
    if variant == "optcompile":
        opt = optcompile.compile(opt)
    elif variant.startswith("optcompile-in-backward"):
        _, _, mib = variant.partition("@")
        sizes = {"bucket_bytes": max(1, int(float(mib) * 2**20))} if mib else {}
        opt = optcompile.compile(opt, in_backward=True, **sizes)
        if variant.startswith(("optcompile-in-backward-own", "optcompile-in-backward-ahead")):
            from optcompile import backward

            backward.send_ahead(opt, variant.startswith("optcompile-in-backward-ahead"))
    elif variant not in ("eager", "eager-fused"):
        raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.optimizer = opt  # type: ignore[attr-defined]
    return step


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One variant, in this process."""
    device = args.device
    layers, heads, width, vocab, context = CONFIGS[args.config]
    torch.manual_seed(0)
    model = GPT(layers, heads, width, vocab, context).to(device)
    step = make_step(args.variant, model, device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    data = [
        torch.randint(0, vocab, (args.batch, (args.context or context) + 1), generator=gen).to(
            device
        )
        for _ in range(args.warmup + args.iters)
    ]

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def iteration(tokens: torch.Tensor) -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        step()
        return float(loss.detach())

    times, losses = [], []
    for i, tokens in enumerate(data):
        if i == args.warmup and device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif i == args.warmup:
            reset_peak_resident()
        sync()
        start = time.perf_counter()
        loss = iteration(tokens)
        sync()
        elapsed = time.perf_counter() - start
        if i == 0:
            first = elapsed
        if i >= args.warmup:
            times.append(elapsed)
            losses.append(loss)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    row: dict[str, Any] = {
        "variant": args.variant,
        "batch": args.batch,
        "iteration_s": statistics.median(times),
        "iteration_s_all": times,
        "first_iteration_s": first,
        "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else peak_resident(),
        "grad_bytes": param_bytes,  # fp32 params: gradients of the same size
        "params": sum(p.numel() for p in model.parameters()),
        "losses": losses,
    }
    opt = getattr(step, "optimizer", None)
    if opt is not None and args.variant.startswith("optcompile"):
        import optcompile

        report = optcompile.explain(opt)
        row["traces"] = report.traces
        row["buckets"] = report.buckets
        row["launches"] = report.kernel_launches_per_step
        row["cudagraphs"] = report.cudagraphs
        row["fallback"] = report.fallback_reason
    return row


def reset_peak_resident() -> None:
    """Start the process's peak resident set (VmHWM) afresh (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_resident() -> int | None:
    """The process's peak resident set in bytes since ``reset_peak_resident`` (Linux)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def run_all(args: argparse.Namespace) -> None:
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):  # (rounds interleave the variants: host drift hits all)
        for batch in args.batches.split(","):
            for variant in args.variants.split(","):
                row = run_one(args, variant, batch)
                runs.setdefault((int(batch), variant), []).append(row)
                shown = {k: v for k, v in row.items() if k != "iteration_s_all"}
                print(json.dumps(shown), flush=True)
    rows = [merged(found) for found in runs.values()]
    meta = {
        "command": "python benchmarks/in_backward.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "device_type": args.device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "config": args.config,
        "batches": args.batches,
        "context": args.context or CONFIGS[args.config][4],
        "warmup": args.warmup,
        "iters": args.iters,
        "rounds": args.rounds,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = report(meta, rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def run_one(args: argparse.Namespace, variant: str, batch: str) -> dict[str, Any]:
    """One variant at one batch size, in a fresh process."""
    command = [sys.executable, __file__, "--variant", variant, "--device", args.device]
    command += ["--config", args.config, "--batch", batch]
    if args.context:
        command += ["--context", str(args.context)]
    command += ["--warmup", str(args.warmup), "--iters", str(args.iters)]
    # (CPU peaks: glibc's malloc then maps each tensor of 64 KiB or more on its own and
    # unmaps it when freed, so the resident set follows the live tensors)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"} if args.device == "cpu" else None
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"variant": variant, "batch": int(batch), "error": error}
    row: dict[str, Any] = json.loads(lines[-1])
    return row


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a variant's rounds: the median of their medians (each round's kept),
    the highest peak; the rest from the first round."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    row = dict(ok[0])
    if len(runs) > 1:
        row["iteration_s_rounds"] = [r["iteration_s"] for r in ok]
        row["iteration_s"] = statistics.median(row["iteration_s_rounds"])
        peaks = [r["peak_bytes"] for r in ok if r.get("peak_bytes") is not None]
        row["peak_bytes"] = max(peaks) if peaks else None
    return row


def report(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    ok = {r["variant"]: r for r in rows if "error" not in r}
    lines = [
        f"# GPT-2 training iteration: the step after backward or inside it ({meta['device']})",
        "",
        f"Command: `{meta['command']}`  ",
        f"torch {meta['torch']}, Triton {meta['triton']}, Python {meta['python']}; "
        f"config {meta['config']}, batches {meta['batches']} of {meta['context']} tokens, "
        f"bf16 autocast, fp32 params, AdamW; {meta['warmup']} warm-up iterations, "
        f"median of {meta['iters']}"
        + (
            f"; each variant run in {meta['rounds']} rounds, interleaved (the median of the "
            "rounds' medians; each round's in the notes)."
            if meta.get("rounds", 1) > 1
            else "."
        )
        + (
            " Peaks on the CPU: the process's peak resident set (torch and Python included)."
            if meta.get("device_type") == "cpu"
            else ""
        ),
        "",
        "| batch | variant | iteration ms | first iteration s | peak MiB "
        "| peak - optcompile's MiB | losses (first, last) | notes |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    after = {
        r["batch"]: r.get("peak_bytes")
        for r in rows
        if r["variant"] == "optcompile" and "error" not in r
    }
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['variant']} | n/a | | | | | {r['error']} |")
            continue
        peak, base = r["peak_bytes"], after.get(r["batch"])
        delta = "" if peak is None or base is None else f"{(peak - base) / 2**20:,.0f}"
        notes = []
        if r.get("buckets"):
            notes.append(f"{len(r['buckets'])} buckets, {r['traces']} traces")
        if r.get("fallback"):
            notes.append(f"fallback: {r['fallback']}")
        if r.get("iteration_s_rounds"):
            each = ", ".join(f"{t * 1e3:,.1f}" for t in r["iteration_s_rounds"])
            notes.append(f"rounds: {each} ms")
        if r.get("cudagraphs"):
            notes.append(f"CUDA graphs: {r['cudagraphs']}")
        losses = r["losses"]
        lines.append(
            f"| {r['batch']} | {r['variant']} | {r['iteration_s'] * 1e3:,.1f} "
            f"| {r['first_iteration_s']:.2f} "
            f"| {'' if peak is None else f'{peak / 2**20:,.0f}'} | {delta} "
            f"| {losses[0]:.4f}, {losses[-1]:.4f} | {'; '.join(notes)} |"
        )
    some = next(iter(ok.values()), None)
    if some is not None:
        size = some["grad_bytes"] / 2**20
        lines += ["", f"Gradients: {size:,.0f} MiB ({some['params']:,} params)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--variant", help="measure this one variant in this process")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="gpt2", choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=8, help="with --variant")
    parser.add_argument(
        "--batches",
        default="1,8",
        help="sequences per iteration, one table row set each: with few, the peak is at the "
        "step (gradients and state alive); with many, activations early in backward dominate",
    )
    parser.add_argument(
        "--context",
        type=int,
        help="tokens per sequence (default: the config's context, 1024 for gpt2); shorter "
        "sequences shrink the activations, so the peak moves to the step",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every variant this many times, interleaved, each in a fresh process (the "
        "host's speed drifts between processes: the median of the rounds' medians)",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
