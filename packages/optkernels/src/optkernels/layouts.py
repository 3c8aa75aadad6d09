"""Memory layouts of a lane's tensors: the kernels read a parameter, its grad and its state
at the same flat offsets, so they must share one dense layout (any order of dims)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
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
            contiguous = [v.is_contiguous() for v in fixed]
            kinds = {
                "contiguous" if c else (tuple(v.shape), tuple(v.stride()))
                for v, c in zip(fixed, contiguous, strict=True)
            }
            # (a contiguous tensor holding values is dense: checked without sorting its dims)
            dense = [
                (c and v.numel() > 0) or _dense(v) for v, c in zip(fixed, contiguous, strict=True)
            ]
            if len(kinds) > 1 or not all(dense):
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


Layouts = dict[int, tuple[tuple[int, ...], tuple[int, ...]]]


def relaid(layouts: Layouts, gm: fx.GraphModule) -> int:
    """How many of the prelude's results (inputs of ``gm``, the main graph) ``with_prelude``
    copies into another layout each call, as the trace recorded them (a tall matrix's
    update, which Muon's matmuls give transposed): one launch each."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return sum(
        1
        for i, (_, stride) in layouts.items()
        if isinstance(vals[i], torch.Tensor) and tuple(vals[i].stride()) != stride
    )


def with_prelude(
    prelude: Any, layouts: Layouts, inputs: Sequence[Any]
) -> tuple[list[Any], tuple[torch.Tensor, ...]]:
    """The kernels' inputs after a prelude (the ops a plan runs on the torch backend first):
    ``inputs`` followed by the prelude's results, each of those ``layouts`` names copied into
    its (shape, stride) where the result came out in another (e.g. a transposed matmul
    result); and the results themselves (for ``write_back``). No prelude: the inputs as a
    list."""
    if prelude is None:
        return (inputs if type(inputs) is list else list(inputs)), ()
    results: tuple[torch.Tensor, ...] = prelude(inputs)
    out = [*inputs, *results]
    for i, (shape, stride) in layouts.items():
        value = out[i]
        if value.stride() != stride:
            out[i] = torch.empty_strided(
                shape, stride, dtype=value.dtype, device=value.device
            ).copy_(value)
    return out, results


def write_back(
    writes: Sequence[tuple[int, int]], inputs: Sequence[Any], results: Sequence[Any]
) -> None:
    """Prelude values written back into inputs (a LAMB moment), as ``(input, result)``
    positions: after the kernels, which read the inputs' old values."""
    if writes:
        with torch.no_grad():
            torch._foreach_copy_([inputs[i] for i, _ in writes], [results[j] for _, j in writes])
