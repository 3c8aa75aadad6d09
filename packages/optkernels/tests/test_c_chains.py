"""Elementwise chains in generated C (``c_chains.fuse_chains``): ATen's bits, operands
broadcast, the ops that must not be fused left to ATen, and ATen's ops where a call's
tensors are not laid out as the graph recorded them."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from optkernels.c_chains import ChainCall, fuse_chains
from optkernels.c_kernel import Compiler, find_compiler
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

COMPILER = find_compiler()
pytestmark = pytest.mark.skipif(isinstance(COMPILER, str), reason=f"{COMPILER}")


def _fused(fn, *args):
    """``fn`` traced (its in-place ops as written), its chains fused; and the calls made."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    assert not isinstance(COMPILER, str)
    fused = fuse_chains(gm.graph, COMPILER)
    gm.recompile()
    calls = [n.target for n in gm.graph.nodes if isinstance(n.target, ChainCall)]
    assert len(calls) == fused
    return gm, calls


def _variance_estimate(row, col, mean, g):  # Adafactor's, as the node-by-node plan runs it
    return (row @ col).div_(mean.clamp(min=1e-30)).clamp_(min=1e-30).rsqrt_().mul_(g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("m", "n"), [(1, 1), (7, 1), (1, 9), (300, 257)])
def test_a_column_times_a_row_then_in_place_ops_is_one_call_with_atens_bits(dtype, m, n):
    gen = torch.Generator().manual_seed(0)
    row, col = (torch.rand(s, generator=gen, dtype=dtype) for s in [(m, 1), (1, n)])
    mean, g = torch.rand((1, 1), generator=gen, dtype=dtype), torch.randn(m, n, dtype=dtype)
    gm, calls = _fused(_variance_estimate, row, col, mean, g)
    assert len(calls) == 1 and len(calls[0].chain.nodes) == 5  # mm, div_, clamp_, rsqrt_, mul_
    assert torch.equal(gm(row, col, mean, g), _variance_estimate(row, col, mean, g))


def test_a_chain_ending_in_another_tensor_writes_it_and_makes_no_intermediate():
    def step(variance, g, p, w, alpha):
        variance.lerp_(g * g, w)
        update = variance.clone().clamp_(min=1e-30).rsqrt_().mul_(g)
        p.mul_(0.99).add_(update, alpha=alpha)

    gen = torch.Generator().manual_seed(1)
    v, g, p = (torch.rand(70_000, generator=gen) for _ in range(3))  # (several threads' work)
    w, alpha = torch.tensor(0.1), torch.tensor(-0.01)
    gm, calls = _fused(lambda v, g, p: step(v, g, p, 0.1, -0.01), v, g, p)
    # (mul, lerp_), then (clone, clamp_, rsqrt_, mul_, add_ into p): the update never made
    assert [len(c.chain.nodes) for c in calls] == [2, 5]
    ours = [t.clone() for t in (v, g, p)]
    gm(*ours)
    step(v, g, p, w.item(), alpha.item())
    for a, b in zip(ours, (v, g, p), strict=True):
        assert torch.equal(a, b)


def test_an_operand_written_between_its_reader_and_the_chains_end_ends_the_chain_there():
    def fn(x, y):
        t = x.clone().mul_(y)
        y.add_(1.0)  # the chain's mul_ read y before this write: a call after it would not
        return t.add_(y)

    x, y = torch.randn(5, 3), torch.randn(3)
    gm, calls = _fused(fn, x, y)
    assert [len(c.chain.nodes) for c in calls] == [2]
    y_ours = y.clone()
    assert torch.equal(gm(x, y_ours), fn(x, y)) and torch.equal(y_ours, y)


def test_tensors_laid_out_otherwise_than_traced_run_the_chains_aten_ops():
    gen = torch.Generator().manual_seed(2)
    row, col, mean = torch.rand(6, 1), torch.rand(1, 4), torch.rand(1, 1)
    gm, calls = _fused(_variance_estimate, row, col, mean, torch.randn(6, 4))
    g = torch.randn(4, 6, generator=gen).t()  # (6, 4), not contiguous
    assert len(calls) == 1
    assert torch.equal(gm(row, col, mean, g), _variance_estimate(row, col, mean, g))


def test_a_chain_whose_c_fails_to_build_runs_its_aten_ops_and_says_why(tmp_path, caplog):
    # A compiler that fails every build (not in the disk cache: its path is in the key).
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'no such target' >&2\nexit 1\n")
    failing.chmod(0o755)
    row, col, mean, g = torch.rand(6, 1), torch.rand(1, 4), torch.rand(1, 1), torch.randn(6, 4)
    gm = make_fx(_variance_estimate, tracing_mode="fake")(row, col, mean, g)
    assert fuse_chains(gm.graph, Compiler(str(failing), "failing 1.0")) == 1
    gm.recompile()
    (call,) = [n.target for n in gm.graph.nodes if isinstance(n.target, ChainCall)]
    call.library.exception()  # (the build is done: it failed)
    with caplog.at_level("WARNING", logger="optkernels.c_chains"):
        assert torch.equal(gm(row, col, mean, g), _variance_estimate(row, col, mean, g))
    assert call.function is None and "no such target" in (call.build_error or "")
    assert "running the chains' ATen ops" in caplog.text


def test_calls_before_the_library_is_built_run_the_aten_ops_then_the_c():
    row, col, mean, g = torch.rand(9, 1), torch.rand(1, 5), torch.rand(1, 1), torch.randn(9, 5)
    gm, (call,) = _fused(_variance_estimate, row, col, mean, g)
    building = call.library
    call.library = concurrent.futures.Future()  # (a build not done yet)
    assert torch.equal(gm(row, col, mean, g), _variance_estimate(row, col, mean, g))
    assert call.function is None  # (ran ATen's ops: no call waits for the compiler)
    call.library.set_result(building.result())
    assert torch.equal(gm(row, col, mean, g), _variance_estimate(row, col, mean, g))
    assert call.function is not None and call.build_error is None


def test_numbers_computed_in_the_step_in_an_ops_kwargs_are_read_at_the_call_by_both_paths():
    """A number the step computes (Adafactor's weight decay, ``add_(p, alpha=-lr * wd)``)
    is a node in the op's kwargs: the C reads it at the call, and so do the chain's ATen
    ops, run until the library is built (a cold disk cache: the first steps)."""
    aten = torch.ops.aten
    graph = fx.Graph()
    p, g, decay, lr = (graph.placeholder(name) for name in ("p", "g", "decay", "lr"))
    val = torch.empty(6, 4)
    p.meta["val"], g.meta["val"], decay.meta["val"], lr.meta["val"] = val, val, 0.5, 0.5
    scaled = graph.call_function(aten.mul_.Scalar, (p, decay))
    stepped = graph.call_function(aten.add_.Tensor, (scaled, g), {"alpha": lr})
    scaled.meta["val"] = stepped.meta["val"] = val
    graph.output(stepped)
    assert not isinstance(COMPILER, str)
    assert fuse_chains(graph, COMPILER) == 1
    gm = fx.GraphModule(torch.nn.Module(), graph)
    (call,) = [n.target for n in graph.nodes if isinstance(n.target, ChainCall)]
    building = call.library
    call.library = concurrent.futures.Future()  # (a build not done yet)
    gen = torch.Generator().manual_seed(4)
    for done in (False, True):
        if done:
            call.library.set_result(building.result())
        param, grad = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
        expected = param.clone().mul_(0.999).add_(grad, alpha=-0.37)
        assert torch.equal(gm(param, grad, 0.999, -0.37), expected)
        assert (call.function is not None) is done  # (the ATen ops, then the C)
