"""Lane programs and the Triton plan on hand-built graphs (no tracer): the kernels run under
TRITON_INTERPRET=1 on the CPU and must match the torch backend on the same graph."""

from __future__ import annotations

import operator
import os

import pytest
import torch
from optkernels import TorchPlan
from optkernels.lanes import NotLanes, analyze
from torch import fx

aten = torch.ops.aten
SIZES = [1, 7, 1000, 4097]


def _placeholder(graph: fx.Graph, name: str, val: object) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _momentum_graph(sizes: list[int], foreach: bool) -> fx.GraphModule:
    """SGD with momentum: buf = buf * m + g; p = p - lr * buf (lr, m are graph inputs)."""
    graph = fx.Graph()
    ps = [_placeholder(graph, f"p{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    gs = [_placeholder(graph, f"g{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    bufs = [_placeholder(graph, f"b{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    lr = _placeholder(graph, "lr", 0.1)
    momentum = _placeholder(graph, "momentum", 0.9)
    neg_lr = graph.call_function(operator.neg, (lr,))
    if foreach:
        scaled = graph.call_function(aten._foreach_mul.Scalar, (bufs, momentum))
        new_bufs = graph.call_function(aten._foreach_add.List, (scaled, gs))
        new_ps = graph.call_function(aten._foreach_add.List, (ps, new_bufs), {"alpha": neg_lr})
        for i in range(len(sizes)):
            buf_i = graph.call_function(operator.getitem, (new_bufs, i))
            p_i = graph.call_function(operator.getitem, (new_ps, i))
            graph.call_function(aten.copy_.default, (bufs[i], buf_i))
            graph.call_function(aten.copy_.default, (ps[i], p_i))
    else:
        for p, g, b in zip(ps, gs, bufs, strict=True):
            scaled = graph.call_function(aten.mul.Tensor, (b, momentum))
            new_b = graph.call_function(aten.add.Tensor, (scaled, g))
            new_p = graph.call_function(aten.add.Tensor, (p, new_b), {"alpha": neg_lr})
            graph.call_function(aten.copy_.default, (b, new_b))
            graph.call_function(aten.copy_.default, (p, new_p))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("foreach", [True, False])
def test_foreach_and_for_loop_graphs_become_the_same_lane_program(foreach):
    program = analyze(_momentum_graph(SIZES, foreach).graph)
    assert program.lanes == len(SIZES)
    assert len(program.inputs) == 3 and not any(program.input_small)
    assert sorted(k for _, k in program.writes) == sorted(
        program.inputs.index(nodes) for nodes in program.inputs if nodes[0].name[0] in "pb"
    )
    assert [op.op for op in program.ops if op.op != "input"] == ["mul", "add", "add"]


def test_a_graph_that_returns_values_is_not_a_lane_program():
    graph = fx.Graph()
    x = _placeholder(graph, "x", torch.empty(3))
    y = graph.call_function(aten._foreach_mul.Scalar, ([x], 2.0))
    graph.output([graph.call_function(operator.getitem, (y, 0))])
    with pytest.raises(NotLanes, match="returns values"):
        analyze(graph)


def test_foreach_lists_of_different_lengths_are_refused():
    graph = fx.Graph()
    xs = [_placeholder(graph, f"x{i}", torch.empty(3)) for i in range(3)]
    graph.call_function(aten._foreach_mul.Scalar, (xs[:2], 2.0))
    graph.call_function(aten._foreach_mul.Scalar, (xs, 2.0))
    graph.output([])
    with pytest.raises(NotLanes, match="different lengths"):
        analyze(graph)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
@pytest.mark.parametrize("foreach", [True, False])
def test_the_kernel_matches_the_torch_backend_on_odd_sizes(foreach):
    from optkernels.triton_backend import TritonPlan

    gm = _momentum_graph(SIZES, foreach)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for _ in range(3) for n in SIZES]
    copies = [t.clone() for t in tensors]
    plan = TritonPlan(gm)
    assert plan.program is not None and plan.kernel_launches_per_step == 1
    for _ in range(2):
        plan([*tensors, 0.1, 0.9])
        TorchPlan(gm)([*copies, 0.1, 0.9])
    for mine, theirs in zip(tensors, copies, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
