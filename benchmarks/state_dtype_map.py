"""Which int8 map for second moments: a measurement (CPU, a minute).

Trains the tiny transformer of ``integration_tests/lowp_training.py`` with AdamW at full
precision, takes every exp_avg_sq it holds after the run (and after 30 steps, when the
moments are young and spread widest), and quantizes them blockwise (256 per block) with
value = absmax * (code / 255) ** power for power 1 (the linear map), 2 (square-root
companded, what optcompile uses) and 4. For each it reports what Adam's update is made of:
the share of nonzero second moments that read back as 0 (their update becomes m / eps), and
the relative error of 1 / (sqrt(v) + eps), median and 99th percentile over the elements.
Then it trains with each map (int8 state) and reports the final loss against full precision
at two learning rates.

    PYTHONPATH=... python benchmarks/state_dtype_map.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration_tests"))

import optkernels.compressed as compressed
from lowp_training import batches, train

EPS = 1e-8


def _moments(steps: int) -> torch.Tensor:
    _, opt = train(lambda ps: torch.optim.AdamW(ps, lr=3e-3), steps=steps)
    vs = [s["exp_avg_sq"].reshape(-1) for s in opt.state.values() if "exp_avg_sq" in s]
    return torch.cat([v for v in vs if v.numel() >= 4096])


def _report(v: torch.Tensor, power: int) -> str:
    compressed.UNSIGNED_POWER = power
    payload = compressed.quantize_state(v, "int8", None, 0)
    got = compressed.dequantize_state(payload, "int8", [v.numel()], torch.float32)
    nonzero = v > 0
    zeroed = ((got == 0) & nonzero).float().sum() / nonzero.float().sum()
    exact, approx = 1 / (v.sqrt() + EPS), 1 / (got.sqrt() + EPS)
    error = ((approx - exact).abs() / exact)[nonzero]
    q = torch.quantile(error[torch.randperm(error.numel())[:100_000]], torch.tensor([0.5, 0.99]))
    return (
        f"power {power}: nonzero v read as 0: {zeroed.item():.2%}; relative error of "
        f"1/(sqrt(v)+eps): median {q[0].item():.3%}, p99 {q[1].item():.3%}"
    )


def main() -> None:
    torch.manual_seed(0)
    for steps in (30, 300):
        v = _moments(steps)
        print(f"exp_avg_sq after {steps} steps ({v.numel()} elements):")
        for power in (1, 2, 4):
            print("  " + _report(v, power))
    data = batches(300)
    for lr in (3e-3, 1e-2):
        make = lambda ps, lr=lr: torch.optim.AdamW(ps, lr=lr)  # noqa: E731
        base, _ = train(make, data=data)
        line = [f"AdamW lr={lr}: full precision {base:.4f}"]
        for power in (1, 2, 4):
            compressed.UNSIGNED_POWER = power
            loss, _ = train(make, data=data, state_dtype="int8")
            line.append(f"power {power} {loss:.4f} ({loss / base - 1:+.2%})")
        print("; ".join(line))
    compressed.UNSIGNED_POWER = 2


if __name__ == "__main__":
    main()
