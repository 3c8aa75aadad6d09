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


def _trust_graph(sizes: list[int], interleaved: bool = False) -> fx.GraphModule:
    """p = p - 0.1 * sqrt(a_i) / sqrt(b_i) * g per lane, a_i and b_i 0-dim inputs of lane i
    (a prelude's all-reduced sums of squares), each rooted by an op of its own."""
    graph = fx.Graph()
    ps = [_placeholder(graph, f"p{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    gs = [_placeholder(graph, f"g{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    a_s = [_placeholder(graph, f"a{i}", torch.empty(())) for i in range(len(sizes))]
    b_s = [_placeholder(graph, f"b{i}", torch.empty(())) for i in range(len(sizes))]
    roots: dict[fx.Node, fx.Node] = {}
    order = [x for pair in zip(a_s, b_s, strict=True) for x in pair] if interleaved else a_s + b_s
    for x in order:
        roots[x] = graph.call_function(aten.pow.Tensor_Scalar, (x, 0.5))
    ratios = graph.call_function(
        aten._foreach_div.List, ([roots[a] for a in a_s], [roots[b] for b in b_s])
    )
    scaled = graph.call_function(aten._foreach_mul.List, (gs, ratios))
    new_ps = graph.call_function(aten._foreach_add.List, (ps, scaled), {"alpha": -0.1})
    for i, p in enumerate(ps):
        graph.call_function(
            aten.copy_.default, (p, graph.call_function(operator.getitem, (new_ps, i)))
        )
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_per_item_ops_on_inputs_form_an_input_column_lane_by_lane():
    gm = _trust_graph(SIZES)
    program = analyze(gm.graph)
    assert program.lanes == len(SIZES)
    names = [tuple(n.name for n in column) for column in program.inputs]
    assert ("a0", "a1", "a2", "a3") in names and ("b0", "b1", "b2", "b3") in names
    assert [op.op for op in program.ops if op.op != "input"] == ["pow", "pow", "div", "mul", "add"]


def test_per_item_ops_on_inputs_out_of_lane_order_are_refused():
    # a0, b0, a1, b1, ...: the k-th root of its kind is item k, so the lists the foreach ops
    # take hold items 0, 2, 4, ... of one lane value, which no kernel computes.
    with pytest.raises(NotLanes, match="different lane values"):
        analyze(_trust_graph(SIZES, interleaved=True).graph)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_the_kernel_takes_per_item_ops_on_inputs_as_the_torch_backend_does():
    from optkernels.triton_backend import TritonPlan

    gm = _trust_graph(SIZES)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for _ in range(2) for n in SIZES]
    sums = [torch.rand((), generator=gen) + 0.5 for _ in range(2 * len(SIZES))]
    copies = [t.clone() for t in tensors]
    plan = TritonPlan(gm)
    assert plan.program is not None and plan.kernel_launches_per_step == 1
    plan([*tensors, *sums])
    TorchPlan(gm)([*copies, *sums])
    for mine, theirs in zip(tensors, copies, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def _scaled_lr_graph(scales: list[float], sizes: list[int]) -> fx.GraphModule:
    """A for-loop step whose lanes read different Python numbers: p = p + g * -(lr * s_i),
    ``lr * s_i`` one scalar node per distinct s_i (Muon's lr scaled by each matrix's shape,
    the same node for the lanes of one scale)."""
    graph = fx.Graph()
    ps = [_placeholder(graph, f"p{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    gs = [_placeholder(graph, f"g{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    lr = _placeholder(graph, "lr", 0.1)
    alphas: dict[float, fx.Node] = {}
    for p, g, s in zip(ps, gs, scales, strict=True):
        if s not in alphas:
            alphas[s] = graph.call_function(
                operator.neg, (graph.call_function(operator.mul, (lr, s)),)
            )
        new_p = graph.call_function(aten.add.Tensor, (p, g), {"alpha": alphas[s]})
        graph.call_function(aten.copy_.default, (p, new_p))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_lanes_that_read_different_python_numbers_pick_theirs_from_the_scalars():
    program = analyze(_scaled_lr_graph([1.0, 2.0, 1.0], [3, 5, 7]).graph)
    (pick,) = [op for op in program.ops if op.op == "pick"]
    refs = pick.args[0][1]  # one ref per lane: lanes 0 and 2 read the same scalar node
    assert refs[0] == refs[2] != refs[1] and all(r[0] == "scalar" for r in refs)
    (add,) = [op for op in program.ops if op.op == "add"]
    assert ("alpha", ("lane", pick.out)) in add.kwargs


def test_lanes_that_differ_in_more_than_a_number_are_refused():
    # (the same ops on the same kinds of inputs, but one lane clamps from below, the other
    # from above: a bound that is None is not a number a lane can pick)
    graph = fx.Graph()
    ps = [_placeholder(graph, f"p{i}", torch.empty(3)) for i in range(2)]
    for p, bounds in zip(ps, [(0.0, None), (None, 0.0)], strict=True):
        clamped = graph.call_function(aten.clamp.default, (p, *bounds))
        graph.call_function(aten.copy_.default, (p, clamped))
    graph.output([])
    with pytest.raises(NotLanes, match="op sequences differ"):
        analyze(graph)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_the_kernel_reads_each_lanes_own_number_as_the_torch_backend_does():
    from optkernels.triton_backend import TritonPlan

    gm = _scaled_lr_graph([1.0, 2.0, 1.0, 3.0], SIZES)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for _ in range(2) for n in SIZES]
    copies = [t.clone() for t in tensors]
    plan = TritonPlan(gm)
    assert plan.program is not None and plan.kernel_launches_per_step == 1
    for lr in (0.1, 0.3):  # a new lr: each lane's number follows it
        plan([*tensors, lr])
        TorchPlan(gm)([*copies, lr])
    assert plan.host  # the lanes' numbers come from the host, one row per lane
    for mine, theirs in zip(tensors, copies, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
