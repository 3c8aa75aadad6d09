"""The Triton helpers generated kernels call (int8 state, stochastic rounding, pow,
bfloat16 rounding), and the part of them a kernel's module needs (``prelude_for``)."""

from __future__ import annotations

import re

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
