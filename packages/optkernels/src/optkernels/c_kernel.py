"""Generated C for a LaneProgram on the CPU: one vectorized, multi-threaded loop nest.

``kernel_source`` emits, per dtype group of a program's lanes, a C function that walks a
table of work items (lane, first element, end) built once from the shapes, OpenMP threads
taking items, and computes the lane program over each item's elements in one ``omp simd``
loop: every tensor is read once and written once per step, with no temporaries in memory.
Each op is lowered as in the Triton kernels (``lowering``, spelled in C by ``c_emitter``):
operands cast to the op's dtype, computed in float32 for float16/bfloat16/float32 and in
float64 for float64, the result rounded to its dtype after each op (bfloat16 to nearest
even, float16 through ``_Float16``), Python scalars read unrounded in the compute dtype, and
``fma`` where ATen's functors compute ``a + b * c``. What depends only on 0-dim inputs (step
counts) and scalars is computed on the host for every lane (``host.host_function``) and read
from ``host_vals``.

``build`` compiles the sources with the system C compiler into a shared library cached on
disk, named by a hash of the source, the compiler, its flags and the CPU (``-march=native``):
written to a temporary file and renamed into place, so processes compiling the same step at
once never wait on each other (both compile; one rename wins, with the same bytes).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optkernels.dtypes import compute_dtype, op_dtypes
from optkernels.errors import KernelError
from optkernels.host import HOST_ROWS
from optkernels.lanes import LaneProgram
from optkernels.lowering import NARROW, Code, Emitter, Scalars, Values, lower

_C_TYPES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.bfloat16: "uint16_t",
    torch.float16: "_Float16",
    torch.bool: "uint8_t",
}
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",  # sqrt vectorizes (it sets no errno); results are IEEE's either way
    "-ffp-contract=off",  # no multiply-add fused where ATen rounds twice (fma() is explicit)
    "-std=gnu11",
    "-shared",
    "-fPIC",
)

_PRELUDE = """#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf2f(uint16_t x) {
    uint32_t b = (uint32_t)x << 16; float f; memcpy(&f, &b, 4); return f;
}
static inline uint16_t f2bf(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)(b >> 16);  /* torch's NaN */
}
static inline float rbf(float f) { return bf2f(f2bf(f)); }
static inline float rhf(float f) { return (float)(_Float16)f; }
static inline float mxf(float a, float b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
static inline float mnf(float a, float b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
static inline double mxd(double a, double b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
static inline double mnd(double a, double b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
"""


def _ctype(dtype: torch.dtype) -> str:
    """The C type a value of ``dtype`` is held in while computing."""
    if dtype is torch.bool:
        return "int"
    return "double" if compute_dtype(dtype) is torch.float64 else "float"


def _store(expr: str, src: torch.dtype, dtype: torch.dtype) -> str:
    """``expr`` (a ``src`` value in its compute type) as a ``dtype`` element to store."""
    if dtype is torch.bool:
        return f"(uint8_t)({expr})"
    if src is torch.float64 and dtype in NARROW:
        expr = f"(float)({expr})"
    if dtype is torch.bfloat16:
        return f"f2bf({expr})"
    return f"({_C_TYPES[dtype]})({expr})"


def _load(k: int, dtype: torch.dtype) -> str:
    element = f"p{k}[i]"
    if dtype is torch.bool:
        return f"({element} != 0)"
    if dtype is torch.bfloat16:
        return f"bf2f({element})"
    if dtype is torch.float16:
        return f"(float){element}"
    return element


def _literal(value: float, compute: torch.dtype) -> str:
    if math.isnan(value):
        text = "NAN"
    elif math.isinf(value):
        text = "INFINITY" if value > 0 else "(-INFINITY)"
    else:
        text = repr(float(value))
    return f"(({_ctype(compute)}){text})"


def c_emitter(program: LaneProgram) -> Emitter:
    """Lane ops as C expressions (for ``lowering``): values are ``float`` (float32, float16,
    bfloat16) or ``double`` (float64) scalars of one element, computed with C's IEEE
    operators and libm (``-ffp-contract=off``: a product is rounded before the sum unless
    written as ``fma``)."""
    load = "    const double {name} = scalars[{slot}];"
    narrow = "    const float {narrow} = (float){name};"
    return Emitter(Scalars(program, load, narrow, suffix="_f"), _CODE, alpha_in_dtype=True)


def _code(compute: torch.dtype) -> Code:
    """How C spells ``lowering.PRIMITIVES`` for ops computing in ``compute``."""
    wide = compute is torch.float64
    f = "" if wide else "f"  # libm's float functions: fmaf, sqrtf, fabsf
    return {
        "literal": lambda value: _literal(value, compute),
        "ignored": "0",
        "cast": "((" + _ctype(compute) + ")({0}))",
        "round": _narrowed,
        "fma": "fma" + f + "({0}, {1}, {2})",
        "div": "({0} / {1})",
        "sqrt": "sqrt" + f + "({0})",
        "abs": "fabs" + f + "({0})",
        "abs_below_half": "fabs((double){0}) < 0.5",
        # mxf/mxd, mnf/mnd (_PRELUDE): NaN if either operand is, as ATen's maximum and clamp
        "maximum": ("mxd" if wide else "mxf") + "({0}, {1})",
        "minimum": ("mnd" if wide else "mnf") + "({0}, {1})",
        "select": "({0} ? {1} : {2})",
        "broadcast": "{0}",  # (one element: nothing to broadcast)
        "float64": lambda fn, *args: _float64(fn, list(args), wide),
        # ATen casts a comparison's operands, a Python number too, to their common dtype:
        # Rprop's ``sign == etaminus`` over bfloat16 compares with etaminus in bfloat16
        "compare_operand": lambda x, common: _narrowed(x, common) if common in NARROW else x,
        "zeros_like": _literal(0.0, compute),
        "ones_like": _literal(1.0, compute),
        "value": "({0})",
        "full": "({0})",
    }


def _narrowed(x: str, dtype: torch.dtype) -> str:
    """``x`` (a float) rounded to bfloat16 or float16, held in a float."""
    return f"rbf({x})" if dtype is torch.bfloat16 else f"rhf({x})"


def _float64(fn: str, args: list[str], wide: bool) -> str:
    """exp, log or pow of ``args`` in double (rounded to float unless ``wide``)."""
    call = f"{fn}({', '.join(f'(double){x}' for x in args)})"
    return call if wide else f"(float){call}"


_CODE = {dtype: _code(dtype) for dtype in (torch.float32, torch.float64)}


def kernel_source(
    program: LaneProgram,
    dtypes: Sequence[torch.dtype],
    name: str,
    host: dict[int, int | None],
    dynamic: Sequence[bool],
    lane: int = 0,
) -> str:
    """C source of ``void name(ptrs, dptrs, items, n_items, scalars, host_vals, threads)``
    for the lanes of ``program`` whose inputs have ``dtypes`` and whose ops record the same
    result dtypes as lane ``lane``'s. ``host`` maps every var computed on the host to its
    column in a ``host_vals`` row (None where the kernel does not read it). Input ``k``'s
    address is ``ptrs[lane * n_static + j]`` or, where ``dynamic[k]`` (grads: new tensors
    every step), ``dptrs[lane * n_dynamic + j]``. ``items``: rows of (lane, start, end)."""
    n_static = max(sum(1 for d in dynamic if not d), 1)
    n_dynamic = max(sum(1 for d in dynamic if d), 1)
    head = [
        f"void {name}(const int64_t *restrict ptrs, const int64_t *restrict dptrs,",
        "        const int64_t *restrict items, int64_t n_items, const double *restrict scalars,",
        "        const double *restrict host_vals, int threads) {",
        "    const int64_t row_stride = (int64_t)host_vals[0];",
    ]
    emit = c_emitter(program)
    pointers: list[str] = []
    counts = {False: 0, True: 0}
    for k, dtype in enumerate(dtypes):
        if dtype not in _C_TYPES:
            raise KernelError(f"dtype {dtype} of a lane input")
        table, width = ("dptrs", n_dynamic) if dynamic[k] else ("ptrs", n_static)
        column = counts[bool(dynamic[k])]
        counts[bool(dynamic[k])] += 1
        if program.input_small[k]:
            continue  # read on the host
        ctype = _C_TYPES[dtype]
        address = f"{table}[lane * {width} + {column}]"
        pointers.append(f"        {ctype} *restrict p{k} = ({ctype} *)(intptr_t){address};")
    per_item: list[str] = []  # host values, read once per work item
    body: list[str] = []  # the elementwise loop
    resolved = op_dtypes(program, lane)
    values = Values()
    for op in program.ops:
        if op.out in host:
            read_at = host[op.out]
            if read_at is not None:
                truth = values.from_host(op)
                read = f"hv[{read_at}]"
                per_item.append(
                    f"        const int v{op.out} = {read} != 0;"
                    if truth
                    else f"        const double v{op.out} = {read};"
                )
            continue
        if op.op == "input":
            dtype = dtypes[op.args[0]]
            expr = _load(op.args[0], dtype)
        else:
            dtype, expr = lower(op, resolved[op.out], values, emit)
        values.computed(op, dtype)
        body.append(f"            const {_ctype(dtype)} v{op.out} = {expr};")
    for var, k in program.writes:
        if program.input_small[k]:
            continue  # written on the host
        body.append(f"            p{k}[i] = {_store(f'v{var}', values.dtype[var], dtypes[k])};")
    lines = [
        *head,
        *emit.scalars.lines,
        "    #pragma omp parallel for if(threads > 1) num_threads(threads) schedule(dynamic, 1)",
        "    for (int64_t it = 0; it < n_items; ++it) {",
        "        const int64_t lane = items[3 * it], start = items[3 * it + 1];",
        "        const int64_t end = items[3 * it + 2];",
        f"        const double *hv = host_vals + {HOST_ROWS} + lane * row_stride;",
        "        (void)hv;",
        *pointers,
        *per_item,
        "        #pragma omp simd",
        "        for (int64_t i = start; i < end; ++i) {",
        *body,
        "        }",
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n"


# -- the compiler and the on-disk cache ------------------------------------------------------


def cache_dir() -> str:
    """Where compiled kernels live: $OPTKERNELS_CACHE_DIR/c, else a per-user temp folder."""
    configured = os.environ.get("OPTKERNELS_CACHE_DIR")
    if configured:
        return os.path.join(configured, "c")
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return os.path.join(tempfile.gettempdir(), f"optkernels-c-{user}")


@dataclass(frozen=True)
class Compiler:
    """A C compiler that builds OpenMP shared libraries here."""

    path: str
    version: str  # its first ``--version`` line


@functools.cache
def find_compiler() -> Compiler | str:
    """The C compiler (``$CC``, else ``cc``, ``gcc``, ``clang``) that can build the kernels,
    or why none can (tried once per process: a trivial OpenMP build, ~0.1 s)."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    found = [p for p in (shutil.which(n) for n in names) if p]
    if not found:
        return f"no C compiler found ({', '.join(names)} on PATH; set CC)"
    path = found[0]
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        version = (out.stdout.splitlines() or ["unknown"])[0].strip()
        probe = (
            "void probe(int n, float *x) {\n#pragma omp parallel for\n"
            "for (int i = 0; i < n; ++i) x[i] += 1.0f;\n}\n"
        )
        # (named by the compiler and flags: a probe another compiler built proves nothing)
        key = hashlib.sha256("\n".join([path, version, *FLAGS]).encode()).hexdigest()[:12]
        _compile(Compiler(path, version), probe, os.path.join(cache_dir(), f"probe_{key}"))
    except (OSError, subprocess.SubprocessError, KernelError) as exc:
        return f"{path} cannot build OpenMP shared libraries here: {exc}"
    return Compiler(path, version)


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the machine and its CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags"))]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(sorted(set(lines)))


def _compile(compiler: Compiler, source: str, stem: str) -> str:
    """Build ``source`` into ``stem``.so unless it exists; the path of the library."""
    path = stem + ".so"
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{stem}.{os.getpid()}.{os.urandom(4).hex()}"
    with open(tmp + ".c", "w") as f:
        f.write(source)
    try:
        done = subprocess.run(
            [compiler.path, *FLAGS, tmp + ".c", "-o", tmp + ".so", "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise KernelError(f"{compiler.path} failed on {tmp}.c:\n{done.stderr[-2000:]}")
        os.replace(tmp + ".so", path)  # atomic: a reader sees the whole library or none
    finally:
        for leftover in (tmp + ".c", tmp + ".so"):
            if os.path.exists(leftover) and not (leftover.endswith(".c") and _keep_sources()):
                os.remove(leftover)
    return path


def _keep_sources() -> bool:
    return os.environ.get("OPTKERNELS_KEEP_C") == "1"


def library_source(functions: Sequence[str]) -> str:
    return _PRELUDE + "\n" + "\n".join(functions)


@functools.cache
def _open(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def _stem(compiler: Compiler, source: str) -> str:
    key = "\n".join([compiler.path, compiler.version, *FLAGS, _cpu_id(), source])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"k_{digest}")


def build(compiler: Compiler, source: str) -> ctypes.CDLL:
    """The loaded library of ``source`` (a ``library_source``), from the disk cache or
    compiled now. Raises KernelError with the compiler's message if it fails."""
    return _open(_compile(compiler, source, _stem(compiler, source)))


@functools.cache
def _builders() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="optkernels-cc"
    )


def build_async(compiler: Compiler, source: str) -> concurrent.futures.Future[ctypes.CDLL]:
    """``build`` in a background thread (the compiler runs as a subprocess: the caller goes
    on with its own work meanwhile); a library already in the disk cache is loaded now.
    The future's ``result()`` raises ``build``'s KernelError."""
    stem = _stem(compiler, source)
    if os.path.exists(stem + ".so"):
        done: concurrent.futures.Future[ctypes.CDLL] = concurrent.futures.Future()
        done.set_result(_open(stem + ".so"))
        return done
    return _builders().submit(lambda: _open(_compile(compiler, source, stem)))


KERNEL_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int]


def function(library: ctypes.CDLL, name: str) -> Any:
    fn = getattr(library, name)
    fn.argtypes = KERNEL_ARGS
    fn.restype = None
    return fn
