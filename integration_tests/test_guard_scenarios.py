"""Guards end to end: changing exactly one input retraces once and the reason names it;
changing nothing never retraces; results always match eager."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import types
import warnings
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


STEP_SCALE = 1.0  # a module global a custom step reads (test below changes it)
# Module globals holding containers and an object a custom step reads items and attributes of
SCALES = {"scale": 1.0}
SCALE_LIST = [1.0, 2.0]
SETTINGS = types.SimpleNamespace(scale=1.0, name="sgd", buffer=torch.zeros(1))


def scaled(value: float) -> float:  # a module helper the step calls (the test replaces it)
    return value * 1.0


@dataclasses.dataclass
class _Config:
    scale: float = 1.0
    double: bool = False


@dataclasses.dataclass(frozen=True)
class _FrozenConfig:
    scale: float = 1.0


@dataclasses.dataclass(slots=True)
class _SlotsConfig:  # (no __dict__: not viewed, used as it is; its slots change in place)
    scale: float = 1.0


class _ConfiguredSGD(torch.optim.Optimizer):
    """Reads its update's scale from a config object, a module global or its class."""

    CLASS_SCALE = 1.0
    CLASS_SCALES = {"scale": 1.0}  # noqa: RUF012 (what the test changes)

    def __init__(self, params: Any, config: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.config = config

    @torch.no_grad()
    def step(self) -> None:
        if isinstance(self.config, str):  # which global holds it
            scale = {
                "global dict": lambda: SCALES["scale"],
                "global list": lambda: SCALE_LIST[0],
                "global object": lambda: SETTINGS.scale,
                "global helper": lambda: scaled(1.0),
                "class float": lambda: self.CLASS_SCALE,
                "class dict": lambda: self.CLASS_SCALES["scale"],
            }[self.config]()
        elif self.config is None:
            scale = STEP_SCALE
        else:
            scale = self.config.scale * (2.0 if getattr(self.config, "double", False) else 1.0)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * scale)


_scaled = scaled


def _change_config(kind: str, opt: Any) -> None:
    global STEP_SCALE
    if kind == "global":
        STEP_SCALE = 3.0
    elif kind == "global dict":
        SCALES["scale"] = 3.0
    elif kind == "global list":
        SCALE_LIST[0] = 3.0
    elif kind == "global object":
        SETTINGS.scale = 3.0
    elif kind == "global helper":
        globals()["scaled"] = lambda value: value * 3.0
    elif kind == "class float":
        _ConfiguredSGD.CLASS_SCALE = 3.0
    elif kind == "class dict":
        _ConfiguredSGD.CLASS_SCALES["scale"] = 3.0
    elif kind == "frozen dataclass replaced":
        opt.config = _FrozenConfig(scale=3.0)
    elif kind.endswith("flag"):
        opt.config.double = True
    else:
        opt.config.scale = 3.0


CONFIGS: dict[str, tuple[Callable[[], Any], str | None]] = {
    # A float on a config object is a graph input, as on the optimizer: no retrace.
    "dataclass float": (_Config, None),
    "SimpleNamespace float": (lambda: types.SimpleNamespace(scale=1.0), None),
    "dataclass flag": (_Config, "L['opt'].config.double: value changed (False -> True)"),
    "frozen dataclass replaced": (_FrozenConfig, "L['opt'].config: a different object"),
    # (its value was baked in and a change kept it, silently: now each slot is guarded)
    "slots dataclass": (_SlotsConfig, "L['opt'].config.scale: value changed (1.0 -> 3.0)"),
    "global": (lambda: None, f"G['{__name__}'].STEP_SCALE: value changed (1.0 -> 3.0)"),
    # A container or a plain object held in a global: its contents were baked in unseen
    # (the old value kept silently); now compared with a copy on each call
    "global dict": (
        lambda: "global dict",
        f"G['{__name__}'].SCALES: value changed ({{'scale': 1.0}} -> {{'scale': 3.0}})",
    ),
    "global list": (
        lambda: "global list",
        f"G['{__name__}'].SCALE_LIST: value changed ([1.0, 2.0] -> [3.0, 2.0])",
    ),
    # Read through the optimizer from its class (was baked in unseen): as an attribute of
    # the instance, a float is an input
    "class float": (lambda: "class float", None),
    "class dict": (lambda: "class dict", None),
    "global object": (
        lambda: "global object",  # (its attributes that hold constants, each)
        f"G['{__name__}'].SETTINGS.scale: value changed (1.0 -> 3.0)",
    ),
    "global helper": (lambda: "global helper", f"G['{__name__}'].scaled: a different object"),
}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_what_a_step_reads_from_config_objects_and_globals_follows_their_changes(kind):
    """Values read off objects the tracker does not hold (a config dataclass, a module
    global) were baked into the graph: now a float is an input, anything else a guard."""
    global STEP_SCALE
    make_config, reason = CONFIGS[kind]
    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(_ConfiguredSGD(model.parameters(), make_config()))
    eager = _ConfiguredSGD(reference.parameters(), make_config())
    try:
        step_both(model, opt, reference, eager, range(2))
        _change_config(kind, opt)
        if not kind.startswith(("global", "class")):  # (shared by both)
            _change_config(kind, eager)
        step_both(model, opt, reference, eager, range(2, 4))
    finally:
        STEP_SCALE = 1.0
        SCALES["scale"] = SCALE_LIST[0] = SETTINGS.scale = 1.0
        globals()["scaled"] = _scaled
        _ConfiguredSGD.CLASS_SCALE = _ConfiguredSGD.CLASS_SCALES["scale"] = 1.0
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    report = optcompile.explain(opt)
    assert report.traces == (1 if reason is None else 2), report.retrace_reasons
    assert [r.split(" (id ")[0] for r in report.retrace_reasons] == ([reason] if reason else [])


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


class _TwoConfigsSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, first: Any, second: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.first, self.second = first, second

    @torch.no_grad()
    def step(self) -> None:
        scale = self.first.scale + self.second.scale
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * scale)


def test_one_config_object_held_twice_then_two_retraces():
    model = small_model()
    reference = copy.deepcopy(model)
    shared, twin = _Config(), _Config()
    opt = optcompile.compile(_TwoConfigsSGD(model.parameters(), shared, shared))
    eager = _TwoConfigsSGD(reference.parameters(), twin, twin)
    step_both(model, opt, reference, eager, range(2))
    opt.second, eager.second = _Config(scale=3.0), _Config(scale=3.0)
    step_both(model, opt, reference, eager, range(2, 4))
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    report = optcompile.explain(opt)
    assert report.retrace_reasons == [
        "L['opt'].second: is no longer the same object as L['opt'].first"
    ]


@dataclasses.dataclass
class _Masked:
    mask: torch.Tensor


class _MaskedSGD(torch.optim.Optimizer):
    def __init__(self, params: Any, config: _Masked) -> None:
        super().__init__(params, {"lr": 0.1})
        self.config = config

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad * self.config.mask, alpha=-group["lr"])


def test_a_tensor_on_a_config_object_is_an_input_read_each_call():
    """Written in place, the next call reads its new values; replaced, its data-pointer
    guard retraces. (Tensors in plain objects are registered as they are read.)"""
    params, twins = [torch.nn.Parameter(torch.zeros(4))], [torch.nn.Parameter(torch.zeros(4))]
    mine, theirs = _Masked(torch.tensor([1.0, 0, 1, 0])), _Masked(torch.tensor([1.0, 0, 1, 0]))
    opt, eager = optcompile.compile(_MaskedSGD(params, mine)), _MaskedSGD(twins, theirs)
    for step in range(4):
        if step == 2:
            mine.mask.mul_(3.0)
            theirs.mask.mul_(3.0)
        if step == 3:
            mine.mask, theirs.mask = torch.tensor([0.0, 1, 0, 1]), torch.tensor([0.0, 1, 0, 1])
        params[0].grad, twins[0].grad = torch.ones(4), torch.ones(4)
        opt.step()
        eager.step()
    torch.testing.assert_close(params[0], twins[0], rtol=0, atol=0)
    report = optcompile.explain(opt)
    assert (
        report.traces == 2
        and "L['opt'].config.mask: data pointer changed" in (report.retrace_reasons[0])
    )


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


class _ScaledPerParam(torch.optim.Optimizer):
    """Scales each parameter's update by an attribute the user set on it (a per-parameter
    lr multiplier), 1.0 where it has none."""

    def __init__(self, params: Any, foreach: bool) -> None:
        super().__init__(params, {"lr": 0.1})
        self.foreach = foreach

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            scales = [getattr(p, "lr_scale", 1.0) for p in params]
            if self.foreach:
                torch._foreach_add_(
                    params,
                    torch._foreach_mul([p.grad for p in params], scales),
                    alpha=-group["lr"],
                )
            else:
                for p, scale in zip(params, scales, strict=True):
                    p.add_(p.grad, alpha=-group["lr"] * scale)


@pytest.mark.parametrize("foreach", [False, True])
def test_an_attribute_set_on_a_parameter_is_read_and_followed(foreach):
    """``getattr(p, "lr_scale", 1.0)``: the traced stand-in of a parameter had none of the
    parameter's own attributes, so every step used the default (silently). Now a float
    there is an input: each parameter's own, a change needs no retrace."""
    model = small_model()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        for k, p in enumerate(m.parameters()):
            if k % 2 == 0:
                p.lr_scale = 0.5 + k
    opt = optcompile.compile(_ScaledPerParam(model.parameters(), foreach))
    eager = _ScaledPerParam(reference.parameters(), foreach)
    step_both(model, opt, reference, eager, range(2))
    for m in (model, reference):
        next(iter(m.parameters())).lr_scale = 3.0
    step_both(model, opt, reference, eager, range(2, 4))
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    assert optcompile.explain(opt).traces == 1
    for m in (model, reference):  # one that had none (the default was taken) gets one
        list(m.parameters())[1].lr_scale = 0.25
    step_both(model, opt, reference, eager, range(4, 6))
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    report = optcompile.explain(opt)
    assert report.traces == 2 and "hasattr(" in report.retrace_reasons[0], report


def test_a_numpy_array_the_step_reads_runs_it_eagerly_with_a_warning():
    """A numpy array in a param group changes in place under one identity: what the step
    read from it was baked in (a change kept the old value, silently). Refused: eager."""
    numpy = pytest.importorskip("numpy")

    class ArrayScaled(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1, "scale": numpy.array([0.5])})

        @torch.no_grad()
        def step(self) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"] * float(group["scale"][0]))

    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(ArrayScaled(model.parameters()))
    eager = ArrayScaled(reference.parameters())
    with pytest.warns(optcompile.FallbackWarning, match="is a numpy array"):
        step_both(model, opt, reference, eager, range(1))
    for o in (opt, eager):
        o.param_groups[0]["scale"][0] = 2.0
    step_both(model, opt, reference, eager, range(1, 3))
    assert_same(model, opt, reference, eager, rtol=0, atol=0)


def test_a_tensor_the_class_body_holds_is_used_as_it_is():
    """Class data read through ``self`` is read as the instance's attributes are; a tensor
    there is not (it is no input the trace collected): the step uses it as eager does."""

    class ClassTensor(torch.optim.Optimizer):
        SCALE = torch.tensor(0.5)

        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad * self.SCALE, alpha=-group["lr"])

    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(ClassTensor(model.parameters()))
    eager = ClassTensor(reference.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled, no fallback
        step_both(model, opt, reference, eager, range(3))
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    assert optcompile.explain(opt).traces == 1
