"""Generated C loop nests (``c_kernel``, ``cpu_backend``) on hand-built graphs: each op as
ATen computes it (against the torch backend on the same graph), the on-disk cache, and
builds that never wait on each other."""

from __future__ import annotations

import operator
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optkernels import TorchPlan
from optkernels.c_kernel import Compiler, build, find_compiler, library_source
from optkernels.cpu_backend import BLOCK, CpuPlan
from optkernels.foreach_kernel import KernelError
from torch import fx

COMPILER = find_compiler()
pytestmark = pytest.mark.skipif(isinstance(COMPILER, str), reason=f"{COMPILER}")
aten = torch.ops.aten


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTKERNELS_CACHE_DIR", str(tmp_path))
    return tmp_path / "c"


def _compiler() -> Compiler:
    assert isinstance(COMPILER, Compiler)
    return COMPILER


def _placeholder(graph: fx.Graph, name: str, val: object) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


# Unary and binary foreach ops over (x, y) lists; each returns a new list like x.
_OPS = {
    "add alpha": lambda g, x, y, s: (aten._foreach_add.List, (x, y), {"alpha": s}),
    "sub": lambda g, x, y, s: (aten._foreach_sub.List, (x, y), {}),
    "mul": lambda g, x, y, s: (aten._foreach_mul.List, (x, y), {}),
    "mul scalar": lambda g, x, y, s: (aten._foreach_mul.Scalar, (x, s), {}),
    "div": lambda g, x, y, s: (aten._foreach_div.List, (x, y), {}),
    "addcmul": lambda g, x, y, s: (aten._foreach_addcmul.Scalar, (x, y, y), {"value": s}),
    "addcdiv": lambda g, x, y, s: (aten._foreach_addcdiv.Scalar, (x, x, y), {"value": s}),
    "lerp": lambda g, x, y, s: (aten._foreach_lerp.Scalar, (x, y, s), {}),
    "sqrt": lambda g, x, y, s: (aten._foreach_sqrt.default, (x,), {}),
    "abs": lambda g, x, y, s: (aten._foreach_abs.default, (x,), {}),
    "maximum": lambda g, x, y, s: (aten._foreach_maximum.List, (x, y), {}),
    "sign": lambda g, x, y, s: (aten._foreach_sign.default, (x,), {}),
    "reciprocal": lambda g, x, y, s: (aten._foreach_reciprocal.default, (x,), {}),
    "exp": lambda g, x, y, s: (aten._foreach_exp.default, (x,), {}),
}


def _chain_graph(ops: list[str], dtype: torch.dtype, sizes: list[int]) -> fx.GraphModule:
    """``x = op_k(...op_1(x, y)...)`` foreach over lanes of ``sizes``; x written back."""
    graph = fx.Graph()
    xs = [_placeholder(graph, f"x{i}", torch.empty(n, dtype=dtype)) for i, n in enumerate(sizes)]
    ys = [_placeholder(graph, f"y{i}", torch.empty(n, dtype=dtype)) for i, n in enumerate(sizes)]
    scalar = _placeholder(graph, "s", 0.3)
    vals = [torch.empty(n, dtype=dtype) for n in sizes]
    current: object = xs
    for name in ops:
        target, args, kwargs = _OPS[name](graph, current, ys, scalar)
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = vals
        current = node
    for i, x in enumerate(xs):
        item = graph.call_function(operator.getitem, (current, i))
        graph.call_function(aten.copy_.default, (x, item))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


def _inputs(dtype: torch.dtype, sizes: list[int], seed: int) -> list[object]:
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    ys = [(torch.randn(n, generator=gen) + 2.0).to(dtype) for n in sizes]
    return [*xs, *ys, 0.3]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart, in ulps of the dtype at the scale of ``b``'s largest finite value;
    inf where their NaNs or infinities differ."""
    if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.isinf(), b.isinf()):
        return float("inf")
    finite = a.isfinite()
    if not finite.any():
        return 0.0
    x, y = a[finite].double(), b[finite].double()
    scale = max(float(y.abs().max()), torch.finfo(a.dtype).tiny)
    return float((x - y).abs().max()) / (torch.finfo(a.dtype).eps * scale)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.sampled_from(sorted(_OPS)), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    sizes=st.lists(st.sampled_from([1, 3, 17, 1000]), min_size=1, max_size=3),
)
def test_generated_loops_compute_each_op_as_the_torch_backend(ops, dtype, sizes):
    gm = _chain_graph(ops, dtype, sizes)
    plan = CpuPlan(gm, _compiler())
    assert plan.fallback is None, plan.reason
    mine, theirs = _inputs(dtype, sizes, 0), _inputs(dtype, sizes, 0)
    plan(mine)
    TorchPlan(gm)(theirs)
    for a, b in zip(mine[: len(sizes)], theirs[: len(sizes)], strict=True):
        # (a fused multiply-add where ATen's CPU kernel rounds the product: an ulp, which a
        # later op of a narrow dtype can carry a little further)
        assert _ulps_apart(a, b) <= 4, (ops, dtype, a, b)


def test_a_lane_larger_than_a_block_is_split_into_work_items_and_computed_whole():
    sizes = [2 * BLOCK + 5, 3]
    gm = _chain_graph(["addcdiv", "sqrt"], torch.float32, sizes)
    plan = CpuPlan(gm, _compiler())
    mine, theirs = _inputs(torch.float32, sizes, 1), _inputs(torch.float32, sizes, 1)
    plan(mine)
    TorchPlan(gm)(theirs)
    for a, b in zip(mine[:2], theirs[:2], strict=True):
        assert _ulps_apart(a, b) <= 4
    assert [len(items) for items in plan.parts[0].items] == [4]


def test_bfloat16_rounds_to_nearest_even_as_torch_does():
    # Values on both sides of half-ulp ties, and NaN and infinities, through one add.
    x = torch.tensor([1.0, 1.0, 1.0, 3.0, float("nan"), float("inf"), -float("inf")])
    y = torch.tensor([2**-8, 3 * 2**-9, 2**-9, 2**-7, 1.0, 1.0, 1.0])
    gm = _chain_graph(["add alpha"], torch.bfloat16, [7])
    mine = [x.bfloat16(), y.bfloat16(), 1.0]
    theirs = [t.clone() if isinstance(t, torch.Tensor) else t for t in mine]
    CpuPlan(gm, _compiler())(mine)
    TorchPlan(gm)(theirs)
    assert torch.equal(mine[0].view(torch.int16), theirs[0].view(torch.int16))


def test_a_second_build_loads_the_library_from_disk_without_compiling(cache):
    source = library_source(["void twice(float *x) { x[0] *= 2.0f; }"])
    build(_compiler(), source)
    (library,) = cache.glob("k_*.so")
    before = library.stat().st_mtime_ns
    build(_compiler(), source)
    assert library.stat().st_mtime_ns == before
    assert [p.name for p in cache.iterdir() if p.suffix != ".so"] == []  # no leftovers


def test_builds_of_one_source_at_once_never_wait_and_leave_one_library(cache):
    source = library_source(["void thrice(float *x) { x[0] *= 3.0f; }"])
    errors: list[BaseException] = []

    def run() -> None:
        try:
            build(_compiler(), source)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert len(list(cache.glob("k_*.so"))) == 1
    assert not [p for p in os.listdir(cache) if ".so" not in p or p.count(".") > 1]


def test_a_compile_error_names_the_compiler_and_its_message(cache):
    with pytest.raises(KernelError, match=r"failed on .*error"):
        build(_compiler(), library_source(["void broken( { }"]))
    assert not list(cache.glob("k_*"))


def test_tensors_off_the_cpu_run_on_the_torch_backend_with_the_reason():
    gm = _chain_graph(["mul"], torch.float32, [4])
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta["val"], torch.Tensor):
            node.meta["val"] = torch.empty(4, device="meta")
    plan = CpuPlan(gm, _compiler())
    assert plan.fallback is not None
    assert plan.describe().startswith("# not fused (its tensors live on meta, not the CPU)")
