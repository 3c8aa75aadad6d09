"""Custom optimizers (subclasses of torch.optim.Optimizer written here) compile and match eager.

Lion (a per-tensor loop, or torch._foreach_* ops with ``foreach=True``) and an unfactored
Adafactor-style optimizer (a 0-dim step tensor in state, tensor-only RMS clipping, relative
step size) both create their state lazily inside ``step()``. Each runs compiled and eagerly
on copies of one model for 5 steps, with a constant float lr and with a LambdaLR that
changes the lr every step. Creating state inside the first step may cost one retrace; the
scheduler must not add any.
"""

from __future__ import annotations

import copy
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, run_pair, set_grads, small_model
from step_optimizers import Lion

STEPS = 5


class Adafactor(torch.optim.Optimizer):
    """Unfactored Adafactor (Shazeer & Stern 2018): second moment only, relative step size.

    beta2_t = 1 - step**decay_rate; v = beta2_t * v + (1 - beta2_t) * g**2;
    u = g / sqrt(v + eps1), clipped to RMS d: u / max(1, rms(u) / d);
    step size = max(eps2, rms(p)) * min(lr, 1 / sqrt(step)). Everything that depends on
    the step count is a tensor op on the 0-dim ``state['step']``: no ``.item()``.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        eps1: float = 1e-30,
        eps2: float = 1e-3,
        d: float = 1.0,
        decay_rate: float = -0.8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {
            "lr": lr,
            "eps1": eps1,
            "eps2": eps2,
            "d": d,
            "decay_rate": decay_rate,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step, v = state["step"], state["exp_avg_sq"]
                beta2_t = 1.0 - step.pow(group["decay_rate"])
                v.mul_(beta2_t).add_(g * g * (1.0 - beta2_t))
                update = g / torch.sqrt(v + group["eps1"])
                rms = update.pow(2).mean().sqrt()
                update = update / torch.clamp(rms / group["d"], min=1.0)
                rho = torch.clamp(step.rsqrt(), max=group["lr"])
                scale = torch.clamp(p.pow(2).mean().sqrt(), min=group["eps2"])
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(update * (scale * rho))
        return loss


class DataSGD(torch.optim.Optimizer):
    """Momentum SGD in the older ``.data`` idioms: reads through ``p.grad.data``, an in-place
    update of ``p.data`` (vectors), and an assignment ``p.data = ...`` (matrices)."""

    def __init__(self, params: Any, lr: float = 1e-2, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                d_p = p.grad.data
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.clone(d_p).detach()
                else:
                    state["buf"].mul_(group["momentum"]).add_(d_p)
                if p.dim() == 1:
                    p.data.add_(state["buf"], alpha=-group["lr"])
                else:
                    p.data = p.data - group["lr"] * state["buf"]


class FreshConstantsSGD(torch.optim.Optimizer):
    """Makes tensors from Python data inside its step (``torch.tensor``): a 0-dim scale and
    index/value vectors for an ``index_add_``."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                p.add_(p.grad * torch.tensor(2.0), alpha=-group["lr"])
                p.view(-1).index_add_(0, torch.tensor([0, 2]), torch.tensor([1e-3, -1e-3]))


OPTIMIZERS = {
    "Lion-loop": lambda ps: Lion(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "Lion-foreach": lambda ps: Lion(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "Adafactor": lambda ps: Adafactor(ps, lr=1e-2),
    "Adafactor-weight-decay": lambda ps: Adafactor(ps, lr=1e-2, weight_decay=0.1),
    "SGD in .data idioms": lambda ps: DataSGD(ps, lr=1e-2),
    "tensors made in the step": lambda ps: FreshConstantsSGD(ps, lr=1e-2),
}


def run(name: str, schedule: bool) -> tuple[Any, ...]:
    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(OPTIMIZERS[name](list(model.parameters())), backend="torch")
    eager = OPTIMIZERS[name](list(reference.parameters()))
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.8**step) if schedule else None
        for o in (opt, eager)
    ]
    for step in range(STEPS):
        for m, o, sched in zip((model, reference), (opt, eager), scheds, strict=True):
            set_grads(m, step)
            o.step()
            if sched is not None:
                sched.step()
    if schedule:
        assert opt.param_groups[0]["lr"] == eager.param_groups[0]["lr"] < 1e-2
    return model, opt, reference, eager


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_custom_optimizer_matches_eager(name):
    model, opt, reference, eager = run(name, schedule=False)
    assert all(len(eager.state[p]) > 0 for p in reference.parameters())
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    # The first step creates the state it then reads: at most one retrace for that.
    assert 1 <= report.traces <= 2, report.retrace_reasons


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_custom_optimizer_with_lambda_lr_matches_eager_without_retrace(name):
    baseline = optcompile.explain(run(name, schedule=False)[1]).traces
    model, opt, reference, eager = run(name, schedule=True)
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    assert report.traces == baseline, report.retrace_reasons


class IntStepAdam(torch.optim.Optimizer):
    """Adam keeping its step count as a Python int in state, as many custom optimizers do."""

    def __init__(self, params: Any, lr: float = 1e-2, betas: tuple[float, float] = (0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                state["m"].lerp_(p.grad, 1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["v"] / (1 - beta2**t)).sqrt_().add_(1e-8)
                p.addcdiv_(state["m"], denom, value=-group["lr"] / (1 - beta1**t))


def test_an_int_step_count_in_state_is_a_graph_input_not_a_retrace():
    model, opt, reference, eager = run_pair(lambda ps: IntStepAdam(ps), steps=6)
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    report = optcompile.explain(opt)
    assert report.traces == 2, report.retrace_reasons  # the second sees the created state
    assert all(opt.state[p]["step"] == 6 for p in model.parameters())
    assert all(type(opt.state[p]["step"]) is int for p in model.parameters())


class ReshapingData(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                p.data = p.data.flatten() - group["lr"] * p.grad.flatten()


def test_assigning_data_of_another_shape_runs_eagerly_naming_it():
    with pytest.warns(optcompile.FallbackWarning, match=r"assigns \.data of a tensor \(\[2, 3\]"):
        model, _, reference, _ = run_pair(
            lambda ps: ReshapingData(ps), model=torch.nn.Linear(3, 2, bias=False), steps=2
        )
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.shape == q.shape == (6,)
        torch.testing.assert_close(p, q, rtol=0, atol=0)
