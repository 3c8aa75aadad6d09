"""Foreach ops on traced tensors: one list node per op, its items inferred once per layout.

A foreach op records one node whose value is a list; an item becomes its own ``getitem``
node only when something uses it alone (``Recorder.node_of``). Its items' metadata is
inferred once per combination of its inputs' layouts (a model's many parameters come in a
few shapes). An in-place foreach op is recorded as its functional form and each written
tensor is rebound to its item (cast back where the op computes in another dtype); one that
writes a tensor twice is refused.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from opttrace import _torch_compat as compat
from opttrace import meta
from opttrace.aliasing import set_value, written_tensor
from opttrace.errors import TraceError
from opttrace.meta import Spec
from opttrace.op_args import arg_specs, item_arg, kwarg_specs, lookup, single_spec
from opttrace.traced_tensor import TracedTensor

if TYPE_CHECKING:
    from opttrace.recorder import Recorder

aten = torch.ops.aten

# Foreach ops whose items are reductions (a 0-dim result per tensor), not pointwise.
_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})


def record_foreach(
    rec: Recorder, func: Any, args: Sequence[Any], kwargs: dict[str, Any], written: tuple[str, ...]
) -> Any:
    """Record the foreach op ``func``: its result list, or (``written``: the argument it
    writes in place) the written tensors rebound to their items."""
    first_list = next(a for a in args if isinstance(a, list | tuple))
    n = len(first_list)
    if not written:
        pointwise = func.overloadpacket.__name__ not in _FOREACH_REDUCTIONS
        items = _foreach_items(func, args, kwargs, first_list, pointwise)
        node = rec._record(func, args, kwargs)
        return _wrap_list(rec, node, items)
    functional = compat.functional_variant(func)
    if functional is None or len(written) != 1:
        raise TraceError(f"{func} writes to its inputs and has no functional form to trace")
    targets = lookup(func, args, kwargs, written[0])
    written_tensors = list(targets)
    for t in written_tensors:  # (a call per item only for the one that fails)
        if not isinstance(t, TracedTensor):
            written_tensor(func, t)
    _refuse_repeats(func, written_tensors)
    pure_args, pure_kwargs = compat.drop_out_args(func, args, kwargs)
    node = rec._record(functional, pure_args, pure_kwargs)
    rec._list_len[node] = n
    promoted = _foreach_promoted(rec, functional, pure_args, pure_kwargs, written_tensors)
    if not any(promoted):
        node.meta["inplace"] = func  # what eager ran: a backend may run it in place too
    node.meta["val"] = tuple(written_tensors)
    views = rec._views
    for i, (t, computed) in enumerate(zip(written_tensors, promoted, strict=True)):
        if computed is None:
            if t._view_of is None and not t._aliases and id(t) not in views:
                t._node, t._item = None, (node, i)  # (set_value's work for a plain item)
            else:
                set_value(rec, t, None, (node, i))
            continue
        # (e.g. a 0-dim float16 param times a 0-dim float32: eager stores it rounded)
        item = rec.call(operator.getitem, (node, i))
        spec = Spec(tuple(t.shape), tuple(t.stride()), computed)
        item.meta["val"] = TracedTensor(rec, spec, t.device)
        cast = rec.call(aten._to_copy.default, (item,), {"dtype": t.dtype})
        set_value(rec, t, cast, None)
        cast.meta["val"] = t
    return None if not func._schema.returns else targets


def _foreach_promoted(
    rec: Recorder,
    functional: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    targets: list[TracedTensor],
) -> list[torch.dtype | None]:
    """Per written item, the dtype the functional foreach op computes it in where that
    differs from the item's own (see ``Recorder._promoted``), else None."""
    dtypes = {t._spec.dtype for t in targets}
    others = {
        a._spec.dtype if type(a) is TracedTensor else a.dtype
        for arg in (*args, *kwargs.values())
        for a in (arg if isinstance(arg, list | tuple) else (arg,))
        if isinstance(a, TracedTensor | torch.Tensor)
    }
    if others <= dtypes and len(dtypes) == 1:
        return [None] * len(targets)
    found: list[torch.dtype | None] = []
    for i, t in enumerate(targets):
        item_args = arg_specs([item_arg(a, i) for a in args])
        item_kwargs = kwarg_specs({k: item_arg(v, i) for k, v in kwargs.items()})
        spec = single_spec(meta.infer(functional, item_args, item_kwargs))
        found.append(spec.dtype if spec.dtype != t.dtype else None)
    return found


def _wrap_list(
    rec: Recorder, node: fx.Node, items: list[tuple[Spec, torch.device, int]]
) -> list[TracedTensor]:
    rec._list_len[node] = len(items)
    outs = []
    for i, (spec, device, layout) in enumerate(items):
        t = TracedTensor(rec, spec, device, False, layout)
        t._item = (node, i)
        outs.append(t)
    node.meta["val"] = tuple(outs)  # what each item is (shape, dtype, device)
    return outs


def _refuse_repeats(func: Any, targets: list[TracedTensor]) -> None:
    """An in-place foreach op must write each tensor once: given one twice (a parameter
    listed twice in an optimizer: torch warns of duplicate parameters), eager applies the
    op to it twice on some paths and once on others."""
    first: dict[int, int] = {}
    for i, t in enumerate(targets):
        j = first.setdefault(id(t._aliases) if t._aliases else id(t), i)
        if j != i:
            where = f"{func} writes one tensor twice (items {j} and {i} of its list)"
            name = _input_name(t)
            if name is not None and name.endswith(".grad"):
                raise TraceError(
                    f"{where}: one grad tensor given to several parameters ({name} is "
                    "another's grad too); give each parameter its own grad (p.grad = g.clone())"
                )
            raise TraceError(
                f"{where}: an optimizer given the same parameter twice"
                f"{f' ({name})' if name else ''}; remove the duplicate"
            )


def _input_name(t: TracedTensor) -> str | None:
    """The Source name of the input ``t`` stands for (None: a value the step computed)."""
    node = t._node
    source = node.meta.get("source") if node is not None and node.op == "placeholder" else None
    return source.name() if source is not None else None


def _foreach_items(
    func: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    first_list: Sequence[Any],
    pointwise: bool,
) -> list[tuple[Spec, torch.device, int]]:
    """Per item of a foreach op's result: its Spec, device and layout id. An item whose
    inputs have the layouts of an earlier item's is that item again (a model's many
    parameters come in a few shapes): inferred once per layout."""
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, list | tuple) and a]
    found: dict[tuple[int, ...], tuple[Spec, torch.device, int]] = {}
    items = []
    for i in range(len(first_list)):
        key = tuple([x._layout if type(x := lst[i]) is TracedTensor else -1 for lst in lists])
        item = found.get(key)  # (-1: an item that is not a traced tensor, never found)
        if item is None:
            item_args = arg_specs([item_arg(a, i) for a in args])
            item_kwargs = kwarg_specs({k: item_arg(v, i) for k, v in kwargs.items()})
            spec = single_spec(meta.infer(func, item_args, item_kwargs, pointwise))
            first = first_list[i]
            device = first._device if type(first) is TracedTensor else first.device
            item = (spec, device, meta.layout_id(spec, device))
            if -1 not in key:
                found[key] = item
        items.append(item)
    return items
