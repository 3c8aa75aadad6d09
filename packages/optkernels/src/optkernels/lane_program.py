"""The LaneProgram: one elementwise program applied to every tensor index (a "lane") of a
step, the form ``lanes.analyze`` gives a step graph and the kernel generators read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten


class NotLanes(Exception):
    """The graph is not a per-lane program; the message says why."""


@dataclass(frozen=True)
class LaneOp:
    """``out = op(args)`` for every lane. Args: ("lane", var) | ("scalar", index) | ("const",
    value) | ("scalar_list", vars_per_lane) ; kwargs likewise."""

    out: int
    op: str
    overload: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    small: bool  # every lane's value is a 0-dim tensor
    # The dtype of the op's result as the graph records it, per lane (one entry: the same for
    # every lane; none: not recorded, as in a hand-built graph). A kernel computes each lane
    # at its recorded dtype: a 0-dim float16 parameter's for-loop ops promote to float32.
    dtypes: tuple[torch.dtype, ...] = ()

    @property
    def lane_vars(self) -> list[int]:
        """The lane values this op reads (none for an input)."""
        return [] if self.op == "input" else lane_vars(self.args, self.kwargs)

    def dtype(self, lane: int) -> torch.dtype | None:
        """The recorded dtype of lane ``lane``'s result, or None."""
        if not self.dtypes:
            return None
        return self.dtypes[lane] if len(self.dtypes) > 1 else self.dtypes[0]


def lane_vars(args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]) -> list[int]:
    """The lane vars among an op's (args, kwargs) references."""
    refs = (*args, *(v for _, v in kwargs))
    return [a[1] for a in refs if isinstance(a, tuple) and a[0] == "lane"]


@dataclass
class LaneProgram:
    lanes: int
    inputs: list[tuple[fx.Node, ...]] = field(default_factory=list)  # per input: a node per lane
    input_small: list[bool] = field(default_factory=list)
    scalar_inputs: list[fx.Node] = field(default_factory=list)  # scalar placeholders
    scalar_nodes: list[fx.Node] = field(default_factory=list)  # host-side arithmetic, in order
    ops: list[LaneOp] = field(default_factory=list)
    writes: list[tuple[int, int]] = field(default_factory=list)  # (lane var, input index)
    num_vars: int = 0
    # Written input columns of compressed state (optkernels.compressed): column -> (format,
    # scalar index of bf16's rounding counter (-1 for int8), salt, the lanes whose payload
    # it is).
    rounding: dict[int, tuple[str, int, int, frozenset[int]]] = field(default_factory=dict)


# Foreach op base name -> per-element op name understood by the kernel generator.
_FOREACH = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "addcmul": "addcmul",
    "addcdiv": "addcdiv",
    "lerp": "lerp",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "reciprocal": "reciprocal",
    "neg": "neg",
    "abs": "abs",
    "sign": "sign",
    "exp": "exp",
    "log": "log",
    "pow": "pow",
    "maximum": "maximum",
    "minimum": "minimum",
    "clamp_min": "maximum",
    "clamp_max": "minimum",
    "copy": "copy",
    "zero": "zero",
}


# Single-tensor ATen op name -> per-element op name (same names as the foreach ones).
_SINGLE = {
    **_FOREACH,
    "rsub": "rsub",
    "clamp": "clamp",
    "where": "where",
    "gt": "gt",
    "lt": "lt",
    "ge": "ge",
    "le": "le",
    "eq": "eq",
    "ne": "ne",
    "clone": "identity",
    "detach": "identity",
    "alias": "identity",
    # A 0-dim lane value used as a Python number (Adagrad's for-loop ``-clr``): the lane
    # keeps it as a per-lane value, nothing leaves the device; ops read it as ATen reads a
    # Python scalar (in their compute dtype, not rounded to a float16 tensor's dtype).
    "_local_scalar_dense": "item",
    "scalar_tensor": "full",
    "ones_like": "ones",
    "zeros_like": "zero",
}


def result_dtypes(node: fx.Node) -> tuple[torch.dtype, ...]:
    """The dtypes ``node``'s metadata records for its result: one per tensor (a foreach op's
    list gives one per lane); none where it records no tensors."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (val.dtype,)
    if isinstance(val, list | tuple) and val and all([isinstance(t, torch.Tensor) for t in val]):
        return tuple([t.dtype for t in val])
    return ()


IGNORED_KWARGS = ("dtype", "device", "layout", "pin_memory", "memory_format", "non_blocking")


def check_numels(program: LaneProgram) -> None:
    columns = [  # (column by column: a step of 10,000 parameters has 10,000 lanes)
        [
            int(stored[2]) if (stored := n.meta.get("dequantized")) else n.meta["val"].numel()
            for n in nodes
        ]
        for nodes, small in zip(program.inputs, program.input_small, strict=True)
        if not small
    ]
    if len(columns) < 2:
        return
    first = columns[0]
    for other in columns[1:]:
        if other != first:
            break
    else:
        return
    for lane, numels in enumerate(zip(*columns, strict=True)):
        if len(set(numels)) > 1:
            raise NotLanes(f"lane {lane} mixes tensors of different sizes {sorted(set(numels))}")


def logical_numel(node: fx.Node) -> int:
    """The elements input ``node`` holds (a compressed payload: those it stores)."""
    stored = node.meta.get("dequantized")
    return int(stored[2]) if stored else int(node.meta["val"].numel())
