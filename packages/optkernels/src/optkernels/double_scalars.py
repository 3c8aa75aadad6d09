"""The torch backend's graph where the kernels do not take a step (or a split's prelude,
which runs before them): the 0-dim inputs eager reads as Python floats (step counts) read in
float64, as the host computes them for the kernels, where every op computing from them takes
the wider dtype (checked on meta tensors); what such a value writes into a 0-dim state, and a
prelude's results, in the dtypes the trace recorded.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Collection
from typing import Any

import torch
from torch import fx


def _python_floats_in_double(
    gm: fx.GraphModule, outputs_as_recorded: bool = False
) -> fx.GraphModule:
    """``gm`` for the torch backend when the kernels do not take it: the 0-dim inputs eager
    reads as Python floats (placeholder meta ``python_float``: step counts) read in float64,
    as the host computes them for the kernels (a copy of the graph; ``gm`` where there are
    none). Written back in their dtype by the graph's copy_, as before. The ops computing
    from them run once on meta tensors first: ``gm`` where one refuses the wider dtype (a
    ``lerp`` whose weight is computed from a step count). ``outputs_as_recorded``: the
    graph's results keep the dtypes the trace recorded (a split's prelude: the kernels read
    them as such)."""
    marked = [
        n
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and n.meta.get("python_float") is True
        and getattr(n.meta.get("val"), "dtype", torch.float64) is not torch.float64
    ]
    if not marked:
        return gm
    graph = copy.deepcopy(gm.graph)
    names = {n.name for n in marked}
    copy_ = torch.ops.aten.copy_.default
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in names]:
        with graph.inserting_after(node):
            wide = graph.call_function(
                torch.ops.aten._to_copy.default, (node,), {"dtype": torch.float64}
            )
        wide.meta["val"] = node.meta["val"]  # (its device and dim: see reference._on_device)
        for user in list(node.users):
            if user is not wide and user.target is not copy_:
                user.replace_input_with(node, wide)
    if not _takes_double(gm, graph, names):
        return gm
    _round_what_states_take(graph, names)
    if outputs_as_recorded and not _outputs_as_recorded(graph, names):
        return gm
    return fx.GraphModule(gm, graph)


def _round_what_states_take(graph: fx.Graph, names: Collection[str]) -> None:
    """A value computed from the widened inputs and copied into a 0-dim tensor, rounded
    first to the dtype the graph records for it (its step counts'), as eager's
    capturable=False path rounds its Python float there (ASGD's ``eta.copy_(
    torch.as_tensor(lr / ...))``: the default dtype; a float64 param's eta after
    load_state_dict keeps that rounding). The host does the same for the kernels."""
    cone = _cone(graph, names)
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.copy.default or len(node.args) < 2:
            continue
        dst, src = node.args[0], node.args[1]
        if not (isinstance(dst, fx.Node) and isinstance(src, fx.Node)) or src not in cone:
            continue
        recorded, taken = getattr(src.meta.get("val"), "dtype", None), dst.meta.get("val")
        if recorded in (None, torch.float64) or not isinstance(taken, torch.Tensor) or taken.dim():
            continue
        with graph.inserting_before(node):
            narrow = graph.call_function(
                torch.ops.aten._to_copy.default, (src,), {"dtype": recorded}
            )
        narrow.meta["val"] = src.meta["val"]
        node.replace_input_with(src, narrow)


def _cone(graph: fx.Graph, names: Collection[str]) -> set[fx.Node]:
    """The placeholders ``names`` and every call computing from them."""
    cone = {n for n in graph.nodes if n.op == "placeholder" and n.name in names}
    for node in graph.nodes:
        if node.op == "call_function" and any(a in cone for a in node.all_input_nodes):
            cone.add(node)
    return cone


def _outputs_as_recorded(graph: fx.Graph, names: Collection[str]) -> bool:
    """Each result computed from the widened inputs cast back to the dtype it was traced in;
    False (nothing changed) where one's is not known."""
    cone = _cone(graph, names)
    output = next(n for n in graph.nodes if n.op == "output")
    results: list[fx.Node] = []
    fx.node.map_arg(output.args, results.append)
    dtypes = {n: _recorded_dtype(n) for n in results if n in cone}
    if any(d is None for d in dtypes.values()):
        return False
    narrowed: dict[fx.Node, fx.Node] = {}
    for node, dtype in dtypes.items():
        if dtype is torch.float64 or node in narrowed:
            continue
        with graph.inserting_before(output):
            cast = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": dtype})
        cast.meta["val"] = node.meta.get("val")
        narrowed[node] = cast
    output.args = fx.node.map_arg(output.args, lambda n: narrowed.get(n, n))
    return True


def _recorded_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype the trace recorded for ``node`` (an item of a list-valued op: that item's)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    source = node.args[0] if node.target is operator.getitem and node.args else None
    if isinstance(source, fx.Node) and isinstance(node.args[1], int):
        vals = source.meta.get("val")
        item = vals[node.args[1]] if isinstance(vals, list | tuple) else None
        if isinstance(item, torch.Tensor):
            dtype: torch.dtype = item.dtype
            return dtype
    return None


def _takes_double(gm: fx.GraphModule, graph: fx.Graph, names: Collection[str]) -> bool:
    """Whether every op computing from the placeholders ``names`` of ``graph`` (a copy of
    ``gm``'s) takes their widened values. Those ops alone run, on meta tensors; the values
    they read from the others are as traced (``meta["val"]``, which ran them), or run too
    where a node has none. Every tensor is a meta one: an op that makes a tensor on a
    device (``torch.where``'s scalar, ``scalar_tensor(..., device='cuda:0')``) makes it on
    the meta device, and a constant is read as a meta tensor (a real CUDA tensor beside
    meta ones made the check fail on a GPU, and the torch backend then computed eager's
    Python floats from float32 step counts: RAdam's for-loop 1e-6 relative off eager on an
    H100). An ``.item()`` gives 1.0 (its value does not matter here, but Python arithmetic
    on it must not divide by zero), and so does the arithmetic computing from it."""
    cone = _cone(graph, names)
    computed: dict[fx.Node, Any] = {}

    def value(node: fx.Node) -> Any:
        if node not in computed:
            val: Any = node.meta.get("val")
            listed = isinstance(val, list | tuple)
            vals = val if listed else (val,)
            if node not in cone and all(isinstance(v, torch.Tensor) for v in vals):
                metas = [_meta_like(v) for v in vals]
                computed[node] = metas if listed else metas[0]
            else:  # (a Python number's node has its type's 0 as its value: run it)
                computed[node] = run(node)
        return computed[node]

    def run(node: fx.Node) -> Any:
        if node.op == "placeholder":
            return _meta_like(node.meta.get("val"))
        if node.op == "get_attr":
            return _meta_like(getattr(gm, str(node.target)))
        if node.target is torch.ops.aten._local_scalar_dense.default:
            return 1.0
        args, kwargs = fx.map_arg((node.args, node.kwargs), value)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return node.target(*args, **kwargs)  # type: ignore[operator]

    try:
        with torch.no_grad():
            for node in graph.nodes:
                if node in cone:
                    value(node)
    except Exception:  # (an op refusing the wider dtype)
        return False
    return True


def _meta_like(val: Any) -> Any:
    """A meta tensor like the traced value ``val`` (a Python scalar stays as it is)."""
    if isinstance(val, torch.Tensor):
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    return val
