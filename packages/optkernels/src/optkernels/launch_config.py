"""The launch shape of the generated kernels: elements per program instance, warps, and
the register limit; tuned on an H100 and overridable from the environment for experiments.
Each element computes the same whichever shape is chosen."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from optkernels.compressed import BLOCK as INT8_BLOCK

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
