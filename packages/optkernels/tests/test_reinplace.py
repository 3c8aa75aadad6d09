"""Writes turned back in place: only ops eager ran in place, only where nothing reads the old
value afterwards; the results are the functional graph's."""

from __future__ import annotations

import copy
import operator

import torch
from optkernels import TorchBackend
from optkernels.reference import TorchPlan
from optkernels.reinplace import reinplace
from torch import fx

aten = torch.ops.aten


def _val(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _momentum_graph(inplace: bool = True) -> fx.Graph:
    """buf <- buf * 0.9 + g (eager: ``buf.mul_(0.9).add_(g)``); p <- p - 0.1 * buf."""
    graph = fx.Graph()
    p, g, buf = (graph.placeholder(n) for n in ("p", "g", "buf"))
    for node in (p, g, buf):
        node.meta["val"] = _val(torch.empty(5))
    scaled = graph.call_function(aten.mul.Tensor, (buf, 0.9))
    summed = graph.call_function(aten.add.Tensor, (scaled, g))
    stepped = graph.call_function(aten.add.Tensor, (p, summed), {"alpha": -0.1})
    for node, op in (
        (scaled, aten.mul_.Tensor),
        (summed, aten.add_.Tensor),
        (stepped, aten.add_.Tensor),
    ):
        node.meta["val"] = _val(torch.empty(5))
        if inplace:
            node.meta["inplace"] = op
    graph.call_function(aten.copy_.default, (p, stepped))
    graph.call_function(aten.copy_.default, (buf, summed))
    graph.output([])
    return graph


def _run(graph: fx.Graph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    copies = [t.clone() for t in inputs]
    TorchPlan(fx.GraphModule(torch.nn.Module(), graph))(copies)
    return copies


def test_a_chain_eager_ran_in_place_runs_in_place_with_no_writebacks_left():
    graph = _momentum_graph()
    inputs = [torch.randn(5) for _ in range(3)]
    expected = _run(copy.deepcopy(graph), inputs)
    assert reinplace(graph) == 3
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [aten.mul_.Tensor, aten.add_.Tensor, aten.add_.Tensor]  # no copy_
    found = _run(graph, inputs)
    for a, b in zip(found, expected, strict=True):
        assert torch.equal(a, b)


def test_ops_eager_ran_out_of_place_stay_out_of_place():
    graph = _momentum_graph(inplace=False)
    assert reinplace(graph) == 0
    assert sum(1 for n in graph.nodes if n.target is aten.copy_.default) == 2


def test_an_old_value_read_after_the_write_keeps_the_op_functional():
    graph = _momentum_graph()
    buf = next(n for n in graph.nodes if n.name == "buf")
    stepped = next(n for n in graph.nodes if n.target is aten.add.Tensor and n.kwargs)
    with graph.inserting_after(stepped):
        late = graph.call_function(aten.mul.Tensor, (buf, 2.0))  # reads buf's old value
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ([late],)
    inputs = [torch.randn(5) for _ in range(3)]
    expected_inputs = [t.clone() for t in inputs]
    (expected,) = TorchPlan(fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph)))(
        expected_inputs
    )
    reinplace(graph)
    scaled = next(n for n in graph.nodes if n.name == "mul_tensor")
    assert scaled.target is aten.mul.Tensor  # buf's old value is still needed
    (found,) = TorchPlan(fx.GraphModule(torch.nn.Module(), graph))(inputs)
    assert torch.equal(found, expected)
    for a, b in zip(inputs, expected_inputs, strict=True):
        assert torch.equal(a, b)


def test_a_foreach_op_eager_ran_in_place_writes_its_list_and_its_items_are_the_tensors():
    graph = fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(2)]
    for x in xs:
        x.meta["val"] = _val(torch.empty(3))
    scaled = graph.call_function(aten._foreach_mul.Scalar, (xs, 0.5))
    scaled.meta["inplace"] = aten._foreach_mul_.Scalar
    added = graph.call_function(aten._foreach_add.Scalar, (scaled, 1.0))
    added.meta["inplace"] = aten._foreach_add_.Scalar
    items = [graph.call_function(operator.getitem, (added, i)) for i in range(2)]
    for x, item in zip(xs, items, strict=True):
        graph.call_function(aten.copy_.default, (x, item))
    graph.output([])
    inputs = [torch.randn(3), torch.randn(3)]
    expected = _run(copy.deepcopy(graph), inputs)
    assert reinplace(graph) == 2
    assert not any(n.target is aten.copy_.default for n in graph.nodes)
    for a, b in zip(_run(graph, inputs), expected, strict=True):
        assert torch.equal(a, b)


def test_the_torch_backend_leaves_the_traced_graph_as_it_was():
    gm = fx.GraphModule(torch.nn.Module(), _momentum_graph())
    before = gm.code
    TorchBackend().compile(gm)
    assert gm.code == before
