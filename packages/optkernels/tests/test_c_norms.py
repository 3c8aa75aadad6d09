"""Column norms in C (``c_norms.vector_norm``): the exact norm rounded once, eager's op for
every call it does not cover, and the graph rewrite that calls it."""

from __future__ import annotations

import pytest
import torch
from optkernels.c_kernel import find_compiler
from optkernels.c_norms import vector_norm, with_c_norms
from torch import fx

COMPILER = find_compiler()
pytestmark = pytest.mark.skipif(isinstance(COMPILER, str), reason=f"{COMPILER}")
aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (5, 1), (1, 7), (300, 257), (2, 3, 130), (0, 4)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_column_norms_are_the_exact_norms_rounded_once_in_float32(dtype, shape, keepdim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, generator=gen).to(dtype)
    exact = aten.linalg_vector_norm.default(x.double(), 2, [-2], keepdim).to(dtype)
    found = vector_norm(x, 2, [-2], keepdim)
    assert found.shape == aten.linalg_vector_norm.default(x, 2, [-2], keepdim).shape
    assert found.dtype == dtype
    # float32: squares summed in float64 round to the exact norm; float64: within an ulp
    tolerance = {"rtol": 0, "atol": 0} if dtype is torch.float32 else {"rtol": 4e-16, "atol": 0}
    torch.testing.assert_close(found, exact, **tolerance)
    torch.testing.assert_close(vector_norm(x, 2, [len(shape) - 2], keepdim), exact, **tolerance)


@pytest.mark.parametrize(
    ("x", "args"),
    [
        (torch.randn(40, 30), (2, None, False)),  # whole tensor
        (torch.randn(40, 30), (2, [-1], True)),  # rows
        (torch.randn(40, 30), (1, [-2], True)),  # another ord
        (torch.randn(30, 40).t(), (2, [-2], True)),  # not contiguous
        (torch.randn(40, 30, dtype=torch.bfloat16), (2, [-2], False)),  # another dtype
        (torch.randn(2, 40, 30), (2, [0, 1], False)),  # two dims
    ],
)
def test_calls_it_does_not_cover_run_eagers_op(x, args):
    assert torch.equal(vector_norm(x, *args), aten.linalg_vector_norm.default(x, *args))


def test_the_rewrite_calls_it_for_every_norm_node_and_leaves_the_graph_as_it_was():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(aten.linalg_vector_norm.default, (x, 2, [-2], True)),))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    rewritten = with_c_norms(gm)
    assert [n.target for n in rewritten.graph.nodes if n.op == "call_function"] == [vector_norm]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [
        aten.linalg_vector_norm.default
    ]
    x = torch.randn(64, 48)
    (found,) = rewritten(x)
    assert torch.equal(found, aten.linalg_vector_norm.default(x.double(), 2, [-2], True).float())
