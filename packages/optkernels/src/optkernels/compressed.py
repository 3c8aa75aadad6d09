"""Optimizer state stored compressed: the formats, and the graph rewrite that uses them.

A state tensor of a parameter's shape (exp_avg, exp_avg_sq, a momentum buffer) is stored in
one of two formats, each a single tensor (so the optimizer's state dict keeps its keys):

- ``"bf16"``: a bfloat16 tensor of the state's shape, written with *stochastic rounding*:
  the float32 value's 16 low bits are dropped after adding 16 random bits, so the expected
  stored value is the exact one and an update far below one bfloat16 ulp still moves the
  state on average (round-to-nearest would lose it every time). The random bits are a
  counter-based hash (murmur3's finalizer) of (element index, step counter, a salt per
  state entry): no generator state, the same bits on every backend (the torch ops here and
  the Triton kernels compute the same uint32 arithmetic), and a replayed CUDA graph draws
  fresh bits because the counter is a scalar input the caller advances on every call (the
  plan writes it into its scalar buffer each call, as it does a learning rate).
- ``"int8"``: blockwise absmax quantization, blocks of 256 elements of the flattened
  tensor, one uint8 code per element followed by one float32 scale per block, packed in
  one flat uint8 tensor (``packed_numel``). Both maps are square-root companded, so values
  far below the block's absmax keep a step of their own instead of collapsing to 0: a
  block with a negative value (a first moment) uses value = absmax * s * s.abs() with
  s = (code - 128) / 127; a block with none (every block of a second moment, which Adam
  divides by the square root of) value = absmax * (code / 255) ** 2. The scale's sign bit
  says which map a block uses. Rounding is to nearest. Both powers were chosen by
  measurement (benchmarks/state_dtype_map.py, docs/state_dtype.md).

``compress_inputs`` rewrites a traced graph so that chosen inputs are such payloads: each is
dequantized where the graph starts and the value written back into it is quantized where
it ends. The two conversions are the custom ops ``optkernels::dequantize_state`` and
``optkernels::quantize_state``, whose torch implementations here are the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx

from optkernels._torch_compat import fake_tensor
from optkernels.errors import BackendError

aten = torch.ops.aten

FORMATS = ("bf16", "int8")
BLOCK = 256  # elements per int8 block (one float32 scale each)
_MASK32 = 0xFFFFFFFF
# The power of int8's map for blocks without negative values: value = absmax * (code /
# 255) ** UNSIGNED_POWER (1 would be the linear map). Chosen by measurement (README).
UNSIGNED_POWER = 2
# The same for blocks with a negative value: value = absmax * sign * (|code - 128| / 127) **
# SIGNED_POWER (1: the linear map).
SIGNED_POWER = 2


class CompressionError(BackendError):
    """A graph whose state cannot be stored compressed; the message names the input."""


def packed_numel(numel: int) -> int:
    """Bytes of an int8 payload for ``numel`` elements: padded codes, then the scales."""
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK + 4 * blocks


def payload_spec(fmt: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of the payload that stores a tensor of ``shape`` in ``fmt``."""
    if fmt == "bf16":
        return shape, torch.bfloat16
    if fmt == "int8":
        return (packed_numel(_numel(shape)),), torch.uint8
    raise ValueError(f"unknown state format {fmt!r}; choose one of {FORMATS}")


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def is_payload(fmt: str, t: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``t`` is a payload of format ``fmt`` for a tensor shaped like ``like``."""
    shape, dtype = payload_spec(fmt, tuple(like.shape))
    return t.dtype is dtype and tuple(t.shape) == shape


def hash32(index: torch.Tensor, counter: int, salt: int) -> torch.Tensor:
    """32 random bits per element (int64 in [0, 2**32)): murmur3's finalizer over the element
    index mixed with the step counter and the salt. Every product wraps in int64 and is
    masked to 32 bits, as uint32 arithmetic in a kernel computes it."""
    seed = (int(counter) * 0x85EBCA77 + salt * 0xC2B2AE3D) & _MASK32
    h = (index * 0x9E3779B1 + seed) & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def round_bf16_stochastic(x: torch.Tensor, counter: int, salt: int) -> torch.Tensor:
    """``x`` (float32) in bfloat16, rounded up with probability equal to the dropped
    fraction of an ulp (see the module docstring); infinities and NaNs stay as they are."""
    x = x.to(torch.float32)
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    rounded = (bits + (hash32(index, counter, salt) & 0xFFFF)) & 0xFFFF0000
    rounded = rounded - ((rounded >> 31) << 32)  # back to a signed 32-bit pattern
    value = rounded.to(torch.int32).view(torch.float32).to(torch.bfloat16)  # exact
    return torch.where(torch.isfinite(x), value, x.to(torch.bfloat16))


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an int8 payload (see the module docstring).

    Each step is one float32 operation that the fused kernel (``_quantize_int8`` in
    foreach_kernel.py) performs the same way, so both give the same bits: a block's scale
    is its largest magnitude; an element's ratio to it is ``x * (1 / absmax)`` (one division
    per block, not per element); its code is the ratio's root, scaled and added to
    ``2**23 + zero_code``, where float32's ulp is 1, so the add rounds it to the nearest
    code (ties to even) and the code is the sum's low 8 bits (no float-to-int conversion)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    rows = padded.view(blocks, BLOCK)
    absmax = rows.abs().amax(dim=1)
    unsigned = (rows >= 0).all(dim=1) | torch.isnan(absmax)
    inverse = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))[:, None]
    ratio = rows * inverse
    magnitude = torch.where(
        unsigned[:, None], _root(ratio.abs(), UNSIGNED_POWER), _root(ratio.abs(), SIGNED_POWER)
    )
    root = torch.copysign(magnitude, ratio)
    levels, zero = _map_constants(unsigned[:, None])
    biased = root * levels + (zero + 2.0**23)
    # A positive value never reads back as 0: a second moment read as 0 would make Adam's
    # update m / eps (a step thousands of times too large); the smallest code overstates
    # it instead, which only shrinks that element's update. (In a block of the signed map
    # a positive value's code is at least 128 already.)
    biased = torch.maximum(biased, torch.where(rows > 0, 2.0**23 + 1, 0.0))
    codes = (biased.view(torch.int32) & 0xFF).to(torch.uint8)
    scales = torch.where(unsigned, -absmax, absmax)  # the sign bit flags the map
    out = torch.empty(packed_numel(n), dtype=torch.uint8, device=x.device)
    out[: blocks * BLOCK] = codes.view(-1)
    out[blocks * BLOCK :] = scales.view(torch.uint8)
    return out


def _map_constants(unsigned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block, the codes from zero to the largest magnitude (255 unsigned, 127 signed)
    and the code of zero (0, 128)."""
    levels = torch.where(unsigned, 255.0, 127.0)
    return levels, torch.where(unsigned, 0.0, 128.0)


def _root(x: torch.Tensor, power: int) -> torch.Tensor:
    return x.sqrt() if power == 2 else x ** (1.0 / power)


def _power(d: torch.Tensor, power: int) -> torch.Tensor:
    """``sign(d) * |d| ** power`` (for power 2 exactly ``d * |d|``, as the kernel has it)."""
    return d * d.abs() if power == 2 else d.sign() * d.abs() ** power


def dequantize_int8(payload: torch.Tensor, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The values an int8 payload stores, as a tensor of ``shape`` and ``dtype``: with
    ``d = code - zero_code``, ``d * |d| * (absmax / levels**2)`` (``d * |d|`` is exact, so
    the value is rounded once; the fused kernel's ``_dequantize_int8`` computes the same
    bits)."""
    n = _numel(shape)
    blocks = -(-n // BLOCK)
    codes = payload[: blocks * BLOCK].view(blocks, BLOCK).to(torch.float32)
    scales = payload[blocks * BLOCK :].view(torch.float32)
    unsigned = torch.signbit(scales)[:, None]
    levels, zero = _map_constants(unsigned)
    centered = codes - zero
    power = torch.where(unsigned, _power(centered, UNSIGNED_POWER), _power(centered, SIGNED_POWER))
    largest = torch.where(unsigned, levels**UNSIGNED_POWER, levels**SIGNED_POWER)
    step = scales.abs()[:, None] / largest
    return (power * step).reshape(-1)[:n].reshape(shape).to(dtype)


@torch.library.custom_op(
    "optkernels::dequantize_state",
    mutates_args=(),
    schema="(Tensor payload, str fmt, SymInt[] shape, ScalarType dtype) -> Tensor",
)
def dequantize_state(
    payload: torch.Tensor, fmt: str, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """The state a payload stores, at its full precision (``dtype``)."""
    if fmt == "bf16":
        return payload.to(dtype)
    return dequantize_int8(payload, shape, dtype)


@dequantize_state.register_fake
def _(payload: torch.Tensor, fmt: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return payload.new_empty(shape, dtype=dtype)


@torch.library.custom_op(
    "optkernels::quantize_state",
    mutates_args=(),
    schema="(Tensor x, str fmt, SymInt counter, int salt) -> Tensor",
)
def quantize_state(x: torch.Tensor, fmt: str, counter: int, salt: int) -> torch.Tensor:
    """``x`` as a payload of ``fmt``; ``counter`` and ``salt`` seed bf16's rounding (int8
    rounds to nearest and ignores them)."""
    if fmt == "bf16":
        return round_bf16_stochastic(x, counter, salt)
    return quantize_int8(x)


@quantize_state.register_fake
def _(x: torch.Tensor, fmt: str, counter: int, salt: int) -> torch.Tensor:
    shape, dtype = payload_spec(fmt, tuple(x.shape))
    return x.new_empty(shape, dtype=dtype)


DEQUANTIZE = torch.ops.optkernels.dequantize_state.default
QUANTIZE = torch.ops.optkernels.quantize_state.default

# Ops that read a compressed input element by element besides the pointwise-tagged ones:
# a fused kernel can dequantize each element where it loads it.
_ELEMENTWISE = {
    aten.copy_.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.detach.default,
    aten.alias.default,
    aten.zero_.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.fill_.Scalar,
}
_NOT_ELEMENTWISE_FOREACH = {"_foreach_norm", "_foreach_max"}


def reads_elementwise(target: object) -> bool:
    """Whether ``target`` reads its tensor arguments element by element (the i-th output
    element from the i-th input element), so a compressed input can be dequantized per
    element inside a kernel."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target in _ELEMENTWISE or torch.Tag.pointwise in target.tags:
        return True
    name = target.__name__.split(".")[0]
    return name.startswith("_foreach_") and name.rstrip("_") not in _NOT_ELEMENTWISE_FOREACH


@dataclass(frozen=True)
class Compressed:
    """One graph input (or output) stored compressed: its format, the dtype it has in the
    step, and the salt of its rounding bits (the caller's: the same for every tensor of one
    state entry, e.g. every exp_avg, so one kernel column rounds with one salt)."""

    fmt: str
    dtype: torch.dtype
    salt: int = 0


def compress_inputs(
    gm: fx.GraphModule,
    inputs: Mapping[int, Compressed],
    names: Mapping[int, str],
    outputs: Mapping[int, Compressed] | None = None,
) -> fx.GraphModule:
    """A copy of ``gm`` whose inputs at ``inputs`` (placeholder positions) are payloads.

    Each such input is dequantized once where the graph starts, and the value the graph
    writes back into it (its trailing ``copy_``) is quantized first; so is each output at
    ``outputs`` (positions in the output list: new state the caller stores). When a format
    needs random bits (bf16) the graph takes one more input, last: the step counter, an int
    the caller advances on every call, so every call draws new bits. A payload placeholder
    records ``meta["dequantized"] = (fmt, dtype, numel)``: kernels read it as ``numel``
    values of that dtype.
    ``names`` name the inputs in errors (their Sources). Raises CompressionError when a
    compressed input is read by an op that is not elementwise, or is an output."""
    old = list(gm.graph.nodes)
    placeholders = [n for n in old if n.op == "placeholder"]
    chosen = {placeholders[i]: (i, c) for i, c in inputs.items()}
    _check_readers(chosen, names)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    payloads: dict[fx.Node, fx.Node] = {}
    for node in placeholders:
        new = env[node] = graph.node_copy(node, env.__getitem__)
        if node in chosen:
            shape, dtype = payload_spec(chosen[node][1].fmt, tuple(node.meta["val"].shape))
            c = chosen[node][1]
            new.meta = {
                **node.meta,
                "val": _fake_like(node, shape, dtype),
                "dequantized": (c.fmt, c.dtype, node.meta["val"].numel()),
            }
            payloads[node] = new
    counter: fx.Node | None = None
    outputs = outputs or {}
    if any(c.fmt == "bf16" for c in (*inputs.values(), *outputs.values())):
        counter = graph.placeholder("state_rounding_counter")
        counter.meta["val"] = 0
    for node, (_, c) in chosen.items():
        val = node.meta["val"]
        d = graph.call_function(DEQUANTIZE, (payloads[node], c.fmt, list(val.shape), c.dtype))
        d.meta["val"] = val
        env[node] = d  # every reader reads the full-precision value
    for node in old:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            results = list(fx.map_arg(node.args[0], env.__getitem__))
            for j, c in outputs.items():
                args = (results[j], c.fmt, 0 if counter is None else counter, c.salt)
                q = graph.call_function(QUANTIZE, args)
                shape, dtype = payload_spec(c.fmt, tuple(results[j].meta["val"].shape))
                q.meta["val"] = _fake_like(results[j], shape, dtype)
                results[j] = q
            graph.output(results)
            break
        dest = node.args[0] if node.target is aten.copy_.default else None
        if isinstance(dest, fx.Node) and dest in chosen:
            _, c = chosen[dest]
            value = env[node.args[1]]
            args = (value, c.fmt, 0 if counter is None else counter, c.salt)
            q = _meta(graph.call_function(QUANTIZE, args), payloads[dest])
            copy = graph.call_function(aten.copy_.default, (payloads[dest], q))
            env[node] = _meta(copy, payloads[dest])
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.lint()
    return fx.GraphModule(gm, graph)


def _meta(node: fx.Node, like: fx.Node) -> fx.Node:
    node.meta["val"] = like.meta["val"]
    return node


def _check_readers(
    chosen: Mapping[fx.Node, tuple[int, Compressed]], names: Mapping[int, str]
) -> None:
    for node, (i, _) in chosen.items():
        name = names.get(i, node.name)
        for user in node.users:
            if user.op == "output":
                raise CompressionError(
                    f"{name} is returned by the step; only state the step updates in place "
                    "can be stored compressed"
                )
            if user.target is aten.copy_.default and user.args[0] is node:
                continue
            if not reads_elementwise(user.target):
                raise CompressionError(
                    f"{name} is read by {user.target} (node {user.name}), which is not "
                    "elementwise: a compressed state tensor is dequantized element by "
                    "element where a kernel loads it, so this step cannot keep it "
                    "compressed; use state_dtype=None for this optimizer"
                )


def _fake_like(node: fx.Node, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return fake_tensor(shape, dtype, node.meta["val"].device)
