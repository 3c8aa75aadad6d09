"""Where the host time of one compiled ``opt.step()`` goes (GPU machine).

Usage: python benchmarks/host_profile.py [--tensors 200] [--rows 18] [--optimizer AdamW]
The optimizer over N tensors of 64x64 (launch-bound: the step time is the host time), for
capturable=False (the default: step counts on the CPU) and capturable=True: host µs per step
(200 steps, synchronized at both ends), then a cProfile of 200 steps sorted by own time.
A diagnostic, not a benchmark result: step_time.py holds the figures we claim.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import optcompile
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--optimizer", default="AdamW")
    args = parser.parse_args()
    params = [torch.nn.Parameter(torch.randn(64, 64, device="cuda")) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    for capturable in (False, True):
        options = {"capturable": capturable} if args.optimizer != "Adagrad" else {}
        opt = optcompile.compile(
            getattr(torch.optim, args.optimizer)(params, lr=1e-3, **options),
            backend="triton",
        )
        for _ in range(5):
            opt.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            opt.step()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / 200 * 1e6
        print(f"capturable={capturable}: {per_step:.0f} us per step")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(200):
            opt.step()
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
