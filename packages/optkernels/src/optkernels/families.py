"""A step graph read as ops repeated over lanes, for the torch backend's batched plan.

A for-loop step applies one op sequence to each parameter; a foreach step applies foreach ops
to all of them and works on single items in between (a step count read as a number, the
writebacks). ``families`` groups the graph's per-item nodes into *families*: the connected
pieces of per-item work (tensor ops and the Python arithmetic on values read from them) that
have the same structure, one member per lane. Each position of a family, each foreach node
and each shared Python-scalar node becomes one BatchedOp, which ``batched.py`` runs as one
call over all its lanes.

Unlike ``lanes`` (what a Triton kernel can compute) this keeps each node's own ATen op, so
the torch backend runs exactly the ops of the graph, and it takes any op: a family's op the
plan cannot batch runs in a loop over the lanes. Running a family's nodes together reorders
the graph, which is safe because it is functional (every read sees the inputs as they were
at the call; the writes are its ``copy_`` nodes, which the plan runs last: nothing may read
an input after its write), has no random ops and no in-place ops besides those writes.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from optkernels.lane_program import NotLanes
from optkernels.lane_scan import is_foreach
from optkernels.numbers import eager_target

aten = torch.ops.aten

# How a batched op reads one argument (``Arg``):
#   ("const", value)           the same constant for every lane
#   ("node", node)             one node's value for every lane (a shared scalar, a whole list)
#   ("column", nodes)          lane i reads nodes[i] (for a foreach op: the list itself)
#   ("seq", type, args)        a list or tuple of such arguments
Arg = tuple[Any, ...]


@dataclass(frozen=True)
class BatchedOp:
    """One call over lanes: ``kind`` "family" (``nodes``: one node per lane, all applying
    ``target``), "foreach" (a foreach node of the graph) or "shared" (a Python-scalar node
    every lane reads, computed once)."""

    kind: str
    target: Any
    nodes: tuple[fx.Node, ...]
    args: tuple[Arg, ...]
    kwargs: tuple[tuple[str, Arg], ...]
    returned: bool = False  # a node is among the graph's outputs

    @property
    def lanes(self) -> int:
        return len(self.nodes)


@dataclass
class Families:
    """A graph as BatchedOps in an order that respects its dataflow, plus its writebacks."""

    placeholders: list[fx.Node]
    constants: list[fx.Node]  # get_attr nodes: tensors the step made from Python data
    ops: list[BatchedOp] = field(default_factory=list)
    writes: list[tuple[fx.Node, fx.Node]] = field(default_factory=list)  # (input, value)
    output: Any = ()  # the output node's argument (nodes inside)
    largest: int = 0  # members of the largest family


def is_python(node: fx.Node) -> bool:
    """Whether ``node`` runs Python arithmetic (on numbers), not an ATen op."""
    return not isinstance(node.target, torch._ops.OpOverload)


def families(graph: fx.Graph) -> Families:
    """The BatchedOps of ``graph``; raises NotLanes naming what keeps it from being batched."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    kind = _kinds(nodes)
    program = Families(
        placeholders=[n for n in nodes if n.op == "placeholder"],
        constants=[n for n in nodes if n.op == "get_attr"],
    )
    program.output = next(n for n in reversed(nodes) if n.op == "output").args[0]
    program.writes = [(n.args[0], n.args[1]) for n in nodes if kind.get(n) == "write"]
    canon = _canonical(nodes, kind)
    components = _components([n for n in nodes if kind.get(n) == "lane"], kind)
    by_signature: dict[Any, list[list[fx.Node]]] = {}
    for component in components:
        key = _signature(component, kind, canon)
        by_signature.setdefault(key, []).append(component)
    keyed: list[tuple[int, BatchedOp]] = []
    for members in by_signature.values():
        program.largest = max(program.largest, len(members))
        for j in range(len(members[0])):
            column = tuple(member[j] for member in members)
            keyed.append((max(position[n] for n in column), _family_op(column, kind)))
    for node in nodes:
        if node.op == "call_function" and kind[node] in ("foreach", "shared"):
            keyed.append((position[node], _single_op(node, kind)))
    if not any(n.op == "call_function" for n in nodes):
        raise NotLanes("the step has no tensor work")
    if program.largest < 2 and not any(k == "foreach" for k in kind.values()):
        raise NotLanes(
            "no per-parameter op sequence repeats (one parameter, each one's ops differ, "
            "or they read each other's values)"
        )
    program.ops = _schedule(keyed)
    return program


def _schedule(keyed: list[tuple[int, BatchedOp]]) -> list[BatchedOp]:
    """The ops in an order where each runs after those whose results it reads, as close to
    the graph's order (``keyed``: the position of an op's last node) as that allows."""
    producer: dict[fx.Node, int] = {}
    for i, (_, op) in enumerate(keyed):
        for node in op.nodes:
            producer[node] = i
            if op.kind == "foreach":
                for user in node.users:  # its items
                    producer[user] = i
    users: list[list[int]] = [[] for _ in keyed]
    waiting = [0] * len(keyed)
    for i, (_, op) in enumerate(keyed):
        deps = {producer[n] for n in _reads(op) if n in producer}
        if i in deps:
            raise NotLanes(
                f"{op.nodes[0].name}: one lane's {op.target} reads another lane's "
                "(through ops between them)"
            )
        for d in deps:
            users[d].append(i)
        waiting[i] = len(deps)
    ready = [(key, i) for i, (key, _) in enumerate(keyed) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(keyed[i][1])
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (keyed[u][0], u))
    if len(order) != len(keyed):
        stuck = next(op for i, (_, op) in enumerate(keyed) if waiting[i])
        raise NotLanes(f"{stuck.nodes[0].name}: lanes of one op depend on each other")
    return order


def _reads(op: BatchedOp) -> set[fx.Node]:
    """The nodes ``op`` reads."""
    found: set[fx.Node] = set()

    def visit(arg: Arg) -> None:
        if arg[0] == "node":
            found.add(arg[1])
        elif arg[0] == "column":
            found.update(arg[1])
        elif arg[0] == "seq":
            for a in arg[2]:
                visit(a)

    for a in (*op.args, *(v for _, v in op.kwargs)):
        visit(a)
    return found


def _kinds(nodes: list[fx.Node]) -> dict[fx.Node, str]:
    """Each node's role: "input" (a tensor placeholder or constant), "shared" (a Python scalar
    every lane reads), "foreach", "item" (an item of a foreach op's result), "write" (a
    copy_ into an input) or "lane" (per-item work)."""
    kind: dict[fx.Node, str] = {}
    written: set[fx.Node] = set()
    for node in nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            kind[node] = "input" if isinstance(val, torch.Tensor) else "shared"
            if isinstance(val, torch.Tensor) and val.device.type != "cpu":
                raise NotLanes(f"its tensors live on {val.device} (foreach ops batch on the CPU)")
            continue
        if node.op == "get_attr":
            kind[node] = "input"
            continue
        if node.op == "output":
            continue
        if node.op != "call_function":
            raise NotLanes(f"{node.op} node {node.name}")
        target = node.target
        read_after_write = written.intersection(node.all_input_nodes)
        if read_after_write:  # the plan writes all inputs at the end
            raise NotLanes(f"{node.name} reads {read_after_write.pop().name} after it was written")
        if target is aten.copy_.default:
            if node.args[0] not in kind or node.args[0].op != "placeholder":  # type: ignore[union-attr]
                raise NotLanes(f"{node.name} writes to something that is not an input")
            kind[node] = "write"
            written.add(node.args[0])  # type: ignore[arg-type]
            continue
        if isinstance(target, torch._ops.OpOverload):
            if target._schema.is_mutable:
                raise NotLanes(f"{node.name} ({target}) writes to its arguments")
            if torch.Tag.nondeterministic_seeded in target.tags:
                raise NotLanes(f"{node.name} ({target}) draws random numbers")
        inputs = node.all_input_nodes
        if target is operator.getitem and kind.get(node.args[0]) == "foreach":  # type: ignore[arg-type]
            kind[node] = "item"
        elif is_foreach(node):
            val = node.meta.get("val")
            if not isinstance(val, list | tuple) or not all(
                isinstance(v, torch.Tensor) for v in val
            ):
                raise NotLanes(f"{node.name} ({target}) does not return a list of tensors")
            kind[node] = "foreach"
        elif is_python(node) and all(kind[a] == "shared" for a in inputs):
            kind[node] = "shared"
        else:
            kind[node] = "lane"
    return kind


def _canonical(nodes: list[fx.Node], kind: dict[fx.Node, str]) -> dict[fx.Node, Any]:
    """A key per shared node: equal for nodes computing the same function of the same
    inputs (a step may compute ``1 - beta`` once per parameter)."""
    canon: dict[fx.Node, Any] = {}
    for node in nodes:
        if kind.get(node) != "shared":
            continue
        if node.op == "placeholder":
            canon[node] = node
        else:
            canon[node] = (node.target, _key(node.args, canon), _key(node.kwargs, canon))
    return canon


def _key(a: Any, canon: dict[fx.Node, Any]) -> Any:
    if isinstance(a, fx.Node):
        return canon[a]
    if isinstance(a, list | tuple):
        return (type(a), tuple(_key(x, canon) for x in a))
    if isinstance(a, dict):
        return (dict, tuple((k, _key(v, canon)) for k, v in sorted(a.items())))
    return _const_key(a)


def _const_key(a: Any) -> Any:
    """Equal only for constants that act the same (1, 1.0 and True hash alike; 0.0 and -0.0
    compare equal)."""
    if isinstance(a, float):
        return (float, repr(a))
    try:
        hash(a)
    except TypeError:
        return (type(a), id(a))
    return (type(a), a)


def _components(lane_nodes: list[fx.Node], kind: dict[fx.Node, str]) -> list[list[fx.Node]]:
    """The per-item nodes grouped by the per-item values they share, each in graph order."""
    parent = {n: n for n in lane_nodes}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in lane_nodes:
        for arg in node.all_input_nodes:
            if kind[arg] == "lane":
                parent[find(arg)] = find(node)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in lane_nodes:
        groups.setdefault(find(node), []).append(node)
    return list(groups.values())


def _signature(
    component: list[fx.Node], kind: dict[fx.Node, str], canon: dict[fx.Node, Any]
) -> Any:
    """What a component computes, with its own nodes and inputs numbered by first use: equal
    for the members of one family."""
    local = {n: i for i, n in enumerate(component)}
    inputs: dict[fx.Node, int] = {}

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            k = kind[a]
            if k == "lane":
                return ("local", local[a])
            if k == "shared":
                return ("shared", canon[a])
            if k == "foreach":
                return ("list", a)
            if k == "item":  # the item's index is the lane's own
                return ("item", a.args[0])
            return ("input", inputs.setdefault(a, len(inputs)))
        if isinstance(a, list | tuple):
            return (type(a), tuple(ref(x) for x in a))
        if isinstance(a, dict):
            return (dict, tuple((k, ref(v)) for k, v in sorted(a.items())))
        return ("const", _const_key(a))

    return tuple((n.target, ref(n.args), ref(n.kwargs)) for n in component)


def _family_op(column: tuple[fx.Node, ...], kind: dict[fx.Node, str]) -> BatchedOp:
    """The BatchedOp running ``column`` (one node per lane, same signature)."""

    def arg(values: tuple[Any, ...]) -> Arg:
        first = values[0]
        if isinstance(first, fx.Node):
            if kind[first] in ("shared", "foreach"):
                return ("node", first)  # the same (or an equal) value in every lane
            return ("column", values)
        if isinstance(first, list | tuple):
            return ("seq", type(first), tuple(arg(v) for v in zip(*values, strict=True)))
        return ("const", first)

    head = column[0]
    args = tuple(arg(v) for v in zip(*(n.args for n in column), strict=True))
    kwargs = tuple((k, arg(tuple(n.kwargs[k] for n in column))) for k in head.kwargs)
    returned = any(user.op == "output" for n in column for user in n.users)
    return BatchedOp("family", eager_target(head), column, args, kwargs, returned)


def _single_op(node: fx.Node, kind: dict[fx.Node, str]) -> BatchedOp:
    """The BatchedOp running one node: a foreach op (list arguments become columns) or a
    shared Python-scalar node."""

    def arg(a: Any) -> Arg:
        if isinstance(a, fx.Node):
            return ("node", a)
        if isinstance(a, list | tuple):
            if a and all(isinstance(x, fx.Node) for x in a):
                return ("column", tuple(a))
            return ("seq", type(a), tuple(arg(x) for x in a))
        return ("const", a)

    args = tuple(arg(a) for a in node.args)
    kwargs = tuple((k, arg(v)) for k, v in node.kwargs.items())
    return BatchedOp(kind[node], eager_target(node), (node,), args, kwargs)
