"""The step inside backward against eager stepping after backward, on drawn cases: an
optimizer of torch.optim over drawn param groups of a small model, updated in buckets of a
drawn size inside each ``loss.backward()``, with drawn changes between iterations (an lr
set, an LR scheduler, a state_dict round trip, eager's state loaded, gradient accumulation,
a param frozen or unused for a backward, a param group added, a ``zero_grad()``, or one with
``set_to_none=False``, which warns once). After each iteration the params and every state
entry must match eager's within ``ULPS`` of each tensor's largest value (float64: 1e-7 of
it, as torch's test_optim allows; the buckets' foreach groups are not eager's; the kernels
round as ATen does on CUDA), and no gradient may be left. The loss is linear in the
params, its gradients drawn per iteration: they do not depend on the params, so a last-bit
difference of one step is not carried into the next step's gradients (and grown there) as
a model's loss would carry it.

CI runs ``CI_EXAMPLES`` derandomized examples; ``OPTCOMPILE_FUZZ_EXAMPLES=n`` (with
``OPTCOMPILE_FUZZ_SEED=m``) draws that many at random, as test_differential.py does.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import optcompile
import pytest
import torch
from eager_pairs import ULPS
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from optcompile.testing import assert_within_ulps
from triton_setup import TRITON_RUNS

CI_EXAMPLES = 40
LONG_EXAMPLES = int(os.environ.get("OPTCOMPILE_FUZZ_EXAMPLES", "0"))
SEED = os.environ.get("OPTCOMPILE_FUZZ_SEED")
FUZZ = settings(
    max_examples=LONG_EXAMPLES or CI_EXAMPLES,
    derandomize=not LONG_EXAMPLES,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", *(["cpu"] if DEVICE == "cpu" else []), *(["triton"] if TRITON_RUNS else [])]

# name -> options drawn per group (each a list of choices), beside lr
OPTIONS: dict[str, dict[str, list[Any]]] = {
    "AdamW": {"weight_decay": [0.0, 0.1], "amsgrad": [False, True]},
    "Adam": {"weight_decay": [0.0, 0.01], "maximize": [False, True]},
    "SGD": {"momentum": [0.0, 0.9], "nesterov": [False], "weight_decay": [0.0, 0.01]},
    "RMSprop": {"momentum": [0.0, 0.5], "centered": [False, True]},
    "Adagrad": {"lr_decay": [0.0, 0.01]},
    "NAdam": {"decoupled_weight_decay": [False, True], "weight_decay": [0.0, 0.01]},
    "Adamax": {"weight_decay": [0.0, 0.01]},
    "RAdam": {"weight_decay": [0.0, 0.01]},
    "Adadelta": {"rho": [0.9, 0.5]},
    "Rprop": {"etas": [(0.5, 1.2)]},
    "ASGD": {"t0": [2.0, 1e6]},
}
CAPTURABLE = {"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta", "RMSprop", "Rprop", "ASGD"}
LRS = {"SGD": 0.05, "Adadelta": 1.0, "Rprop": 0.01, "ASGD": 0.05}
EVENTS = ["set_lr", "scheduler", "round_trip", "from_eager", "accumulate", "freeze", "unused",
          "add_group", "zero_grad", "zero_grad_to_zeros"]  # fmt: skip


class Net(torch.nn.Module):
    """Params of several shapes (a 0-dim scale, vectors, matrices), one a drawn iteration
    leaves out (it then gets no gradient), one in no group until added. Its loss is linear
    in the params: ``sum(p * g)`` over the used ones, ``g`` the iteration's gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.second = torch.nn.Linear(8, 5)
        self.branch = torch.nn.Linear(6, 5, bias=False)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.extra = torch.nn.Parameter(torch.randn(5) * 0.1)  # in no group until added

    def forward(self, grads: dict[str, torch.Tensor], use_branch: bool = True) -> torch.Tensor:
        used = [(n, p) for n, p in self.named_parameters() if use_branch or n != "branch.weight"]
        zero = torch.zeros((), device=DEVICE, dtype=self.scale.dtype)
        return sum(((p * grads[n]).sum() for n, p in used), zero)


def _grads(model: Net, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """An iteration's gradients: normal draws, some elements tiny or zero (where Adagrad's
    and RMSprop's denominators meet eps)."""
    drawn = {}
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        g = torch.where(torch.rand(p.shape, generator=gen) < 0.1, g * 1e-6, g)
        drawn[name] = g.to(DEVICE)
    return drawn


@dataclass
class Case:
    optimizer: str
    groups: list[tuple[list[str], dict[str, Any]]]  # (param names, options)
    bucket_bytes: int
    backend: str
    events: list[list[str]] = field(default_factory=list)  # per iteration, before it
    seed: int = 0
    dtype: str = "float32"


@st.composite
def cases(draw: st.DrawFn) -> Case:
    name = draw(st.sampled_from(sorted(OPTIONS)))
    names = [n for n, _ in Net().named_parameters() if n != "extra"]
    count = draw(st.integers(1, 3))
    assignment = draw(st.lists(st.integers(0, count - 1), min_size=len(names), max_size=len(names)))
    groups = []
    for index in range(count):
        members = [n for n, g in zip(names, assignment, strict=True) if g == index]
        if not members:
            continue
        options = {k: draw(st.sampled_from(v)) for k, v in OPTIONS[name].items()}
        options["lr"] = LRS.get(name, 0.01) * draw(st.sampled_from([1.0, 0.5]))
        options["foreach"] = draw(st.sampled_from([None, False, True]))
        if DEVICE == "cuda" and name in CAPTURABLE:  # (eager's capturable paths need a GPU)
            options["capturable"] = draw(st.booleans())
        groups.append((members, options))
    iterations = draw(st.integers(2, 5))
    events = [
        draw(st.lists(st.sampled_from(EVENTS), max_size=2, unique=True)) for _ in range(iterations)
    ]
    return Case(
        optimizer=name,
        groups=groups,
        bucket_bytes=draw(st.sampled_from([64, 200, 1024, 1 << 20])),
        backend=draw(st.sampled_from(BACKENDS)),
        events=events,
        seed=draw(st.integers(0, 3)),
        dtype=draw(st.sampled_from(["float32", "float64"])),
    )


def _optimizer(case: Case, model: Net) -> torch.optim.Optimizer:
    params = dict(model.named_parameters())
    groups = [{"params": [params[n] for n in members], **opts} for members, opts in case.groups]
    return getattr(torch.optim, case.optimizer)(groups)


def run_case(case: Case) -> None:
    torch.manual_seed(case.seed)
    model = Net().to(DEVICE, getattr(torch, case.dtype))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a FallbackWarning is the driver's to give)
        opt = optcompile.compile(
            _optimizer(case, model),
            in_backward=True,
            bucket_bytes=case.bucket_bytes,
            backend=case.backend,
        )
    eager = _optimizer(case, reference)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (opt, eager)]
    added = warned = False
    gen = torch.Generator().manual_seed(case.seed)
    for iteration, events in enumerate(case.events):
        x = _grads(model, gen)
        use_branch, frozen, accumulate = True, False, False
        for event in events:
            if event == "set_lr":
                for o in (opt, eager):
                    o.param_groups[-1]["lr"] *= 0.5
            elif event == "scheduler":
                for s in scheds:
                    s.step()
            elif event == "round_trip":
                saved = copy.deepcopy(eager.state_dict())
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                eager.load_state_dict(saved)
            elif event == "from_eager":  # (both load eager's: the same state after)
                saved = eager.state_dict()
                opt.load_state_dict(copy.deepcopy(saved))
                eager.load_state_dict(copy.deepcopy(saved))
            elif event == "accumulate":
                accumulate = True
            elif event == "freeze":
                frozen = True
            elif event == "unused":
                use_branch = False
            elif event == "add_group" and not added:
                added = True
                lr = LRS.get(case.optimizer, 0.01)
                opt.add_param_group({"params": [model.extra], "lr": lr})
                eager.add_param_group({"params": [reference.extra], "lr": lr})
            elif event == "zero_grad":
                opt.zero_grad()
                eager.zero_grad()
        for m in (model, reference):
            m.first.bias.requires_grad_(not frozen)
        x0 = _grads(model, gen) if accumulate else None
        try:  # eager first: what it refuses, the in-backward side must refuse alike
            if x0 is not None:
                reference(x0, use_branch).backward()
            reference(x, use_branch).backward()
            eager.step()
        except Exception as exc:  # (Adagrad's add_param_group on torch 2.11: no "sum")
            with pytest.raises(type(exc)):
                if x0 is not None:
                    with optcompile.accumulate(opt):
                        model(x0, use_branch).backward()
                model(x, use_branch).backward()
                opt.step()
            return
        if x0 is not None:  # one more micro-batch first, its gradients held for the next
            with optcompile.accumulate(opt):
                model(x0, use_branch).backward()
        model(x, use_branch).backward()
        left = [n for n, p in model.named_parameters() if p.grad is not None and _owned(opt, p)]
        assert not left, f"iteration {iteration}: gradients left after backward: {left}"
        opt.step()  # (inside backward: the hooks only)
        if "zero_grad_to_zeros" in events:  # (no gradient is held to be zeroed: it warns)
            with (
                pytest.warns(UserWarning, match="no zero gradient is held")
                if not warned
                else _quiet()
            ):
                opt.zero_grad(set_to_none=False)
            warned = True
        else:
            opt.zero_grad()
        eager.zero_grad()  # (eager's zeros would step a frozen param: docs/in_backward.md)
        for m in (model, reference):
            m.first.bias.requires_grad_(True)
        where = f"iteration {iteration} ({events})"
        try:
            _assert_matches(model, opt, reference, eager)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (said once only)
        yield


def _owned(opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    return any(p is q for g in opt.param_groups for q in g["params"])


def _assert_matches(
    model: Net, opt: torch.optim.Optimizer, reference: Net, eager: torch.optim.Optimizer
) -> None:
    """Every param (the one in no group yet too) and the state of those in a group (read
    with ``get``: the state is a defaultdict)."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        _within(p, q, name)
        if not _owned(eager, q):
            continue
        mine, theirs = opt.state.get(p, {}), eager.state.get(q, {})
        assert set(mine) == set(theirs), (name, set(mine), set(theirs))
        for key, value in theirs.items():
            _within(mine[key], value, f"{name} {key}")


_EPS64 = torch.finfo(torch.float64).eps


def _within(actual: Any, expected: Any, what: str) -> None:
    if not isinstance(expected, torch.Tensor):
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), what
        return
    # (float64: 1e-7 of the largest value, what torch's test_optim allows between its paths:
    # RAdam's foreach step is that far from eager in float64, README; a 0-dim float64 state,
    # ASGD's eta or NAdam's mu_product after load_state_dict, which eager computes in
    # float32 tensor arithmetic and the kernels' host in double: 3e-7, two float32 ulps)
    ulps = ULPS[expected.dtype]
    if expected.dtype == torch.float64:
        ulps = (3e-7 if expected.dim() == 0 else 1e-7) / _EPS64
    try:
        assert_within_ulps(actual, expected, ulps)
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from None


def _seeded(test: Any) -> Any:
    if SEED is None:
        return test
    from hypothesis import seed

    return seed(int(SEED))(test)


@_seeded
@FUZZ
@given(case=cases())
def test_in_backward_matches_eager_after_backward_on_drawn_cases(case: Case) -> None:
    note(f"run_case({case!r})")
    run_case(case)
