from __future__ import annotations

import torch
from optkernels.triton_backend import _python_floats_in_double
from torch import fx

aten = torch.ops.aten


def _radam_like_graph(device: str) -> fx.GraphModule:
    """``p * where(bc > 0.5, bc, 1.0)`` with ``bc = 1 - 0.999 ** (step + 1)``, ``step`` a
    step count eager reads as a Python float, the where's scalar made on ``device`` (as
    RAdam's capturable path makes ``torch.where(rho_t > 5.0, ..., 1.0)``'s on the GPU)."""
    graph = fx.Graph()
    step, p = graph.placeholder("step"), graph.placeholder("p")
    step.meta["val"], step.meta["python_float"] = torch.tensor(1.0), True
    p.meta["val"] = torch.empty(3, dtype=torch.float64, device="meta")
    inc = graph.call_function(aten.add.Tensor, (step, 1))
    bc = graph.call_function(
        aten.rsub.Scalar, (graph.call_function(aten.pow.Scalar, (0.999, inc)), 1)
    )
    one = graph.call_function(
        aten.scalar_tensor.default, (1.0,), {"dtype": torch.float64, "device": torch.device(device)}
    )
    weight = graph.call_function(
        aten.where.self, (graph.call_function(aten.gt.Scalar, (bc, 0.5)), bc, one)
    )
    graph.call_function(aten.copy_.default, (step, inc))
    graph.output([graph.call_function(aten.mul.Tensor, (p, weight))])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_step_counts_are_widened_in_a_graph_that_makes_tensors_on_a_device():
    """The torch backend reads eager's Python floats (step counts) in float64; whether every
    op takes the wider dtype is checked on meta tensors. A tensor the graph makes on a
    device (here CUDA, which this check must not need) made that check fail on a GPU, and
    the graph computed the bias corrections from the float32 step counts instead (RAdam's
    for-loop on an H100: 1e-6 relative off eager)."""
    gm = _radam_like_graph("cuda")
    widened = _python_floats_in_double(gm)
    assert widened is not gm
    (pow_node,) = widened.graph.find_nodes(op="call_function", target=aten.pow.Scalar)
    (exponent,) = pow_node.all_input_nodes[0].all_input_nodes
    assert exponent.target is aten._to_copy.default
    assert exponent.kwargs["dtype"] is torch.float64
    # the step count is written back from the widened value, in its own dtype, by the copy_
    (copy_node,) = widened.graph.find_nodes(op="call_function", target=aten.copy_.default)
    assert copy_node.args[0].op == "placeholder"
