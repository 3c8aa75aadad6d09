"""How Triton spells each lane op's pieces (``TritonEmitter``, for ``lowering``, which
lowers the ops as ATen computes them), and the casts around a kernel's loads and stores
(``foreach_kernel.kernel_source`` assembles the kernel around them)."""

from __future__ import annotations

import math
import os

import torch

from optkernels.lanes import LaneProgram
from optkernels.lowering import NARROW, Scalars

_TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.bool: "tl.int8",  # one byte each, read as ``!= 0`` (a mask a prelude computed)
    torch.uint8: "tl.uint8",  # int8 state: codes, then block scales (optkernels.compressed)
}


def _round(expr: str, dtype: torch.dtype) -> str:
    """``expr`` (float32) rounded to ``dtype`` and back. Triton's interpreter truncates when
    it converts float32 to bfloat16; the GPU rounds to nearest even, and so does _bf16. On
    the GPU a bfloat16 round trip is _bf16_rn: two values per conversion, off the
    transcendental unit (the same bits as ``.to(tl.bfloat16).to(tl.float32)``)."""
    if dtype is torch.bfloat16:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        return f"_bf16({expr})" if interpret else f"_bf16_rn({expr})"
    return f"({expr}).to({_TL_DTYPES[dtype]}).to(tl.float32)"


def _store_cast(expr: str, src: torch.dtype, dtype: torch.dtype) -> str:
    """``expr`` (dtype ``src`` in its compute dtype) as a ``dtype`` value to store."""
    if dtype is torch.bool:
        return f"{expr}.to(tl.int8)"
    if src is torch.float64 and dtype in NARROW:
        expr = f"({expr}).to(tl.float32)"  # (the interpreter casts float64 to bfloat16 wrongly)
    if dtype is torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return f"_bf16({expr}).to(tl.bfloat16)"  # rounded to nearest even, then exact
    return f"({expr}).to({_TL_DTYPES[dtype]})"


class TritonEmitter:
    """Lane ops as Triton expressions (``lowering.Emitter``): values are blocks of a
    kernel's elements, or Python floats for literals; float32 math through Triton's
    correctly rounded functions (``tl.div_rn``, ``tl.sqrt_rn``, ``tl.fma``)."""

    ignored = "None"

    def __init__(self, program: LaneProgram) -> None:
        self.scalars = Scalars(
            program,
            load="    {name} = tl.load(scalars + {slot})",
            narrow="    {narrow} = {name}.to(tl.float32)",
            suffix="_f32",
        )

    def literal(self, value: float, compute: torch.dtype) -> str:
        return repr(value)  # (an int stays one: sign compares with 0)

    def cast(self, expr: str, compute: torch.dtype) -> str:
        return f"({expr}).to({_TL_DTYPES[compute]})"

    def round(self, expr: str, dtype: torch.dtype) -> str:
        return _round(expr, dtype)

    def fma(self, x: str, y: str, z: str, compute: torch.dtype) -> str:
        return f"tl.fma({x}, {y}, {z})"

    def div(self, x: str, y: str, compute: torch.dtype) -> str:
        return _div(x, y, compute is torch.float64)

    def sqrt(self, x: str, compute: torch.dtype) -> str:
        return _sqrt(x, compute is torch.float64)

    def abs(self, x: str, compute: torch.dtype) -> str:
        return f"tl.abs({x})"

    def abs_below_half(self, x: str) -> str:
        return f"tl.abs({x}) < 0.5"

    def maximum(self, x: str, y: str, compute: torch.dtype) -> str:
        return f"tl.maximum({x}, {y}, propagate_nan=tl.PropagateNan.ALL)"

    def minimum(self, x: str, y: str, compute: torch.dtype) -> str:
        return f"tl.minimum({x}, {y}, propagate_nan=tl.PropagateNan.ALL)"

    def select(self, condition: str, x: str, y: str) -> str:
        return f"tl.where({condition}, {x}, {y})"

    def broadcast(self, value: str, like: str) -> str:
        return _full(value, like)

    def float64_call(self, fn: str, args: list[str], compute: torch.dtype) -> str:
        wide = compute is torch.float64
        if fn == "pow":  # _pow (kernel_prelude) takes float32 and computes in float64
            out = f"_pow({', '.join(args)})"
        else:
            out = f"tl.{fn}({args[0]})" if wide else f"tl.{fn}({args[0]}.to(tl.float64))"
        return out if wide else f"{out}.to(tl.float32)"

    def compare_operand(self, x: str, common: torch.dtype | None) -> str:
        # (Rprop's sign == etaminus in bfloat16: etaminus rounded to bfloat16 first)
        return _narrowed(x, common) if common in NARROW else x

    def zeros_like(self, x: str, compute: torch.dtype) -> str:
        return f"tl.zeros_like({x})"

    def ones_like(self, x: str, compute: torch.dtype) -> str:
        return f"(tl.zeros_like({x}) + 1.0)"

    def value(self, x: str) -> str:
        return x

    def full(self, x: str, compute: torch.dtype) -> str:
        if not _is_literal(x):
            return f"({x} - 0.0)"
        number = float(x)  # (tl.full makes any zero +0.0: a negative value is negated)
        full = f"tl.full([], {abs(number)!r}, {_TL_DTYPES[compute]})"
        return f"(-{full})" if math.copysign(1.0, number) < 0 else full


def _div(x: str, y: str, wide: bool) -> str:
    """``x / y`` rounded to nearest, as ATen divides (``/`` is IEEE division in float64 on a
    GPU; ``tl.div_rn`` takes float32 only)."""
    if wide:
        return f"({x} / {y})"
    return f"tl.div_rn({_full(x, y)}, {_full(y, x)})"


def _sqrt(x: str, wide: bool) -> str:
    """The correctly rounded square root (``tl.sqrt_rn`` takes float32 only; ``tl.sqrt`` of
    a float64 is correctly rounded)."""
    return f"tl.sqrt({x})" if wide else f"tl.sqrt_rn({x})"


def _full(value: str, like: str) -> str:
    """``value`` broadcast to ``like``'s shape (never through arithmetic on ``like``, which
    would carry its NaNs and infinities into the result; ``value - 0`` keeps a -0.0, where
    ``0 + value`` would make it +0.0)."""
    if _is_literal(like):
        return value
    return f"({value} - tl.zeros_like({like}))"


def _narrowed(expr: str, dtype: torch.dtype) -> str:
    """An operand (a float32 value or literal) rounded to ``dtype``, as ATen casts every
    operand of a comparison, Python numbers included, to its common dtype."""
    if _is_literal(expr):
        return repr(float(torch.tensor(float(expr), dtype=dtype)))
    return _round(expr, dtype)


def _is_literal(expr: str) -> bool:
    try:
        float(expr)
    except ValueError:
        return False
    return True
