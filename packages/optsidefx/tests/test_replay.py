from __future__ import annotations

import ast
import math

import pytest
import torch
from optguard import AttrSource, ItemSource, LocalSource
from optsidefx import (
    AttrStore,
    Build,
    Const,
    Input,
    ItemStore,
    Output,
    Return,
    SideEffectError,
    TensorWrite,
    generate_replay,
)

X = LocalSource("x")
STATE = LocalSource("state")


class Box:
    count = 0


def test_replay_applies_stores_with_this_calls_outputs():
    replay = generate_replay(
        [
            ItemStore(Input(STATE), Const("buf"), Output(0)),
            AttrStore(Input(LocalSource("box")), "count", Const(3)),
        ]
    )
    state, box = {}, Box()
    out = torch.ones(2)
    assert replay({"state": state, "box": box}, [out]) is None
    assert state["buf"] is out and box.count == 3


def test_built_containers_are_fresh_each_call():
    replay = generate_replay(
        [ItemStore(Input(STATE), Const("d"), Build(dict, (Output(0),), ("m",)))]
    )
    state: dict[str, object] = {}
    replay({"state": state}, [torch.ones(1)])
    first = state["d"]
    replay({"state": state}, [torch.ones(1)])
    assert state["d"] is not first and state["d"] == {"m": state["d"]["m"]}  # type: ignore[index]


def test_returning_an_input_returns_that_same_object():
    replay = generate_replay([Return(Build(tuple, (Input(X), Output(0))))])
    x = torch.ones(2)
    result = replay({"x": x}, [torch.zeros(1)])
    assert result[0] is x and isinstance(result, tuple)


def test_replay_code_names_variables_after_sources():
    source = ItemSource(AttrSource(LocalSource("opt"), "param_groups"), 0)
    replay = generate_replay([ItemStore(Input(source), Const("lr"), Const(0.5))])
    assert "opt_param_groups_0['lr'] = 0.5" in replay.code


def test_returning_an_input_directly_returns_that_same_object():
    x = torch.ones(2)
    assert generate_replay([Return(Input(X))])({"x": x}, []) is x


def test_each_call_stores_its_own_outputs():
    replay = generate_replay([ItemStore(Input(STATE), Const("buf"), Output(0))])
    state: dict[str, object] = {}
    second = torch.zeros(1)
    replay({"state": state}, [torch.ones(1)])
    replay({"state": state}, [second])
    assert state["buf"] is second


def test_item_store_keyed_by_an_input_tensor_uses_that_tensor_as_key():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    groups = AttrSource(LocalSource("opt"), "param_groups")
    param = ItemSource(ItemSource(ItemSource(groups, 0), "params"), 0)
    state = AttrSource(LocalSource("opt"), "state")
    buf = Build(dict, (Output(0),), ("momentum_buffer",))
    replay = generate_replay([ItemStore(Input(state), Input(param), buf)])
    out = torch.ones(2)
    replay({"opt": opt}, [out])
    assert opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"] is out


@pytest.mark.parametrize("kind", [list, tuple])
def test_built_sequence_is_a_fresh_object_each_call(kind):
    replay = generate_replay([Return(Build(kind, (Output(0), Const(1))))])
    out = torch.ones(1)
    first, second = replay({}, [out]), replay({}, [out])
    assert type(first) is kind and first is not second and first == second


def test_one_item_tuple_is_built_as_a_tuple():
    assert generate_replay([Return(Build(tuple, (Const(1),)))])({}, []) == (1,)


def test_nested_builds_are_built_inside_out():
    replay = generate_replay([Return(Build(dict, (Build(list, (Output(0),)),), ("xs",)))])
    out = torch.ones(1)
    assert replay({}, [out]) == {"xs": [out]}


def test_tensor_writes_emit_no_replay_code():
    replay = generate_replay([TensorWrite(X, "node")])
    assert replay.code == "def replay(L, outs):\n    return None\n"


def test_replay_code_fetches_a_shared_source_once():
    group = ItemSource(AttrSource(LocalSource("opt"), "param_groups"), 0)
    replay = generate_replay(
        [
            ItemStore(Input(group), Const("lr"), Const(0.5)),
            ItemStore(Input(group), Const("momentum"), Const(0.9)),
        ]
    )
    assert replay.code.count(".param_groups") == 1


def test_replay_code_is_valid_python_defining_replay():
    replay = generate_replay([AttrStore(Input(LocalSource("box")), "count", Output(0))])
    assert [node.name for node in ast.parse(replay.code).body] == ["replay"]  # type: ignore[attr-defined]


def test_nan_constant_is_replayed_as_nan():
    assert math.isnan(generate_replay([Return(Const(float("nan")))])({}, []))


def test_non_literal_constant_is_replayed_as_the_same_object():
    assert generate_replay([Return(Const(torch.float32))])({}, []) is torch.float32


def test_infinite_constant_is_replayed():
    replay = generate_replay([ItemStore(Input(STATE), Const("best"), Const(float("inf")))])
    state: dict[str, float] = {}
    replay({"state": state}, [])
    assert state["best"] == float("inf")


def test_build_of_an_unsupported_kind_is_refused():
    with pytest.raises(SideEffectError, match="cannot replay a reference to Build"):
        generate_replay([Return(Build(set, (Const(1),)))])


def test_raw_value_that_is_no_ref_is_refused():
    with pytest.raises(SideEffectError, match="cannot replay a reference to 5"):
        generate_replay([Return(5)])


def test_unknown_effect_is_refused():
    with pytest.raises(SideEffectError, match="unknown effect"):
        generate_replay([Output(0)])  # type: ignore[list-item]
