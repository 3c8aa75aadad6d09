from __future__ import annotations

import pytest
import torch
from optkernels import BackendError, TorchBackend, get_backend
from torch import fx

aten = torch.ops.aten


def _sgd_graph() -> fx.GraphModule:
    """p <- p - lr * g, written back in place; returns p * 2 as a new tensor."""
    graph = fx.Graph()
    p, g = graph.placeholder("p"), graph.placeholder("g")
    new_p = graph.call_function(aten.add.Tensor, (p, g), {"alpha": -0.5})
    doubled = graph.call_function(aten.mul.Tensor, (new_p, 2.0))
    graph.call_function(aten.copy_.default, (p, new_p))
    graph.output([doubled])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_torch_plan_matches_eager_ops_and_writes_back():
    p, g = torch.randn(7), torch.randn(7)
    expected = p - 0.5 * g
    (doubled,) = TorchBackend().compile(_sgd_graph())([p, g])
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(doubled, expected * 2)


def test_plan_writes_into_a_leaf_that_requires_grad():
    p = torch.nn.Parameter(torch.ones(3))
    TorchBackend().compile(_sgd_graph())([p, torch.ones(3)])
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.5))


def test_wrong_number_of_inputs_is_refused():
    with pytest.raises(ValueError, match="takes 2 inputs, got 1"):
        TorchBackend().compile(_sgd_graph())([torch.ones(3)])


def test_describe_shows_the_ops():
    assert "aten.add.Tensor" in TorchBackend().compile(_sgd_graph()).describe()


def test_get_backend_by_name():
    assert get_backend("torch").name == "torch"
    with pytest.raises(BackendError, match="not available yet"):
        get_backend("triton")
    with pytest.raises(BackendError, match="torch, triton"):
        get_backend("tpu")
