"""What arming a bucket's direct update reads (optcompile.backward_direct), on any machine:
the walk over the paths of an entry's guards and inputs, the guards grouped by param-group
entry for a schedule's new numbers, and the refusals. The replays themselves need CUDA
(integration_tests/test_in_backward_direct.py)."""

from __future__ import annotations

import pytest
import torch
from optcompile import compile
from optcompile.backward_direct import NotDirect, _group_key, _no_effect, _numbers, _reached
from optcompile.driver import newest
from optcompile.optimizer import registered
from optguard.sources import AttrSource, ItemSource, LocalSource
from optsidefx.ledger import Const, Return, TensorWrite

SCALE = 0.5  # read by _GlobalScaled's step: a global the view does not hold


class _GlobalScaled(torch.optim.Optimizer):
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * SCALE)


def _entry(
    opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], backend: str = "torch"
) -> object:
    compiled = compile(opt, backend=backend)
    for _ in range(2):
        for p in params:
            p.grad = torch.ones_like(p)
        compiled.step()
    entry = newest(registered(compiled))
    assert entry is not None
    return entry


def test_the_walk_finds_the_groups_the_state_and_the_tensors_but_not_the_grads():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    entry = _entry(opt, params)
    dicts, lists, tensors = _reached(entry, {"opt": opt})
    ids = {id(d) for d in dicts}
    assert id(opt.param_groups[0]) in ids and id(opt.state) in ids
    assert all(id(opt.state[p]) in ids for p in params)  # each param's state entry
    assert id(opt.__dict__) in ids  # the optimizer itself: its attributes
    assert any(lst is opt.param_groups for lst in lists)
    held = {id(t) for t in tensors}
    assert all(id(p) in held for p in params)
    assert all(id(opt.state[p][k]) in held for p in params for k in ("exp_avg", "exp_avg_sq"))
    assert not any(t is p.grad for p in params for t in tensors)  # grads: checked apart


def test_a_step_reading_a_global_is_not_armed():
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = _GlobalScaled(params)
    entry = _entry(opt, params)
    with pytest.raises(NotDirect, match="outside the optimizer"):
        _reached(entry, {"opt": opt})


def test_guards_are_grouped_by_param_group_entry_and_params_are_left_out():
    groups = AttrSource(LocalSource("opt"), "param_groups")
    group = ItemSource(groups, 1)
    assert _group_key(group) == (1, None)
    assert _group_key(ItemSource(group, "lr")) == (1, "lr")
    assert _group_key(ItemSource(ItemSource(group, "betas"), 0)) == (1, "betas")
    assert _group_key(ItemSource(ItemSource(group, "params"), 0)) is None
    assert _group_key(groups) is None

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.Adam(params, lr=1e-3, foreach=True)
    numbers = _numbers(_entry(opt, params, backend="triton"))  # (a Triton plan's numbers)
    assert (0, "lr") in numbers.checks and (0, "betas") in numbers.checks
    assert not any(key == "params" for _, key in numbers.checks)
    L = {"opt": opt}
    assert numbers.checks[0, "lr"](L)
    opt.param_groups[0]["lr"] = 2e-3  # a schedule's new number: the guards still hold
    assert numbers.checks[0, "lr"](L)
    opt.param_groups[0]["maximize"] = True  # a flag the trace branched on: they do not
    assert not numbers.checks[0, "maximize"](L)


def test_only_in_place_writes_and_return_none_count_as_no_effect():
    target = ItemSource(ItemSource(AttrSource(LocalSource("opt"), "param_groups"), 0), "lr")
    assert _no_effect(Return(Const(None)))
    assert _no_effect(TensorWrite(target, None))
    assert not _no_effect(Return(Const(1)))


class _ClassScaled(torch.optim.Optimizer):
    FACTOR = 0.5

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                scale = getattr(p, "lr_scale", 1.0) * self.FACTOR
                p.add_(p.grad, alpha=-group["lr"] * scale)


def test_a_parameter_attribute_is_checked_through_the_parameter_dict():
    params = [torch.nn.Parameter(torch.randn(3))]
    params[0].lr_scale = 0.25
    _ClassScaled.FACTOR = 0.5
    opt = _ClassScaled(params)
    entry = _entry(opt, params)
    with pytest.raises(NotDirect, match="from a class"):  # (FACTOR: no tag to check)
        _reached(entry, {"opt": opt})
    _ClassScaled.FACTOR = 0.5  # (an instance attribute now: its dict has a tag)
    opt.FACTOR = 0.5
    entry = _entry(opt, params)
    dicts, _, _ = _reached(entry, {"opt": opt})
    assert any(d is params[0].__dict__ for d in dicts)  # a change of lr_scale is seen
