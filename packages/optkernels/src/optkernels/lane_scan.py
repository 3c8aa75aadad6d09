"""One pass over a step graph (``scan``): its Python scalars, the per-lane numbers among
them, and its tensor ops grouped into independent components, which ``lanes`` reads as
lanes (a for-loop step) or param groups (a foreach step)."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from optkernels.numbers import reads_tensor, scalar_constant

aten = torch.ops.aten


def parts(scan: Scan) -> dict[int, set[fx.Node]]:
    """Tensor ops connected through the tensors and lists they share, ignoring the Python
    scalars every part reads, by their lane count (``lane_count``)."""
    # Parts over the same number of tensors stay one program (a group's step increments are
    # not connected to its update but belong to the same lanes): one kernel per group size.
    by_lanes: dict[int, set[fx.Node]] = {}
    for component in scan.components:
        by_lanes.setdefault(lane_count(component), set()).update(component)
    return by_lanes


@dataclass
class Scan:
    """What one pass over a step graph finds (``scan``)."""

    foreach: bool  # it has foreach ops
    numbers: set[fx.Node]  # Python arithmetic on a lane's value
    scalars: frozenset[fx.Node]  # its Python scalars (``is_scalar``)
    ordered: list[fx.Node]  # the same, in graph order
    # Its tensor ops grouped by the tensors and lists they share, and
    # each op's shape: its target (by id) and which of its inputs are Python scalars.
    components: list[list[fx.Node]]
    shapes: dict[fx.Node, tuple[int, tuple[bool, ...]]]


def scan(graph: fx.Graph) -> Scan:
    """The Python scalars of ``graph``, its lane numbers (Python arithmetic on a value read
    from a tensor, ``.item()``, directly or through other such arithmetic, and the checks on
    it: per-lane values, not scalars every lane shares) and its tensor ops grouped by the
    tensors and lists they share (Python scalars and 0-dim constants, which every op may
    read, do not connect them; lane numbers do), each group in graph order. One pass:
    the graph is in dataflow order, so each node's inputs are classified before it (a large
    for-loop step has tens of nodes per parameter, each looked at once here)."""
    numbers: set[fx.Node] = set()
    scalars: set[fx.Node] = set()
    ordered: list[fx.Node] = []
    # A node's component (an id, until merged: ``merged``); -1: a scalar every op may read
    # (not a lane number) or a 0-dim constant, which joins nothing; none: an unread input.
    comp: dict[fx.Node, int] = {}
    merged: dict[int, int] = {}
    ops: list[fx.Node] = []
    shapes: dict[fx.Node, tuple[int, tuple[bool, ...]]] = {}
    foreach = False
    kinds = _TARGET_KINDS
    is_scalar = scalars.__contains__
    for node in graph.nodes:
        op = node.op
        if op == "placeholder":
            if not isinstance(node.meta.get("val"), torch.Tensor):
                scalars.add(node)
                ordered.append(node)
                comp[node] = -1
            continue
        if op == "get_attr":
            if scalar_constant(node) is not None:
                comp[node] = -1
            continue
        if op != "call_function":
            continue
        target = node.target
        # (by id: an OpOverload hashes in Python; the entry keeps its target alive)
        known = kinds.get(id(target))
        if known is None or known[0] is not target:
            known = (target, *_target_kind(target))
            if len(kinds) < 4096:  # (a step's few distinct ops, asked per node)
                kinds[id(target)] = known
        _, scalar, checked, _, foreach_op = known
        foreach = foreach or foreach_op
        inputs = node.all_input_nodes
        if checked and (  # (a lane number; arithmetic on shared scalars: quickly not)
            not numbers.isdisjoint(inputs)
            or (not scalars.issuperset(inputs) and any(reads_tensor(a, numbers) for a in inputs))
        ):
            numbers.add(node)
        if scalar:
            scalars.add(node)
            ordered.append(node)
            if node not in numbers:
                comp[node] = -1
                continue
        mine = -1
        for a in inputs:
            c = comp.get(a)
            if c is None:  # an input's first read
                if mine < 0:
                    mine = len(ops)
                comp[a] = mine
            elif c >= 0:
                while c in merged:
                    c = merged[c]
                if mine < 0:
                    mine = c
                elif c != mine:
                    merged[c] = mine
        comp[node] = mine if mine >= 0 else len(ops)
        ops.append(node)
        shapes[node] = (id(target), tuple(map(is_scalar, inputs)))  # (alive as the graph is)
    components: dict[int, list[fx.Node]] = {}
    for node in ops:
        c = comp[node]
        if merged:
            while c in merged:
                c = merged[c]
        components.setdefault(c, []).append(node)
    return Scan(foreach, numbers, frozenset(scalars), ordered, list(components.values()), shapes)


def _target_kind(target: Any) -> tuple[bool, bool, bool, bool]:
    """Of a call_function node with ``target``: (``is_scalar``, ``is_python_op`` or
    ``is_assert`` (what may be a lane number), ``is_python_op``, ``is_foreach``)."""
    getitem = target is operator.getitem
    operator_fn = not getitem and getattr(target, "__module__", "") == "_operator"
    python = operator_fn or (not getitem and target in (min, max, abs))
    checked = python or target is aten._assert_scalar.default
    return operator_fn, checked, python, getattr(target, "__name__", "").startswith("_foreach_")


_TARGET_KINDS: dict[int, tuple[Any, bool, bool, bool, bool]] = {}


def lane_count(component: list[fx.Node]) -> int:
    """The length of the lists the first foreach op of ``component`` (in graph order) takes;
    -1 if it has none."""
    for node in component:
        if is_foreach(node):
            for arg in node.args:
                if isinstance(arg, list | tuple) and arg:
                    return len(arg)
    return -1


def is_foreach(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    found = _FOREACH_TARGETS.get(target)
    if found is None:
        found = getattr(target, "__name__", "").startswith("_foreach_")
        if len(_FOREACH_TARGETS) < 4096:  # (a step's few distinct ops, asked per node)
            _FOREACH_TARGETS[target] = found
    return found


_FOREACH_TARGETS: dict[Any, bool] = {}


def is_scalar(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "placeholder":
        return not isinstance(node.meta.get("val"), torch.Tensor)
    if node.op != "call_function":
        return False
    target = node.target
    found = _OPERATOR_TARGETS.get(target)
    if found is None:
        found = target is not operator.getitem and getattr(target, "__module__", "") == "_operator"
        if len(_OPERATOR_TARGETS) < 4096:  # (a step's few distinct ops, asked per node)
            _OPERATOR_TARGETS[target] = found
    return found


_OPERATOR_TARGETS: dict[Any, bool] = {}
