"""Each lane op as a Triton expression, computed as ATen computes it: operands cast to the
op's dtype, computed in its compute dtype, the result rounded to its dtype, Python scalars
read unrounded, and ``tl.fma`` where ATen's functors compute ``a + b * c``
(``foreach_kernel.kernel_source`` assembles the kernel around them)."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from optkernels.dtypes import COMPARE, OpDtypes, compute_dtype
from optkernels.errors import KernelError
from optkernels.host import scalar_slot
from optkernels.lanes import LaneOp, LaneProgram

_TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.bool: "tl.int8",  # one byte each, read as ``!= 0`` (a mask a prelude computed)
    torch.uint8: "tl.uint8",  # int8 state: codes, then block scales (optkernels.compressed)
}
_NARROW = (torch.float16, torch.bfloat16)


def _round(expr: str, dtype: torch.dtype) -> str:
    """``expr`` (float32) rounded to ``dtype`` and back. Triton's interpreter truncates when
    it converts float32 to bfloat16; the GPU rounds to nearest even, and so does _bf16. On
    the GPU a bfloat16 round trip is _bf16_rn: two values per conversion, off the
    transcendental unit (the same bits as ``.to(tl.bfloat16).to(tl.float32)``)."""
    if dtype is torch.bfloat16:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        return f"_bf16({expr})" if interpret else f"_bf16_rn({expr})"
    return f"({expr}).to({_TL_DTYPES[dtype]}).to(tl.float32)"


def _convert(expr: str, src: torch.dtype, dst: torch.dtype) -> str:
    """``expr``, a value of dtype ``src`` held in its compute dtype, as a value of dtype
    ``dst`` held in dst's compute dtype: rounded where ``dst`` cannot hold it, as ATen casts
    a tensor operand to an op's dtype (float64 goes through float32 to a narrower type, as
    torch's conversions do)."""
    if src is dst or torch.bool in (src, dst):
        return expr
    if compute_dtype(src) is not compute_dtype(dst):
        expr = f"({expr}).to({_TL_DTYPES[compute_dtype(dst)]})"
    return _round(expr, dst) if dst in _NARROW else expr


def _store_cast(expr: str, src: torch.dtype, dtype: torch.dtype) -> str:
    """``expr`` (dtype ``src`` in its compute dtype) as a ``dtype`` value to store."""
    if dtype is torch.bool:
        return f"{expr}.to(tl.int8)"
    if src is torch.float64 and dtype in _NARROW:
        expr = f"({expr}).to(tl.float32)"  # (the interpreter casts float64 to bfloat16 wrongly)
    if dtype is torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return f"_bf16({expr}).to(tl.bfloat16)"  # rounded to nearest even, then exact
    return f"({expr}).to({_TL_DTYPES[dtype]})"


class _Scalars:
    """The Python scalars a kernel reads (float64 in the ``scalars`` buffer), loaded once at
    its top and converted once to each compute dtype an op reads them in."""

    def __init__(self, program: LaneProgram) -> None:
        self.program = program
        self.lines: list[str] = []
        self.names: set[str] = set()

    def ref(self, index: int, compute: torch.dtype) -> str:
        slot = scalar_slot(index, self.program)
        name = f"s{slot}"
        if name not in self.names:
            self.names.add(name)
            self.lines.append(f"    {name} = tl.load(scalars + {slot})")
        if compute is torch.float64:
            return name
        if f"{name}_f32" not in self.names:
            self.names.add(f"{name}_f32")
            self.lines.append(f"    {name}_f32 = {name}.to(tl.float32)")
        return f"{name}_f32"


def _lower(
    op: LaneOp,
    dtypes: OpDtypes,
    program: LaneProgram,
    value_dtype: dict[int, torch.dtype],
    numbers: set[int],
    scalars: _Scalars,
) -> tuple[torch.dtype, str]:
    """The dtype of ``op``'s value and its Triton expression (in that dtype's compute dtype):
    operands cast to the op's common dtype, computed in its compute dtype, the result
    rounded to the result dtype (a Python number, ``.item()``, is held in float64)."""
    refs = {v: _operand(v, value_dtype[v], dtypes.common, v in numbers) for v in op.lane_vars}
    compute = compute_dtype(dtypes.common)
    expr = _expr(op, program, refs, compute, scalars, dtypes.common)
    if dtypes.result is torch.bool:
        return torch.bool, expr
    result = dtypes.result or torch.float64
    return result, _convert(expr, compute, result)


def _operand(var: int, dtype: torch.dtype, common: torch.dtype, number: bool) -> str:
    """Lane value ``var`` as an operand of an op computing at ``common``: a tensor operand
    is cast to it; a Python number (an ``.item()``, a value the host computed) is read as
    ATen reads a scalar, in the op's compute dtype."""
    if dtype is torch.bool:
        return f"v{var}"
    if number:
        return _convert(f"v{var}", dtype, compute_dtype(common))
    return _convert(f"v{var}", dtype, common)


_OMITTED = "<omitted>"  # what _ref gives for a None argument (no valid Triton expression)


def _ref(arg: Any, refs: dict[int, str], compute: torch.dtype, scalars: _Scalars) -> str:
    kind = arg[0]
    if kind == "lane":
        return refs[arg[1]]
    if kind == "scalar":
        return scalars.ref(arg[1], compute)
    if kind == "const":
        value = arg[1]
        if value is None:
            return _OMITTED  # a bound clamp goes without: see _expr
        if isinstance(value, bool):
            raise KernelError(f"constant {value!r} as an operand")
        return f"{float(value)!r}"
    if kind == "ignore":
        return "None"
    raise KernelError(f"argument {arg!r}")


def _expr(
    op: LaneOp,
    program: LaneProgram,
    refs: dict[int, str],
    compute: torch.dtype,
    scalars: _Scalars,
    common: torch.dtype | None = None,
) -> str:
    """``op`` as a Triton expression over its operands (``refs``: lane values already in
    ``compute``, the op's compute dtype; ``common``: the dtype its operands are cast to)."""
    a = [_ref(x, refs, compute, scalars) for x in op.args]
    kw = {k: _ref(v, refs, compute, scalars) for k, v in op.kwargs}
    name = op.op
    wide = compute is torch.float64
    if name != "clamp" and (_OMITTED in a or _OMITTED in kw.values()):
        raise KernelError(f"constant None as an operand of {name}")
    # ATen's functors compute ``a + b * c`` as one fused multiply-add (nvcc contracts them,
    # and so does Triton on a GPU): written as tl.fma, the interpreter rounds them once too.
    if name in ("add", "sub"):  # self + alpha * other
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha is None:
            return f"({a[0]} {'+' if name == 'add' else '-'} {a[1]})"
        return f"tl.fma({a[1] if name == 'add' else f'(-{a[1]})'}, {alpha}, {a[0]})"
    if name == "mul":
        return f"({a[0]} * {a[1]})"
    if name == "div":
        return _div(a[0], a[1], wide)
    if name in ("addcmul", "addcdiv"):  # self + value * (t1 * t2), self + value * (t1 / t2)
        value = kw.get("value", a[3] if len(a) > 3 else "1.0")
        product = f"({a[1]} * {a[2]})" if name == "addcmul" else _div(a[1], a[2], wide)
        return f"tl.fma({value}, {product}, {a[0]})"
    if name == "lerp":  # exact at both ends; |weight| < 0.5 picks the formula
        s, e, w = a[0], a[1], a[2]
        near, far = f"tl.fma({w}, {e} - {s}, {s})", f"tl.fma({s} - {e}, 1.0 - {w}, {e})"
        if _is_literal(w):
            return near if abs(float(w)) < 0.5 else far
        return f"tl.where(tl.abs({w}) < 0.5, {near}, {far})"
    if name == "sqrt":
        return _sqrt(a[0], wide)
    if name == "rsqrt":
        return _div("1.0", _sqrt(a[0], wide), wide)
    if name == "reciprocal":
        return _div("1.0", a[0], wide)
    if name == "neg":
        return f"(-{a[0]})"
    if name == "abs":
        return f"tl.abs({a[0]})"
    if name == "sign":
        x = a[0]  # torch.sign(nan) is 0, like sign(0)
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, tl.zeros_like({x})))"
    if name in ("exp", "log"):
        if wide:
            return f"tl.{name}({a[0]})"
        return f"tl.{name}({a[0]}.to(tl.float64)).to(tl.float32)"
    if name == "pow":  # computed in float64 (see _PRELUDE)
        out = f"_pow({_full(a[0], a[1])}, {_full(a[1], a[0])})"
        return out if wide else f"{out}.to(tl.float32)"
    if name in ("maximum", "minimum"):
        fn = "tl.maximum" if name == "maximum" else "tl.minimum"
        return f"{fn}({a[0]}, {_full(a[1], a[0])}, propagate_nan=tl.PropagateNan.ALL)"
    if name == "rsub":  # other - alpha * self
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha is None:
            return f"({a[1]} - {a[0]})"
        return f"tl.fma((-{a[0]}), {alpha}, {a[1]})"
    if name == "clamp":
        low = kw.get("min", a[1] if len(a) > 1 else _OMITTED)
        high = kw.get("max", a[2] if len(a) > 2 else _OMITTED)
        out = a[0]
        if low != _OMITTED:
            out = f"tl.maximum({out}, {_full(low, a[0])}, propagate_nan=tl.PropagateNan.ALL)"
        if high != _OMITTED:
            out = f"tl.minimum({out}, {_full(high, a[0])}, propagate_nan=tl.PropagateNan.ALL)"
        return out
    if name == "where":
        return f"tl.where({a[0]}, {_full(a[1], a[2])}, {_full(a[2], a[1])})"
    if name in COMPARE:
        if common in _NARROW:  # ATen casts a scalar too (Rprop's sign == etaminus in bfloat16)
            a = [_narrowed(x, common) for x in a]
        return f"({a[0]} {_COMPARE[name]} {a[1]})"
    if name in ("identity", "item"):
        return a[0]
    if name == "full":  # a 0-dim tensor holding the value
        if not _is_literal(a[0]):
            return f"({a[0]} - 0.0)"
        number = float(a[0])  # (tl.full makes any zero +0.0: a negative value is negated)
        full = f"tl.full([], {abs(number)!r}, {_TL_DTYPES[compute]})"
        return f"(-{full})" if math.copysign(1.0, number) < 0 else full
    if name == "copy":
        return _full(a[1], a[0])
    if name == "zero":
        return f"tl.zeros_like({a[0]})"
    if name == "ones":
        return f"(tl.zeros_like({a[0]}) + 1.0)"
    raise KernelError(f"op {name}.{op.overload}")


_COMPARE = {"gt": ">", "lt": "<", "ge": ">=", "le": "<=", "eq": "==", "ne": "!="}


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
