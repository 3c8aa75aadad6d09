"""Helpers to check a compiled optimizer against eager torch.optim on copies of one model."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

import optcompile

MakeOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def small_model(seed: int = 0) -> torch.nn.Module:
    """A two-layer MLP with parameters of several shapes."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def set_grads(model: torch.nn.Module, step: int) -> None:
    """Deterministic random gradients for ``step`` (the same on copies of a model)."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        grad = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        p.grad = grad.to(device=p.device, dtype=p.dtype)


def run_pair(
    make_opt: MakeOptimizer,
    steps: int = 5,
    model: torch.nn.Module | None = None,
    **compile_options: Any,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, torch.optim.Optimizer]:
    """Compiled and eager optimizers over deep copies of one model, stepped ``steps`` times.

    Returns ``(model, compiled_opt, reference_model, eager_opt)``.
    """
    model = small_model() if model is None else model
    reference = copy.deepcopy(model)
    opt = optcompile.compile(make_opt(list(model.parameters())), **compile_options)
    eager = make_opt(list(reference.parameters()))
    step_both(model, opt, reference, eager, range(steps))
    return model, opt, reference, eager


def step_both(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    reference: torch.nn.Module,
    eager: torch.optim.Optimizer,
    steps: range,
) -> None:
    """Give both models the same gradients and step both optimizers, for each step."""
    for step in steps:
        for m, o in ((model, opt), (reference, eager)):
            set_grads(m, step)
            o.step()


def assert_same(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    reference: torch.nn.Module,
    eager: torch.optim.Optimizer,
    **tolerances: Any,
) -> None:
    """Parameters and every state entry of the two optimizers match."""
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, **tolerances)
        assert set(opt.state[p]) == set(eager.state[q]), (set(opt.state[p]), set(eager.state[q]))
        for key, value in eager.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, **tolerances)


def assert_within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: float) -> None:
    """Infinities (with their signs) and NaNs where ``b`` has them; finite values within
    ``ulps`` of the dtype at the scale of ``b``'s largest finite value."""
    a, b = a.detach(), b.detach()
    torch.testing.assert_close(a.isnan(), b.isnan())
    torch.testing.assert_close(a.isinf() & (a > 0), b.isinf() & (b > 0))
    torch.testing.assert_close(a.isinf() & (a < 0), b.isinf() & (b < 0))
    finite = a.isfinite() & b.isfinite()
    if finite.any():
        scale = float(b[finite].abs().max().double())
        atol = ulps * torch.finfo(a.dtype).eps * max(scale, torch.finfo(a.dtype).tiny)
        torch.testing.assert_close(a[finite], b[finite], rtol=0, atol=atol)
