"""Host time of a compiled step right after backward (cold host caches) against a warm one.

    python benchmarks/cold_step.py [--iters 30]

GPT-2 124M (benchmarks/in_backward.py's model), batch 1 x 128 tokens, bf16 autocast, AdamW
(lr 6e-4, betas (0.9, 0.95), its two param groups) compiled with optcompile, with the
defaults and with capturable=True. Each iteration runs forward and backward, then times
(host microseconds, medians over ``--iters`` iterations):

- the prologue alone (the cache lookup: guards checked, inputs gathered; no effects) twice
  in a row: the first reads the tensors' and state's objects from memory, the second from
  the caches the first filled;
- the whole ``opt.step()``, after those two prologues and alone;
- the same after a device synchronize (an empty launch queue), and after reading a 256 MiB
  array besides (the host's caches emptied).

The first prologue against the second is what cold caches cost; the step against the step
after a synchronize is what a deep launch queue costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import in_backward
import optcompile
from optcompile.api import _OPTIMIZERS


def run(capturable: bool, iters: int) -> dict[str, float]:
    layers, heads, width, vocab, context = in_backward.CONFIGS["gpt2"]
    torch.manual_seed(0)
    model = in_backward.GPT(layers, heads, width, vocab, context).cuda()
    groups = in_backward.optimizer_groups(model)
    opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), capturable=capturable)
    opt = optcompile.compile(opt)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (1, 129), generator=gen).cuda()
    compiled, L = _OPTIMIZERS[opt], {"opt": opt}
    big = np.ones((256 << 20) // 8)
    clock = time.perf_counter_ns

    def backward() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()

    def step() -> float:
        t0 = clock()
        opt.step()
        t1 = clock()
        opt.zero_grad(set_to_none=True)
        return (t1 - t0) / 1e3

    def prologue() -> float:
        t0 = clock()
        found = compiled.cache.find(L)
        t1 = clock()
        assert found is not None
        found[0].prologue.release()
        return (t1 - t0) / 1e3

    for _ in range(5):
        backward()
        step()
    torch.cuda.synchronize()
    rows: dict[str, list[float]] = {}
    for _ in range(iters):
        for where, before in [
            ("after backward", lambda: None),
            ("after backward + synchronize", torch.cuda.synchronize),
            (
                "after backward + synchronize + caches emptied",
                lambda: (torch.cuda.synchronize(), big.sum()),
            ),
        ]:
            backward()
            before()
            rows.setdefault(f"{where}: prologue, 1st", []).append(prologue())
            rows.setdefault(f"{where}: prologue, 2nd", []).append(prologue())
            rows.setdefault(f"{where}: step after them", []).append(step())
            backward()
            before()
            rows.setdefault(f"{where}: step alone", []).append(step())
    torch.cuda.synchronize()
    return {name: statistics.median(times) for name, times in rows.items()}


def main() -> None:
    import triton

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}"
        f", Python {sys.version.split()[0]}; medians of {args.iters} iterations"
    )
    results = {
        variant: run(variant == "capturable", args.iters) for variant in ("defaults", "capturable")
    }
    print("| where | defaults µs | capturable=True µs |\n| --- | ---: | ---: |")
    for name in results["defaults"]:
        print(f"| {name} | {results['defaults'][name]:.1f} | {results['capturable'][name]:.1f} |")


if __name__ == "__main__":
    main()
