"""Which int8 map for second moments: a measurement (CPU, a minute).

Trains the tiny transformer of ``integration_tests/lowp_training.py`` with AdamW at full
precision, takes every exp_avg_sq it holds after the run (and after 30 steps, when the
moments are young and spread widest), and quantizes them blockwise (256 per block) with
value = absmax * (code / 255) ** power for power 1 (the linear map), 2 (square-root
companded, what optcompile uses) and 4. For each it reports what Adam's update is made of:
the share of nonzero second moments that read back as 0 (their update becomes m / eps), and
the relative error of 1 / (sqrt(v) + eps), median and 99th percentile over the elements.
The same for the first moments (exp_avg) with the signed map, value = absmax * sign *
(|code - 128| / 127) ** power, power 1 (linear) and 2 (used). Then it trains with pairs of
maps (int8 state) and reports the final loss against full precision at two learning rates.

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


def _moments(steps: int) -> dict[str, torch.Tensor]:
    _, opt = train(lambda ps: torch.optim.AdamW(ps, lr=3e-3), steps=steps)
    return {
        key: torch.cat([s[key].reshape(-1) for s in opt.state.values() if s[key].numel() >= 4096])
        for key in ("exp_avg", "exp_avg_sq")
    }


def _readback(x: torch.Tensor) -> torch.Tensor:
    payload = compressed.quantize_state(x, "int8", 0, 0)
    return compressed.dequantize_state(payload, "int8", [x.numel()], torch.float32)


def _quantiles(error: torch.Tensor) -> tuple[float, float]:
    sample = error[torch.randperm(error.numel())[:100_000]]
    q = torch.quantile(sample, torch.tensor([0.5, 0.99]))
    return q[0].item(), q[1].item()


def _second(v: torch.Tensor, power: int) -> str:
    compressed.UNSIGNED_POWER = power
    got = _readback(v)
    nonzero = v > 0
    zeroed = ((got == 0) & nonzero).float().sum() / nonzero.float().sum()
    exact, approx = 1 / (v.sqrt() + EPS), 1 / (got.sqrt() + EPS)
    median, p99 = _quantiles(((approx - exact).abs() / exact)[nonzero])
    return (
        f"unsigned power {power}: nonzero v read as 0: {zeroed.item():.2%}; relative error "
        f"of 1/(sqrt(v)+eps): median {median:.3%}, p99 {p99:.3%}"
    )


def _first(m: torch.Tensor, power: int) -> str:
    compressed.SIGNED_POWER = power
    got = _readback(m)
    nonzero = m != 0
    zeroed = ((got == 0) & nonzero).float().sum() / nonzero.float().sum()
    median, p99 = _quantiles(((got - m).abs() / m.abs())[nonzero])
    return (
        f"signed power {power}: nonzero m read as 0: {zeroed.item():.2%}; relative error: "
        f"median {median:.3%}, p99 {p99:.3%}"
    )


def main() -> None:
    torch.manual_seed(0)
    chosen = compressed.SIGNED_POWER, compressed.UNSIGNED_POWER
    for steps in (30, 300):
        moments = _moments(steps)
        print(f"after {steps} steps ({moments['exp_avg'].numel()} elements each):")
        for power in (1, 2, 4):
            print("  exp_avg_sq, " + _second(moments["exp_avg_sq"], power))
        for power in (1, 2):
            print("  exp_avg, " + _first(moments["exp_avg"], power))
        compressed.SIGNED_POWER, compressed.UNSIGNED_POWER = chosen
    data = batches(300)
    for lr in (3e-3, 1e-2):
        make = lambda ps, lr=lr: torch.optim.AdamW(ps, lr=lr)  # noqa: E731
        base, _ = train(make, data=data)
        line = [f"AdamW lr={lr}: full precision {base:.4f}"]
        for signed, unsigned in ((1, 1), (1, 2), (2, 2), (2, 4)):
            compressed.SIGNED_POWER, compressed.UNSIGNED_POWER = signed, unsigned
            loss, _ = train(make, data=data, state_dtype="int8")
            line.append(f"powers {signed}/{unsigned} {loss:.4f} ({loss / base - 1:+.2%})")
        print("; ".join(line))
    compressed.SIGNED_POWER, compressed.UNSIGNED_POWER = chosen


if __name__ == "__main__":
    main()
