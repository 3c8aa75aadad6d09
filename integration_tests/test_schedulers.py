"""LR schedulers on compiled optimizers: parity with eager; hyperparameter changes never retrace.

Every scheduler in torch.optim.lr_scheduler is attached to a compiled optimizer and to an
eager one on a copy of the model and run for 10 steps. Parameters, state and the group
hyperparameters must match eager, and the number of traces must equal what the same
optimizer needs without a scheduler (measured on a third copy): lr, betas and momentum are
inputs of the graph, not constants. A Python decision on a hyperparameter
(``if weight_decay != 0``) may retrace, but only when its outcome flips.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, run_pair, set_grads, small_model, step_both

S = torch.optim.lr_scheduler
STEPS = 10
LR = 0.01

MakeOpt = Callable[[list[torch.nn.Parameter], Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, MakeOpt] = {
    "AdamW-foreach": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01, foreach=True),
    "AdamW-loop": lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01, foreach=False),
    "SGD-momentum": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
}

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda step: 0.9**step),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda step: 0.95),
    "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5, 8], gamma=0.5),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=STEPS),
    # cycle_momentum=True cycles SGD's momentum, or AdamW's betas[0].
    "CyclicLR": lambda o: S.CyclicLR(
        o,
        base_lr=0.001,
        max_lr=0.01,
        step_size_up=3,
        cycle_momentum=True,
        base_momentum=0.8,
        max_momentum=0.9,
    ),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2),
    # OneCycleLR also cycles SGD's momentum, or AdamW's betas[0] (a new betas tuple per step).
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.01, total_steps=STEPS),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.25, total_iters=5),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=1),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=8, power=2.0),
    "SequentialLR": lambda o: S.SequentialLR(
        o,
        [S.LinearLR(o, start_factor=0.25, total_iters=3), S.ExponentialLR(o, gamma=0.9)],
        milestones=[3],
    ),
    "ChainedScheduler": lambda o: S.ChainedScheduler(
        [S.ConstantLR(o, factor=0.5, total_iters=4), S.ExponentialLR(o, gamma=0.9)]
    ),
}

# A loss that improves once and then plateaus, so ReduceLROnPlateau halves the lr.
PLATEAU_LOSSES = [1.0, 0.9] + [0.9] * (STEPS - 2)

# Tensor lr: torch accepts it with every scheduler here for SGD and for AdamW's for-loop
# path (AdamW foreach needs capturable=True for a tensor lr, which needs CUDA).
TENSOR_LR_CASES = [
    (sched, opt)
    for sched in ["LambdaLR", "CosineAnnealingLR", "CyclicLR", "OneCycleLR", "ReduceLROnPlateau"]
    for opt in ["AdamW-loop", "SGD-momentum"]
]


def _lr(kind: str) -> float | torch.Tensor:
    return torch.tensor(LR) if kind == "tensor" else LR


def _sched_step(sched: Any, step: int) -> None:
    if isinstance(sched, S.ReduceLROnPlateau):
        sched.step(PLATEAU_LOSSES[step])
    else:
        sched.step()


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    keys = ("lr", "betas", "momentum")
    return [
        {k: (float(g[k]) if k != "betas" else tuple(map(float, g[k]))) for k in keys if k in g}
        for g in opt.param_groups
    ]


def traces_without_scheduler(make_opt: MakeOpt, lr_kind: str) -> int:
    """How many traces this optimizer needs over STEPS steps when nothing changes its groups."""
    model = small_model()
    opt = optcompile.compile(make_opt(list(model.parameters()), _lr(lr_kind)), backend="torch")
    for step in range(STEPS):
        set_grads(model, step)
        opt.step()
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    return report.traces


def check_scheduler(sched_name: str, opt_name: str, lr_kind: str) -> None:
    make_opt, make_sched = OPTIMIZERS[opt_name], SCHEDULERS[sched_name]
    baseline = traces_without_scheduler(make_opt, lr_kind)
    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(make_opt(list(model.parameters()), _lr(lr_kind)), backend="torch")
    eager = make_opt(list(reference.parameters()), _lr(lr_kind))
    pairs = [(model, opt, make_sched(opt)), (reference, eager, make_sched(eager))]
    lrs_seen = set()
    for step in range(STEPS):
        for m, o, sched in pairs:
            set_grads(m, step)
            o.step()
            _sched_step(sched, step)
        lrs_seen.add(_hyperparameters(eager)[0]["lr"])
    # The scheduler must really have changed the lr, or the test would prove nothing.
    assert len(lrs_seen) > 1, lrs_seen
    if sched_name == "ReduceLROnPlateau":
        assert _hyperparameters(eager)[0]["lr"] < LR
    assert _hyperparameters(opt) == _hyperparameters(eager)
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    assert report.traces == baseline, report.retrace_reasons


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("sched_name", sorted(SCHEDULERS))
def test_scheduler_float_lr_matches_eager_without_retrace(sched_name, opt_name):
    check_scheduler(sched_name, opt_name, "float")


@pytest.mark.parametrize(("sched_name", "opt_name"), TENSOR_LR_CASES)
def test_scheduler_tensor_lr_matches_eager_without_retrace(sched_name, opt_name):
    check_scheduler(sched_name, opt_name, "tensor")


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_hand_changed_betas_and_momentum_do_not_retrace(opt_name):
    make_opt = OPTIMIZERS[opt_name]
    baseline = traces_without_scheduler(make_opt, "float")
    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(make_opt(list(model.parameters()), LR), backend="torch")
    eager = make_opt(list(reference.parameters()), LR)
    for step in range(STEPS):
        for m, o in ((model, opt), (reference, eager)):
            group = o.param_groups[0]
            if "betas" in group:
                group["betas"] = (0.9 - 0.02 * step, 0.999 - 0.005 * step)
            if "momentum" in group:
                group["momentum"] = 0.9 - 0.05 * step
            set_grads(m, step)
            o.step()
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    assert report.traces == baseline, report.retrace_reasons


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
def test_python_decision_on_hyperparameter_retraces_only_when_it_flips(foreach):
    # SGD without momentum keeps no state, so nothing but weight_decay can cause a retrace.
    def make(ps):
        return torch.optim.SGD(ps, lr=0.1, weight_decay=0.0, foreach=foreach)

    model, opt, reference, eager = run_pair(make, steps=2, backend="torch")
    assert_same(model, opt, reference, eager)
    assert optcompile.explain(opt).traces == 1

    # `weight_decay != 0` flips from False to True: exactly one retrace, and it says why.
    for o in (opt, eager):
        o.param_groups[0]["weight_decay"] = 0.1
    step_both(model, opt, reference, eager, range(2, 4))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 2, report.retrace_reasons
    assert "weight_decay" in report.retrace_reasons[-1]

    # 0.1 -> 0.2 keeps the outcome (still != 0): the value is an input, no retrace.
    for o in (opt, eager):
        o.param_groups[0]["weight_decay"] = 0.2
    step_both(model, opt, reference, eager, range(4, 6))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 2, report.retrace_reasons
    assert report.fallback_reason is None
