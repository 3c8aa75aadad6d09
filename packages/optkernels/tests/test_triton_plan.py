"""TritonPlan's torch-backend side: the plan it falls back to, and when it is prepared."""

from __future__ import annotations

import operator
import os

import pytest
import torch
from optkernels.double_scalars import _python_floats_in_double
from optkernels.reference import TorchPlan
from optkernels.triton_backend import TritonPlan
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


def _step_count_graph(lerp: bool) -> fx.GraphModule:
    """p <- p / (1 - 0.9**step), or p.lerp(g, step expanded to p's size); step += 1. ``step``
    is a float32 0-dim count eager reads as a Python float."""
    graph = fx.Graph()
    p, g, step = graph.placeholder("p"), graph.placeholder("g"), graph.placeholder("step")
    p.meta["val"], g.meta["val"] = torch.ones(3), torch.ones(3)
    step.meta.update(val=torch.tensor(1.0), python_float=True)
    if lerp:  # (its weight must have p's dtype)
        weight = graph.call_function(aten.expand.default, (step, [3]))
        new_p = graph.call_function(aten.lerp.Tensor, (p, g, weight))
    else:
        power = graph.call_function(aten.pow.Scalar, (0.9, step))
        new_p = graph.call_function(
            aten.div.Tensor, (p, graph.call_function(aten.rsub.Scalar, (power, 1)))
        )
    new_step = graph.call_function(aten.add.Tensor, (step, 1))
    graph.call_function(aten.copy_.default, (p, new_p))
    graph.call_function(aten.copy_.default, (step, new_step))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_step_counts_read_as_python_floats_are_read_in_double_by_the_torch_backend():
    gm = _step_count_graph(lerp=False)
    widened = _python_floats_in_double(gm)
    assert widened is not gm and "torch.float64" in widened.code
    p, step = torch.full((3,), 2.0), torch.tensor(3.0)
    TorchPlan(widened)([p, torch.ones(3), step])
    expected = torch.tensor(2.0, dtype=torch.float64) / (
        1 - 0.9 ** torch.tensor(3.0, dtype=torch.float64)
    )
    assert torch.equal(p, expected.float().expand(3))  # (rounded once, from double)
    assert step.dtype is torch.float32 and step.item() == 4.0  # (written back in its dtype)


def test_an_op_refusing_the_wider_step_count_keeps_the_graph_as_traced():
    gm = _step_count_graph(lerp=True)
    assert _python_floats_in_double(gm) is gm


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
def test_a_plan_whose_kernels_run_never_prepares_its_torch_backend_plan():
    graph = fx.Graph()
    p, g = graph.placeholder("p"), graph.placeholder("g")
    p.meta["val"], g.meta["val"] = torch.ones(5), torch.ones(5)
    new_p = graph.call_function(aten.add.Tensor, (p, g), {"alpha": -0.5})
    new_p.meta["val"] = torch.ones(5)
    graph.call_function(aten.copy_.default, (p, new_p))
    graph.output([])
    plan = TritonPlan(fx.GraphModule(torch.nn.Module(), graph))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    p_value, g_value = torch.ones(5, device=device), torch.full((5,), 2.0, device=device)
    plan([p_value, g_value])
    assert plan.parts and "reference" not in vars(plan)
    assert torch.equal(p_value.cpu(), torch.zeros(5))


def test_python_arithmetic_on_a_value_read_with_item_is_checked_with_a_nonzero_value():
    """A Tensor beta read with ``.item()`` outside the step counts' ops, divided into in
    Python, then used with them: the check gives every ``.item()`` 1.0 and runs the Python
    arithmetic from it (its node's traced value is 0.0, a division by zero)."""
    graph = fx.Graph()
    p, step, beta = (graph.placeholder(n) for n in ("p", "step", "beta"))
    p.meta["val"], beta.meta["val"] = torch.ones(3), torch.tensor(0.9)
    step.meta.update(val=torch.tensor(1.0), python_float=True)
    item = graph.call_function(aten._local_scalar_dense.default, (beta,))
    inverse = graph.call_function(operator.truediv, (1.0, item))
    item.meta["val"], inverse.meta["val"] = 0.0, 0.0  # (what the tracer records: the type)
    power = graph.call_function(aten.pow.Scalar, (inverse, step))
    graph.call_function(aten.copy_.default, (p, graph.call_function(aten.mul.Tensor, (p, power))))
    graph.output([])
    assert _python_floats_in_double(fx.GraphModule(torch.nn.Module(), graph)).code.count("float64")
