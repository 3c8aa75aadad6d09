"""Which dtype each op of a lane program computes in and returns, as ATen decides.

An ATen op on tensors casts its tensor operands to a common dtype (type promotion, where 0-dim
tensors give way to the others and Python numbers do not count), computes in that dtype's
"opmath" type (float32 for float16, bfloat16 and float32; float64 for float64) and stores its
result in the output's dtype: the common one, or for an in-place op (which the traced graph
records as the op's result dtype) its ``self``'s. Both depend on the lane: a 0-dim float16
parameter's ``p / bias_correction`` promotes to float32 where a larger one stays float16.
``op_dtypes`` gives them for one lane, from the graph's dtypes and shapes; lanes that agree
share a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from optkernels.lanes import LaneProgram
from optkernels.numbers import HOST_ONLY

COMPARE = frozenset({"gt", "lt", "ge", "le", "eq", "ne"})


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ATen computes an op of ``dtype`` in (its opmath type)."""
    return torch.float64 if dtype is torch.float64 else torch.float32


@dataclass(frozen=True)
class OpDtypes:
    """One op of one lane: its operands are cast to ``common``, it computes in
    ``compute_dtype(common)`` and its result is a ``result`` (None: a Python number, an
    ``.item()``; torch.bool: a comparison)."""

    common: torch.dtype
    result: torch.dtype | None


def lanes_by_dtypes(program: LaneProgram) -> dict[tuple[Any, ...], list[int]]:
    """The lanes of ``program`` by their inputs' dtypes and what each op computes in and
    returns (``op_dtypes``, sorted by var): one kernel per group."""
    by_id: dict[tuple[Any, int], tuple[tuple[Any, ...], list[int]]] = {}
    items: dict[int, tuple[Any, ...]] = {}  # id of a shared dict -> its sorted items
    by_lane = op_dtypes_by_lane(program)
    columns = [[n.meta["val"].dtype for n in column] for column in program.inputs]
    for lane, (ops, dtypes) in enumerate(
        zip(by_lane, _by_lane(columns, program.lanes), strict=True)
    ):
        found = items.get(id(ops))
        if found is None:
            found = items[id(ops)] = tuple(sorted(ops.items()))
        # (grouped by the id of the shared op dtypes: a tuple's hash is not cached, and
        # hashing every lane's key would hash each of its ops' dtypes)
        by_id.setdefault((dtypes, id(found)), ((dtypes, found), []))[1].append(lane)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for key, lanes in by_id.values():  # (lanes of other shapes may compute alike)
        groups[key] = sorted(groups[key] + lanes) if key in groups else lanes
    return groups


def op_dtypes_by_lane(program: LaneProgram) -> list[dict[int, OpDtypes]]:
    """``op_dtypes`` of every lane, computed once per distinct lane (10,000 parameters of
    a few dtypes need a few, not 10,000; equal lanes share one dict: do not modify)."""
    known: dict[tuple[Any, ...], dict[int, OpDtypes]] = {}
    out = []
    for lane, key in enumerate(_lane_keys(program)):
        found = known.get(key)
        if found is None:
            found = known[key] = op_dtypes(program, lane)
        out.append(found)
    return out


def _lane_keys(program: LaneProgram) -> list[tuple[Any, ...]]:
    """Everything ``op_dtypes`` reads of each lane (built column by column: a step of
    10,000 parameters asks for 10,000 keys)."""
    lanes = program.lanes
    inputs = [
        [
            (val.dtype, node.meta.get("dequantized", (None, val.dtype))[1], val.dim())
            for node in column
            for val in (node.meta["val"],)
        ]
        for column in program.inputs
    ]
    ops = [
        op.dtypes if len(op.dtypes) > 1 else (op.dtypes[0] if op.dtypes else None,) * lanes
        for op in program.ops
    ]
    return list(zip(_by_lane(inputs, lanes), _by_lane(ops, lanes), strict=True))


def _by_lane(columns: list[Any], lanes: int) -> list[tuple[Any, ...]]:
    """Per lane, its entry of every column (each column: one entry per lane)."""
    return list(zip(*columns, strict=True)) if columns else [()] * lanes


def op_dtypes(program: LaneProgram, lane: int) -> dict[int, OpDtypes]:
    """Per var of ``program`` (inputs included), its dtypes in lane ``lane``."""
    out: dict[int, OpDtypes] = {}
    dim0: dict[int, bool] = {}  # the lane's value is a 0-dim tensor (or a number)
    for op in program.ops:
        if op.op == "input":
            node = program.inputs[op.args[0]][lane]
            val = node.meta["val"]
            # compressed state (a bfloat16 payload) is read as the dtype it stores
            stored = node.meta.get("dequantized", (None, val.dtype))[1]
            out[op.out] = OpDtypes(val.dtype, stored)
            dim0[op.out] = val.dim() == 0
            continue
        lanes = op.lane_vars
        operands = lanes[1:] if op.op == "where" else lanes  # (a where's condition: a bool)
        tensors = [v for v in operands if out[v].result not in (None, torch.bool)]
        dim0[op.out] = all(dim0[v] for v in lanes)
        big = [out[v].result for v in tensors if not dim0[v]]
        promoted = _promote(big or [out[v].result for v in tensors])
        recorded = op.dtype(lane)
        if op.op == "item" or op.op in HOST_ONLY:  # a Python number (a double)
            out[op.out] = OpDtypes(torch.float64, None)
        elif op.op in COMPARE:
            out[op.out] = OpDtypes(promoted or torch.float32, torch.bool)
        elif op.op == "copy":  # the source is cast to the destination's dtype
            result = recorded or out[lanes[0]].result or torch.float32
            out[op.out] = OpDtypes(result, result)
        else:
            common = promoted or recorded or torch.float32
            out[op.out] = OpDtypes(common, recorded or common)
    return out


def _promote(dtypes: list[torch.dtype | None]) -> torch.dtype | None:
    result: torch.dtype | None = None
    for d in dtypes:
        if d is not None:
            result = d if result is None else torch.promote_types(result, d)
    return result
