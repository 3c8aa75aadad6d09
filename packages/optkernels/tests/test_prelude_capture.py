"""Which preludes (torch-backend ops before the kernels) a CUDA graph may record."""

from __future__ import annotations

import pytest
import torch
from optkernels.prelude_capture import capture_reason
from torch import fx

aten = torch.ops.aten
CUDA = torch.device("cuda")  # (only compared: nothing runs on it)


def _prelude(op, *, count_device=None):
    """grad -> op(grad) -> output, with an optional 0-dim step count added to the grad (a
    grad off the CPU: a meta tensor stands for a device's)."""
    graph = fx.Graph()
    grad = graph.placeholder("grad")
    grad.meta["val"] = torch.empty(4, 3, device="meta")
    value = grad
    if count_device is not None:
        count = graph.placeholder("step")
        count.meta["val"] = torch.zeros((), device=count_device)
        value = graph.call_function(aten.add.Tensor, (value, count))
    graph.output((op(graph, value),))
    return fx.GraphModule(torch.nn.Module(), graph)


def _matmul(graph, x):
    return graph.call_function(aten.mm.default, (x, graph.call_function(aten.t.default, (x,))))


def test_matmuls_and_norms_on_the_device_are_recorded():
    assert capture_reason(_prelude(_matmul), CUDA) is None
    norm = _prelude(lambda g, x: g.call_function(aten.linalg_vector_norm.default, (x,)))
    assert capture_reason(norm, CUDA) is None


@pytest.mark.parametrize(
    ("op", "says"),
    [
        (lambda g, x: g.call_function(aten._local_scalar_dense.default, (x,)), ".item()"),
        (
            lambda g, x: g.call_function(
                torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0")
            ),
            "collective",
        ),
        (lambda g, x: g.call_function(aten.rand_like.default, (x,)), "random"),
    ],
    ids=["item", "collective", "random"],
)
def test_a_host_sync_a_collective_or_a_random_op_keeps_the_graph_out(op, says):
    reason = capture_reason(_prelude(op), CUDA)
    assert reason is not None and says in reason


def test_a_cpu_step_count_beside_device_tensors_keeps_the_graph_out():
    reason = capture_reason(_prelude(_matmul, count_device="cpu"), CUDA)
    assert reason is not None and "CPU tensor step" in reason and "capturable=True" in reason
    # All on the CPU (the interpreter's kernels): nothing is copied from the host.
    assert capture_reason(_prelude(_matmul, count_device="cpu"), torch.device("cpu")) is None
