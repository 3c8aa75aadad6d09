"""A traced foreach graph seen as one program applied to every tensor index (a "lane").

An optimizer's foreach step applies the same ops to the i-th param, grad and state tensors
for every i. ``analyze`` turns such a graph into a LaneProgram: its lane inputs (lists of
graph inputs, one per lane), its Python-scalar inputs and the scalar arithmetic on them,
its per-lane ops, and which lane values are written back into which inputs. A kernel
generator can then emit one elementwise kernel covering all lanes. Graphs that are not of
this form (per-tensor op sequences, reductions, data-dependent reads, graph outputs) are
refused with the reason, and the caller runs them another way.

Its parts: ``lane_program`` (the program), ``lane_scan`` (one pass over the graph),
``loop_lanes`` (for-loop steps), ``foreach_lanes`` (foreach steps).
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch import fx

from optkernels.compressed import DEQUANTIZE, QUANTIZE
from optkernels.foreach_lanes import Builder
from optkernels.lane_program import (
    _FOREACH,
    _SINGLE,
    LaneOp,
    LaneProgram,
    NotLanes,
    lane_vars,
    logical_numel,
)
from optkernels.lane_scan import is_scalar, parts, scan
from optkernels.loop_lanes import analyze_per_tensor
from optkernels.numbers import is_assert, scalar_constant

__all__ = [
    "LaneOp",
    "LaneProgram",
    "NotLanes",
    "analyze",
    "analyze_parts",
    "fusible",
    "lane_vars",
    "logical_numel",
]

aten = torch.ops.aten


def fusible(node: fx.Node) -> bool:
    """Whether the kernel generator knows ``node``'s op (placeholders and outputs count;
    a constant the step made, ``torch.tensor(...)``, is handed over by the torch backend
    unless it is a 0-dim float, which the kernels take as a constant)."""
    if node.op == "get_attr":
        return scalar_constant(node) is not None
    if node.op != "call_function":
        return True
    target = node.target
    if target is operator.getitem or target is aten.copy_.default or is_scalar(node):
        return True
    if is_assert(node):  # a check on a Python number (the host makes it)
        return True
    if target in (DEQUANTIZE, QUANTIZE):  # compressed state: converted where loaded/stored
        return node.args[1] in ("bf16", "int8")
    if target in (min, max, abs):
        return True
    base = getattr(target, "__name__", "").partition(".")[0]
    if base in _SINGLE:
        return True
    return base.startswith("_foreach_") and base[len("_foreach_") :] in _FOREACH


def analyze(graph: fx.Graph) -> LaneProgram:
    """The LaneProgram of ``graph``; raises NotLanes naming what does not fit."""
    programs = analyze_parts(graph)
    if len(programs) != 1:
        raise NotLanes(f"the graph has {len(programs)} independent parts (param groups)")
    return programs[0]


def analyze_parts(graph: fx.Graph) -> list[LaneProgram]:
    """One LaneProgram per independent part of ``graph``: a foreach step over several param
    groups runs one set of foreach ops per group, with lists of different lengths; the
    per-tensor ops of its for-loop groups (``foreach=False`` beside ``True``) are one more
    part, a for-loop program."""
    graph_scan = scan(graph)
    if not graph_scan.foreach:
        return [analyze_per_tensor(graph, graph_scan)]
    numbers = graph_scan.numbers
    programs = []
    by_lanes = parts(graph_scan)
    loose = by_lanes.pop(-1, None)  # (no foreach op: the for-loop groups beside foreach ones)
    if loose is not None:
        components = [c for c in graph_scan.components if c[0] in loose]
        programs.append(analyze_per_tensor(graph, replace(graph_scan, components=components)))
    for count, part in by_lanes.items():
        builder = Builder(count, numbers)
        for node in graph.nodes:
            if (
                node in part
                or node in graph_scan.scalars
                or node.op in ("placeholder", "output", "get_attr")
            ):
                builder.visit(node)
        programs.append(builder.finish())
    return programs
