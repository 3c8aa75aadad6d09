"""Per-lane dtypes of a lane program (``dtypes``): computed once per distinct lane."""

from __future__ import annotations

import torch
from optkernels.dtypes import lanes_by_dtypes, op_dtypes, op_dtypes_by_lane
from optkernels.lanes import analyze
from torch import fx

aten = torch.ops.aten
# Per lane: the parameter and grad dtype, and whether the parameter is 0-dim (a 0-dim
# float16 times a float scalar stays float16; a 0-dim float16 lane next to 1-dim ones
# computes like them).
LANES = [
    (torch.float32, 3),
    (torch.float16, 3),
    (torch.float32, 5),
    (torch.bfloat16, 0),
    (torch.float16, 3),
    (torch.float32, 3),
]


def _placeholder(graph: fx.Graph, name: str, val: object) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _graph(lanes: list[tuple[torch.dtype, int]] = LANES) -> fx.Graph:
    """p = p + g * lr, per lane, with a float32 scale tensor (promotion differs by lane)."""
    graph = fx.Graph()
    shape = [(n,) if n else () for _, n in lanes]
    ps = [
        _placeholder(graph, f"p{i}", torch.empty(s, dtype=d))
        for i, ((d, _), s) in enumerate(zip(lanes, shape, strict=True))
    ]
    gs = [
        _placeholder(graph, f"g{i}", torch.empty(s, dtype=d))
        for i, ((d, _), s) in enumerate(zip(lanes, shape, strict=True))
    ]
    lr = _placeholder(graph, "lr", 0.1)
    for p, g in zip(ps, gs, strict=True):
        scaled = graph.call_function(aten.mul.Tensor, (g, lr))
        scaled.meta["val"] = torch.empty_like(g.meta["val"])
        new_p = graph.call_function(aten.add.Tensor, (p, scaled))
        new_p.meta["val"] = torch.empty_like(p.meta["val"])
        graph.call_function(aten.copy_.default, (p, new_p))
    graph.output([])
    return graph


def test_each_lane_gets_the_dtypes_op_dtypes_computes_for_it():
    program = analyze(_graph())
    by_lane = op_dtypes_by_lane(program)
    assert by_lane == [op_dtypes(program, lane) for lane in range(program.lanes)]
    assert by_lane[0] is by_lane[5] and by_lane[1] is by_lane[4]  # (computed once)
    assert by_lane[0] != by_lane[1]


def test_lanes_are_grouped_by_their_input_and_op_dtypes():
    groups = lanes_by_dtypes(analyze(_graph()))
    assert sorted(groups.values()) == [[0, 2, 5], [1, 4], [3]]


def test_lanes_of_other_shapes_computing_alike_share_a_group_in_lane_order():
    # (a 0-dim float32 lane has its own op dtypes, equal to the 1-dim lanes')
    lanes = [(torch.float32, 3), (torch.float32, 0), (torch.float32, 3), (torch.float16, 3)]
    program = analyze(_graph(lanes))
    by_lane = op_dtypes_by_lane(program)
    assert by_lane[0] is not by_lane[1] and by_lane[0] == by_lane[1]
    assert list(lanes_by_dtypes(program).values()) == [[0, 1, 2], [3]]
