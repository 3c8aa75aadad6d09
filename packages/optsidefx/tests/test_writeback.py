from __future__ import annotations

import pytest
import torch
from optguard import LocalSource
from optsidefx import Const, Return, SideEffectError, TensorWrite, append_writebacks
from torch import fx

X = LocalSource("x")


def _graph():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    total = graph.call_function(torch.ops.aten.add.Tensor, (x, y))
    graph.output([])
    return graph, x, total


def test_writeback_updates_the_input_in_place():
    graph, x, total = _graph()
    append_writebacks(graph, [TensorWrite(LocalSource("x"), total)], {LocalSource("x"): x})
    gm = fx.GraphModule(torch.nn.Module(), graph)
    a, b = torch.ones(3), torch.full((3,), 2.0)
    gm(a, b)
    assert torch.equal(a, torch.full((3,), 3.0))
    assert [n.target for n in graph.nodes][-2] is torch.ops.aten.copy_.default


def test_write_to_a_tensor_that_is_no_input_is_refused():
    graph, x, total = _graph()
    with pytest.raises(SideEffectError, match=r"L\['z'\]"):
        append_writebacks(graph, [TensorWrite(LocalSource("z"), total)], {LocalSource("x"): x})


def test_writeback_returns_the_copy_nodes_it_added():
    graph, x, total = _graph()
    added = append_writebacks(graph, [TensorWrite(X, total)], {X: x})
    assert [(n.target, n.args) for n in added] == [(torch.ops.aten.copy_.default, (x, total))]


def test_effects_other_than_tensor_writes_add_no_nodes():
    graph, x, _ = _graph()
    before = len(graph.nodes)
    assert append_writebacks(graph, [Return(Const(1))], {X: x}) == []
    assert len(graph.nodes) == before


def test_copy_node_takes_the_placeholders_meta_val():
    graph, x, total = _graph()
    x.meta["val"] = torch.empty(3)
    (copy,) = append_writebacks(graph, [TensorWrite(X, total)], {X: x})
    assert copy.meta["val"] is x.meta["val"]


def test_writebacks_follow_the_order_of_the_effects_before_the_output():
    graph, x, total = _graph()
    y = next(n for n in graph.nodes if n.name == "y")
    writes = [TensorWrite(LocalSource("y"), total), TensorWrite(X, total)]
    append_writebacks(graph, writes, {X: x, LocalSource("y"): y})
    nodes = list(graph.nodes)
    assert [n.args[0] for n in nodes[-3:-1]] == [y, x] and nodes[-1].op == "output"
