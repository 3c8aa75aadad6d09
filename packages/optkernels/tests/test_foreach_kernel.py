"""Generated kernels compute each op as ATen does, on hand-built graphs (no tracer): the
kernels run under TRITON_INTERPRET=1 on the CPU against the torch backend on the same graph
(or, for values eager computes with Python floats, against float64 arithmetic).

What the interpreter does (checked here and in ``test_the_interpreter_rounds_as_the_gpu``):
float32 <-> float16 conversions round to nearest even, with subnormals, overflow to inf;
float32 -> bfloat16 ``.to()`` truncates (the generator rounds with ``_bf16`` instead);
float64 -> bfloat16 ``.to()`` is not a conversion at all (the generator goes through
float32); float64 arithmetic is numpy's (IEEE); ``tl.fma`` rounds once.
"""

from __future__ import annotations

import operator
import os

import pytest
import torch
from optkernels import TorchPlan
from optkernels.foreach_kernel import kernel_source, load_kernel, prelude_for
from optkernels.lanes import analyze
from torch import fx

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels under the interpreter"
)

aten = torch.ops.aten


def _placeholder(graph: fx.Graph, name: str, val: object) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _call(graph: fx.Graph, target: object, args: tuple, val: object, **kwargs: object) -> fx.Node:
    node = graph.call_function(target, args, kwargs)  # type: ignore[arg-type]
    node.meta["val"] = val
    return node


def _write_back(graph: fx.Graph, dsts: list[fx.Node], result: fx.Node) -> fx.GraphModule:
    """``dst_i.copy_(result[i])`` for a foreach result, then the graph module."""
    for i, dst in enumerate(dsts):
        item = graph.call_function(operator.getitem, (result, i))
        graph.call_function(aten.copy_.default, (dst, item))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


def _run_both(gm: fx.GraphModule, inputs: list, **plan_options: object) -> tuple[list, list]:
    from optkernels.triton_backend import TritonPlan

    mine = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    theirs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    plan = TritonPlan(gm, **plan_options)  # type: ignore[arg-type]
    assert plan.parts, plan.reason  # the kernels run it, not the torch backend
    plan(mine)
    TorchPlan(gm)(theirs)
    return mine, theirs


def _momentum_graph(dtype: torch.dtype, sizes: list[int]) -> fx.GraphModule:
    """buf = buf * momentum + g; p = p - lr * buf, foreach over ``sizes``."""
    graph = fx.Graph()
    ps = [_placeholder(graph, f"p{i}", torch.empty(n, dtype=dtype)) for i, n in enumerate(sizes)]
    gs = [_placeholder(graph, f"g{i}", torch.empty(n, dtype=dtype)) for i, n in enumerate(sizes)]
    bufs = [_placeholder(graph, f"b{i}", torch.empty(n, dtype=dtype)) for i, n in enumerate(sizes)]
    lr = _placeholder(graph, "lr", 0.1)
    momentum = _placeholder(graph, "momentum", 0.9)
    neg_lr = graph.call_function(operator.neg, (lr,))
    vals = [torch.empty(n, dtype=dtype) for n in sizes]
    scaled = _call(graph, aten._foreach_mul.Scalar, (bufs, momentum), vals)
    new_bufs = _call(graph, aten._foreach_add.List, (scaled, gs), vals)
    new_ps = _call(graph, aten._foreach_add.List, (ps, new_bufs), vals, alpha=neg_lr)
    for i in range(len(sizes)):
        graph.call_function(
            aten.copy_.default, (bufs[i], graph.call_function(operator.getitem, (new_bufs, i)))
        )
    return _write_back(graph, ps, new_ps)


def test_float64_lanes_compute_in_float64_with_float64_scalars():
    """lr = 0.1 and momentum = 0.9 are not float32 numbers: a float32 kernel (or float32
    scalars) is off by ~1e-8 relative where ATen's float64 ops are exact to an ulp."""
    sizes = [7, 1000]
    gm = _momentum_graph(torch.float64, sizes)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(3) for n in sizes]
    mine, theirs = _run_both(gm, [*tensors, 0.1, 0.9])
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=4e-16, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_a_division_by_negative_zero_keeps_its_sign(dtype):
    """Broadcasting a divisor as ``0 + x`` made -0.0 into +0.0 (x / -0.0 gave +inf)."""
    graph = fx.Graph()
    xs = [_placeholder(graph, f"x{i}", torch.empty(4, dtype=dtype)) for i in range(2)]
    ys = [_placeholder(graph, f"y{i}", torch.empty((), dtype=dtype)) for i in range(2)]
    out = _call(graph, aten._foreach_div.List, (xs, ys), [torch.empty(4, dtype=dtype)] * 2)
    gm = _write_back(graph, xs, out)
    x = torch.tensor([1.0, -2.0, 0.0, 3.0], dtype=dtype)
    inputs = [x, x.clone(), torch.tensor(-0.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)]
    mine, theirs = _run_both(gm, inputs)
    assert mine[0].tolist()[:2] == [float("-inf"), float("inf")]
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_lerp_picks_atens_formula_by_the_weights_magnitude():
    """ATen's lerp takes ``end - (end - start) * (1 - weight)`` where |weight| >= 0.5; the
    kernel took the other formula for every weight below 0.5, negative ones included."""
    graph = fx.Graph()
    vals = [torch.empty(3)]
    start, end, weight = (_placeholder(graph, n, torch.empty(3)) for n in ("s", "e", "w"))
    out = _call(graph, aten._foreach_lerp.List, ([start], [end], [weight]), vals)
    gm = _write_back(graph, [start], out)
    inf = float("inf")
    inputs = [
        torch.tensor([1.0, 1.0, 2.0]),
        torch.tensor([inf, 3.0, 5.0]),
        torch.tensor([-1.0, -0.75, 0.25]),
    ]
    mine, theirs = _run_both(gm, inputs)
    assert mine[0][0].isnan()  # inf - inf * 2: eager's NaN (the other formula gives -inf)
    torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=0, equal_nan=True)


def test_a_0dim_float16_lane_computes_in_the_dtype_its_ops_promote_to():
    """For-loop ops on a 0-dim float16 parameter and a 0-dim float32 value promote to
    float32 (the graph records it), where a larger parameter's stay float16: 60000 * 2 * 0.25
    is 30000 in one and inf in the other."""
    graph = fx.Graph()
    lanes = [torch.empty(3, dtype=torch.float16), torch.empty((), dtype=torch.float16)]
    for i, like in enumerate(lanes):
        x = _placeholder(graph, f"x{i}", like)
        t = _placeholder(graph, f"t{i}", torch.empty(()))
        result = torch.empty(like.shape, dtype=torch.float16 if like.dim() else torch.float32)
        doubled = _call(graph, aten.mul.Tensor, (x, t), result)
        quarter = _call(graph, aten.mul.Tensor, (doubled, 0.25), result)
        graph.call_function(aten.copy_.default, (x, quarter))
    graph.output([])
    gm = fx.GraphModule(torch.nn.Module(), graph)
    big = torch.full((3,), 60000.0, dtype=torch.float16)
    small = torch.tensor(60000.0, dtype=torch.float16)
    mine, theirs = _run_both(gm, [big, torch.tensor(2.0), small, torch.tensor(2.0)])
    assert mine[0].isinf().all() and float(mine[2]) == 30000.0
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_item_is_read_as_a_python_number_not_rounded_to_the_tensors_dtype():
    """``x * t.item()`` multiplies by a Python float: ATen computes it in float32 without
    rounding the number to float16 first (as it would a 0-dim float32 tensor operand)."""
    graph = fx.Graph()
    for i, n in enumerate((5, 300)):
        x = _placeholder(graph, f"x{i}", torch.empty(n, dtype=torch.float16))
        t = _placeholder(graph, f"t{i}", torch.empty(()))
        number = graph.call_function(aten._local_scalar_dense.default, (t,))
        product = _call(graph, aten.mul.Tensor, (x, number), torch.empty(n, dtype=torch.float16))
        graph.call_function(aten.copy_.default, (x, product))
    graph.output([])
    gm = fx.GraphModule(torch.nn.Module(), graph)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen).to(torch.float16) for n in (5, 300)]
    t = torch.tensor(0.0123456789)  # 0.01234436 as a float16: ~1e-4 off
    mine, theirs = _run_both(gm, [xs[0], t, xs[1], t.clone()])
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bias_correction_graph(dtype: torch.dtype, sizes: list[int]) -> fx.GraphModule:
    """step += 1; x = x / beta ** step (a bias correction the host computes from CPU step
    counts when the kernels run on a device: host_small)."""
    graph = fx.Graph()
    xs = [_placeholder(graph, f"x{i}", torch.empty(n, dtype=dtype)) for i, n in enumerate(sizes)]
    steps = [_placeholder(graph, f"step{i}", torch.empty(())) for i in range(len(sizes))]
    beta = _placeholder(graph, "beta", 0.9)
    counts = [torch.empty(()) for _ in sizes]
    new_steps = _call(graph, aten._foreach_add.Scalar, (steps, 1), counts)
    corrections = _call(graph, aten._foreach_pow.ScalarAndTensor, (beta, new_steps), counts)
    vals = [torch.empty(n, dtype=dtype) for n in sizes]
    out = _call(graph, aten._foreach_div.List, (xs, corrections), vals)
    for i in range(len(sizes)):
        graph.call_function(
            aten.copy_.default, (steps[i], graph.call_function(operator.getitem, (new_steps, i)))
        )
    return _write_back(graph, xs, out)


@pytest.mark.parametrize("uniform", [True, False], ids=["same steps", "steps differ"])
def test_values_the_host_computes_reach_a_float64_kernel_in_float64(uniform):
    """Eager's capturable=False path computes bias corrections with Python floats: the host
    does too, and stages them as float64 (float32 staging lost ~1e-8 of each)."""
    sizes = [7, 300]
    gm = _bias_correction_graph(torch.float64, sizes)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]
    steps = [torch.tensor(4.0), torch.tensor(4.0 if uniform else 9.0)]
    mine, _ = _run_both(gm, [*xs, *steps, 0.9], host_small=True)
    for x, step, result in zip(xs, steps, mine, strict=False):
        expected = x / 0.9 ** (float(step) + 1)
        torch.testing.assert_close(result, expected, rtol=4e-16, atol=0)
    assert [float(s) for s in mine[2:4]] == [float(s) + 1 for s in steps]


def test_a_power_with_no_real_value_on_uniform_lanes_gives_torchs_nan():
    """(-0.9) ** 5.5 is complex in Python: the uniform lanes' Python arithmetic gives up and
    the array path computes torch's nan."""
    gm = _bias_correction_graph(torch.float64, [7, 300])
    xs = [torch.ones(n, dtype=torch.float64) for n in (7, 300)]
    mine, theirs = _run_both(gm, [*xs, torch.tensor(4.5), torch.tensor(4.5), -0.9], host_small=True)
    assert all(x.isnan().all() for x in mine[:2])
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_values_the_host_computes_are_read_unrounded_by_float16_ops():
    """A value the host computed is a CPU scalar to ATen's CUDA kernels (and a Python float
    in eager's capturable=False path): ops read it in float32, not rounded to float16."""
    sizes = [7, 300]
    gm = _bias_correction_graph(torch.float16, sizes)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen).to(torch.float16) for n in sizes]
    steps = [torch.tensor(4.0), torch.tensor(4.0)]
    mine, theirs = _run_both(gm, [*xs, *steps, 0.9], host_small=True)
    for x, result in zip(xs, mine, strict=False):
        expected = (x.float() / torch.tensor(0.9**5, dtype=torch.float32)).to(torch.float16)
        torch.testing.assert_close(result, expected, rtol=0, atol=0)
    # (ATen's CPU division by a 0-dim tensor reads it unrounded too: the torch backend agrees)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_float64_program_gets_its_own_kernel_source_and_cache_file():
    """The on-disk kernel cache is keyed by a hash of the generated source: the compute
    dtype is in that text (float64 operations, float32 conversions), so programs that differ
    only in dtype never share a file or a compiled binary."""
    sources = {}
    for dtype in (torch.float32, torch.float64, torch.float16):
        program = analyze(_momentum_graph(dtype, [7]).graph)
        sources[dtype] = kernel_source(program, [dtype] * 3, "k")
    assert len(set(sources.values())) == 3
    assert "tl.float32" not in sources[torch.float64]  # nothing narrows a float64 lane
    assert ".to(tl.float16).to(tl.float32)" in sources[torch.float16]  # each op rounded
    files = {load_kernel(source, "k").record for source in sources.values()}
    assert len(files) == 3


def test_gpu_source_loads_every_input_first_and_rounds_bfloat16_two_at_a_time(monkeypatch):
    """The GPU's source (no interpreter): in each branch every input is loaded before the
    first op computes (a param read only by the last op no longer waits for the math before
    it), and a bfloat16 round trip is _bf16_rn (cvt.rn.bf16x2.f32), not one F2F per value."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    program = analyze(_momentum_graph(torch.bfloat16, [7]).graph)
    source = kernel_source(program, [torch.bfloat16] * 3, "k")
    assert "_bf16_rn(" in source and ".to(tl.bfloat16).to(tl.float32)" not in source
    branches = source.split("    else:\n")
    assert len(branches) == 2
    for branch in branches:
        lines = [ln.strip() for ln in branch.splitlines() if ln.strip().startswith("v")]
        loads = [i for i, ln in enumerate(lines) if "+ offs, mask=mask" in ln and "tl.load" in ln]
        assert len(loads) == 3 and loads == list(range(3)), lines


def test_the_interpreter_rounds_as_the_gpu():
    """The interpreter facts the generator relies on (module docstring)."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, half_ptr, fma_ptr, y_ptr, z_ptr):
        x = tl.load(x_ptr + tl.arange(0, 4))
        tl.store(half_ptr + tl.arange(0, 4), x.to(tl.float16))
        y = tl.load(y_ptr + tl.arange(0, 4))
        z = tl.load(z_ptr + tl.arange(0, 4))
        tl.store(fma_ptr + tl.arange(0, 4), tl.fma(x, y, z))

    x = torch.tensor([1e5, 3e-8, 1.0 + 2**-11, -(2**-25)])  # overflow, subnormal, ties
    y = torch.tensor([1.0 + 2**-23, 3.0, 1.0 + 2**-12, 7.0])
    z = torch.tensor([-1e5, 0.5, -1.0, 1.0])
    half = torch.empty(4, dtype=torch.float16)
    fused = torch.empty(4)
    convert[(1,)](x, half, fused, y, z)
    assert half.tolist() == x.to(torch.float16).tolist()
    assert fused.tolist() == (x.double() * y.double() + z.double()).float().tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("config", [None, (512, 4), (256, 2), (2048, 8)], ids=str)
def test_each_launch_configuration_gives_the_same_bits(dtype, config, monkeypatch):
    """The launch shape (elements per program, warps, registers) is tuned per dtype; every
    configuration, the default for this dtype included (None), must give the bits of the
    untuned one (1024 by 4 warps, no register limit) on sizes that do not divide the block
    (the masked tail, one-element lanes, a lane spanning several blocks), and agree with the
    torch backend."""
    from optkernels import launch_config
    from optkernels.triton_backend import TritonPlan

    sizes = [1, 511, 513, 1025, 3]
    gm = _momentum_graph(dtype, sizes)
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen).to(dtype) for _ in range(3) for n in sizes]

    def run(override: tuple[str | None, str | None], maxnreg: str | None) -> tuple[list, int]:
        monkeypatch.setattr(launch_config, "_OVERRIDE", override)
        monkeypatch.setattr(launch_config, "_MAXNREG_OVERRIDE", maxnreg)
        plan = TritonPlan(gm)
        inputs = [x.clone() for x in tensors] + [0.1, 0.9]
        plan(inputs)
        groups = [g for part in plan.parts for g in part.groups]
        limits = {
            options.get("maxnreg") for part in plan.parts for *_, options in part.kernel_calls()
        }
        assert limits == {g.maxnreg for g in groups}, limits  # (what the launch is given)
        blocks = {(g.block, g.maxnreg) for g in groups}
        assert len(blocks) == 1, blocks
        return inputs, blocks.pop()

    untuned, _ = run(("1024", "4"), "0")
    mine, (block, maxnreg) = run(tuple(str(c) for c in config) if config else (None, None), None)
    assert block == (config[0] if config else 1024)
    # 16-bit lanes are held to 64 registers a thread (spilling to L1), float32 ones are not
    assert maxnreg == (None if dtype is torch.float32 else 64)
    for a, b in zip(mine, untuned, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    theirs = [x.clone() for x in tensors] + [0.1, 0.9]
    TorchPlan(gm)(theirs)
    for a, b in zip(mine, theirs, strict=True):  # (ATen's CPU kernels round differently)
        torch.testing.assert_close(
            a, b, **({} if dtype is torch.float32 else {"rtol": 0.02, "atol": 0.02})
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_whole_aligned_blocks_and_the_rest_give_the_same_bits(dtype):
    """Whole blocks of tensors at 16-byte addresses run the kernel's unmasked, wide-access
    branch; a lane's partial last block and a tensor at an odd address (a view one element
    in) run the masked one. The same values give the same bits on either path."""
    from optkernels.triton_backend import TritonPlan

    sizes = [1030, 2048, 7]
    gm = _momentum_graph(dtype, sizes)
    source = "".join(g.source for part in TritonPlan(gm).parts for g in part.groups)
    assert "tl.multiple_of(" in source and "mask = offs < numel" in source
    gen = torch.Generator().manual_seed(2)
    values = [torch.randn(n, generator=gen).to(dtype) for _ in range(3) for n in sizes]

    def run(offset: int) -> list[torch.Tensor]:
        # each tensor a view ``offset`` elements into its own storage
        inputs = []
        for x in values:
            storage = torch.zeros(x.numel() + offset, dtype=dtype)
            storage[offset:] = x
            inputs.append(storage[offset:])
        plan = TritonPlan(gm)
        plan([*inputs, 0.1, 0.9])
        return inputs

    aligned, odd = run(0), run(1)
    assert all(x.data_ptr() % 16 != 0 for x in odd)
    for a, b in zip(aligned, odd, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(aligned[0], values[0])  # the step ran


def test_a_kernel_module_defines_only_the_prelude_helpers_it_uses():
    # (each helper a module defines is a JITFunction built on import: ~1 ms in a warm process)
    assert "@triton.jit" not in prelude_for("def k(x):\n    return x\n")
    rounding = prelude_for("y = _bf16_rn(x)\n")
    assert "def _bf16_rn(" in rounding and "def _bf16(" not in rounding
    # a helper used by another (here as reduce's combine function, not called) comes along
    quantizing = prelude_for("_store_int8(codes, scales, x, offs, start, mask, BLOCK)\n")
    assert quantizing.count("@triton.jit") == 2 and "def _max_nan(" in quantizing
    assert prelude_for("").startswith("import triton\nimport triton.language as tl\n")
