from __future__ import annotations

import operator
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optkernels import TorchBackend
from optkernels.compressed import (
    BLOCK,
    SIGNED_POWER,
    UNSIGNED_POWER,
    Compressed,
    CompressionError,
    compress_inputs,
    dequantize_state,
    hash32,
    packed_numel,
    quantize_state,
    reads_elementwise,
)
from torch import fx

aten = torch.ops.aten


def _int8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    payload = quantize_state(x, "int8", 0, 0)
    assert payload.dtype is torch.uint8 and payload.shape == (packed_numel(x.numel()),)
    return dequantize_state(payload, "int8", list(x.shape), x.dtype)


@settings(max_examples=25, deadline=None)
@given(
    numel=st.integers(1, 3 * BLOCK + 7),
    scale=st.floats(1e-8, 1e4),
    nonnegative=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_int8_roundtrip_error_is_within_half_a_code_of_each_blocks_map(
    numel: int, scale: float, nonnegative: bool, seed: int
) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    if nonnegative:
        x = x.abs()
    y = _int8_roundtrip(x)
    pad = -numel % BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)
    got = torch.nn.functional.pad(y, (0, pad)).view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    # companded maps: within half a code in the map's root domain
    power, codes = (UNSIGNED_POWER, 255) if nonnegative else (SIGNED_POWER, 127)
    root = 1.0 / power
    a, b = got / absmax, blocks / absmax
    exact = b.sign() * b.abs() ** root
    error = (a.sign() * a.abs() ** root - exact).abs()
    # (a positive value below half the smallest code reads back as the smallest code)
    raised = nonnegative & (b > 0) & (exact < 0.5 / codes)
    assert (error <= torch.where(raised, 1.0 / codes, 0.5 / codes) + 1e-6).all()


def test_int8_second_moments_keep_small_values_that_a_linear_map_would_zero() -> None:
    v = torch.tensor([1.0, 1e-3, 1e-4] + [0.5] * (BLOCK - 3))
    y = _int8_roundtrip(v)
    assert y[1] > 0 and y[2] > 0  # a linear map's smallest step is 1/254 of the absmax
    assert abs(y[1] / 1e-3 - 1) < 0.3


def test_int8_positive_second_moments_never_read_back_as_zero() -> None:
    v = torch.tensor([1.0, 1e-9, 1e-30] + [0.0] * (BLOCK - 3))
    y = _int8_roundtrip(v)
    assert (y[:3] > 0).all() and torch.equal(y[3:], torch.zeros(BLOCK - 3))
    smallest = torch.full((2,), (1 / 255) ** UNSIGNED_POWER)  # the smallest code's value
    torch.testing.assert_close(y[1:3], smallest)


def test_int8_zero_blocks_and_the_padding_of_the_last_block_read_back_as_zeros() -> None:
    x = torch.zeros(BLOCK + 5)
    x[-1] = -2.0
    y = _int8_roundtrip(x)
    assert torch.equal(y[:BLOCK], torch.zeros(BLOCK))
    assert y[-1] == -2.0 and torch.equal(y[BLOCK:-1], torch.zeros(4))


def _hash_in_python(index: int, counter: int, salt: int) -> int:
    """The hash as uint32 arithmetic, the way a kernel computes it."""
    m = 0xFFFFFFFF
    h = (index * 0x9E3779B1 + ((counter * 0x85EBCA77 + salt * 0xC2B2AE3D) & m)) & m
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_rounding_hash_equals_uint32_arithmetic_for_large_indices_and_counters() -> None:
    index = torch.tensor([0, 1, 2**31 - 1, 2**32 + 5, 123456789])
    got = hash32(index, 2**40 + 3, 7).tolist()
    assert got == [_hash_in_python(i, 2**40 + 3, 7) for i in index.tolist()]


def test_bf16_stochastic_rounding_picks_a_neighbour_and_is_unbiased() -> None:
    value = 1.0 + 2**-10  # 1/8 of the way from 1.0 to the next bfloat16
    x = torch.full((200_000,), value)
    y = quantize_state(x, "bf16", 5, 3).float()
    assert set(y.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(y.mean().item() - value) < 2e-5


def test_bf16_rounding_is_reproducible_per_counter_and_salt_and_keeps_specials() -> None:
    x = torch.randn(4096)
    a = quantize_state(x, "bf16", 9, 1)
    assert torch.equal(a, quantize_state(x, "bf16", 9, 1))
    assert not torch.equal(a, quantize_state(x, "bf16", 10, 1))
    assert not torch.equal(a, quantize_state(x, "bf16", 9, 2))
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.3895e38, -0.0])
    y = quantize_state(special, "bf16", 0, 0)
    assert y[0] == float("inf") and y[1] == -float("inf") and torch.isnan(y[2])
    assert torch.isfinite(y[3]) or y[3] == float("inf")  # rounds up at most to inf


def _momentum_graph(matmul: bool = False) -> fx.GraphModule:
    """buf <- 0.9 * buf + g; p <- p - 0.1 * buf (written back in place)."""
    graph = fx.Graph()
    p, g, buf = (graph.placeholder(n) for n in ("p", "g", "buf"))
    for node, val in zip((p, g, buf), (torch.empty(64, 80),) * 3, strict=True):
        node.meta["val"] = val
    source = graph.call_function(aten.mm.default, (buf, buf)) if matmul else buf
    new_buf = graph.call_function(
        aten.add.Tensor, (graph.call_function(aten.mul.Tensor, (source, 0.9)), g)
    )
    new_p = graph.call_function(aten.add.Tensor, (p, new_buf), {"alpha": -0.1})
    graph.call_function(aten.copy_.default, (p, new_p))
    graph.call_function(aten.copy_.default, (buf, new_buf))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_compressed_graph_dequantizes_updates_and_requantizes_its_state(fmt: str) -> None:
    compressed = {2: Compressed(fmt, torch.float32, salt=77)}
    gm = compress_inputs(_momentum_graph(), compressed, {2: "buf"})
    p, g, buf = torch.randn(64, 80), torch.randn(64, 80), torch.randn(64, 80)
    payload = quantize_state(buf, fmt, 4, 99)
    full = dequantize_state(payload, fmt, [64, 80], torch.float32)
    inputs = [p.clone(), g, payload] + ([5] if fmt == "bf16" else [])  # (the counter)
    TorchBackend().compile(gm)(inputs)
    new_buf = full * 0.9 + g
    torch.testing.assert_close(inputs[0], p - 0.1 * new_buf)
    assert torch.equal(payload, quantize_state(new_buf, fmt, 5, 77))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[2].meta["dequantized"] == (fmt, torch.float32, 64 * 80)


def test_a_state_read_by_a_matmul_is_refused_with_its_name() -> None:
    with pytest.raises(CompressionError, match=r"state\['buf'\] is read by aten.mm.default"):
        compress_inputs(
            _momentum_graph(matmul=True),
            {2: Compressed("int8", torch.float32)},
            {2: "state['buf']"},
        )


def test_elementwise_readers_are_pointwise_and_foreach_ops_but_not_reductions() -> None:
    assert reads_elementwise(aten.lerp.Scalar) and reads_elementwise(aten._foreach_lerp.Scalar)
    assert reads_elementwise(aten.copy_.default)
    assert not reads_elementwise(aten.mm.default) and not reads_elementwise(aten.sum.default)
    assert not reads_elementwise(aten._foreach_norm.Scalar)


def _foreach_momentum_graph(sizes: list[int]) -> fx.GraphModule:
    """buf_i <- 0.9 * buf_i + g_i; p_i <- p_i - buf_i, as one foreach step."""
    graph = fx.Graph()

    def placeholder(name: str, val: object) -> fx.Node:
        node = graph.placeholder(name)
        node.meta["val"] = val
        return node

    ps = [placeholder(f"p{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    gs = [placeholder(f"g{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    bufs = [placeholder(f"b{i}", torch.empty(n)) for i, n in enumerate(sizes)]
    vals = [torch.empty(n) for n in sizes]

    def call(target: object, args: tuple[object, ...]) -> fx.Node:
        node = graph.call_function(target, args)  # type: ignore[arg-type]
        node.meta["val"] = vals
        return node

    new_bufs = call(aten._foreach_add.List, (call(aten._foreach_mul.Scalar, (bufs, 0.9)), gs))
    new_ps = graph.call_function(aten._foreach_add.List, (ps, new_bufs), {"alpha": -1.0})
    new_ps.meta["val"] = vals
    for dsts, result in ((ps, new_ps), (bufs, new_bufs)):
        for i, dst in enumerate(dsts):
            item = graph.call_function(operator.getitem, (result, i))
            graph.call_function(aten.copy_.default, (dst, item))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize(
    ("fmt", "config"),
    [("bf16", None), ("int8", None), ("int8", ("512", "1")), ("int8", ("1024", "4"))],
    ids=str,
)
def test_triton_kernel_converts_state_where_it_loads_and_stores_it_as_the_reference(
    fmt: str, config: tuple[str, str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 lanes run one int8 block by one warp (the default); a wider launch shape (two
    blocks by one warp, four by four warps) reduces each block's row and gives the same
    bits."""
    from optkernels import launch_config
    from optkernels.triton_backend import TritonPlan

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if config is not None:
        monkeypatch.setattr(launch_config, "_OVERRIDE", config)

    sizes = [300, 1500, 7]  # the last stays float32 (a small tensor)
    compressed = {6: Compressed(fmt, torch.float32, 5), 7: Compressed(fmt, torch.float32, 5)}
    gm = compress_inputs(_foreach_momentum_graph(sizes), compressed, {})
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(n, generator=gen) for n in sizes]
    gs = [torch.randn(n, generator=gen) for n in sizes]
    bufs = [torch.randn(n, generator=gen) for n in sizes]
    bufs[1] = bufs[1].abs()  # (int8: the unsigned map)
    payloads = [quantize_state(b, fmt, 0, 5) for b in bufs[:2]]
    counter = [12] if fmt == "bf16" else []  # the rounding counter
    inputs = [t.to(device) for t in (*ps, *gs, *payloads, bufs[2])] + counter
    plan = TritonPlan(gm)
    assert plan.parts and plan.split is None, plan.reason  # fully fused
    if fmt == "int8":
        groups = [g for g in plan.parts[0].groups if torch.uint8 in g.dtypes]
        blocks = {(g.block, g.num_warps, g.maxnreg) for g in groups}
        assert blocks == {(*map(int, config), 64) if config else (BLOCK, 1, 64)}
    fused = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    reference = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    plan(fused)
    TorchBackend().compile(gm)(reference)
    for got, expected in zip(fused[:9], reference[:9], strict=True):
        assert got.dtype == expected.dtype
        if got.dtype is torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # Equal float32 values give equal bits (the interpreter). On a GPU the kernel's fused
    # multiply-adds may put a value an ulp of float32 off the torch backend's: a block's
    # absmax (its scale) then differs by that ulp, and a code next to a rounding boundary by
    # one; values that far apart are the same state for every later step.
    exact = device == "cpu"
    for k, n in ((6, sizes[0]), (7, sizes[1])):
        if fmt == "int8":  # (the codes of the last block's padding are never read)
            padded = -(-n // BLOCK) * BLOCK
            codes, want = fused[k][:n].int(), reference[k][:n].int()
            scales = fused[k][padded:].view(torch.float32)
            want_scales = reference[k][padded:].view(torch.float32)
            if exact:
                assert torch.equal(codes, want) and torch.equal(scales, want_scales)
            else:
                assert (codes - want).abs().max() <= 1
                torch.testing.assert_close(scales, want_scales, rtol=2**-22, atol=0)
        elif exact:
            assert torch.equal(fused[k], reference[k])
        else:  # bfloat16 bits: one ulp of bfloat16 at most
            got, want = (
                fused[k].view(torch.bfloat16).float(),
                reference[k].view(torch.bfloat16).float(),
            )
            torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
