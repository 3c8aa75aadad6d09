"""How Triton spells each lane op's pieces (``triton_emitter``, for ``lowering``, which
lowers the ops as ATen computes them), and the casts around a kernel's loads and stores
(``foreach_kernel.kernel_source`` assembles the kernel around them)."""

from __future__ import annotations

import math
import os

import torch

from optkernels.lanes import LaneProgram
from optkernels.lowering import NARROW, Code, Emitter, Scalars

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


def _div(x: str, y: str, wide: bool) -> str:
    """``x / y`` rounded to nearest, as ATen divides (``/`` is IEEE division in float64 on a
    GPU; ``tl.div_rn`` takes float32 only)."""
    if wide:
        return f"({x} / {y})"
    return f"tl.div_rn({_full(x, y)}, {_full(y, x)})"


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


def _float64(fn: str, args: list[str], wide: bool) -> str:
    """exp, log or pow of ``args`` computed in float64 (rounded to float32 unless ``wide``)."""
    if fn == "pow":  # _pow (kernel_prelude) takes float32 and computes in float64
        out = f"_pow({', '.join(args)})"
    else:
        out = f"tl.{fn}({args[0]})" if wide else f"tl.{fn}({args[0]}.to(tl.float64))"
    return out if wide else f"{out}.to(tl.float32)"


def _full_tensor(x: str, compute: torch.dtype) -> str:
    """A 0-dim tensor holding ``x``."""
    if not _is_literal(x):
        return f"({x} - 0.0)"
    number = float(x)  # (tl.full makes any zero +0.0: a negative value is negated)
    full = f"tl.full([], {abs(number)!r}, {_TL_DTYPES[compute]})"
    return f"(-{full})" if math.copysign(1.0, number) < 0 else full


def _code(compute: torch.dtype) -> Code:
    """How Triton spells ``lowering.PRIMITIVES`` for ops computing in ``compute``."""
    wide = compute is torch.float64
    return {
        "literal": repr,  # (an int stays one: sign compares with 0)
        "ignored": "None",
        "cast": "({0}).to(" + _TL_DTYPES[compute] + ")",
        "round": _round,
        "fma": "tl.fma({0}, {1}, {2})",
        "div": lambda x, y: _div(x, y, wide),
        # (tl.sqrt_rn, correctly rounded, takes float32 only; tl.sqrt of a float64 is)
        "sqrt": "tl.sqrt({0})" if wide else "tl.sqrt_rn({0})",
        "abs": "tl.abs({0})",
        "abs_below_half": "tl.abs({0}) < 0.5",
        "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
        "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
        "select": "tl.where({0}, {1}, {2})",
        "broadcast": _full,
        "float64": lambda fn, *args: _float64(fn, list(args), wide),
        # (Rprop's sign == etaminus in bfloat16: etaminus rounded to bfloat16 first)
        "compare_operand": lambda x, common: _narrowed(x, common) if common in NARROW else x,
        "zeros_like": "tl.zeros_like({0})",
        "ones_like": "(tl.zeros_like({0}) + 1.0)",
        "value": "{0}",
        "full": lambda x: _full_tensor(x, compute),
    }


_CODE = {dtype: _code(dtype) for dtype in (torch.float32, torch.float64)}


def triton_emitter(program: LaneProgram) -> Emitter:
    """Lane ops as Triton expressions (for ``lowering``): values are blocks of a kernel's
    elements, or Python floats for literals; float32 math through Triton's correctly rounded
    functions (``tl.div_rn``, ``tl.sqrt_rn``, ``tl.fma``)."""
    load, narrow = "    {name} = tl.load(scalars + {slot})", "    {narrow} = {name}.to(tl.float32)"
    return Emitter(Scalars(program, load, narrow, suffix="_f32"), _CODE)
