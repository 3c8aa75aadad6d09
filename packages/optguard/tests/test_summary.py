from __future__ import annotations

import torch
from optguard import (
    AttrSource,
    ConstantGuard,
    DataPtrGuard,
    ItemSource,
    KeyedSource,
    LocalSource,
    TensorMatchGuard,
    TensorMeta,
    TypeGuard,
    group_guards,
    guard_kind,
)
from optguard.summary import pattern

OPT = LocalSource("opt")
PARAMS = ItemSource(ItemSource(AttrSource(OPT, "param_groups"), 0), "params")


def _param(i: int) -> ItemSource:
    return ItemSource(PARAMS, i)


def test_pattern_replaces_indices_and_keyed_entries_with_stars():
    state = ItemSource(KeyedSource(AttrSource(OPT, "state"), _param(3)), "exp_avg")
    assert pattern(_param(7)) == "L['opt'].param_groups[*]['params'][*]"
    assert pattern(state) == "L['opt'].state[*]['exp_avg']"


def test_guards_of_many_params_form_one_group_with_kinds_counted():
    t = torch.zeros(2)
    guards = []
    for i in range(5):
        guards.append(TensorMatchGuard(_param(i), TensorMeta.of(t)))
        if i < 3:
            guards.append(DataPtrGuard(_param(i), t.data_ptr()))
    [group] = group_guards(guards)
    assert group.pattern == "L['opt'].param_groups[*]['params'][*]"
    assert (group.sources, group.guards) == (5, 8)
    assert group.kinds == (("metadata", 5), ("data pointer", 3))


def test_string_keys_under_a_starred_path_merge_into_one_group_listing_them():
    group0 = ItemSource(AttrSource(OPT, "param_groups"), 0)
    guards = [
        TypeGuard(ItemSource(group0, "lr"), float),
        ConstantGuard(ItemSource(group0, "maximize"), False),
        ConstantGuard(ItemSource(ItemSource(AttrSource(OPT, "param_groups"), 1), "maximize"), True),
    ]
    [group] = group_guards(guards)
    assert group.pattern == "L['opt'].param_groups[*][key]"
    assert group.keys == ("lr", "maximize")
    assert group.kinds == (("type", 1), ("value", 2))


def test_an_unknown_guard_kind_is_named_after_its_class():
    class ShapeParityGuard(TypeGuard):
        pass

    assert guard_kind(ShapeParityGuard(OPT, int)) == "type"  # a subclass keeps its kind
    assert guard_kind(TypeGuard(OPT, int)) == "type"
