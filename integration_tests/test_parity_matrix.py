"""The parity matrix: every torch.optim optimizer, every option it accepts, compiled vs eager.

Each option set runs with foreach on and off and with ``lr`` given as a float or as a 0-dim
tensor. The compiled optimizer (backend "torch") and eager torch.optim step deep copies of
one model three times; parameters and every state tensor must match, and the step must have
been compiled (no eager fallback). Combinations that eager torch.optim itself rejects on this
machine (in the constructor or in ``step()``) are skipped with torch's own message, never
guessed: e.g. ``capturable=True`` needs CUDA params, and Adam/AdamW refuse a tensor ``lr``
with ``foreach=True`` unless ``capturable=True``.

Also here: several param groups with different options, params whose grad is None on some
steps, and one optimizer over params of four dtypes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, set_grads, small_model

STEPS = 3

# Option sets per optimizer. Together they cover every constructor option of torch 2.13
# except ``differentiable`` and ``fused`` (eager fallbacks by design, see README). AdamW has
# no ``decoupled_weight_decay`` argument (it is always decoupled); Adagrad has no
# ``capturable``; SGD has neither ``capturable`` nor ``eps``.
OPTIONS: dict[str, list[dict[str, Any]]] = {
    "Adam": [
        {},
        {"weight_decay": 0.1, "amsgrad": True},
        {"weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True},
        {"betas": (0.8, 0.99), "eps": 1e-6, "amsgrad": True, "maximize": True},
        {"capturable": True},
    ],
    "AdamW": [
        {},
        {"weight_decay": 0.0, "amsgrad": True},
        {"betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "maximize": True},
        {"capturable": True, "amsgrad": True},
    ],
    "NAdam": [
        {},
        {"weight_decay": 0.1, "momentum_decay": 1e-2},
        {"weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True},
        {"betas": (0.8, 0.99), "eps": 1e-6},
        {"capturable": True},
    ],
    "RAdam": [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True},
        # beta2 = 0.9 makes the rectification term positive from step 2 on, so both
        # branches of RAdam's rect > 5 decision are exercised within 3 steps.
        {"betas": (0.8, 0.9), "eps": 1e-6},
        {"capturable": True},
    ],
    "Adamax": [
        {},
        {"weight_decay": 0.1, "maximize": True},
        {"betas": (0.8, 0.99), "eps": 1e-6},
        {"capturable": True},
    ],
    "Adadelta": [
        {},
        {"rho": 0.8, "eps": 1e-5, "weight_decay": 0.1},
        {"maximize": True},
        {"capturable": True},
    ],
    "Adagrad": [
        {},
        {"lr_decay": 0.01, "weight_decay": 0.1},
        {"initial_accumulator_value": 0.1, "eps": 1e-8, "maximize": True},
    ],
    "RMSprop": [
        {},
        {"alpha": 0.9, "eps": 1e-6, "weight_decay": 0.1},
        {"momentum": 0.5},
        {"centered": True},
        {"momentum": 0.9, "centered": True, "maximize": True},
        {"capturable": True},
    ],
    "Rprop": [
        {},
        {"etas": (0.4, 1.5), "step_sizes": (1e-5, 1.0)},
        {"maximize": True},
        {"capturable": True},
    ],
    "SGD": [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.1},
        {"momentum": 0.9, "nesterov": True, "maximize": True},
        {"weight_decay": 0.1, "maximize": True},
    ],
    "ASGD": [
        {},
        # t0=1 starts the averaging (ax, mu != 1) inside the three steps.
        {"lambd": 1e-3, "alpha": 0.5, "t0": 1.0, "weight_decay": 0.1},
        {"maximize": True},
        {"capturable": True},
    ],
}
LR = {"Adadelta": 0.5}  # everything else: 1e-2


def _label(options: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"


CASES = [
    pytest.param(name, options, id=f"{name}-{_label(options)}")
    for name, sets in OPTIONS.items()
    for options in sets
]


def _lr(name: str, kind: str) -> float | torch.Tensor:
    value = LR.get(name, 1e-2)
    return torch.tensor(value) if kind == "tensor" else value


def _factory(
    name: str, options: dict[str, Any], foreach: bool, lr_kind: str
) -> Callable[[Any], torch.optim.Optimizer]:
    # A fresh lr tensor per optimizer: copies must not share hyperparameter storage.
    def make(params: Any) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, name)
        return cls(params, lr=_lr(name, lr_kind), foreach=foreach, **options)

    return make


GradPattern = Iterable[tuple[int, ...]]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, none: tuple[int, ...]):
    set_grads(model, step)
    params = list(model.parameters())
    for i in none:
        params[i].grad = None
    opt.step()


def _run_eager(
    make: Callable[[Any], torch.optim.Optimizer],
    model: torch.nn.Module,
    pattern: GradPattern,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(model)
    opt = make(list(model.parameters()))
    for step, none in enumerate(pattern):
        _step(model, opt, step, none)
    return model, opt


def _max_abs_diff(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[Any, Any]) -> float:
    worst = 0.0
    for p, q in zip(a[0].parameters(), b[0].parameters(), strict=True):
        pairs = [(p, q)] + [
            (value, b[1].state[q][key])
            for key, value in a[1].state[p].items()
            if isinstance(value, torch.Tensor) and key in b[1].state[q]
        ]
        for x, y in pairs:
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def eager_tolerance(
    name: str,
    options: dict[str, Any],
    foreach: bool,
    lr_kind: str,
    model: torch.nn.Module,
    pattern: GradPattern,
) -> float:
    """The atol a compiled run may need: what eager needs between its foreach and loop paths.

    Runs eager torch.optim with these options on copies of ``model``, once with ``foreach``
    as requested and once with the other path, and returns the max abs difference over
    params and state, floored at 1e-6. Skips the test if eager rejects the requested
    combination. If only the *other* path is rejected, the floor (1e-6) is used.

    Why this and not torch.testing's defaults (float32: atol=1e-5, rtol=1.3e-6): the
    compiled graph runs the same ATen ops as the eager path it traced, so it must be at least
    as close to eager as eager's two implementations are to each other; with rtol=0 and this
    atol the check is tighter than the defaults for every case in this matrix (on torch 2.13
    CPU the measured eager difference is 0 for all of them, so the atol is the 1e-6 floor),
    and it still passes wherever the compiled result is as close to eager as eager is to
    itself.
    """
    pattern = list(pattern)
    try:
        reference = _run_eager(_factory(name, options, foreach, lr_kind), model, pattern)
    except Exception as exc:
        rejected = f"{type(exc).__name__}: {exc}"
    else:
        rejected = None
    if rejected is not None:
        pytest.skip(f"eager torch.optim rejects this combination on CPU: {rejected}")
    try:
        other = _run_eager(_factory(name, options, not foreach, lr_kind), model, pattern)
    except Exception:
        return 1e-6
    return max(_max_abs_diff(reference, other), 1e-6)


def compiled_and_eager(
    make: Callable[[Any], torch.optim.Optimizer],
    model: torch.nn.Module,
    pattern: GradPattern,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, torch.optim.Optimizer]:
    reference = copy.deepcopy(model)
    opt = optcompile.compile(make(list(model.parameters())), backend="torch")
    eager = make(list(reference.parameters()))
    for step, none in enumerate(pattern):
        _step(model, opt, step, none)
        _step(reference, eager, step, none)
    return model, opt, reference, eager


def assert_compiled(opt: torch.optim.Optimizer) -> None:
    """The step really ran compiled: traced at least once and never fell back to eager."""
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    assert report.traces >= 1


@pytest.mark.parametrize("lr_kind", ["float", "tensor"])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize(("name", "options"), CASES)
def test_option_matrix_matches_eager(name, options, foreach, lr_kind):
    pattern = [()] * STEPS
    tol = eager_tolerance(name, options, foreach, lr_kind, small_model(), pattern)
    make = _factory(name, options, foreach, lr_kind)
    model, opt, reference, eager = compiled_and_eager(make, small_model(), pattern)
    assert_compiled(opt)
    assert_same(model, opt, reference, eager, atol=tol, rtol=0.0)


# Two param groups per optimizer, each overriding different options of the defaults.
GROUPS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "Adam": (
        {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True},
        {"betas": (0.8, 0.9), "maximize": True},
    ),
    "AdamW": ({"weight_decay": 0.0}, {"lr": 0.05, "amsgrad": True, "eps": 1e-6}),
    "NAdam": (
        {"momentum_decay": 1e-2},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    "RAdam": (
        {"weight_decay": 0.1},
        {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    "Adamax": ({"weight_decay": 0.1}, {"betas": (0.8, 0.9), "maximize": True}),
    "Adadelta": ({"rho": 0.8}, {"lr": 0.25, "weight_decay": 0.1}),
    "Adagrad": ({"lr_decay": 0.01}, {"weight_decay": 0.1, "initial_accumulator_value": 0.1}),
    "RMSprop": ({"centered": True}, {"momentum": 0.9, "alpha": 0.9}),
    "Rprop": ({"etas": (0.4, 1.5)}, {"step_sizes": (1e-5, 1.0), "maximize": True}),
    "SGD": ({"momentum": 0.9, "nesterov": True}, {"momentum": 0.0, "weight_decay": 0.1}),
    "ASGD": ({"t0": 1.0, "lambd": 1e-3}, {"alpha": 0.5, "weight_decay": 0.1}),
}


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_param_groups_with_different_options(name, foreach):
    first, second = GROUPS[name]

    def make(ps):
        groups = [{"params": ps[:2], **first}, {"params": ps[2:], **second}]
        return getattr(torch.optim, name)(groups, lr=LR.get(name, 1e-2), foreach=foreach)

    model, opt, reference, eager = compiled_and_eager(make, small_model(), [()] * STEPS)
    assert_compiled(opt)
    assert_same(model, opt, reference, eager)


# Which params (by index in small_model) have grad None at each step. Param 1 starts
# without a grad, so its state is created late, as eager does.
NONE_PATTERN = [(1,), (), (0, 3), (), (2,)]


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_grad_none_on_some_steps_is_skipped_like_eager(name, foreach):
    tol = eager_tolerance(name, {}, foreach, "float", small_model(), NONE_PATTERN)
    make = _factory(name, {}, foreach, "float")
    model, opt, reference, eager = compiled_and_eager(make, small_model(), NONE_PATTERN)
    assert_compiled(opt)
    assert_same(model, opt, reference, eager, atol=tol, rtol=0.0)


class MixedDtypes(torch.nn.Module):
    """Four parameters of four dtypes (grads from set_grads take the param's dtype)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w32 = torch.nn.Parameter(torch.randn(4, 3))
        self.wbf16 = torch.nn.Parameter(torch.randn(3, 2).to(torch.bfloat16))
        self.w16 = torch.nn.Parameter(torch.randn(5).to(torch.float16))
        self.w64 = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_mixed_dtypes_in_one_optimizer(name, foreach):
    model = MixedDtypes()
    dtypes = [p.dtype for p in model.parameters()]
    assert dtypes == [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    make = _factory(name, {}, foreach, "float")
    model, opt, reference, eager = compiled_and_eager(make, model, [()] * STEPS)
    assert_compiled(opt)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.dtype == q.dtype
        for key, value in eager.state[q].items():
            assert opt.state[p][key].dtype == value.dtype, (key, p.dtype)
    # torch.testing's per-dtype defaults (e.g. bfloat16 rtol 1.6e-2, float64 rtol 1e-7) are
    # the dtype-appropriate tolerance here; eager's foreach and loop paths already differ in
    # the low bits for the half types.
    assert_same(model, opt, reference, eager)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "loop"])
@pytest.mark.parametrize(
    ("name", "options"),
    [("RAdam", {}), ("RAdam", {"weight_decay": 0.1, "decoupled_weight_decay": True}), ("ASGD", {})],
)
def test_steps_deciding_on_step_counts_compute_from_them_as_eager_does(
    name, options, foreach, dtype
):
    """RAdam's and ASGD's non-capturable paths decide on step counts in Python, so the
    compiled step runs their capturable path; eager computes from the counts (and ASGD's
    for-loop from eta and mu) as Python floats: so does the compiled step, in double (it
    computed in float32: 1e-5 relative off in float64). The for-loop paths match bitwise."""
    model = small_model().to(dtype)
    make = lambda ps: getattr(torch.optim, name)(ps, foreach=foreach, **options)  # noqa: E731
    model, opt, reference, eager = compiled_and_eager(make, model, [()] * 8)
    assert_compiled(opt)
    exact = not foreach or name == "ASGD"
    tol = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 0.0, "rtol": 1e-7}
    assert_same(model, opt, reference, eager, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_low_precision_foreach_steps_on_cpu_match_eager_bitwise(name, dtype):
    """The trace records an in-place foreach op as its functional form; on the CPU,
    ``_foreach_mul_`` by a scalar rounds float16/bfloat16 differently from ``_foreach_mul``
    (1 ulp, compounding over steps: RMSprop, Adam's exp_avg_sq), so the torch backend runs
    the op eager ran."""
    model = small_model().to(dtype)
    make = lambda ps: getattr(torch.optim, name)(ps, foreach=True)  # noqa: E731
    model, opt, reference, eager = compiled_and_eager(make, model, [()] * 6)
    assert_compiled(opt)
    assert_same(model, opt, reference, eager, atol=0.0, rtol=0.0)
