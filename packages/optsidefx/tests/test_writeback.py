from __future__ import annotations

import pytest
import torch
from optguard import LocalSource
from optsidefx import SideEffectError, TensorWrite, append_writebacks
from torch import fx


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
