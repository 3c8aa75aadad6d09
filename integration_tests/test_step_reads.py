"""What a custom step reads besides its param groups and state, end to end: values on
config objects the optimizer holds, data its class holds, attributes set on its parameters,
module globals (constants, containers, plain objects, helper functions), numpy arrays. A
change to any of them reaches the compiled step (a float as a graph input) or retraces it,
naming what changed; results always match eager."""

from __future__ import annotations

import copy
import dataclasses
import types
import warnings
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, small_model, step_both

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
