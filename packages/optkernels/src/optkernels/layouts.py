"""Memory layouts of a lane's tensors: the kernels read a parameter, its grad and its state
at the same flat offsets, so they must share one dense layout (any order of dims)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx

from optkernels.lanes import LaneProgram, NotLanes


def _dense(t: Any) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (any order of dims)."""
    expected = 1
    dims = zip(t.shape, t.stride(), strict=True)
    for stride, size in sorted((st, sz) for sz, st in dims if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def layouts(
    programs: Sequence[LaneProgram], index: dict[fx.Node, int], num_inputs: int
) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The kernels read a lane's tensors element for element at the same offsets: they must
    share one dense memory layout. The step's own inputs (layouts fixed by the entry's
    guards) are checked here (NotLanes if they differ); for values the torch backend computes
    first (``index >= num_inputs``), returns the (shape, stride) each must be given."""
    out: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for program in programs:
        for lane in range(program.lanes):
            vals = [
                (index[column[lane]], column[lane].meta["val"])
                for column, small in zip(program.inputs, program.input_small, strict=True)
                if not small
            ]
            fixed = [v for i, v in vals if i < num_inputs]
            kinds = {
                "contiguous" if v.is_contiguous() else (tuple(v.shape), tuple(v.stride()))
                for v in fixed
            }
            if len(kinds) > 1 or not all(_dense(v) for v in fixed):
                raise NotLanes(
                    f"lane {lane}'s tensors do not share one dense memory layout (shapes and "
                    f"strides {sorted({(tuple(v.shape), tuple(v.stride())) for v in fixed})})"
                )
            like = fixed[0] if fixed and "contiguous" not in kinds else None
            for i, v in vals:
                if i >= num_inputs:
                    shape = tuple(v.shape)
                    if like is not None and tuple(like.shape) == shape:
                        out[i] = (shape, tuple(like.stride()))
                    elif like is None:
                        out[i] = (shape, _contiguous_strides(shape))
                    else:
                        raise NotLanes(
                            f"lane {lane} mixes a {list(shape)} result with a "
                            f"{list(like.shape)} tensor of strides {list(like.stride())}"
                        )
    return out
