"""One Triton launch for every lane of a LaneProgram, through device-side tables.

Each program instance handles BLOCK elements of one lane: it reads its lane and offset from
a block table built once from the shapes, loads the lane's tensor addresses from an int64
address table (the only part that changes when tensors move), computes the lane program as
ATen computes each op (see ``kernel_source``) and stores the written values in each tensor's
dtype. Per-lane 0-dim results (step counts) are written by the lane's first block to a small
float64 buffer and copied into their tensors by one more launch: written in place, a later
block of the lane could read the new count instead of the old. Python scalars (lr, betas,
and the arithmetic on them) are evaluated on the host per call and read from a small float64
device buffer.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import torch

from optkernels._triton_compat import Kernel
from optkernels.compressed import BLOCK as INT8_BLOCK
from optkernels.dtypes import COMPARE, OpDtypes, compute_dtype, op_dtypes
from optkernels.host import HOST_ROWS, scalar_slot
from optkernels.lanes import LaneOp, LaneProgram
from optkernels.numbers import HOST_ONLY

BLOCK = 1024  # elements per program instance
NUM_WARPS = 4  # warps per program instance (Triton's default): 8 elements per thread, 16
# bytes per access of a 16-bit lane in the aligned branch (see _branches). Measured on an H100
# (benchmarks/results/kernel_tuning_h100.md): with that branch, 1024 by 4 is the fastest for
# bfloat16 and float32 lanes alike (512 by 4 was, for 16-bit lanes, before it).
# Lanes of int8 state: one int8 block (256 elements) by one warp, so the block's absmax is
# reduced by shuffles within the warp and its scale is one number. At 1024 by 4 warps a
# block spans two or four warps (reduced through shared memory with barriers), every
# element loads its block's scale, and the kernel needs 154 registers against 126 here
# (sm_90; docs/state_dtype.md has the instruction counts).
INT8_BLOCK_WARPS = INT8_BLOCK, 1
# Registers per thread (Triton's ``maxnreg``) of kernels over 16- and 8-bit lanes. Loading
# every input first keeps them all live: 118-128 registers (sm_90), 16 warps per SM. Held to
# 64, ptxas spills 56-224 bytes a thread to L1 and twice the warps hide the loads' latency.
# Measured on an H100 (benchmarks/results/kernel_tuning_h100.md): int8 state 1.15 -> 1.07x
# its floor, bf16 state 1.07 -> 1.02x, 1.3B bf16 AdamW 1.065 -> 1.028x, GPT-2 bf16/fp16 AdamW
# 1.09 -> 1.06x; float32 lanes gained nothing (1.01x either way) and stay unlimited. 80 was
# no better than none for int8. Register allocation only: the same instructions, the same bits.
NARROW_MAXNREG = 64
# Experiments (benchmarks/tune_kernels.py) override these, for every lane, at import
# (OPTKERNELS_MAXNREG=0: no limit).
_OVERRIDE = os.environ.get("OPTKERNELS_BLOCK"), os.environ.get("OPTKERNELS_NUM_WARPS")
_MAXNREG_OVERRIDE = os.environ.get("OPTKERNELS_MAXNREG")


def launch_config(dtypes: Sequence[torch.dtype]) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for a kernel over lanes of tensors of ``dtypes``: the launch
    shape only (each element computes the same, whichever is chosen)."""
    block, warps = INT8_BLOCK_WARPS if torch.uint8 in dtypes else (BLOCK, NUM_WARPS)
    block_override, warps_override = _OVERRIDE
    return (
        int(block_override) if block_override else block,
        int(warps_override) if warps_override else warps,
    )


def register_limit(dtypes: Sequence[torch.dtype]) -> int | None:
    """Triton's ``maxnreg`` for a kernel over lanes of tensors of ``dtypes`` (None: no
    limit): register allocation only, each element computes the same."""
    if _MAXNREG_OVERRIDE is not None:
        return int(_MAXNREG_OVERRIDE) or None
    narrow = any((d.is_floating_point and d.itemsize < 4) or d is torch.uint8 for d in dtypes)
    return NARROW_MAXNREG if narrow else None


_TL_DTYPES = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.bool: "tl.int8",  # one byte each, read as ``!= 0`` (a mask a prelude computed)
    torch.uint8: "tl.uint8",  # int8 state: codes, then block scales (optkernels.compressed)
}
_NARROW = (torch.float16, torch.bfloat16)


class KernelError(Exception):
    """The lane program uses something the generator cannot emit."""


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


def kernel_source(
    program: LaneProgram,
    dtypes: Sequence[torch.dtype],
    name: str,
    host: dict[int, int | None] | None = None,
    dynamic: Sequence[bool] | None = None,
    lane: int = 0,
    rounding: dict[int, tuple[str, int, int]] | None = None,
) -> str:
    """Triton source of the kernel for ``program`` whose inputs have ``dtypes``, for lanes
    whose ops record the same result dtypes as lane ``lane``'s. ``host`` maps vars computed
    on the host to their column in the ``host_vals`` buffer, or to None where the kernel does
    not read them (host.host_reads). Input ``k``'s addresses come from the static table
    ``ptrs`` (addresses the guards fix: params, state) or, where ``dynamic[k]``, from
    ``dptrs`` (grads: new tensors every step).

    Each op computes as ATen's does: in the compute dtype of its result dtype (float32 for
    float16/bfloat16/float32, float64 for float64), its tensor operands first cast to its
    dtype (a 0-dim float32 count used with bfloat16 tensors is rounded to bfloat16, as
    TensorIterator does), its Python scalars (lr, betas, eps; a ``.item()``; values the host
    computed, which the torch backend holds as CPU scalars) read in the compute dtype, not
    rounded to a float16 tensor's dtype, and its result rounded to its dtype. So eager's
    infinities and NaNs (a float16 ``(1 - beta2) * g * g`` that underflows) come out the
    same. Expressions have the shape of ATen's CUDA functors (``a + alpha * b``,
    ``self + value * (t1 * t2)``), which the GPU compiles to the same fused multiply-adds;
    the interpreter rounds their products separately (a one-ulp float32 difference, seen in
    a narrower dtype only where it flips a rounding). ATen's CPU kernels differ from its
    CUDA ones by such ulps too: they round ``add``'s alpha and scalar to the tensor's dtype,
    and read a 0-dim tensor divided or multiplied by unrounded."""
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
        "    offs = tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK)",
        "    first = start == 0",
    ]
    if any(column is not None for column in host.values()):
        # host_vals: [row stride, 3 unused, one row of values per lane]; a stride of 0
        # when every lane has the same values (one row is written: see host.host_reads).
        lines.append("    row = lane * tl.load(host_vals).to(tl.int64)")
    for k, dtype in enumerate(dtypes):
        if dtype not in _TL_DTYPES:
            raise KernelError(f"dtype {dtype} of a lane input")
        lines.append(f"    a{k} = tl.load({columns[k]})")
    scalars = _Scalars(program)
    body: list[str] = []
    loads: list[str] = []  # the inputs' loads (see below)
    resolved = op_dtypes(program, lane)
    value_dtype: dict[int, torch.dtype] = {}  # what each var's Triton value holds
    numbers: set[int] = set()  # vars ATen reads as Python numbers (see _operand)
    for op in program.ops:
        if op.out in host:
            column = host[op.out]
            if column is not None:
                # (a comparison the host made, RAdam's rect > 5, comes as 0.0/1.0: a where
                # takes it back as a bool)
                truth = op.op in COMPARE
                value_dtype[op.out] = torch.bool if truth else torch.float64
                if not truth:
                    numbers.add(op.out)
                load = f"tl.load(host_vals + {HOST_ROWS} + row + {column})"
                body.append(f"    v{op.out} = {load}{' != 0' if truth else ''}")
            continue
        if op.op in HOST_ONLY:
            raise KernelError(
                f"{op.op}: Python arithmetic on a value read with .item() is computed on "
                "the host only"
            )
        if op.op == "input" and dtypes[op.args[0]] is torch.uint8:
            k = op.args[0]  # int8 state: the codes, and the scale of each one's block
            scale = f"_int8_scale({_scales(k)}, offs, start, mask, BLOCK)"
            loads.append(f"    c{op.out} = tl.load(p{k} + offs, mask=mask, other=0)")
            dtype, expr = torch.float32, f"_dequantize_int8(c{op.out}, {scale})"
        elif op.op == "input":
            dtype = dtypes[op.args[0]]
            expr = _load(op, dtype)
        else:
            dtype, expr = _lower(op, resolved[op.out], program, value_dtype, numbers, scalars)
        if op.op == "item":
            numbers.add(op.out)
        value_dtype[op.out] = dtype
        # every load first (they depend on nothing computed, and no store comes before the
        # end): their latencies overlap, where a load written at its first use (Adam's
        # param, read by the last op) waited until the math before it was done. int8 state:
        # its codes' load first, decoded at first use (8 decoded floats per thread held from
        # the top cost registers, occupancy, more than the early load gained: H100 1.31x vs
        # 1.17x the floor)
        hoist = op.op == "input" and dtypes[op.args[0]] is not torch.uint8
        (loads if hoist else body).append(f"    v{op.out} = {expr}")
    rounding = rounding or {}
    counters = {
        k: scalars.ref(c, torch.float64) for k, (f, c, _) in rounding.items() if f == "bf16"
    }
    core = loads + body
    for var, k in program.writes:
        if program.input_small[k] and host:
            continue  # written on the host
        if program.input_small[k]:
            j = small_writes.index((var, k))
            value = _convert(f"v{var}", value_dtype[var], torch.float64)
            core.append(
                f"    tl.store(small_out + lane * {len(small_writes)} + {j}, {value}, mask=first)"
            )
        elif dtypes[k] is torch.uint8:  # int8 state: codes and block scales
            if rounding.get(k, ("",))[0] != "int8":
                raise KernelError(f"input column {k} (uint8) is written without its scales")
            value = _convert(f"v{var}", value_dtype[var], torch.float32)
            args = f"p{k}, {_scales(k)}, {value}, offs, start, mask, BLOCK"
            core.append(f"    _store_int8({args})")
        elif k in counters:  # bfloat16 state, stochastically rounded (optkernels.compressed)
            value = _convert(f"v{var}", value_dtype[var], torch.float32)
            mix = rounding[k][2] * 0xC2B2AE3D
            stored = f"_round_bf16_stochastic({value}, offs, {counters[k]}, {mix})"
            core.append(f"    tl.store(p{k} + offs, {stored}, mask=mask)")
        else:
            stored = _store_cast(f"v{var}", value_dtype[var], dtypes[k])
            core.append(f"    tl.store(p{k} + offs, {stored}, mask=mask)")
    lines += _branches(program, dtypes, scalars.lines, core)
    if small_writes and not host:
        copies = _small_kernel(dtypes, name, small_writes, table_columns(dynamic, "lanes"))
        lines += ["", "", *copies]
    return "\n".join(lines) + "\n"


def _branches(
    program: LaneProgram, dtypes: Sequence[torch.dtype], head: list[str], core: list[str]
) -> list[str]:
    """The kernel's body twice: for a whole block whose tensors all start at 16-byte
    addresses, without a mask and with the addresses' alignment told to Triton (its loads
    and stores then move 16 bytes per instruction: a 16-bit lane's scalar accesses stay
    short of the bandwidth floor), and for the rest (a lane's last, partial block, or a
    tensor at an odd address: a view) with the mask. Each element computes the same either
    way; only the width of its memory accesses differs."""
    wide = [k for k in range(len(dtypes)) if not program.input_small[k]]
    if not wide:
        pointers = [
            f"    p{k} = a{k}.to(tl.pointer_type({_TL_DTYPES[d]}))" for k, d in enumerate(dtypes)
        ]
        return [*head, *pointers, "    mask = offs < numel", *core]
    addresses = " | ".join(f"a{k}" for k in wide)
    out = [*head, f"    if ((({addresses}) & 15) == 0) & (start + BLOCK <= numel):"]
    # Every input is told the alignment of as many elements as 16 bytes of the widest hold,
    # so all access the same elements per thread: told 16 bytes, a narrower input (bf16 or
    # int8 state beside float32 params) would get wider vectors in another layout, and
    # Triton would convert between the two through shared memory with barriers.
    vector = 16 // max(_itemsize(dtypes[k]) for k in wide)
    for aligned in (True, False):
        if not aligned:
            out.append("    else:")
        for k, dtype in enumerate(dtypes):
            pointer = f"a{k}.to(tl.pointer_type({_TL_DTYPES[dtype]}))"
            if aligned and k in wide:
                pointer = f"tl.multiple_of({pointer}, {vector * _itemsize(dtype)})"
            out.append(f"        p{k} = {pointer}")
        mask = "tl.full([BLOCK], 1, tl.int1)" if aligned else "offs < numel"
        out.append(f"        mask = {mask}")
        out += ["    " + line for line in core]
    return out


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element as the kernel stores it (a bool mask: one byte)."""
    return 1 if dtype is torch.bool else dtype.itemsize


def _scales(k: int) -> str:
    """Where input ``k``'s int8 block scales start: after its codes, padded to whole blocks."""
    padded = f"(numel + {INT8_BLOCK - 1}) // {INT8_BLOCK} * {INT8_BLOCK}"
    return f"(p{k} + {padded}).to(tl.pointer_type(tl.float32))"


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
        value = _store_cast(f"x{j}", torch.float64, dtypes[k])
        lines += [
            f"    a{j} = tl.load({columns[k]}, mask=m, other=0)",
            f"    x{j} = tl.load(small_out + lanes * {len(small_writes)} + {j}, mask=m, other=0)",
            f"    tl.store(a{j}.to(tl.pointer_type({tl_type})), {value}, mask=m)",
        ]
    return lines


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


def _load(op: LaneOp, dtype: torch.dtype) -> str:
    """Lane input ``k``'s value: in its compute dtype, or a bool (one byte each, a mask a
    prelude computed)."""
    (k,) = op.args
    load = f"tl.load(p{k})" if op.small else f"tl.load(p{k} + offs, mask=mask, other=0)"
    if dtype is torch.bool:
        return f"({load} != 0)"
    return load if dtype is torch.float64 else f"{load}.to(tl.float32)"


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


# pow in float64 through exp and log, so that it runs under TRITON_INTERPRET (which has no
# libdevice): rounded to float32 for a float32 op, correctly in nearly every case (CUDA's
# powf, which ATen calls, is not always: a float32 bias correction can differ by an ulp); a
# float64 op gets it to about |e * log(b)| float64 ulps (beta ** step: a few).
_PRELUDE = """import triton
import triton.language as tl


@triton.jit
def _int8_scale(scales, offs, start, mask, BLOCK: tl.constexpr):
    # The scale of each element's block: one number when the kernel block is one int8 block
    if BLOCK == 256:
        return tl.load(scales + start // 256)
    else:
        return tl.load(scales + offs // 256, mask=mask, other=0.0)


@triton.jit
def _dequantize_int8(code, scale):
    # optkernels.compressed.dequantize_int8 (maps of power 2), step by step: d * |d| * step,
    # d the code less the map's zero code: the code's bits under 2**23's exponent make
    # 2**23 + code, an exact float32, without an int-to-float conversion
    unsigned = scale.to(tl.int32, bitcast=True) < 0
    step = tl.div_rn(tl.abs(scale), tl.where(unsigned, 65025.0, 16129.0))
    biased = (code.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    d = biased - tl.where(unsigned, 8388608.0, 8388736.0)
    return d * tl.abs(d) * step


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _store_int8(codes, scales, x, offs, start, mask, BLOCK: tl.constexpr):
    # optkernels.compressed.quantize_int8 (maps of power 2), step by step. One int8 block
    # per kernel block (BLOCK == 256, one warp: launch_config) reduces within a warp and
    # stores one scale; wider kernel blocks reduce each 256-element row.
    xm = tl.where(mask, x, 0.0)
    if BLOCK == 256:
        absmax = tl.reduce(tl.abs(xm), 0, _max_nan)
        low = tl.min(xm, 0)
    else:
        rows = tl.reshape(xm, (BLOCK // 256, 256))
        absmax = tl.reduce(tl.abs(rows), 1, _max_nan)[:, None]
        low = tl.min(rows, 1)[:, None]
        absmax = tl.reshape(tl.broadcast_to(absmax, (BLOCK // 256, 256)), (BLOCK,))
        low = tl.reshape(tl.broadcast_to(low, (BLOCK // 256, 256)), (BLOCK,))
    unsigned = (low >= 0) | (absmax != absmax)
    nonzero = absmax > 0
    inverse = tl.where(nonzero, tl.div_rn(1.0, tl.where(nonzero, absmax, 1.0)), 0.0)
    ratio = x * inverse
    root = tl.sqrt(tl.abs(ratio))
    sign = ratio.to(tl.uint32, bitcast=True) & 0x80000000
    root = (root.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    # 2**23 + zero code + the scaled root: float32's ulp there is 1, so the add rounds to
    # the nearest code and the code is the low 8 bits (no float-to-int conversion)
    biased = root * tl.where(unsigned, 255.0, 127.0) + tl.where(unsigned, 8388608.0, 8388736.0)
    biased = tl.maximum(biased, tl.where(x > 0, 8388609.0, 0.0))  # positive: a code >= 1
    code = (biased.to(tl.int32, bitcast=True) & 0xFF).to(tl.uint8)
    tl.store(codes + offs, code, mask=mask)
    scale = tl.where(unsigned, -absmax, absmax)  # the sign bit flags the map
    if BLOCK == 256:
        tl.store(scales + start // 256, scale)
    else:
        tl.store(scales + offs // 256, scale, mask=mask & (offs % 256 == 0))


@triton.jit
def _round_bf16_stochastic(x, offs, counter, salt_mix):
    # optkernels.compressed.round_bf16_stochastic in uint32 arithmetic (which wraps as the
    # reference's masked int64 does); the seed is one number, in int64 as the reference's
    seed = ((counter.to(tl.int64) * 0x85EBCA77 + salt_mix) & 0xFFFFFFFF).to(tl.uint32)
    h = offs.to(tl.uint32) * 0x9E3779B1 + seed
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    h = h ^ (h >> 16)
    bits = x.to(tl.uint32, bitcast=True)
    y = ((bits + (h & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    # (an infinity's 16 low bits are 0: adding fewer than 2**16 leaves it as it is)
    return tl.where(x == x, y, x).to(tl.bfloat16)


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
    return out


@triton.jit
def _bf16_rn(x):
    # float32 -> nearest bfloat16 (ties to even; NaN -> the canonical NaN) -> float32, two
    # values per cvt.rn.bf16x2.f32: Triton converts one value at a time with an F2F, which
    # on sm_90 issues on the quarter-rate unit that the divisions and square roots use, and
    # an update in bfloat16 rounds after every op. Exactly what .to(tl.bfloat16) computes.
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; "
        "shl.b32 $0, t, 16; and.b32 $1, t, 0xffff0000; }",
        "=r,=r,r,r",
        [x],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _bf16(x):
    # float32 -> nearest bfloat16 (ties to even), as a float32; NaN stays NaN.
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = bits & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


"""


_HELPERS = {
    match.group(1): block
    for block in re.split(r"\n(?=@triton\.jit\n)", _PRELUDE)[1:]
    if (match := re.match(r"@triton\.jit\ndef (\w+)\(", block))
}


# Any helper's name, as a word; and the helpers each helper calls.
_HELPER_NAME = re.compile(r"\b(" + "|".join(map(re.escape, _HELPERS)) + r")\b")
_CALLS = {name: frozenset(_HELPER_NAME.findall(block)) - {name} for name, block in _HELPERS.items()}
_HEADER = _PRELUDE.split("\n@triton.jit\n", 1)[0]


def prelude_for(source: str) -> str:
    """The prelude's imports and the helpers ``source`` uses, directly or through another
    helper: a warm process imports the module for its kernel, and each helper there is a
    JITFunction that Triton builds from its source lines on import (~1 ms each)."""
    needed = set(_HELPER_NAME.findall(source))
    todo = list(needed)
    while todo:
        for name in _CALLS[todo.pop()] - needed:
            needed.add(name)
            todo.append(name)
    return _HEADER + "".join("\n" + block for name, block in _HELPERS.items() if name in needed)


def source_dir() -> str:
    """Where generated kernel sources live: $OPTKERNELS_CACHE_DIR, else a per-user folder
    in the temp dir."""
    configured = os.environ.get("OPTKERNELS_CACHE_DIR")
    if configured:
        return configured
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return os.path.join(tempfile.gettempdir(), f"optkernels-src-{user}")


def load_kernel(source: str, name: str) -> Kernel:
    """The kernel ``name`` of the generated ``source``, written to a module file (Triton's
    JIT needs real source files), which is imported when the kernel's function is needed.

    The on-disk kernel cache: a module's file is named by a hash of its text, which the graph
    structure and dtypes determine, so a second process compiling the same optimizer finds
    the same file, and the record of the kernels compiled from it (Triton's files, keyed by
    that source, the Triton version, the target and the compile options): it launches them
    without running the compiler or Triton's per-process self-hash, and without importing
    the module, whose ``@triton.jit`` functions Triton builds from their source lines
    (``_triton_compat.Kernel``)."""
    text, digest = _module_text(source)
    directory = source_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"k_{digest}.py")
    _write_module(path, text)
    module_name = f"optkernels_generated_{digest}"
    record = os.path.join(directory, f"k_{digest}.{name}.json")
    module = sys.modules.get(module_name)
    load = functools.partial(_import_kernel, module_name, path, text, name)
    return Kernel(record, load, getattr(module, name, None))


@functools.lru_cache(maxsize=64)
def _module_text(source: str) -> tuple[str, str]:
    """The module text of a kernel's ``source`` (the prelude's helpers it uses first) and its
    hash (a kernel and its ``_small`` kernel share the module)."""
    text = prelude_for(source) + source
    return text, hashlib.sha256(text.encode()).hexdigest()[:16]


_IMPORTING = threading.Lock()  # (a module's first launches on two threads import it once)


def _import_kernel(module_name: str, path: str, text: str, name: str) -> Any:
    with _IMPORTING:
        return getattr(_import_module(module_name, path, text), name)


def _write_module(path: str, text: str) -> None:
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def _import_module(module_name: str, path: str, text: str) -> Any:
    module = sys.modules.get(module_name)
    if module is None:
        _write_module(path, text)  # (again, where the cache was emptied since)
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return module
