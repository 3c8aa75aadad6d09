"""One lowering of a lane op to an expression, shared by the Triton and the C kernels.

What an op means does not depend on the language it is written in: which arguments ATen reads
and in what order (``add``'s optional alpha, ``rsub``'s reversed operands, ``clamp``'s
optional bounds, ``addcdiv``'s default value), the casts around it (tensor operands to the
op's dtype, Python numbers read unrounded in its compute dtype, the result rounded to its
dtype) and the arithmetic ATen's functors do (one fused multiply-add for ``a + b * c``,
lerp's two formulas, exp/log/pow in float64). That is written once here, as ``lower`` and
``expression``. A target supplies a table of how its source spells each of a few primitives
(``PRIMITIVES``: a literal, a cast, a rounding to float16/bfloat16, fma, division, a square
root, a NaN-propagating max/min, a select, a call in float64, ...), one table per compute
dtype, in an ``Emitter``: ``triton_ops.triton_emitter`` and ``c_kernel.c_emitter`` make them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

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


# What ``expression`` asks a target to spell, with what it means ({0}, {1}, ...: the operands,
# expressions already in the compute dtype of the table, float32 or float64, unless said).
PRIMITIVES = {
    "literal": "the Python number {0} as a value",
    "ignored": "an argument the op takes but does not read",
    "cast": "{0} (float32 or float64) converted to the compute dtype",
    "round": "{0} (float32) rounded to dtype {1} (float16 or bfloat16) and back",
    "fma": "{0} * {1} + {2}, rounded once",
    "div": "{0} / {1}, rounded to nearest (IEEE division, as ATen divides)",
    "sqrt": "the correctly rounded square root of {0}",
    "abs": "the magnitude of {0}",
    "abs_below_half": "the condition |{0}| < 0.5 (lerp's choice of formula)",
    "maximum": "the larger of {0} and {1}, NaN if either is (ATen's maximum and clamp)",
    "minimum": "the smaller of {0} and {1}, NaN if either is",
    "select": "{1} where {0} holds, else {2}",
    "broadcast": "{0} in the shape of {1} (for a target whose values have shapes)",
    "float64": "{0} (exp, log or pow) of the rest computed in float64, rounded once to "
    "the compute dtype (see kernel_prelude on pow)",
    "compare_operand": "{0} as an operand of a comparison whose operands are cast to {1}",
    "zeros_like": "zeros in the shape of {0}",
    "ones_like": "ones in the shape of {0}",
    "value": "{0} as an op's value of its own (identity, item, copy)",
    "full": "a 0-dim tensor holding {0}",
}
Rule = str | Callable[..., str]  # a format of the operands ("{0} / {1}"), or a function of them
Code = Mapping[str, Rule]  # a target's rule for each primitive, for one compute dtype


@dataclass
class Emitter:
    """One target's spelling of the primitives (``code``: a table per compute dtype, each
    covering PRIMITIVES) and the scalars its kernel reads."""

    scalars: Scalars
    code: Mapping[torch.dtype, Code]
    # Whether an add's or sub's alpha is rounded to a float16/bfloat16 operand's dtype first,
    # as ATen's CPU kernels take it (its CUDA kernels compute with it in float32)
    alpha_in_dtype: bool = False

    def __call__(self, compute: torch.dtype, primitive: str, *operands: Any) -> str:
        """``primitive`` of ``operands`` for an op computing in ``compute``."""
        rule = self.code[compute][primitive]
        return rule.format(*operands) if isinstance(rule, str) else rule(*operands)


def convert(expr: str, src: torch.dtype, dst: torch.dtype, emit: Emitter) -> str:
    """``expr``, a value of dtype ``src`` held in its compute dtype, as a value of dtype
    ``dst`` held in dst's compute dtype: rounded where ``dst`` cannot hold it, as ATen casts
    a tensor operand to an op's dtype (float64 goes through float32 to a narrower type, as
    torch's conversions do)."""
    if src is dst or torch.bool in (src, dst):
        return expr
    if compute_dtype(src) is not compute_dtype(dst):
        expr = emit(compute_dtype(dst), "cast", expr)
    return emit(torch.float32, "round", expr, dst) if dst in NARROW else expr


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
        return emit(compute, "literal", float(value))
    if kind == "ignore":
        return emit(compute, "ignored")
    raise KernelError(f"argument {arg!r}")


def _alpha_in(dtype: torch.dtype, a: list[str], kw: dict[str, str], emit: Emitter) -> None:
    """An add's or sub's alpha (in ``kw`` or third in ``a``) rounded to ``dtype`` in place."""
    if "alpha" in kw:
        kw["alpha"] = emit(torch.float32, "round", kw["alpha"], dtype)
    elif len(a) > 2:
        a[2] = emit(torch.float32, "round", a[2], dtype)


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
    spell = functools.partial(emit, compute)
    a = [_ref(x, refs, compute, emit) for x in op.args]
    kw = {k: _ref(v, refs, compute, emit) for k, v in op.kwargs}
    name = op.op
    one = spell("literal", 1.0)
    if name != "clamp" and (_OMITTED in a or _OMITTED in kw.values()):
        raise KernelError(f"constant None as an operand of {name}")
    # ATen's functors compute ``a + b * c`` as one fused multiply-add (nvcc contracts them,
    # and so does Triton on a GPU): written as an explicit fma, every target rounds once.
    if name in ("add", "sub", "rsub") and emit.alpha_in_dtype and common in NARROW:
        _alpha_in(common, a, kw, emit)
    if name in ("add", "sub"):  # self + alpha * other
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha is None:
            return f"({a[0]} {'+' if name == 'add' else '-'} {a[1]})"
        return spell("fma", a[1] if name == "add" else f"(-{a[1]})", alpha, a[0])
    if name == "rsub":  # other - alpha * self
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha is None:
            return f"({a[1]} - {a[0]})"
        return spell("fma", f"(-{a[0]})", alpha, a[1])
    if name == "mul":
        return f"({a[0]} * {a[1]})"
    if name == "div":
        return spell("div", a[0], a[1])
    if name in ("addcmul", "addcdiv"):  # self + value * (t1 * t2), self + value * (t1 / t2)
        value = kw.get("value", a[3] if len(a) > 3 else one)
        t1, t2 = a[1], a[2]
        product = f"({t1} * {t2})" if name == "addcmul" else spell("div", t1, t2)
        return spell("fma", value, product, a[0])
    if name == "lerp":  # exact at both ends; |weight| < 0.5 picks the formula
        s, e, w = a[0], a[1], a[2]
        near = spell("fma", w, f"{e} - {s}", s)
        far = spell("fma", f"{s} - {e}", f"{one} - {w}", e)
        weight = constant(op.args[2])
        if weight is not None:
            return near if abs(weight) < 0.5 else far
        return spell("select", spell("abs_below_half", w), near, far)
    if name == "sqrt":
        return spell("sqrt", a[0])
    if name == "rsqrt":
        return spell("div", one, spell("sqrt", a[0]))
    if name == "reciprocal":
        return spell("div", one, a[0])
    if name == "neg":
        return f"(-{a[0]})"
    if name == "abs":
        return spell("abs", a[0])
    if name == "sign":  # torch.sign(nan) is 0, like sign(0)
        x, zero = a[0], spell("literal", 0)  # (an int: Triton compares with 0)
        below = spell("select", f"{x} < {zero}", f"-{one}", spell("zeros_like", x))
        return spell("select", f"{x} > {zero}", one, below)
    if name in ("exp", "log"):
        return spell("float64", name, a[0])
    if name == "pow":
        base = spell("broadcast", a[0], a[1])
        exponent = spell("broadcast", a[1], a[0])
        return spell("float64", name, base, exponent)
    if name in ("maximum", "minimum"):
        return spell(name, a[0], spell("broadcast", a[1], a[0]))
    if name == "clamp":  # either bound may be None
        low = kw.get("min", a[1] if len(a) > 1 else _OMITTED)
        high = kw.get("max", a[2] if len(a) > 2 else _OMITTED)
        out = a[0]
        if low != _OMITTED:
            out = spell("maximum", out, spell("broadcast", low, a[0]))
        if high != _OMITTED:
            out = spell("minimum", out, spell("broadcast", high, a[0]))
        return out
    if name == "where":
        x, y = spell("broadcast", a[1], a[2]), spell("broadcast", a[2], a[1])
        return spell("select", a[0], x, y)
    if name in COMPARE:  # ATen casts every operand, a Python number too, to the common dtype
        x, y = (spell("compare_operand", v, common) for v in a[:2])
        return f"({x} {_COMPARE[name]} {y})"
    if name in ("identity", "item"):
        return spell("value", a[0])
    if name == "full":  # a 0-dim tensor holding the value
        return spell("full", a[0])
    if name == "copy":
        return spell("value", spell("broadcast", a[1], a[0]))
    if name == "zero":
        return spell("zeros_like", a[0])
    if name == "ones":
        return spell("ones_like", a[0])
    raise KernelError(f"op {name}.{op.overload}")


_COMPARE = {"gt": ">", "lt": "<", "ge": ">=", "le": "<=", "eq": "==", "ne": "!="}
