"""Column 2-norms of CPU tensors in C (``linalg_vector_norm(x, 2, dim=-2)``).

A step that is not a lane program runs on the torch backend (``cpu_backend``); Adafactor's
spent most of its time in one op: ATen's norm of a float32 matrix over its columns
(``norm(grad, dim=-2)``, for the factored second moment) walks the matrix column by column,
at a tenth of the memory bandwidth (149 ms for GPT-2's 50257 x 768 embedding on 2 cores,
where reading it takes 12 ms), with a relative error of ~1e-5 there (float32 sums).
``vector_norm`` computes that norm reading the matrix once in memory order, OpenMP threads
taking blocks of columns, squares summed in float64: more exactly than ATen, so the results
differ from eager's by eager's own rounding error (within an ulp on small matrices). Every
other call (another ``ord``, dim or dtype, a non-contiguous tensor) runs ATen's op, whose
row and whole-tensor norms are as fast as memory allows: eager's values to the bit.
"""

from __future__ import annotations

import concurrent.futures
import copy
import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from optkernels.c_kernel import build_async, find_compiler

_ATEN = torch.ops.aten.linalg_vector_norm.default
_COLUMNS = 128  # columns per work item: a row's slice is 512 bytes or more

_SOURCE = """#include <stdint.h>
#include <math.h>

#define COLUMN_NORMS(T, S) \\
void cols_##S(const T *restrict x, int64_t batch, int64_t m, int64_t n, \\
        double *restrict out, int threads) { \\
    const int64_t blocks = (n + COLUMNS - 1) / COLUMNS; \\
    _Pragma("omp parallel for if(threads > 1 && batch * m * n > 32768) num_threads(threads)") \\
    for (int64_t item = 0; item < batch * blocks; ++item) { \\
        const int64_t b = item / blocks, j0 = (item % blocks) * COLUMNS; \\
        const int64_t w = n - j0 < COLUMNS ? n - j0 : COLUMNS; \\
        const T *restrict base = x + b * m * n + j0; \\
        double acc[COLUMNS] = {0}; \\
        for (int64_t i = 0; i < m; ++i) { \\
            const T *restrict row = base + i * n; \\
            _Pragma("omp simd") \\
            for (int64_t j = 0; j < w; ++j) acc[j] += (double)row[j] * (double)row[j]; \\
        } \\
        for (int64_t j = 0; j < w; ++j) out[b * n + j0 + j] = sqrt(acc[j]); \\
    } \\
}

COLUMN_NORMS(float, f32)
COLUMN_NORMS(double, f64)
""".replace("COLUMNS", str(_COLUMNS))

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


@functools.cache
def _library() -> concurrent.futures.Future[ctypes.CDLL]:
    """The library, built once per process (from the disk cache after once), in the
    background: ``use_c_norms`` starts it, the first norm waits for it."""
    compiler = find_compiler()
    if isinstance(compiler, str):
        raise RuntimeError(compiler)
    return build_async(compiler, _SOURCE)


@functools.cache
def _functions() -> dict[torch.dtype, Any]:
    """The C functions by dtype."""
    library = _library().result()
    functions = {}
    for dtype, suffix in _SUFFIX.items():
        fn = getattr(library, f"cols_{suffix}")
        fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_int]
        fn.restype = None
        functions[dtype] = fn
    return functions


def _over_columns(ndim: int, dim: Any) -> bool:
    if ndim < 2 or dim is None:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim)
    return len(dims) == 1 and dims[0] % ndim == ndim - 2


def vector_norm(
    x: torch.Tensor,
    ord: float = 2,
    dim: int | Sequence[int] | None = None,
    keepdim: bool = False,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``aten.linalg_vector_norm``, its column norms computed in C (see the module)."""
    if (
        ord != 2
        or dtype is not None
        or x.dtype not in _SUFFIX
        or x.device.type != "cpu"
        or not _over_columns(x.dim(), dim)
        or not x.is_contiguous()
    ):
        return _ATEN(x, ord, dim, keepdim, dtype=dtype)  # type: ignore[no-any-return]
    *batch_shape, m, n = x.shape
    out = torch.empty([*batch_shape, n], dtype=torch.float64)
    batch = out.numel() // n if n else 0
    _functions()[x.dtype](x.data_ptr(), batch, m, n, out.data_ptr(), torch.get_num_threads())
    result = out.to(x.dtype)
    return result.unsqueeze(-2) if keepdim else result


def use_c_norms(graph: fx.Graph) -> int:
    """Make ``graph``'s ``linalg_vector_norm`` nodes call ``vector_norm`` (in place); how
    many it changed."""
    changed = 0
    for node in graph.nodes:
        if node.target is _ATEN:
            node.target = vector_norm
            changed += 1
    if changed and not isinstance(find_compiler(), str):
        _library()  # (its build starts now, while the plan is made)
    return changed


def with_c_norms(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose ``linalg_vector_norm`` nodes call ``vector_norm``."""
    graph = copy.deepcopy(gm.graph)
    use_c_norms(graph)
    return fx.GraphModule(gm, graph)
