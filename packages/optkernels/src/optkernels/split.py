"""Splitting a step graph around the ops the kernel generator does not know.

A step such as LARS or LAMB takes a norm of each tensor (a reduction) and uses it in
otherwise elementwise work. ``split_unfused`` moves each such op, with everything it depends
on, into a *prelude* the torch backend runs first; the rest becomes the *main* graph, whose
extra inputs are the prelude's results (per-tensor norms become 0-dim lane inputs of the
kernel). Writes of prelude values back into the inputs are *deferred*: the plan copies them
after the main graph ran, since the main graph still reads those inputs' old values (the
step graph is functional: its reads see the inputs as they were at the call).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from optkernels.lane_scan import is_foreach, is_scalar
from optkernels.lanes import fusible

aten = torch.ops.aten


@dataclass
class Split:
    prelude_graph: fx.Graph  # the step's inputs -> the values the rest needs
    main_graph: fx.Graph  # the step's inputs + the prelude's results -> the graph's outputs
    writes: list[tuple[int, int]]  # (input index, prelude result index), copied after main
    unfused: list[fx.Node]  # the ops the kernel generator does not know, in graph order
    owner: fx.GraphModule  # the split graph's module (its attributes: constants)

    # The graphs' modules, made at their first use: Python compiles a GraphModule's code
    # (~0.1 s per 1,000 nodes), wasted where the main graph turns out not to be lanes.
    @functools.cached_property
    def prelude(self) -> fx.GraphModule:
        return fx.GraphModule(self.owner, self.prelude_graph)

    @functools.cached_property
    def main(self) -> fx.GraphModule:
        return fx.GraphModule(self.owner, self.main_graph)


def split_unfused(gm: fx.GraphModule) -> Split | None:
    """The prelude / main split of ``gm``; None when every op is one the kernels know."""
    graph = gm.graph
    unfused = [n for n in graph.nodes if not fusible(n)]
    if not unfused:
        return None
    prelude = _ancestors(unfused)
    # A list-valued prelude op (``_foreach_norm``) is read through its items: they join it,
    # so that the prelude's results are tensors.
    for node in list(prelude):
        prelude.update(u for u in node.users if u.target is operator.getitem)
    prelude |= _shared_from(prelude, graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    deferred = [
        n
        for n in graph.nodes
        if n.target is aten.copy_.default and n not in prelude and n.args[1] in prelude
    ]
    rest = [
        n for n in graph.nodes if n.op != "placeholder" and n not in prelude and n not in deferred
    ]
    needed: dict[fx.Node, None] = {}  # prelude values the rest reads, in order
    for node in rest:
        for arg in node.all_input_nodes:
            if arg in prelude:
                needed[arg] = None
    for node in deferred:
        needed[node.args[1]] = None
    # Results are tensors: a list value (a foreach op's) is returned item by item.
    results: list[tuple[fx.Node, int | None]] = []
    for node in needed:
        val = node.meta.get("val")
        if isinstance(val, list | tuple):
            results.extend((node, i) for i in range(len(val)))
        else:
            results.append((node, None))

    first = fx.Graph()
    env: dict[fx.Node, Any] = {}
    scalars = _needed(prelude)
    for node in graph.nodes:
        if node.op == "placeholder" or node in prelude or node in scalars:
            env[node] = first.node_copy(node, env.__getitem__)
    first.output(
        tuple(
            env[n] if i is None else first.call_function(operator.getitem, (env[n], i))
            for n, i in results
        )
    )

    steps = _python_float_writes(deferred)
    second = fx.Graph()
    env = {}
    for node in placeholders:
        env[node] = second.node_copy(node, env.__getitem__)
    position: dict[fx.Node, int] = {}
    for j, (node, i) in enumerate(results):
        position.setdefault(node, j)
        extra = second.placeholder(f"unfused_{j}_{node.name}")
        extra.meta = {k: v for k, v in node.meta.items() if k != "source"}
        if i is not None:
            extra.meta["val"] = node.meta["val"][i]
            env.setdefault(node, []).append(extra)
        else:
            env[node] = extra
        extra.meta["static_address"] = False  # a new tensor every call
        if (node, i) in steps:  # (a step count's new value: what eager reads as a float)
            extra.meta["python_float"] = True
    for node in rest:
        env[node] = second.node_copy(node, env.__getitem__)

    index = {n: i for i, n in enumerate(placeholders)}
    writes = [(index[n.args[0]], position[n.args[1]]) for n in deferred]
    for made in (first, second):  # (their constants, ``get_attr``, read from ``gm`` until
        made.owning_module = gm  # their own module is made)
    return Split(first, second, writes, unfused, gm)


def _python_float_writes(deferred: list[fx.Node]) -> set[tuple[fx.Node, int | None]]:
    """The prelude results written back into inputs eager reads as Python floats (placeholder
    meta ``python_float``: a step count's ``step + 1``, NAdam's float64 ``mu_product``), as
    (node, item) and, for an item of a list, also (list node, item): the value such a step
    reads after its write is the input's new value, which the main graph's host then reads
    in double as eager does (a bias correction ``1 - beta2 ** step`` computed by the kernel
    in float32 from it was 2e-5 relative off eager's: NAdam over a float64 param after
    load_state_dict, whose float64 ``mu_product`` puts its step sizes in the prelude)."""
    found: set[tuple[fx.Node, int | None]] = set()
    for write in deferred:
        target, value = write.args[0], write.args[1]
        if not (isinstance(target, fx.Node) and target.meta.get("python_float") is True):
            continue
        assert isinstance(value, fx.Node)
        found.add((value, None))
        if value.target is operator.getitem and isinstance(value.args[1], int):
            source = value.args[0]
            assert isinstance(source, fx.Node)
            found.add((source, value.args[1]))
    return found


def _shared_from(prelude: set[fx.Node], graph: fx.Graph) -> set[fx.Node]:
    """Tensor work on prelude values that every lane shares: what feeds a foreach op's one
    tensor argument (``_foreach_mul(grads, clip)``, ``clip = (1 / (norm + eps)).clamp(max=1)``
    over a global norm). The kernels take per-lane values only, so it joins the prelude,
    which hands them its result; per-lane work on prelude values (a trust ratio from each
    tensor's norm) stays in the kernel."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if not is_foreach(node) or node in prelude:
            continue
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg not in prelude and not is_scalar(arg):
                chain = _computed_from(arg, prelude | found)
                if chain is not None:
                    found |= chain
    return found


def _computed_from(node: fx.Node, known: set[fx.Node]) -> set[fx.Node] | None:
    """``node`` and the tensor ops between it and ``known`` values, if it depends on
    nothing else (no input of the step, no list); else None."""
    chain: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in known or n in chain or is_scalar(n):
            continue
        if n.op != "call_function" or is_foreach(n) or isinstance(n.meta.get("val"), list | tuple):
            return None
        chain.add(n)
        todo.extend(n.all_input_nodes)
    return chain if chain and any(a in known for c in chain for a in c.all_input_nodes) else None


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """``nodes`` and the tensor ops they depend on, also through Python scalar math (a
    tensor's value read as a number, ``max(eps, p.norm().item())``); placeholders and the
    scalar math itself excluded: every graph keeps its own copy of the latter."""
    found: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node in seen or node.op == "placeholder":
            continue
        seen.add(node)
        if not is_scalar(node):
            found.add(node)
        todo.extend(node.all_input_nodes)
    return found


def _needed(nodes: set[fx.Node]) -> set[fx.Node]:
    """The Python scalar nodes ``nodes`` read, directly or through other scalar nodes."""
    found: set[fx.Node] = set()
    todo = [a for n in nodes for a in n.all_input_nodes if is_scalar(a)]
    while todo:
        node = todo.pop()
        if node in found or node.op == "placeholder":
            continue
        found.add(node)
        todo.extend(a for a in node.all_input_nodes if is_scalar(a))
    return found
