"""One lowering of a lane op to an expression, shared by the Triton and the C kernels.

What an op means does not depend on the language it is written in: which arguments ATen reads
and in what order (``add``'s optional alpha, ``rsub``'s reversed operands, ``clamp``'s
optional bounds, ``addcdiv``'s default value), the casts around it (tensor operands to the
op's dtype, Python numbers read unrounded in its compute dtype, the result rounded to its
dtype) and the arithmetic ATen's functors do (one fused multiply-add for ``a + b * c``,
lerp's two formulas, exp/log/pow in float64). That is written once here, as ``lower`` and
``expression``. A target supplies an ``Emitter``: how its source spells a literal, a cast, a
rounding to float16/bfloat16, fma, division, a square root, a NaN-propagating max/min, a
select, a float64 call. ``triton_ops.TritonEmitter`` and ``c_kernel.CEmitter`` are the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from optkernels.dtypes import COMPARE, OpDtypes, compute_dtype
from optkernels.errors import KernelError
from optkernels.host import scalar_slot
from optkernels.lanes import LaneOp, LaneProgram

NARROW = (torch.float16, torch.bfloat16)  # held and computed in float32, rounded after each op


@dataclass
class Scalars:
    """The Python scalars a kernel reads (float64 in its ``scalars`` buffer), loaded once at
    its top and converted once to float32 for the ops that read them in float32. ``load``
    and ``narrow`` are the target's lines, formatted with ``name``, ``slot`` and ``narrow``
    (the float32 copy's name: ``name + suffix``)."""

    program: LaneProgram
    load: str
    narrow: str
    suffix: str
    lines: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)

    def ref(self, index: int, compute: torch.dtype) -> str:
        slot = scalar_slot(index, self.program)
        name = f"s{slot}"
        if name not in self.names:
            self.names.add(name)
            self.lines.append(self.load.format(name=name, slot=slot))
        if compute is torch.float64:
            return name
        narrow = name + self.suffix
        if narrow not in self.names:
            self.names.add(narrow)
            self.lines.append(self.narrow.format(name=name, narrow=narrow))
        return narrow


@dataclass
class Values:
    """What a kernel holds for each lane var computed so far: the dtype of its value (held in
    that dtype's compute dtype), and whether ATen reads it as a Python number (an ``.item()``,
    a value the host computed) rather than as a tensor."""

    dtype: dict[int, torch.dtype] = field(default_factory=dict)
    numbers: set[int] = field(default_factory=set)

    def from_host(self, op: LaneOp) -> bool:
        """Record ``op``'s value as read from the host's values; whether it is a truth value
        (a comparison the host made, RAdam's rect > 5, comes as 0.0/1.0: a where takes it
        back as a bool). Any other host value is a Python number, held in float64."""
        truth = op.op in COMPARE
        self.dtype[op.out] = torch.bool if truth else torch.float64
        if not truth:
            self.numbers.add(op.out)
        return truth

    def computed(self, op: LaneOp, dtype: torch.dtype) -> None:
        """Record ``op``'s value as computed by the kernel, a ``dtype``."""
        if op.op == "item":
            self.numbers.add(op.out)
        self.dtype[op.out] = dtype


class Emitter(Protocol):
    """How one target's source spells what ``expression`` needs. Operands are expressions
    already in ``compute``, the dtype an op computes in (float32 or float64)."""

    scalars: Scalars
    ignored: str  # an argument the op takes but does not read

    def literal(self, value: float, compute: torch.dtype) -> str:
        """The number ``value`` as a ``compute`` value."""
        ...

    def cast(self, expr: str, compute: torch.dtype) -> str:
        """``expr`` (float32 or float64) converted to ``compute``."""
        ...

    def round(self, expr: str, dtype: torch.dtype) -> str:
        """``expr`` (float32) rounded to ``dtype`` (float16 or bfloat16) and back."""
        ...

    def fma(self, x: str, y: str, z: str, compute: torch.dtype) -> str:
        """``x * y + z`` rounded once."""
        ...

    def div(self, x: str, y: str, compute: torch.dtype) -> str:
        """``x / y`` rounded to nearest (IEEE division)."""
        ...

    def sqrt(self, x: str, compute: torch.dtype) -> str:
        """The correctly rounded square root."""
        ...

    def abs(self, x: str, compute: torch.dtype) -> str: ...

    def abs_below_half(self, x: str) -> str:
        """The condition ``|x| < 0.5`` (lerp's choice of formula)."""
        ...

    def maximum(self, x: str, y: str, compute: torch.dtype) -> str:
        """The larger of ``x`` and ``y``, NaN if either is (as ATen's maximum and clamp)."""
        ...

    def minimum(self, x: str, y: str, compute: torch.dtype) -> str:
        """The smaller of ``x`` and ``y``, NaN if either is."""
        ...

    def select(self, condition: str, x: str, y: str) -> str:
        """``x`` where ``condition`` holds, else ``y``."""
        ...

    def broadcast(self, value: str, like: str) -> str:
        """``value`` in the shape of ``like`` (for a target whose values have shapes)."""
        ...

    def float64_call(self, fn: str, args: list[str], compute: torch.dtype) -> str:
        """``fn`` (exp, log or pow) of ``args`` computed in float64, rounded once to
        ``compute`` for a float32 op (see kernel_prelude on pow)."""
        ...

    def compare_operand(self, x: str, common: torch.dtype | None) -> str:
        """An operand of a comparison whose operands are cast to ``common``."""
        ...

    def zeros_like(self, x: str, compute: torch.dtype) -> str: ...

    def ones_like(self, x: str, compute: torch.dtype) -> str: ...

    def value(self, x: str) -> str:
        """``x`` as an op's value of its own (identity, item, copy)."""
        ...

    def full(self, x: str, compute: torch.dtype) -> str:
        """A 0-dim tensor holding ``x``."""
        ...


def convert(expr: str, src: torch.dtype, dst: torch.dtype, emit: Emitter) -> str:
    """``expr``, a value of dtype ``src`` held in its compute dtype, as a value of dtype
    ``dst`` held in dst's compute dtype: rounded where ``dst`` cannot hold it, as ATen casts
    a tensor operand to an op's dtype (float64 goes through float32 to a narrower type, as
    torch's conversions do)."""
    if src is dst or torch.bool in (src, dst):
        return expr
    if compute_dtype(src) is not compute_dtype(dst):
        expr = emit.cast(expr, compute_dtype(dst))
    return emit.round(expr, dst) if dst in NARROW else expr


def lower(op: LaneOp, dtypes: OpDtypes, values: Values, emit: Emitter) -> tuple[torch.dtype, str]:
    """The dtype of ``op``'s value and its expression (in that dtype's compute dtype):
    operands cast to the op's common dtype, computed in its compute dtype, the result
    rounded to the result dtype (a Python number, ``.item()``, is held in float64)."""
    refs = {v: _operand(v, values, dtypes.common, emit) for v in op.lane_vars}
    compute = compute_dtype(dtypes.common)
    expr = expression(op, refs, compute, emit, dtypes.common)
    if dtypes.result is torch.bool:
        return torch.bool, expr
    result = dtypes.result or torch.float64
    return result, convert(expr, compute, result, emit)


def _operand(var: int, values: Values, common: torch.dtype, emit: Emitter) -> str:
    """Lane value ``var`` as an operand of an op computing at ``common``: a tensor operand
    is cast to it; a Python number (an ``.item()``, a value the host computed) is read as
    ATen reads a scalar, in the op's compute dtype."""
    dtype = values.dtype[var]
    if dtype is torch.bool:
        return f"v{var}"
    if var in values.numbers:
        return convert(f"v{var}", dtype, compute_dtype(common), emit)
    return convert(f"v{var}", dtype, common, emit)


_OMITTED = "<omitted>"  # what _ref gives for a None argument (no valid expression)


def _ref(arg: Any, refs: dict[int, str], compute: torch.dtype, emit: Emitter) -> str:
    kind = arg[0]
    if kind == "lane":
        return refs[arg[1]]
    if kind == "scalar":
        return emit.scalars.ref(arg[1], compute)
    if kind == "const":
        value = arg[1]
        if value is None:
            return _OMITTED  # a bound clamp goes without: see expression
        if isinstance(value, bool):
            raise KernelError(f"constant {value!r} as an operand")
        return emit.literal(float(value), compute)
    if kind == "ignore":
        return emit.ignored
    raise KernelError(f"argument {arg!r}")


def constant(arg: Any) -> float | None:
    """The number ``arg`` stands for when it is a literal, else None."""
    if arg[0] == "const" and isinstance(arg[1], int | float) and not isinstance(arg[1], bool):
        return float(arg[1])
    return None


def expression(
    op: LaneOp,
    refs: dict[int, str],
    compute: torch.dtype,
    emit: Emitter,
    common: torch.dtype | None = None,
) -> str:
    """``op`` as an expression over its operands (``refs``: lane values already in
    ``compute``, the op's compute dtype; ``common``: the dtype its operands are cast to)."""
    a = [_ref(x, refs, compute, emit) for x in op.args]
    kw = {k: _ref(v, refs, compute, emit) for k, v in op.kwargs}
    name = op.op
    one = emit.literal(1.0, compute)
    if name != "clamp" and (_OMITTED in a or _OMITTED in kw.values()):
        raise KernelError(f"constant None as an operand of {name}")
    # ATen's functors compute ``a + b * c`` as one fused multiply-add (nvcc contracts them,
    # and so does Triton on a GPU): written as an explicit fma, every target rounds once.
    if name in ("add", "sub"):  # self + alpha * other
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha is None:
            return f"({a[0]} {'+' if name == 'add' else '-'} {a[1]})"
        return emit.fma(a[1] if name == "add" else f"(-{a[1]})", alpha, a[0], compute)
    if name == "rsub":  # other - alpha * self
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha is None:
            return f"({a[1]} - {a[0]})"
        return emit.fma(f"(-{a[0]})", alpha, a[1], compute)
    if name == "mul":
        return f"({a[0]} * {a[1]})"
    if name == "div":
        return emit.div(a[0], a[1], compute)
    if name in ("addcmul", "addcdiv"):  # self + value * (t1 * t2), self + value * (t1 / t2)
        value = kw.get("value", a[3] if len(a) > 3 else one)
        t1, t2 = a[1], a[2]
        product = f"({t1} * {t2})" if name == "addcmul" else emit.div(t1, t2, compute)
        return emit.fma(value, product, a[0], compute)
    if name == "lerp":  # exact at both ends; |weight| < 0.5 picks the formula
        s, e, w = a[0], a[1], a[2]
        near = emit.fma(w, f"{e} - {s}", s, compute)
        far = emit.fma(f"{s} - {e}", f"{one} - {w}", e, compute)
        weight = constant(op.args[2])
        if weight is not None:
            return near if abs(weight) < 0.5 else far
        return emit.select(emit.abs_below_half(w), near, far)
    if name == "sqrt":
        return emit.sqrt(a[0], compute)
    if name == "rsqrt":
        return emit.div(one, emit.sqrt(a[0], compute), compute)
    if name == "reciprocal":
        return emit.div(one, a[0], compute)
    if name == "neg":
        return f"(-{a[0]})"
    if name == "abs":
        return emit.abs(a[0], compute)
    if name == "sign":  # torch.sign(nan) is 0, like sign(0)
        x, zero = a[0], emit.literal(0, compute)  # (an int: Triton compares with 0)
        below = emit.select(f"{x} < {zero}", f"-{one}", emit.zeros_like(x, compute))
        return emit.select(f"{x} > {zero}", one, below)
    if name in ("exp", "log"):
        return emit.float64_call(name, [a[0]], compute)
    if name == "pow":
        base, exponent = emit.broadcast(a[0], a[1]), emit.broadcast(a[1], a[0])
        return emit.float64_call(name, [base, exponent], compute)
    if name in ("maximum", "minimum"):
        extremum = emit.maximum if name == "maximum" else emit.minimum
        return extremum(a[0], emit.broadcast(a[1], a[0]), compute)
    if name == "clamp":  # either bound may be None
        low = kw.get("min", a[1] if len(a) > 1 else _OMITTED)
        high = kw.get("max", a[2] if len(a) > 2 else _OMITTED)
        out = a[0]
        if low != _OMITTED:
            out = emit.maximum(out, emit.broadcast(low, a[0]), compute)
        if high != _OMITTED:
            out = emit.minimum(out, emit.broadcast(high, a[0]), compute)
        return out
    if name == "where":
        return emit.select(a[0], emit.broadcast(a[1], a[2]), emit.broadcast(a[2], a[1]))
    if name in COMPARE:  # ATen casts every operand, a Python number too, to the common dtype
        x, y = (emit.compare_operand(v, common) for v in a[:2])
        return f"({x} {_COMPARE[name]} {y})"
    if name in ("identity", "item"):
        return emit.value(a[0])
    if name == "full":  # a 0-dim tensor holding the value
        return emit.full(a[0], compute)
    if name == "copy":
        return emit.value(emit.broadcast(a[1], a[0]))
    if name == "zero":
        return emit.zeros_like(a[0], compute)
    if name == "ones":
        return emit.ones_like(a[0], compute)
    raise KernelError(f"op {name}.{op.overload}")


_COMPARE = {"gt": ">", "lt": "<", "ge": ">=", "le": "<=", "eq": "==", "ne": "!="}
