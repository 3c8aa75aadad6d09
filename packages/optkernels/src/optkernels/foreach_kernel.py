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

from collections.abc import Sequence

import torch

from optkernels.compressed import BLOCK as INT8_BLOCK
from optkernels.dtypes import op_dtypes
from optkernels.errors import KernelError
from optkernels.host import HOST_ROWS
from optkernels.kernel_cache import load_kernel, source_dir
from optkernels.kernel_prelude import prelude_for
from optkernels.lanes import LaneOp, LaneProgram
from optkernels.launch_config import BLOCK, launch_config, register_limit
from optkernels.lowering import Values, convert, lower
from optkernels.numbers import HOST_ONLY
from optkernels.triton_ops import _TL_DTYPES, _store_cast, triton_emitter

__all__ = [
    "BLOCK",
    "KernelError",
    "kernel_source",
    "launch_config",
    "load_kernel",
    "prelude_for",
    "register_limit",
    "source_dir",
    "table_columns",
]


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
    emit = triton_emitter(program)
    body: list[str] = []
    loads: list[str] = []  # the inputs' loads (see below)
    resolved = op_dtypes(program, lane)
    values = Values()  # what each var's Triton value holds
    for op in program.ops:
        if op.out in host:
            column = host[op.out]
            if column is not None:
                truth = values.from_host(op)
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
            dtype, expr = lower(op, resolved[op.out], values, emit)
        values.computed(op, dtype)
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
        k: emit.scalars.ref(c, torch.float64) for k, (f, c, _) in rounding.items() if f == "bf16"
    }
    core = loads + body
    for var, k in program.writes:
        if program.input_small[k] and host:
            continue  # written on the host
        if program.input_small[k]:
            j = small_writes.index((var, k))
            value = convert(f"v{var}", values.dtype[var], torch.float64, emit)
            core.append(
                f"    tl.store(small_out + lane * {len(small_writes)} + {j}, {value}, mask=first)"
            )
        elif dtypes[k] is torch.uint8:  # int8 state: codes and block scales
            if rounding.get(k, ("",))[0] != "int8":
                raise KernelError(f"input column {k} (uint8) is written without its scales")
            value = convert(f"v{var}", values.dtype[var], torch.float32, emit)
            args = f"p{k}, {_scales(k)}, {value}, offs, start, mask, BLOCK"
            core.append(f"    _store_int8({args})")
        elif k in counters:  # bfloat16 state, stochastically rounded (optkernels.compressed)
            value = convert(f"v{var}", values.dtype[var], torch.float32, emit)
            mix = rounding[k][2] * 0xC2B2AE3D
            stored = f"_round_bf16_stochastic({value}, offs, {counters[k]}, {mix})"
            core.append(f"    tl.store(p{k} + offs, {stored}, mask=mask)")
        else:
            stored = _store_cast(f"v{var}", values.dtype[var], dtypes[k])
            core.append(f"    tl.store(p{k} + offs, {stored}, mask=mask)")
    lines += _branches(program, dtypes, emit.scalars.lines, core)
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


def _load(op: LaneOp, dtype: torch.dtype) -> str:
    """Lane input ``k``'s value: in its compute dtype, or a bool (one byte each, a mask a
    prelude computed)."""
    (k,) = op.args
    load = f"tl.load(p{k})" if op.small else f"tl.load(p{k} + offs, mask=mask, other=0)"
    if dtype is torch.bool:
        return f"({load} != 0)"
    return load if dtype is torch.float64 else f"{load}.to(tl.float32)"
