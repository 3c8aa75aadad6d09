"""What the host computes for each call of a lane program's kernels.

Python scalars (lr, betas, and the arithmetic on them) are evaluated per call into the scalar
buffer (``scalar_function``). With 0-dim inputs on the CPU (the step counts of capturable=False
optimizers), what depends only on them and on scalars (``host_vars``: bias corrections, step
sizes) is computed there too, for every lane at once (``host_function``), and the values the
kernel reads (``host_reads``) go to its ``host_vals`` buffer. Both run as straight-line Python
generated once per program.
"""

from __future__ import annotations

import hashlib
import linecache
import math
import struct
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import fx

from optkernels.dtypes import OpDtypes, compute_dtype, op_dtypes_by_lane
from optkernels.lanes import LaneProgram, NotLanes
from optkernels.numbers import ASSERT, HOST_ONLY, PICK, PYTHON_FUNCTIONS


def host_vars(program: LaneProgram) -> list[int]:
    """Vars computed from 0-dim inputs and scalars only (step counts and what is derived
    from them), in program order: when those inputs live on the CPU they are computed there,
    for all lanes at once, and the kernel reads the ones it needs from a small buffer."""
    small: set[int] = set()
    for op in program.ops:
        if op.op == "input":
            if program.input_small[op.args[0]]:
                small.add(op.out)
            continue
        if all(v in small for v in op.lane_vars):
            small.add(op.out)
    return [op.out for op in program.ops if op.out in small]


# Where the rows of ``host_vals`` start (after the row stride, 16 bytes in).
HOST_ROWS = 4


def host_reads(program: LaneProgram, host: Sequence[int]) -> list[int]:
    """The vars of ``host`` (host_vars) the kernel reads: operands of the ops it computes
    and values it stores into full-size inputs. Only these are sent to the device, in
    ``host_vals``: a row stride (as a float: 0 when every lane has the same values, else
    the row's length), 3 unused values, then one row per lane (or one for all)."""
    on_host = set(host)
    read = {v for op in program.ops if op.out not in on_host for v in op.lane_vars}
    read.update(v for v, k in program.writes if not program.input_small[k])
    return [v for v in host if v in read]


def scalar_slot(index: int, program: LaneProgram) -> int:
    """Position in the scalar buffer: inputs first, then host-computed scalar nodes."""
    return index if index >= 0 else len(program.scalar_inputs) + (-1 - index)


ScalarFunction = Callable[[Sequence[Any]], list[float]]


def scalar_function(program: LaneProgram, index: dict[Any, int]) -> ScalarFunction:
    """``f(inputs)``: the values of the scalar inputs (at ``index[node]`` in the plan's
    inputs) and of the host-side scalar arithmetic, in the scalar buffer's order (see
    ``scalar_slot``), for one call: straight-line Python generated once."""
    constants: list[Any] = []
    names: dict[fx.Node, str] = {}
    lines = ["def scalars(inputs):"]
    for node in program.scalar_inputs:
        names[node] = f"s{len(names)}"
        lines.append(f"    {names[node]} = inputs[{index[node]}]")
    for node in program.scalar_nodes:
        args = []
        for a in node.args:
            if isinstance(a, fx.Node):
                args.append(names[a])
            else:
                constants.append(a)
                args.append(f"c[{len(constants) - 1}]")
        constants.append(node.target)
        names[node] = f"s{len(names)}"
        lines.append(f"    {names[node]} = c[{len(constants) - 1}]({', '.join(args)})")
    lines.append("    return [" + "".join(f"float({name}), " for name in names.values()) + "]")
    scope: dict[str, Any] = {"c": constants}
    exec(_compiled("\n".join(lines), "optkernels:scalar_function"), scope)
    fn: ScalarFunction = scope["scalars"]
    return fn


HostFunction = Callable[[dict[int, Any], Sequence[float], int], dict[int, Any]]


def python_floats(program: LaneProgram) -> bool:
    """Whether ``program`` reads 0-dim inputs that eager reads as Python floats (the step
    counts of a capturable=False optimizer traced on its capturable path, marked by the
    tracer: placeholder meta ``python_float``): the host then computes what depends on them
    in double, as eager's Python floats, not in the dtypes the graph records. On a device,
    such a step's 0-dim inputs are the ones on the CPU (the step counts, a Tensor lr the
    user made there); with the kernels on the CPU too (under the interpreter) only the mark
    tells them from the 0-dim tensors of a step that computes with them in their dtype (a
    custom step's)."""
    return any(
        node.meta.get("python_float") is True
        for k, nodes in enumerate(program.inputs)
        if program.input_small[k]
        for node in nodes
    )


def needs_host(program: LaneProgram) -> bool:
    """Whether ``program`` has values only the host computes (numbers.py): Python arithmetic
    on values read with ``.item()`` from 0-dim inputs (eager's own capturable=False path: its
    bias corrections and step sizes), numbers that differ between lanes (PICK: Muon's lr per
    shape), or tensor arithmetic with ``.item()`` values on other 0-dim inputs (a Tensor
    beta: ``1 - beta1 ** step`` is a float32 op on the CPU in eager), which the host computes
    as ATen does there (host_dtypes)."""
    return any(op.op == PICK for op in program.ops) or _reads_items(program)


def _reads_items(program: LaneProgram) -> bool:
    """Whether ``program`` computes with values read with ``.item()``: Python arithmetic on
    them, or tensor arithmetic with them on other 0-dim inputs (not a PICK alone)."""
    if any(op.op in HOST_ONLY and op.op != PICK for op in program.ops):
        return True
    ops = {op.out: op for op in program.ops}
    return any(ops[v].op == "item" for v in host_vars(program))


def host_dtypes(program: LaneProgram, order: Sequence[int]) -> dict[int, OpDtypes] | None:
    """The dtypes the host rounds the tensor ops among ``order`` to, as ATen computes them
    on eager's 0-dim CPU tensors (``step += 1``, NAdam's ``mu_product *= mu``: float32), in
    a program that computes eager's Python floats itself (arithmetic on ``.item()``: eager's own
    capturable=False path); None elsewhere, where its tensor ops stand for those Python
    floats (the capturable path traced for a capturable=False step: all in double).
    Raises NotLanes if the lanes' 0-dim values differ in dtype."""
    if not _reads_items(program) or python_floats(program):
        return None
    lanes = list({id(d): d for d in op_dtypes_by_lane(program)}.values())  # (equal lanes share)
    out = {}
    for var in order:
        found = {lane[var] for lane in lanes}
        if len(found) > 1:
            raise NotLanes(
                "the lanes' 0-dim values the host computes differ in dtype "
                f"({', '.join(sorted(str(d.result) for d in found))})"
            )
        out[var] = found.pop()
        if any(d is not None and d.is_complex for d in (out[var].result, out[var].common)):
            raise NotLanes("a 0-dim complex value the host would compute (it computes reals)")
    return out


def _compiled(code: str, kind: str) -> types.CodeType:
    """``code`` compiled under a file name of its own, its text put in ``linecache`` so a
    traceback through it shows the generated line."""
    filename = f"<{kind}:{hashlib.sha256(code.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    return compile(code, filename, "exec")


def picks_differ(program: LaneProgram, lanes: Sequence[int]) -> bool:
    """Whether ``lanes`` read different numbers at one of ``program``'s PICK ops (Muon's lr
    scaled per shape): then no one row of host values serves them all."""
    return any(
        len({op.args[0][1][lane] for lane in lanes}) > 1 for op in program.ops if op.op == PICK
    )


def host_function(
    program: LaneProgram,
    order: Sequence[int],
    uniform: bool = False,
    dtypes: dict[int, OpDtypes] | None = None,
    lanes: Sequence[int] | None = None,
) -> HostFunction:
    """``f(small_inputs, scalars, lanes)``: the host vars ``order`` for every lane at once,
    as straight-line Python generated once (an interpreter loop cost ~0.7 µs an op).
    ``small_inputs`` maps input index to its lanes' values: numpy arrays (views of the CPU
    buffer they alias), or with ``uniform`` one Python number standing for every lane (all
    lanes hold the same step count: the usual case).

    numpy, not torch: an op on 200 values costs ~1 µs instead of ~5 µs, and ~15 of them run
    per call for Adam's bias corrections. Both forms compute in float64, as eager's
    capturable=False path computes these values with Python floats (float32 lost ~1e-5 of
    ``1 - 0.999 ** step`` to cancellation, and a float64 parameter's step would have used
    it): the arrays are read as float64 (the caller casts the written 0-dim values back to
    their dtype), so both forms give the same numbers. Run it under
    ``np.errstate(all="ignore")`` so overflow and division by zero give inf/nan as in torch,
    without warnings. Uniform lanes take Python floats (~50 ns an op, and no float32
    denormals, which made ``0.9 ** step`` cost ~7 µs per call on 200 lanes once it
    underflows). There a Python error (division by zero, overflow, sqrt of a negative)
    raises ArithmeticError or ValueError: the caller then takes the array path, which gives
    torch's inf/nan.

    Python arithmetic on ``.item()`` values (numbers.py: eager's bias corrections) is
    Python's own, lane by lane: the same operators on the same floats, so the same bits
    (numpy's vectorized power differs from Python's in the last bit) and the same errors
    (a ZeroDivisionError, an OverflowError: raised from the array path too). ``dtypes``
    (host_dtypes): round each tensor op's operands and result as ATen does on 0-dim CPU
    tensors of those dtypes. ``lanes``: the program's lanes the function computes, in order
    (default: all), which a PICK gathers its numbers for (uniform: lane ``lanes[0]``'s; see
    picks_differ)."""
    chosen = list(range(program.lanes)) if lanes is None else list(lanes)
    ops = {op.out: op for op in program.ops}
    stand_in = dtypes is None and python_floats(program)  # (tensor ops for Python floats)
    table = _HOST_SCALAR if uniform else _HOST
    constants: list[Any] = []
    rounds = _ROUND_SCALAR if uniform else _ROUND

    def const(value: Any) -> str:
        constants.append(value)
        return f"c[{len(constants) - 1}]"

    def rounded(expr: str, dtype: torch.dtype | None) -> str:
        if dtype is None or dtype is torch.float64 or dtype is torch.bool:
            return expr
        if dtype is not torch.float32:  # (through the compute dtype, as ATen rounds)
            expr = f"{const(rounds[torch.float32])}({expr})"
        return f"{const(rounds[dtype])}({expr})"

    def ref(a: Any, op_dtypes: OpDtypes | None = None) -> str:
        if op_dtypes is None:
            if a[0] == "lane":
                return f"v{a[1]}"
            if a[0] == "scalar":
                return f"scalars[{scalar_slot(a[1], program)}]"
            return const(a[1])
        assert dtypes is not None
        common, compute = op_dtypes.common, compute_dtype(op_dtypes.common)
        if a[0] == "lane":  # a tensor is cast to the common dtype, a number read in opmath
            operand = dtypes[a[1]].result if a[1] in dtypes else None
            if operand is torch.bool:
                return f"v{a[1]}"
            target = compute if operand is None else common
            return f"v{a[1]}" if operand is target else rounded(f"v{a[1]}", target)
        if a[0] == "scalar":
            return rounded(ref(a), compute)
        if isinstance(a[1], float) and compute is not torch.float64:
            return const(_ROUND_SCALAR[torch.float32](a[1]))
        return const(a[1])

    lines = ["def host(small, scalars, lanes):"]
    for var in order:
        op = ops[var]
        exact = dtypes[var] if dtypes is not None and op.op not in _EXEMPT else None
        if op.op == "input":
            value = f"small[{op.args[0]}]"
            if not uniform:
                value = f"np.asarray({value}, dtype=np.float64)"
        elif op.op == "full":  # a 0-dim tensor of a number (``scalar_tensor(0.0)``)
            # (the number may differ by lane: Rprop's etas picked from each lane's group)
            if uniform:
                number = f"float({ref(op.args[0])})"
            else:
                number = f"np.broadcast_to(np.asarray({ref(op.args[0])}, np.float64), (lanes,))"
            value = number if exact is None else rounded(number, exact.result)
        elif op.op in PYTHON_FUNCTIONS:  # Python's arithmetic, lane by lane
            python = const(PYTHON_FUNCTIONS[op.op])
            operands = ", ".join(ref(x) for x in op.args)
            value = (
                f"_py({python}, {operands})"
                if uniform
                else f"_py_lanes({python}, lanes, {operands})"
            )
        elif op.op == PICK:  # the number each lane reads, as the scalars hold it
            refs = [op.args[0][1][lane] for lane in chosen[: 1 if uniform else None]]
            numbers = ", ".join(f"float({ref(r)})" for r in refs)
            value = numbers if uniform else f"np.array([{numbers}], dtype=np.float64)"
        elif op.op == ASSERT:
            check = "_check" if uniform else "_check_lanes"
            value = f"{check}({ref(op.args[0])}, {const(op.args[1][1])})"
        elif op.op == "copy" and stand_in and _recorded(ops, op.args[1]) is not None:
            # What the capturable path copies into a 0-dim state, rounded to the dtype it
            # records (its step counts'), as eager's capturable=False path rounds its Python
            # float there (ASGD's ``eta.copy_(torch.as_tensor(lr / ...))``: the default
            # dtype; a float64 param's eta after load_state_dict keeps that rounding)
            value = rounded(ref(op.args[1]), _recorded(ops, op.args[1]))
        elif exact is not None and op.op == "pow" and _number(op.args[1], dtypes):
            base, exponent = ref(op.args[0], exact), ref(op.args[1])
            compute = const(compute_dtype(exact.common))
            value = rounded(f"{const(_aten_pow)}({base}, {exponent}, {compute})", exact.result)
        elif exact is not None and op.op in _ATEN_UNARY:
            aten, compute = const(_ATEN_UNARY[op.op]), const(compute_dtype(exact.common))
            value = rounded(f"_aten({aten}, {ref(op.args[0], exact)}, {compute})", exact.result)
        elif exact is not None:
            kwargs = [(k, v) for k, v in op.kwargs if v[0] != "ignore"]
            args = "".join(f"{ref(x, exact)}, " for x in op.args)
            kw = ", ".join(f"{k!r}: {ref(v, exact)}" for k, v in kwargs)
            value = rounded(f"{const(table[op.op])}(({args}), {{{kw}}})", exact.result)
        else:
            kwargs = [(k, v) for k, v in op.kwargs if v[0] != "ignore"]
            inline = _INLINE.get(op.op) if uniform and not kwargs else None
            if inline is not None and inline[1] == len(op.args):
                value = inline[0].format(*map(ref, op.args))  # a Python expression
            else:
                args = "".join(f"{ref(x)}, " for x in op.args)
                kw = ", ".join(f"{k!r}: {ref(v)}" for k, v in kwargs)
                value = f"{const(table[op.op])}(({args}), {{{kw}}})"
        lines.append(f"    v{var} = {value}")
    lines.append("    return {" + ", ".join(f"{v}: v{v}" for v in order) + "}")
    scope: dict[str, Any] = {
        "c": constants,
        "np": np,
        "sqrt": math.sqrt,
        "_py": _py,
        "_py_lanes": _py_lanes,
        "_check": _check,
        "_check_lanes": _check_lanes,
        "pow_": _scalar_pow,
        "_aten": _aten,
    }
    exec(_compiled("\n".join(lines), "optkernels:host_function"), scope)
    fn: HostFunction = scope["host"]
    return fn


def _recorded(ops: dict[int, Any], arg: Any) -> torch.dtype | None:
    """The one dtype the graph records for lane value ``arg`` in every lane, or None."""
    if arg[0] != "lane":
        return None
    found = set(ops[arg[1]].dtypes)
    return found.pop() if len(found) == 1 else None


def _number(arg: Any, dtypes: dict[int, OpDtypes] | None) -> bool:
    """Whether the lane program operand ``arg`` is a Python number where eager runs the op
    (a constant, a scalar, an ``.item()`` value or Python arithmetic on one)."""
    if arg[0] != "lane":
        return True
    return dtypes is not None and arg[1] in dtypes and dtypes[arg[1]].result is None


def _aten(fn: Callable[..., Any], x: Any, dtype: torch.dtype) -> Any:
    """``fn`` (a torch function) of ``x`` (a number, or an array of lanes) as ATen computes
    it on a CPU tensor of ``dtype``: its sqrt, exp and log differ from Python's ``math`` in
    the last bit for ~1% of values (the same kernel for one value and for many)."""
    if np.ndim(x) == 0:
        return fn(torch.tensor(float(x), dtype=dtype)).item()
    return fn(torch.from_numpy(np.asarray(x, dtype=np.float64)).to(dtype)).double().numpy()


# Ops a host computes by calling ATen (see _aten) where it rounds as eager's tensor ops.
_ATEN_UNARY: dict[str, Callable[..., Any]] = {
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "exp": torch.exp,
    "log": torch.log,
}


def _aten_pow(x: Any, y: Any, dtype: torch.dtype) -> Any:
    """``x ** y`` for a 0-dim CPU tensor ``x`` of compute dtype ``dtype`` (float32 or
    float64) and a Python number ``y``, as ATen's pow_tensor_scalar computes it: its sqrt,
    rsqrt and reciprocal kernels for 0.5, -0.5 and -1, products in ``dtype`` for 2, 3 and
    -2, else the double ``pow`` rounded to ``dtype``. (``1 - beta2 ** 3`` loses most of
    its float32 digits to cancellation: an ulp of ``beta2 ** 3`` is 2e-5 of the bias
    correction.) Lane by lane for arrays; inf/nan where Python raises, as in torch."""
    if np.ndim(x) or np.ndim(y):
        xs, ys = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(y, np.float64))
        out = np.array(_pow_lanes(xs, ys), dtype=np.float64)
        flat = out.reshape(-1)
        for i, (a, b) in enumerate(zip(xs.flat, ys.flat, strict=True)):
            try:
                flat[i] = _aten_pow(float(a), float(b), dtype)
            except (ArithmeticError, ValueError):
                flat[i] = _ROUND[dtype](flat[i]) if dtype in _ROUND else flat[i]
        return out
    r = _ROUND_SCALAR.get(dtype, float)
    if y in (0.5, -0.5):
        return _aten(torch.sqrt if y == 0.5 else torch.rsqrt, x, dtype)
    if y == -1.0:
        return r(1.0 / x)
    if y in (2.0, 3.0, -2.0):
        square = r(x * x)
        return r(square * x) if y == 3.0 else square if y == 2.0 else r(1.0 / square)
    return r(_scalar_pow(x, y))


# Ops whose values are not a tensor op's (Python numbers, checks): never rounded.
_EXEMPT = frozenset({"input", "item", "identity", *HOST_ONLY})


def _py(fn: Callable[..., Any], *args: Any) -> Any:
    """Python arithmetic on one lane's numbers; a complex result (a negative base to a
    fractional power) is an error here (the array path then gives nan)."""
    out = fn(*args)
    if isinstance(out, complex):
        raise ValueError("complex result")
    return out


def _py_lanes(fn: Callable[..., Any], lanes: int, *args: Any) -> Any:
    """Python arithmetic lane by lane: Python's errors propagate, as in eager."""
    columns = [a.tolist() if isinstance(a, np.ndarray) else [a] * lanes for a in args]
    out = [fn(*xs) for xs in zip(*columns, strict=True)]
    return np.array([math.nan if isinstance(x, complex) else x for x in out], dtype=np.float64)


def _check(condition: Any, message: str) -> float:
    """``torch._check`` on a Python number: raises as the torch backend does."""
    if not condition:
        raise RuntimeError(message)
    return 0.0


def _check_lanes(condition: Any, message: str) -> Any:
    if not np.all(condition):
        raise RuntimeError(message)
    return np.zeros_like(condition, dtype=np.float64)


def _pack(fmt: str) -> Callable[[float], float]:
    packer = struct.Struct(fmt)

    def rounded(x: float) -> float:  # (OverflowError past the dtype's range)
        value: float = packer.unpack(packer.pack(x))[0]
        return value

    return rounded


def _bfloat16(x: Any) -> Any:
    out = torch.as_tensor(x, dtype=torch.float32).to(torch.bfloat16).double()
    return out.item() if out.dim() == 0 else out.numpy()


# Rounding a double to a dtype (and back): of a Python float (uniform lanes), of an array.
_ROUND_SCALAR: dict[torch.dtype, Callable[[Any], Any]] = {
    torch.float32: _pack("f"),
    torch.float16: _pack("e"),
    torch.bfloat16: _bfloat16,
}
_ROUND: dict[torch.dtype, Callable[[Any], Any]] = {
    torch.float32: lambda x: np.asarray(x, dtype=np.float32).astype(np.float64),
    torch.float16: lambda x: np.asarray(x, dtype=np.float16).astype(np.float64),
    torch.bfloat16: _bfloat16,
}


def _pow_lanes(x: Any, y: Any) -> Any:
    """``x ** y`` lane by lane as Python computes it (numpy's vectorized power differs in
    the last bit for ~1% of bias corrections), inf/nan where Python raises."""
    xs, ys = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
    out = np.power(xs, ys)
    flat = out.reshape(-1)
    for i, (a, b) in enumerate(zip(xs.flat, ys.flat, strict=True)):
        try:
            value = float(a) ** float(b)
        except (ArithmeticError, ValueError):
            continue
        if not isinstance(value, complex):
            flat[i] = value
    return out


def _alpha(a: Sequence[Any], kw: dict[str, Any], position: int = 2) -> Any:
    return kw.get("alpha", a[position] if len(a) > position else 1)


def _scaled(x: Any, alpha: Any) -> Any:
    """``alpha * x``, or ``x`` where alpha is the number 1 (every lane's alpha, an array of
    the numbers of their groups, multiplies)."""
    return x if np.ndim(alpha) == 0 and alpha == 1 else alpha * x


def _like(x: Any, value: Any) -> Any:
    return np.full_like(x, value) if np.ndim(value) == 0 else np.asarray(value).astype(x.dtype)


def _lerp(start: Any, end: Any, weight: Any) -> Any:
    # torch's formula: exact at both ends
    diff = end - start
    return np.where(np.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


def _clamp(a: Sequence[Any], kw: dict[str, Any]) -> Any:
    low = kw.get("min", a[1] if len(a) > 1 else None)
    high = kw.get("max", a[2] if len(a) > 2 else None)
    x = a[0]
    if low is not None:
        x = np.maximum(x, low)
    if high is not None:
        x = np.minimum(x, high)
    return x


_HOST: dict[str, Any] = {
    "add": lambda a, kw: a[0] + _scaled(a[1], _alpha(a, kw)),
    "sub": lambda a, kw: a[0] - _scaled(a[1], _alpha(a, kw)),
    "rsub": lambda a, kw: a[1] - _scaled(a[0], _alpha(a, kw)),
    "mul": lambda a, kw: a[0] * a[1],
    "div": lambda a, kw: np.true_divide(a[0], a[1]),
    "pow": lambda a, kw: _pow_lanes(a[0], a[1]),
    "sqrt": lambda a, kw: np.sqrt(a[0]),
    "rsqrt": lambda a, kw: 1.0 / np.sqrt(a[0]),
    "reciprocal": lambda a, kw: 1.0 / a[0],
    "neg": lambda a, kw: np.negative(a[0]),
    "abs": lambda a, kw: np.abs(a[0]),
    "sign": lambda a, kw: np.sign(a[0]),
    "exp": lambda a, kw: np.exp(a[0]),
    "log": lambda a, kw: np.log(a[0]),
    "maximum": lambda a, kw: np.maximum(a[0], a[1]),
    "minimum": lambda a, kw: np.minimum(a[0], a[1]),
    "identity": lambda a, kw: a[0],
    "item": lambda a, kw: a[0],
    "copy": lambda a, kw: _like(a[0], a[1]),
    "zero": lambda a, kw: np.zeros_like(a[0]),
    "ones": lambda a, kw: np.ones_like(a[0]),
    "gt": lambda a, kw: np.greater(a[0], a[1]),
    "lt": lambda a, kw: np.less(a[0], a[1]),
    "ge": lambda a, kw: np.greater_equal(a[0], a[1]),
    "le": lambda a, kw: np.less_equal(a[0], a[1]),
    "eq": lambda a, kw: np.equal(a[0], a[1]),
    "ne": lambda a, kw: np.not_equal(a[0], a[1]),
    "where": lambda a, kw: np.where(a[0], a[1], a[2]),
    "clamp": _clamp,
    "lerp": lambda a, kw: _lerp(a[0], a[1], a[2]),
    "addcmul": lambda a, kw: a[0] + _scaled(a[1] * a[2], kw.get("value", _alpha(a, {}, 3))),
    "addcdiv": lambda a, kw: (
        a[0] + _scaled(np.true_divide(a[1], a[2]), kw.get("value", _alpha(a, {}, 3)))
    ),
}


def _nan_aware(pick: Any) -> Any:
    # torch.maximum / minimum propagate NaN; Python's max and min do not
    return lambda a, kw: a[0] if a[0] != a[0] else a[1] if a[1] != a[1] else pick(a[0], a[1])


def _scalar_clamp(a: Sequence[Any], kw: dict[str, Any]) -> Any:
    low = kw.get("min", a[1] if len(a) > 1 else None)
    high = kw.get("max", a[2] if len(a) > 2 else None)
    x = a[0]
    if x != x:
        return x
    if low is not None:
        x = max(x, low)
    if high is not None:
        x = min(x, high)
    return x


def _scalar_sign(x: float) -> float:
    """torch.sign of a number (a Python float or a 0-dim numpy value: its bools do not
    subtract): NaN stays NaN."""
    return x if x != x else float(int(x > 0) - int(x < 0))


def _scalar_pow(x: float, y: float) -> float:
    out: Any = float(x) ** y
    if isinstance(out, complex):  # a negative base, a fractional exponent: torch gives nan
        raise ValueError("complex power")
    return float(out)


def _scalar_lerp(start: float, end: float, weight: float) -> float:
    diff = end - start
    return start + weight * diff if abs(weight) < 0.5 else end - diff * (1 - weight)


# Ops on Python numbers written as expressions (uniform lanes, no keyword arguments): the
# same results and errors as _HOST_SCALAR's, without a call per op. (template, operands)
_INLINE: dict[str, tuple[str, int]] = {
    "add": ("({0} + {1})", 2),
    "sub": ("({0} - {1})", 2),
    "rsub": ("({1} - {0})", 2),
    "mul": ("({0} * {1})", 2),
    "div": ("({0} / {1})", 2),
    "neg": ("(-{0})", 1),
    "reciprocal": ("(1.0 / {0})", 1),
    "sqrt": ("sqrt({0})", 1),
    "rsqrt": ("(1.0 / sqrt({0}))", 1),
    "pow": ("pow_({0}, {1})", 2),  # (a function: a complex result must raise)
}


# The same ops on Python numbers (uniform lanes); errors propagate (see host_function).
_HOST_SCALAR: dict[str, Any] = {
    "add": lambda a, kw: a[0] + _alpha(a, kw) * a[1],
    "sub": lambda a, kw: a[0] - _alpha(a, kw) * a[1],
    "rsub": lambda a, kw: a[1] - _alpha(a, kw) * a[0],
    "mul": lambda a, kw: a[0] * a[1],
    "div": lambda a, kw: a[0] / a[1],
    "pow": lambda a, kw: _scalar_pow(a[0], a[1]),
    "sqrt": lambda a, kw: math.sqrt(a[0]),
    "rsqrt": lambda a, kw: 1.0 / math.sqrt(a[0]),
    "reciprocal": lambda a, kw: 1.0 / a[0],
    "neg": lambda a, kw: -a[0],
    "abs": lambda a, kw: abs(a[0]),
    "sign": lambda a, kw: _scalar_sign(a[0]),
    "exp": lambda a, kw: math.exp(a[0]),
    "log": lambda a, kw: math.log(a[0]),
    "maximum": _nan_aware(max),
    "minimum": _nan_aware(min),
    "identity": lambda a, kw: a[0],
    "item": lambda a, kw: a[0],
    "copy": lambda a, kw: a[1],
    "zero": lambda a, kw: 0.0,
    "ones": lambda a, kw: 1.0,
    "gt": lambda a, kw: a[0] > a[1],
    "lt": lambda a, kw: a[0] < a[1],
    "ge": lambda a, kw: a[0] >= a[1],
    "le": lambda a, kw: a[0] <= a[1],
    "eq": lambda a, kw: a[0] == a[1],
    "ne": lambda a, kw: a[0] != a[1],
    "where": lambda a, kw: a[1] if a[0] else a[2],
    "clamp": _scalar_clamp,
    "lerp": lambda a, kw: _scalar_lerp(a[0], a[1], a[2]),
    "addcmul": lambda a, kw: a[0] + kw.get("value", _alpha(a, {}, 3)) * a[1] * a[2],
    "addcdiv": lambda a, kw: a[0] + kw.get("value", _alpha(a, {}, 3)) * a[1] / a[2],
}
