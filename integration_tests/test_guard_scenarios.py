"""Guards end to end: changing exactly one input retraces once and the reason names it;
changing nothing never retraces; results always match eager."""

from __future__ import annotations

import copy
import gc
import io
import weakref
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from optcompile.testing import assert_same, run_pair, set_grads, small_model, step_both

optim = torch.optim


def _both(model, opt, reference, eager, change: Callable[[Any, Any], None]) -> None:
    change(model, opt)
    change(reference, eager)


def _first(opt: torch.optim.Optimizer) -> torch.Tensor:
    return opt.param_groups[0]["params"][0]


def _replace_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    state = opt.state[_first(opt)]
    state["exp_avg"] = torch.zeros_like(state["exp_avg"])


def _set(key: str, value: Any) -> Callable[[Any, Any], None]:
    def change(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.param_groups[0][key] = value

    return change


def _add_group(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    extra = torch.nn.Parameter(torch.ones(5))
    model.register_parameter("extra", extra)
    opt.add_param_group({"params": [extra], "lr": 0.05})


def _to_double(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model.double()


CASES: dict[str, tuple[Callable[[list[Any]], Any], Callable[[Any, Any], None], str]] = {
    "state.clear()": (
        lambda ps: optim.AdamW(ps, lr=1e-2, foreach=True),
        lambda m, o: o.state.clear(),
        "L['opt'].state: keys changed (4 entries -> 0)",
    ),
    "a state tensor replaced by zeros_like": (
        lambda ps: optim.AdamW(ps, lr=1e-2, foreach=True),
        _replace_state,
        "['exp_avg']: data pointer changed (0x",
    ),
    "amsgrad flipped off": (
        lambda ps: optim.Adam(ps, lr=1e-2, amsgrad=True),
        _set("amsgrad", False),
        "L['opt'].param_groups[0]['amsgrad']: value changed (True -> False)",
    ),
    "maximize flipped": (
        lambda ps: optim.AdamW(ps, lr=1e-2),
        _set("maximize", True),
        "L['opt'].param_groups[0]['maximize']: value changed (False -> True)",
    ),
    "foreach flipped": (
        lambda ps: optim.AdamW(ps, lr=1e-2, foreach=False),
        _set("foreach", True),
        "L['opt'].param_groups[0]['foreach']: value changed (False -> True)",
    ),
    "a param group added": (
        lambda ps: optim.SGD(ps, lr=0.1),
        _add_group,
        "L['opt'].param_groups: length changed (1 -> 2)",
    ),
    "params moved to float64": (
        lambda ps: optim.SGD(ps, lr=0.1),
        _to_double,
        "L['opt'].param_groups[0]['params'][0]: dtype changed (torch.float32 -> torch.float64)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_changing_one_input_retraces_once_naming_it(case):
    make, change, reason = CASES[case]
    model, opt, reference, eager = run_pair(make, steps=3)
    before = optcompile.explain(opt).traces
    _both(model, opt, reference, eager, change)
    step_both(model, opt, reference, eager, range(3, 7))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == before + 1, report.retrace_reasons
    assert reason in report.retrace_reasons[-1], report.retrace_reasons
    assert report.fallback_reason is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_changing_nothing_never_retraces(case):
    make, _, _ = CASES[case]
    _, opt, *_ = run_pair(make, steps=3)
    traces = optcompile.explain(opt).traces
    _, opt2, *_ = run_pair(make, steps=8)
    assert optcompile.explain(opt2).traces == traces


def test_a_grad_becoming_none_and_back_reuses_the_first_entry():
    model, opt, reference, eager = run_pair(lambda ps: optim.AdamW(ps, lr=1e-2), steps=2)
    for step in range(2, 6):
        for m, o in ((model, opt), (reference, eager)):
            set_grads(m, step)
            if step == 3:
                next(iter(m.parameters())).grad = None
            o.step()
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 2  # one for the None pattern; back to the first entry after
    assert "grad: became None" in report.retrace_reasons[-1]
    assert report.entries == 2 and len(report.entry_guards) == 2


def test_a_checkpoint_load_that_retraces_lets_the_old_state_go():
    """load_state_dict with another weight decay: new state tensors, a new entry. The old
    entry stays cached (its hyperparameters may come back) but must not keep the old state
    tensors alive: memory the size of the optimizer state."""
    make = lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    model, opt, reference, eager = run_pair(make, steps=3)
    old = [weakref.ref(t) for s in opt.state.values() for t in s.values()]
    checkpoint = copy.deepcopy(eager.state_dict())
    checkpoint["param_groups"][0]["weight_decay"] = 0.0
    opt.load_state_dict(checkpoint)
    eager.load_state_dict(copy.deepcopy(checkpoint))
    step_both(model, opt, reference, eager, range(3, 5))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 2 and report.entries == 2
    gc.collect()
    assert all(ref() is None for ref in old)


def test_freeing_the_optimizer_takes_its_entries_with_it():
    model = small_model()
    opt = optcompile.compile(optim.AdamW(model.parameters(), lr=1e-2))
    set_grads(model, 0)
    opt.step()
    compiled = _OPTIMIZERS[opt]
    opt_ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert opt_ref() is None
    assert compiled.released and compiled.cache.entries == []


def test_explain_shows_the_check_with_its_fast_tier():
    _, opt, *_ = run_pair(lambda ps: optim.AdamW(ps, lr=1e-2, foreach=True), steps=3)
    report = optcompile.explain(opt)
    assert "def check(L)" in report.check_code
    assert "C++ guard tree" in report.check_code
    assert "entries are unchanged (dict versions)" in report.check_code


class _MatmulStep(torch.optim.Optimizer):
    """A step with a matmul, which torch.autocast runs in its lower dtype."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad @ p.grad.T @ p.grad, alpha=-group["lr"])


def test_entering_or_leaving_autocast_retraces_and_each_state_keeps_its_entry():
    """The casts autocast makes are recorded in the graph: a step traced inside an autocast
    region must not run outside one (nor in another dtype's)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 6))]
    twins = copy.deepcopy(params)
    opt, eager = optcompile.compile(_MatmulStep(params)), _MatmulStep(twins)
    regions = [torch.bfloat16, torch.bfloat16, None, torch.float16, None, torch.bfloat16]
    for step, dtype in enumerate(regions):
        gen = torch.Generator().manual_seed(step)
        params[0].grad = torch.randn(8, 6, generator=gen)
        twins[0].grad = params[0].grad.clone()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            opt.step()
            eager.step()
        torch.testing.assert_close(params[0], twins[0], rtol=0, atol=0)
    report = optcompile.explain(opt)
    assert report.traces == 3 and report.entries == 3  # bf16, off, fp16; then reused
    assert report.retrace_reasons[0] == "torch.autocast: changed (on (cpu:bfloat16) -> off)"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_numpy_float64_lr_changed_every_step_is_a_graph_input_too(backend):
    """numpy's float64 is a float: an lr computed with numpy never retraces (an object
    identity guard on it would retrace every step)."""
    numpy = pytest.importorskip("numpy")
    make = lambda ps: optim.AdamW(ps, lr=numpy.float64(1e-2), foreach=True)  # noqa: E731
    model, opt, reference, eager = run_pair(make, steps=1, backend=backend)
    for step in range(1, 5):
        for o in (opt, eager):
            o.param_groups[0]["lr"] = numpy.float64(1e-2) / step
        step_both(model, opt, reference, eager, range(step, step + 1))
    assert_same(model, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.traces == 1 and report.fallback_reason is None
    assert type(opt.param_groups[0]["lr"]) is numpy.float64


def test_hyperparameters_switching_between_float_and_numpy_float64_never_retrace():
    numpy = pytest.importorskip("numpy")
    make = lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=numpy.float64(0.1))  # noqa: E731
    model, opt, reference, eager = run_pair(make, steps=1)
    for step, lr in enumerate([numpy.float64(5e-3), 4e-3, numpy.float64(3e-3)], start=1):
        for o in (opt, eager):
            o.param_groups[0]["lr"] = lr
            o.param_groups[0]["weight_decay"] = float(o.param_groups[0]["weight_decay"])
        step_both(model, opt, reference, eager, range(step, step + 1))
    assert_same(model, opt, reference, eager)
    assert optcompile.explain(opt).traces == 1


def test_a_numpy_hyperparameter_decision_that_changes_names_its_guard():
    """The decision ``weight_decay != 0`` on a numpy float64 evaluates (numpy 2 prints
    ``np.float64(0.1)``, which is not Python the guard could evaluate)."""
    numpy = pytest.importorskip("numpy")
    make = lambda ps: optim.SGD(ps, lr=0.1, weight_decay=numpy.float64(0.1))  # noqa: E731
    model, opt, reference, eager = run_pair(make, steps=1)
    for o in (opt, eager):
        o.param_groups[0]["weight_decay"] = numpy.float64(0.0)
    step_both(model, opt, reference, eager, range(1, 3))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 2
    assert report.retrace_reasons == [
        "L['opt'].param_groups[0]['weight_decay']: "
        "(L['opt'].param_groups[0]['weight_decay'] != 0.0) changed (True -> False)"
    ]


_RESTRIDE = {
    "t_": lambda t: t.t_(),
    "as_strided_": lambda t: t.as_strided_((4, 4), (1, 4)),
    ".data =": lambda t: setattr(t, "data", t.data.t()),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("how", list(_RESTRIDE))
def test_a_state_tensor_restrided_in_place_at_its_address_retraces(backend, how):
    """Same object, same address, same dict version: only its strides tell (the Triton
    kernel would pair element (i, j) of the param with (j, i) of the state)."""
    model = torch.nn.Linear(4, 4, bias=False)
    model, opt, reference, eager = run_pair(
        lambda ps: optim.Adam(ps, lr=0.1), steps=2, model=model, backend=backend
    )
    for o, p in ((opt, _first(opt)), (eager, _first(eager))):
        exp_avg = o.state[p]["exp_avg"]
        address = exp_avg.data_ptr()
        _RESTRIDE[how](exp_avg)
        assert exp_avg.data_ptr() == address and exp_avg.stride() == (1, 4)
    step_both(model, opt, reference, eager, range(2, 5))
    assert_same(model, opt, reference, eager, rtol=1e-4, atol=1e-5)  # (kernel vs eager)
    report = optcompile.explain(opt)
    assert report.traces == 2
    assert report.retrace_reasons[0].endswith("['exp_avg']: stride changed ((4, 1) -> (1, 4))")


_STEP_CHANGES = {
    "dtype": (lambda t: setattr(t, "data", t.data.double()), "dtype changed"),
    "shape": (lambda t: setattr(t, "data", t.data.reshape(1)), "shape changed"),
    "requires_grad": (lambda t: t.requires_grad_(), "requires_grad changed"),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("how", list(_STEP_CHANGES))
def test_a_step_count_changed_in_place_retraces(backend, how):
    """A 0-dim CPU step count has no address guard (a backend may move it), but its
    metadata is guarded like any state tensor's: changed in place (same object, same dict
    version) it must miss the fast tier as it misses the full check (the Triton backend
    stacked it with the other lanes' step counts and set their values to 0)."""
    model = torch.nn.Linear(4, 4, bias=False)
    model, opt, reference, eager = run_pair(
        lambda ps: optim.Adam(ps, lr=0.1), steps=2, model=model, backend=backend
    )
    change, reason = _STEP_CHANGES[how]
    for o, p in ((opt, _first(opt)), (eager, _first(eager))):
        change(o.state[p]["step"])
    step_both(model, opt, reference, eager, range(2, 5))
    assert_same(model, opt, reference, eager, rtol=1e-4, atol=1e-5)  # (kernel vs eager)
    assert opt.state[_first(opt)]["step"].item() == eager.state[_first(eager)]["step"].item()
    report = optcompile.explain(opt)
    assert report.traces == 2
    assert f"['step']: {reason}" in report.retrace_reasons[0]


class _ReplacingMomentum(torch.optim.Optimizer):
    """Momentum kept by storing a new tensor each step (``buf = buf * m + g``), as many
    custom optimizers write it."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1, "momentum": 0.9})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"] = state["buf"] * group["momentum"] + p.grad
                p.add_(state["buf"], alpha=-group["lr"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_state_tensor_the_step_replaces_each_call_does_not_retrace(backend):
    """Its address changes every call by the step's own doing: no data-pointer guard on it
    (each call retraced, and the step went eager at the recompile limit)."""
    model, opt, reference, eager = run_pair(_ReplacingMomentum, steps=12, backend=backend)
    assert_same(model, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.traces == 2 and report.fallback_reason is None  # (+ the buffers)


def _reload(opt: torch.optim.Optimizer, saved: bytes) -> None:
    opt.load_state_dict(torch.load(io.BytesIO(saved)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fifty_checkpoint_reloads_stay_compiled_without_piling_up_entries(backend):
    """Each reload gives the state new tensors: the entry for the old ones is replaced, not
    kept (8 reloads reached the recompile limit); the group's key order, which
    load_state_dict changes ('params' last), retraces nothing."""
    make = lambda ps: optim.AdamW(ps, lr=1e-2)  # noqa: E731
    model, opt, reference, eager = run_pair(make, steps=3, backend=backend)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    saved = buffer.getvalue()
    for step in range(3, 53):
        for o in (opt, eager):
            _reload(o, saved)
        step_both(model, opt, reference, eager, range(step, step + 1))
    assert_same(model, opt, reference, eager, rtol=1e-4, atol=1e-5)  # (kernel vs eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and report.entries <= 2
    assert not any("keys changed" in r for r in report.retrace_reasons)


class _IteratingSGD(torch.optim.Optimizer):
    """Reads its hyperparameters by iterating the group: the keys' order then matters."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1, "scale": 2.0})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            factors = [v for k, v in group.items() if k != "params"]
            for p in group["params"]:
                p.add_(p.grad, alpha=-(factors[0] * factors[1]))


def test_key_order_is_guarded_only_for_a_step_that_iterates_the_group():
    model, opt, reference, eager = run_pair(_IteratingSGD, steps=1)
    for o in (opt, eager):
        group = o.param_groups[0]
        params = group.pop("params")
        group["params"] = params  # the same keys, 'params' last
    step_both(model, opt, reference, eager, range(1, 3))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 2 and "keys changed" in report.retrace_reasons[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_frozen_param_given_a_grad_later_is_stepped(backend):
    """A param with requires_grad=False and no grad at the first trace: its grad's None-ness
    is guarded too (the entry was reused and the param silently left as it was)."""
    model, opt, reference, eager = run_pair(lambda ps: optim.SGD(ps, lr=0.1), steps=0)
    for m in (model, reference):
        next(m.parameters()).requires_grad_(False)
    for step in range(4):
        for m, o in ((model, opt), (reference, eager)):
            set_grads(m, step)
            if step == 0:
                next(m.parameters()).grad = None  # frozen: no grad yet
            o.step()
    assert_same(model, opt, reference, eager, rtol=1e-5, atol=1e-6)
    assert optcompile.explain(opt).traces == 2
