"""One Triton launch for every lane of a LaneProgram, through device-side tables.

Each program instance handles BLOCK elements of one lane: it reads its lane and offset from
a block table built once from the shapes, loads the lane's tensor addresses from an int64
address table (the only part that changes when tensors move), computes the lane program in
float32 (as ATen's opmath does) and stores the written values in each tensor's dtype.
Per-lane 0-dim results (step counts) are written by the lane's first block to a small
buffer and copied into their tensors by one more launch: written in place, a later block of
the lane could read the new count instead of the old. Python scalars (lr, betas, and the
arithmetic on them) are evaluated on the host per call and read from a small device buffer.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from optkernels._triton_compat import Kernel
from optkernels.host import HOST_ROWS, scalar_slot
from optkernels.lanes import LaneOp, LaneProgram

BLOCK = 1024
_TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.bool: "tl.int8",  # one byte each, read as ``!= 0`` (a mask a prelude computed)
}


class KernelError(Exception):
    """The lane program uses something the generator cannot emit."""


def _round(expr: str, dtype: torch.dtype) -> str:
    """``expr`` (float32) rounded to ``dtype`` and back. Triton's interpreter truncates when
    it converts float32 to bfloat16; the GPU rounds to nearest even, and so does _bf16."""
    if dtype is torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return f"_bf16({expr})"
    return f"({expr}).to({_TL_DTYPES[dtype]}).to(tl.float32)"


def _store_cast(expr: str, dtype: torch.dtype) -> str:
    if dtype is torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return f"_bf16({expr}).to(tl.bfloat16)"  # already representable: exact
    return f"{expr}.to({_TL_DTYPES[dtype]})"


def kernel_source(
    program: LaneProgram,
    dtypes: Sequence[torch.dtype],
    name: str,
    host: dict[int, int | None] | None = None,
    dynamic: Sequence[bool] | None = None,
) -> str:
    """Triton source of the kernel for ``program`` whose inputs have ``dtypes``. ``host``
    maps vars computed on the host to their column in the ``host_vals`` buffer, or to None
    where the kernel does not read them (host.host_reads). Input
    ``k``'s addresses come from the static table ``ptrs`` (addresses the guards fix: params,
    state) or, where ``dynamic[k]``, from ``dptrs`` (grads: new tensors every step)."""
    host = host or {}
    dynamic = list(dynamic) if dynamic is not None else [False] * len(program.inputs)
    columns = table_columns(dynamic)
    small_writes = [(v, k) for v, k in program.writes if program.input_small[k]]
    lines = [
        "@triton.jit",
        f"def {name}(ptrs, dptrs, numels, blk_lane, blk_start, scalars, small_out, host_vals,"
        " BLOCK: tl.constexpr):",
        "    pid = tl.program_id(0)",
        "    lane = tl.load(blk_lane + pid).to(tl.int64)",
        "    start = tl.load(blk_start + pid)",
        "    numel = tl.load(numels + lane)",
        "    offs = start + tl.arange(0, BLOCK)",
        "    mask = offs < numel",
        "    first = start == 0",
    ]
    if any(column is not None for column in host.values()):
        # host_vals: [row stride, 3 unused, one row of values per lane]; a stride of 0
        # when every lane has the same values (one row is written: see host.host_reads).
        lines.append("    row = lane * tl.load(host_vals).to(tl.int64)")
    for k, dtype in enumerate(dtypes):
        if dtype not in _TL_DTYPES:
            raise KernelError(f"dtype {dtype} of a lane input")
        tl_type = _TL_DTYPES[dtype]
        lines.append(f"    p{k} = tl.load({columns[k]}).to(tl.pointer_type({tl_type}))")
    # Eager materializes each foreach result in its tensors' dtype: rounding every value to
    # that dtype after each op (and computing in float32 between) gives eager's numbers.
    # Operands are first cast to the op's result dtype (a 0-dim float32 count used with
    # bfloat16 tensors is rounded to bfloat16, as TensorIterator does), Python scalars are not.
    var_dtype: dict[int, torch.dtype] = {}
    small = {op.out: op.small for op in program.ops}
    for op in program.ops:
        if op.out in host:
            column = host[op.out]
            if column is not None:
                # (a comparison the host made, RAdam's rect > 5, comes as 0.0/1.0: a where
                # takes it back as a bool)
                truth = op.op in _COMPARE
                var_dtype[op.out] = torch.bool if truth else torch.float32
                load = f"tl.load(host_vals + {HOST_ROWS} + row + {column})"
                lines.append(f"    v{op.out} = {load}{' != 0' if truth else ''}")
            continue
        if op.op == "input":
            dtype = dtypes[op.args[0]]
            expr = _load(op, dtype)
        else:
            lanes = op.lane_vars
            values = [v for v in lanes if var_dtype[v] is not torch.bool]
            if op.op == "where":
                values = [v for v in lanes[1:] if var_dtype[v] is not torch.bool]
            big = [var_dtype[v] for v in values if not small[v]]
            dtype = _promote(big or [var_dtype[v] for v in values] or [torch.float32])
            rounded = {  # (a where's condition stays a bool)
                v: _round(f"v{v}", dtype)
                for v in lanes
                if var_dtype[v] not in (dtype, torch.bool)
                and dtype not in (torch.float32, torch.float64)
            }
            expr = _expr(op, program, rounded)
            if op.op in _COMPARE:
                dtype = torch.bool
            elif dtype not in (torch.float32, torch.float64):
                expr = _round(expr, dtype)
        var_dtype[op.out] = dtype
        lines.append(f"    v{op.out} = {expr}")
    for var, k in program.writes:
        if program.input_small[k] and host:
            continue  # written on the host
        if program.input_small[k]:
            j = small_writes.index((var, k))
            lines.append(
                f"    tl.store(small_out + lane * {len(small_writes)} + {j}, v{var}, mask=first)"
            )
        else:
            stored = _store_cast(f"v{var}", dtypes[k])
            lines.append(f"    tl.store(p{k} + offs, {stored}, mask=mask)")
    if small_writes and not host:
        copies = _small_kernel(dtypes, name, small_writes, table_columns(dynamic, "lanes"))
        lines += ["", "", *copies]
    return "\n".join(lines) + "\n"


def table_columns(dynamic: Sequence[bool], lane: str = "lane") -> list[str]:
    """Per input, the address-table expression of its lane's pointer: static inputs in
    ``ptrs`` and dynamic ones in ``dptrs``, each a [lanes, columns] row-major table."""
    dynamic = list(dynamic)
    n_static = max(dynamic.count(False), 1)
    n_dynamic = max(dynamic.count(True), 1)
    out, counts = [], {False: 0, True: 0}
    for d in dynamic:
        table, width = ("dptrs", n_dynamic) if d else ("ptrs", n_static)
        out.append(f"{table} + {lane} * {width} + {counts[d]}")
        counts[d] += 1
    return out


def _small_kernel(
    dtypes: Sequence[torch.dtype],
    name: str,
    small_writes: list[tuple[int, int]],
    columns: list[str],
) -> list[str]:
    """``{name}_small``: copies each lane's 0-dim results from the small buffer into their
    tensors, addresses from the same tables: one launch for all lanes, no Python per lane."""
    lines = [
        "@triton.jit",
        f"def {name}_small(ptrs, dptrs, small_out, n_lanes, BLOCK: tl.constexpr):",
        "    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)",
        "    m = lanes < n_lanes",
    ]
    for j, (_, k) in enumerate(small_writes):
        tl_type = _TL_DTYPES[dtypes[k]]
        lines += [
            f"    a{j} = tl.load({columns[k]}, mask=m, other=0)",
            f"    x{j} = tl.load(small_out + lanes * {len(small_writes)} + {j}, mask=m, other=0)",
            f"    tl.store(a{j}.to(tl.pointer_type({tl_type})), x{j}.to({tl_type}), mask=m)",
        ]
    return lines


def _promote(dtypes: list[torch.dtype]) -> torch.dtype:
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


_OMITTED = "<omitted>"  # what _ref gives for a None argument (no valid Triton expression)


def _ref(arg: Any, program: LaneProgram, rounded: dict[int, str]) -> str:
    kind = arg[0]
    if kind == "lane":
        return rounded.get(arg[1], f"v{arg[1]}")
    if kind == "scalar":
        return f"tl.load(scalars + {scalar_slot(arg[1], program)})"
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


def _load(op: LaneOp, dtype: torch.dtype) -> str:
    """Lane input ``k``'s value: in float32 (the ops compute in it), or a bool (one byte
    each, a mask a prelude computed)."""
    (k,) = op.args
    load = f"tl.load(p{k})" if op.small else f"tl.load(p{k} + offs, mask=mask, other=0)"
    return f"({load} != 0)" if dtype is torch.bool else f"{load}.to(tl.float32)"


def _expr(op: LaneOp, program: LaneProgram, rounded: dict[int, str]) -> str:
    a = [_ref(x, program, rounded) for x in op.args]
    kw = {k: _ref(v, program, rounded) for k, v in op.kwargs}
    name = op.op
    if name != "clamp" and (_OMITTED in a or _OMITTED in kw.values()):
        raise KernelError(f"constant None as an operand of {name}")
    if name in ("add", "sub"):
        other = a[1]
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        if alpha is not None:
            other = f"({other} * {alpha})"
        return f"({a[0]} {'+' if name == 'add' else '-'} {other})"
    if name == "mul":
        return f"({a[0]} * {a[1]})"
    if name == "div":
        return f"tl.div_rn({a[0]}, {_full(a[1], a[0])})"
    if name in ("addcmul", "addcdiv"):
        value = kw.get("value", a[3] if len(a) > 3 else "1.0")
        if name == "addcmul":  # ATen: self + value * t1 * t2, left to right
            return f"({a[0]} + {value} * {a[1]} * {a[2]})"
        return f"({a[0]} + {value} * tl.div_rn({a[1]}, {a[2]}))"
    if name == "lerp":
        s, e, w = a[0], a[1], a[2]
        return f"tl.where({w} < 0.5, {s} + {w} * ({e} - {s}), {e} - ({e} - {s}) * (1.0 - {w}))"
    if name == "sqrt":
        return f"tl.sqrt_rn({a[0]})"
    if name == "rsqrt":
        return f"tl.div_rn(1.0, tl.sqrt_rn({a[0]}))"
    if name == "reciprocal":
        return f"tl.div_rn({_full('1.0', a[0])}, {a[0]})"
    if name == "neg":
        return f"(-{a[0]})"
    if name == "abs":
        return f"tl.abs({a[0]})"
    if name == "sign":
        x = a[0]  # torch.sign(nan) is 0, like sign(0)
        return f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, tl.zeros_like({x})))"
    if name in ("exp", "log"):
        return f"tl.{name}({a[0]}.to(tl.float64)).to(tl.float32)"
    if name == "pow":
        return f"_pow({_full(a[0], a[1])}, {_full(a[1], a[0])})"
    if name in ("maximum", "minimum"):
        fn = "tl.maximum" if name == "maximum" else "tl.minimum"
        return f"{fn}({a[0]}, {_full(a[1], a[0])}, propagate_nan=tl.PropagateNan.ALL)"
    if name == "rsub":
        alpha = kw.get("alpha", a[2] if len(a) > 2 else None)
        scaled = f"({a[0]} * {alpha})" if alpha is not None else a[0]
        return f"({a[1]} - {scaled})"
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
    if name in _COMPARE:
        return f"({a[0]} {_COMPARE[name]} {a[1]})"
    if name == "identity":
        return a[0]
    if name == "full":
        return f"({a[0]} + 0.0)"
    if name == "copy":
        return _full(a[1], a[0])
    if name == "zero":
        return f"tl.zeros_like({a[0]})"
    if name == "ones":
        return f"(tl.zeros_like({a[0]}) + 1.0)"
    raise KernelError(f"op {name}.{op.overload}")


_COMPARE = {"gt": ">", "lt": "<", "ge": ">=", "le": "<=", "eq": "==", "ne": "!="}


def _full(value: str, like: str) -> str:
    """``value`` broadcast to ``like``'s shape (never through arithmetic on ``like``, which
    would carry its NaNs and infinities into the result)."""
    if _is_literal(like):
        return value
    return f"(tl.zeros_like({like}) + {value})"


def _is_literal(expr: str) -> bool:
    try:
        float(expr)
    except ValueError:
        return False
    return True


# pow in float64 then rounded: as accurate as powf, and it runs under TRITON_INTERPRET.
_PRELUDE = """import triton
import triton.language as tl


@triton.jit
def _pow(b, e):
    b64 = b.to(tl.float64)
    e64 = e.to(tl.float64)
    mag = tl.exp(e64 * tl.log(tl.abs(b64)))
    is_int = e64 == tl.floor(e64)
    odd = is_int & (tl.abs(e64 - 2.0 * tl.floor(e64 * 0.5)) == 1.0)
    signed = tl.where(odd, -mag, mag)
    neg = tl.where(is_int, signed, float("nan"))
    out = tl.where(b64 < 0, neg, mag)
    zero = tl.where(e64 > 0, 0.0, tl.where(e64 == 0, 1.0, float("inf")))
    out = tl.where(b64 == 0, zero, out)
    out = tl.where(e64 == 0, 1.0, out)
    return out.to(tl.float32)


@triton.jit
def _bf16(x):
    # float32 -> nearest bfloat16 (ties to even), as a float32; NaN stays NaN.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = bits & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


"""


def source_dir() -> str:
    """Where generated kernel sources live: $OPTKERNELS_CACHE_DIR, else a per-user folder
    in the temp dir."""
    configured = os.environ.get("OPTKERNELS_CACHE_DIR")
    if configured:
        return configured
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return os.path.join(tempfile.gettempdir(), f"optkernels-src-{user}")


def load_kernel(source: str, name: str) -> Kernel:
    """Import the generated source as a module (Triton jit needs real source files) and
    return the kernel.

    The on-disk kernel cache: a module's file is named by a hash of its text, which the graph
    structure and dtypes determine, so a second process compiling the same optimizer
    imports the same file, and the compiled binary Triton stored for it (keyed by that
    source, the Triton version, the target and the compile options) is loaded without
    running the compiler or Triton's per-process self-hash (``_triton_compat.Kernel``)."""
    text = _PRELUDE + source
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    directory = source_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"k_{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    module_name = f"optkernels_generated_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return Kernel(getattr(module, name), os.path.join(directory, f"k_{digest}.{name}.json"))
