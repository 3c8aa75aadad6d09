from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from optguard import (
    AttrSource,
    ConstantGuard,
    DictLengthGuard,
    ItemSource,
    KeyedSource,
    KeysGuard,
    LengthGuard,
    LocalSource,
    NoneGuard,
    TensorMatchGuard,
    TensorMeta,
    TypeGuard,
)

OPT = LocalSource("opt")
GROUP = ItemSource(AttrSource(OPT, "param_groups"), 0)
PARAM = ItemSource(ItemSource(GROUP, "params"), 0)


def test_sources_print_readable_access_paths():
    assert ItemSource(GROUP, "lr").name() == "L['opt'].param_groups[0]['lr']"
    state = KeyedSource(AttrSource(OPT, "state"), PARAM)
    assert state.name() == "L['opt'].state[L['opt'].param_groups[0]['params'][0]]"


def test_keyed_source_reads_missing_entry_as_none_without_creating_it():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    assert isinstance(opt.state, defaultdict)
    assert KeyedSource(AttrSource(OPT, "state"), PARAM).fetch({"opt": opt}) is None
    assert len(opt.state) == 0


@pytest.mark.parametrize(
    ("guard", "good", "bad", "reason"),
    [
        (TypeGuard(OPT, list), [], (), "type changed (list -> tuple)"),
        (ConstantGuard(OPT, 1e-3), 1e-3, 2e-3, "value changed (0.001 -> 0.002)"),
        (ConstantGuard(OPT, 1), 1, 1.0, "value changed (1 -> 1.0)"),
        (ConstantGuard(OPT, True), True, 1, "value changed (True -> 1)"),
        (LengthGuard(OPT, 2), [1, 2], [1], "length changed (2 -> 1)"),
        (DictLengthGuard(OPT, 3), {1: 0, 2: 0, 3: 0}, {}, "keys changed (3 entries -> 0)"),
        (KeysGuard(OPT, ("a", "b")), {"a": 1, "b": 2}, {"a": 1}, "['a', 'b'] -> ['a']"),
        (KeysGuard(OPT, None), None, {"a": 1}, "keys changed (absent -> ['a'])"),
        (NoneGuard(OPT, is_none=False), torch.ones(1), None, "became None"),
        (NoneGuard(OPT, is_none=True), None, torch.ones(1), "became a tensor"),
    ],
)
def test_guard_holds_on_its_value_and_names_the_change(guard, good, bad, reason):
    assert guard.holds(good)
    assert not guard.holds(bad)
    assert reason in guard.changed(bad)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: t.to(torch.bfloat16), "dtype changed (torch.float32 -> torch.bfloat16)"),
        (lambda t: t.reshape(3, 2), "shape changed ((2, 3) -> (3, 2))"),
        (lambda t: t.t(), "shape changed"),
        (lambda t: t.detach().requires_grad_(True), "requires_grad changed (False -> True)"),
        (lambda t: torch.nn.Parameter(t), "type changed (Tensor -> Parameter)"),
        (lambda t: t.contiguous().as_strided((2, 3), (1, 2)), "stride changed"),
    ],
)
def test_tensor_match_fails_on_each_metadata_change(change, reason):
    t = torch.randn(2, 3)
    guard = TensorMatchGuard(PARAM, TensorMeta.of(t))
    assert guard.holds(torch.randn(2, 3))
    changed = change(t)
    assert not guard.holds(changed)
    assert reason in guard.changed(changed)


def test_guard_describe_starts_with_its_source():
    guard = ConstantGuard(ItemSource(GROUP, "lr"), 0.1)
    assert guard.describe() == "L['opt'].param_groups[0]['lr'] == 0.1"
