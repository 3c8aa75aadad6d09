"""Run a traced step's writes in place, as eager does, where that computes the same values.

The traced graph is functional: ``exp_avg.lerp_(g, w)`` is recorded as ``v = lerp(exp_avg,
g, w)`` and a trailing ``copy_(exp_avg, v)``. Run as is, every such op allocates its result
and the writeback copies it: on the CPU the allocations of large results (fresh pages each
time) made the torch backend many times slower than eager. This pass turns a node back into
the in-place op eager ran (``node.meta["inplace"]``, set by the tracer) when nothing reads
the tensor's old value afterwards, and drops the writeback that becomes a no-op. Only ops
eager ran in place are turned back, so the rounding is eager's own (CPU kernels of some
in-place ops round differently from their functional forms).

Rule: a node ``n = f(a, ...)`` whose first argument ``a`` holds an input ``x``'s storage
(``x`` itself, or a node already turned in place over ``x``) becomes ``f_(a, ...)`` when every
other reader of ``a`` runs before ``n``; for a foreach node, for every item of its first list.
A trailing ``copy_(x, v)`` whose ``v`` now is ``x`` is dropped. A tensor the step made (the
fresh result of an op such as ``mm`` or ``clone``, not a view) is written in place likewise:
Adafactor's ``(row @ col).div_(m).clamp_(e).rsqrt_().mul_(g)`` then allocates one result,
as eager does, instead of five.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

_COPY = torch.ops.aten.copy_.default


def reinplace(graph: fx.Graph) -> int:
    """Rewrite ``graph`` in place (see the module); return how many nodes now write in place."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    storage: dict[fx.Node, fx.Node] = {n: n for n in graph.nodes if n.op == "placeholder"}
    turned = 0
    for node in list(graph.nodes):
        if _fresh(node):
            storage[node] = node
        inplace = node.meta.get("inplace")
        if node.op != "call_function" or not _writes_self(inplace):
            continue
        first = node.args[0] if node.args else None
        if isinstance(first, list | tuple):
            items = list(first)
            if not items or not all(_free(a, node, storage, order) for a in items):
                continue
            if len({storage[a] for a in items}) != len(items):
                continue  # one tensor twice in the list
            node.target = inplace
            _replace_list_uses(graph, node, [storage[a] for a in items], storage)
        elif isinstance(first, fx.Node) and _free(first, node, storage, order):
            if not _same_layout(node, first):
                continue
            node.target = inplace
            storage[node] = storage[first]
        else:
            continue
        turned += 1
    for node in list(graph.nodes):
        if node.target is _COPY and not node.users:
            target, value = node.args[0], node.args[1]
            if isinstance(value, fx.Node) and storage.get(value) is target:
                graph.erase_node(node)
    return turned


def _writes_self(op: Any) -> bool:
    """An in-place overload writing its first argument (``add_``, ``_foreach_mul_``)."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema
    written = [
        a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write
    ]
    return schema.name.endswith("_") and written == ["self"]


def _fresh(node: fx.Node) -> bool:
    """A functional op's single tensor result, in new storage (its schema aliases nothing)."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
        return False
    schema = op._schema
    return (
        isinstance(node.meta.get("val"), torch.Tensor)
        and len(schema.returns) == 1
        and schema.returns[0].alias_info is None
        and not any(a.alias_info is not None for a in schema.arguments)
    )


def _free(
    a: Any, node: fx.Node, storage: dict[fx.Node, fx.Node], order: dict[fx.Node, int]
) -> bool:
    """Whether ``a`` holds an input's storage that ``node`` may overwrite: nothing else reads
    ``a`` after ``node``."""
    if not isinstance(a, fx.Node) or a not in storage:
        return False
    for user in a.users:
        if user is node or order[user] < order[node]:
            continue
        if user.target is _COPY and user.args[0] is a and a.op == "placeholder":
            continue  # the trailing writeback into the input: it writes x, not reads it
        return False
    return True


def _same_layout(node: fx.Node, a: fx.Node) -> bool:
    """The functional result has the written tensor's dtype and shape (no promotion, no
    broadcast): the in-place op then stores exactly that value."""
    out, base = node.meta.get("val"), a.meta.get("val")
    return (
        isinstance(out, torch.Tensor)
        and isinstance(base, torch.Tensor)
        and out.dtype == base.dtype
        and tuple(out.shape) == tuple(base.shape)
    )


def _replace_list_uses(
    graph: fx.Graph, node: fx.Node, targets: list[fx.Node], storage: dict[fx.Node, fx.Node]
) -> None:
    """An in-place foreach op returns nothing: its items are the written tensors themselves.
    ``node[i]`` becomes ``targets[i]``; ``node`` passed as a list becomes the list."""
    for user in list(node.users):
        if user.target is operator.getitem and user.args[0] is node:
            index = user.args[1]
            assert isinstance(index, int)
            storage[user] = targets[index]
            user.replace_all_uses_with(targets[index])
            graph.erase_node(user)
        else:
            user.args = tuple(list(targets) if a is node else a for a in user.args)
            user.kwargs = {k: list(targets) if v is node else v for k, v in user.kwargs.items()}
