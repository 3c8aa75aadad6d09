"""The compressed-state kernels as they were before the int8 rework, for side-by-side timing.

``state_dtype_gpu.py`` times its ``int8-before`` and ``bf16-before`` variants inside
``kernels_before()``: the generated kernels are today's, with the int8 conversions, bf16's
rounding and the aligned branch's alignment hints (16 bytes for every input) put back as
they were (commit e3ee4fd):

- int8: 1024 elements by 4 warps per program; each element loads its block's scale; the
  four 256-element blocks of a program reduce their absmax and sign across the four warps
  (Triton goes through shared memory with barriers); divisions and square roots correctly
  rounded, per element; codes through float-to-int conversions;
- bf16: the rounding hash in int64 arithmetic masked to 32 bits.

Both read and write the same payload format as today's kernels (a code's value and a
block's scale mean the same), so the optimizer steps alike and only the time differs.
``launch_shape(block, warps)`` instead keeps today's int8 kernel and changes its launch
shape (e.g. 1024 by 4 warps, the shape before: four blocks a program, each across two warps).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import optkernels.kernel_cache as kernel_cache
import optkernels.triton_group as triton_group
import torch

_HELPERS_BEFORE = """
@triton.jit
def _dequantize_int8_before(code, scale):
    c = code.to(tl.float32)
    centered = (c - 128.0) * (1.0 / 127.0)
    fraction = c * (1.0 / 255.0)
    unsigned = scale.to(tl.int32, bitcast=True) < 0
    return tl.where(unsigned, fraction * fraction, centered * tl.abs(centered)) * tl.abs(scale)


@triton.jit
def _quantize_int8_before(x, mask, BLOCK: tl.constexpr):
    a = tl.where(mask, tl.abs(x), 0.0)
    neg = tl.where(mask & (x < 0), 1, 0)
    absmax = tl.max(tl.reshape(a, (BLOCK // 256, 256)), axis=1)
    any_neg = tl.max(tl.reshape(neg, (BLOCK // 256, 256)), axis=1)
    absmax = tl.reshape(tl.broadcast_to(absmax[:, None], (BLOCK // 256, 256)), (BLOCK,))
    any_neg = tl.reshape(tl.broadcast_to(any_neg[:, None], (BLOCK // 256, 256)), (BLOCK,))
    unsigned = any_neg == 0
    safe = tl.where(absmax > 0, absmax, 1.0)
    ratio = tl.minimum(tl.maximum(tl.div_rn(tl.where(mask, x, 0.0), safe), -1.0), 1.0)
    root = tl.sqrt_rn(tl.abs(ratio))
    signed = tl.floor(tl.where(ratio < 0, -root, root) * 127.0 + 128.0 + 0.5)
    positive = tl.floor(tl.sqrt_rn(tl.maximum(ratio, 0.0)) * 255.0 + 0.5)
    positive = tl.where(ratio > 0, tl.maximum(positive, 1.0), positive)
    code = tl.where(unsigned, positive, signed)
    return code.to(tl.uint8), tl.where(unsigned, -absmax, absmax)


@triton.jit
def _round_bf16_stochastic_before(x, offs, counter, salt_mix):
    seed = (counter.to(tl.int64) * 0x85EBCA77 + salt_mix) & 0xFFFFFFFF
    h = (offs.to(tl.int64) * 0x9E3779B1 + seed) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    bits = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    r = (bits + (h & 0xFFFF)) & 0xFFFF0000
    r = tl.where(r >= 0x80000000, r - 0x100000000, r)
    y = r.to(tl.int32).to(tl.float32, bitcast=True)
    finite = (x == x) & (tl.abs(x) != float("inf"))
    return tl.where(finite, y, x).to(tl.bfloat16)

"""

_SCALE = re.compile(r"_int8_scale\((.+?), offs, start, mask, BLOCK\)")
_HINT = re.compile(r"tl\.multiple_of\((a\d+\.to\(tl\.pointer_type\(tl\.\w+\)\)), \d+\)")
_STORE = re.compile(r"^    _store_int8\((p\d+), (.+), ([^,]+), offs, start, mask, BLOCK\)$", re.M)


def _source_before(source: str) -> str:
    """A generated kernel's source with the int8 and bf16 conversions as they were."""
    source = source.replace("_round_bf16_stochastic(", "_round_bf16_stochastic_before(")
    source = source.replace("_dequantize_int8(", "_dequantize_int8_before(")
    source = _SCALE.sub(r"tl.load(\1 + offs // 256, mask=mask, other=0.0)", source)
    source = _HINT.sub(r"tl.multiple_of(\1, 16)", source)

    def store(match: re.Match[str]) -> str:
        p, scales, value = match.groups()
        return (
            f"    q_{p}, scale_{p} = _quantize_int8_before({value}, mask, BLOCK)\n"
            f"    tl.store({p} + offs, q_{p}, mask=mask)\n"
            f"    tl.store({scales} + offs // 256, scale_{p}, mask=mask & (offs % 256 == 0))"
        )

    return _STORE.sub(store, source)


@contextlib.contextmanager
def _patched(source: Any, config: Any, extra_helpers: str = "") -> Iterator[None]:
    """Kernels lowered within use ``source`` and ``config``; each kernel module gets
    ``extra_helpers`` after the helpers it uses (patched where the kernel cache looks
    ``prelude_for`` up: the prelude's helper table is built at import)."""
    saved = triton_group.kernel_source, triton_group.launch_config, kernel_cache.prelude_for
    today_prelude = kernel_cache.prelude_for
    triton_group.kernel_source, triton_group.launch_config = source, config
    kernel_cache.prelude_for = lambda text: today_prelude(text) + extra_helpers
    try:
        yield
    finally:
        triton_group.kernel_source, triton_group.launch_config, kernel_cache.prelude_for = saved


def kernels_before() -> contextlib.AbstractContextManager[None]:
    """Within: kernels lowered now are generated as before the int8 rework (the module
    docstring). Compile and run the optimizer's first step inside."""
    today_source, today_config = triton_group.kernel_source, triton_group.launch_config

    def source(*args: Any, **kwargs: Any) -> str:
        return _source_before(today_source(*args, **kwargs))

    def config(dtypes: Any) -> tuple[int, int]:
        return (1024, 4) if torch.uint8 in dtypes else today_config(dtypes)

    return _patched(source, config, _HELPERS_BEFORE)


def launch_shape(block: int, warps: int) -> contextlib.AbstractContextManager[None]:
    """Within: today's int8 kernels launched ``block`` elements by ``warps`` warps."""
    today_config = triton_group.launch_config

    def config(dtypes: Any) -> tuple[int, int]:
        return (block, warps) if torch.uint8 in dtypes else today_config(dtypes)

    return _patched(triton_group.kernel_source, config)
