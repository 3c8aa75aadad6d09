from __future__ import annotations

import torch
from optguard import AttrSource, ItemSource, LocalSource
from optsidefx import AttrStore, Build, Const, Input, ItemStore, Output, Return, generate_replay

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
