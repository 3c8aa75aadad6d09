"""Aliasing among traced tensors, and what an in-place write does to it.

Tensors sharing all of one value (``detach``, ``alias``, a same-shape ``view``) share one
alias list and are rebound together; a partial view (slice, select, reshape, ...) knows its
root and the view ops from it (``view_writes.ViewStep``), and goes stale when the root is
written. A write through a view gives its root a new value: the view's new value scattered
into the old one (``slice_scatter``, a transpose undone, ...). ``rebind`` and ``set_value``
are what the Recorder does to the tensor an in-place or ``out=`` op writes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from opttrace.errors import TraceError
from opttrace.meta import Spec
from opttrace.traced_tensor import TracedTensor
from opttrace.view_writes import ViewStep, bound

if TYPE_CHECKING:
    from opttrace.recorder import Recorder

aten = torch.ops.aten

# View ops whose output, when it has its input's shape and strides, is all of its input.
_FULL_ALIAS = {aten.alias.default, aten.detach.default, aten.view.default, aten.expand.default}


def rebind(rec: Recorder, target: Any, node: fx.Node, spec: Spec) -> None:
    """Bind the tensor an in-place op wrote to ``node``, its new value of the same shape
    and dtype (``spec``)."""
    target = written_tensor(None, target)
    if spec.shape != target._spec.shape or spec.dtype != target._spec.dtype:
        raise TraceError(
            f"an in-place op changes a tensor's shape or dtype ({list(target.shape)} "
            f"{target.dtype} -> {list(spec.shape)} {spec.dtype}); resize in place "
            "cannot be traced"
        )
    set_value(rec, target, node, None)
    node.meta["val"] = target


def set_value(
    rec: Recorder, target: TracedTensor, node: fx.Node | None, item: tuple[fx.Node, int] | None
) -> None:
    """Bind ``target`` (and every full alias of it) to a new value; views of it go stale.
    A write through a view writes its base: the base's new value scatters the view's
    into the old one (``slice_scatter``, a transpose undone, ...)."""
    if target._view_of is not None:
        _write_through_view(rec, target, node, item)
        return
    for t in target._aliases or (target,):
        t._node, t._item = node, item
        for view in rec._views.pop(id(t), ()):
            view._stale = (
                f"the step uses a view (shape {list(view.shape)}) of a tensor after writing "
                "that tensor in place; take the view again after the write"
            )


def note_view(
    rec: Recorder, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any
) -> None:
    """Record that ``out`` (a view op's output, or its outputs) views ``args[0]``: all of
    it (a full alias) or a part (a view of its root, through the view ops so far)."""
    base: TracedTensor = args[0]
    several = isinstance(out, list | tuple)
    for index, view in enumerate(out if several else (out,)):
        full = view._spec == base._spec and func in _FULL_ALIAS
        if full and base._view_of is None:
            group = base._aliases or [base]
            base._aliases = view._aliases = group
            group.append(view)
        else:
            root = base._view_of if base._view_of is not None else base
            view._view_of = root
            step = ViewStep(func, bound(func, args, kwargs), index if several else None)
            view._view_chain = (*base._view_chain, step)
            register_view(rec, root, view)


def register_view(rec: Recorder, root: TracedTensor, view: TracedTensor) -> None:
    """Make ``view`` go stale when ``root`` (or a full alias of it) is written."""
    for alias in root._aliases or (root,):
        rec._views.setdefault(id(alias), []).append(view)


def _write_through_view(
    rec: Recorder, view: TracedTensor, node: fx.Node | None, item: tuple[fx.Node, int] | None
) -> None:
    root = view._view_of
    assert root is not None
    if node is None:  # an item of a foreach result
        assert item is not None
        node = rec.call(operator.getitem, item)
        node.meta["val"] = view
    # The tensors along the chain, as they are now: root, root's view, ..., the view's base.
    bases: list[tuple[fx.Node, TracedTensor]] = [(rec.node_of(root), root)]
    for step in view._view_chain[:-1]:
        bases.append(step.apply(rec, *bases[-1]))
    levels = [b for _, b in bases[1:]] + [view]  # what each step made of its base
    new = node
    for step, (base_node, base), made in zip(
        reversed(view._view_chain), reversed(bases), reversed(levels), strict=True
    ):
        new = step.scatter(rec, base_node, base, new, made)
    set_value(rec, root, new, None)  # every other view of root goes stale
    new.meta["val"] = root
    view._node, view._item, view._stale = node, None, None
    register_view(rec, root, view)


def written_tensor(func: Any, t: Any) -> TracedTensor:
    """``t``, the tensor an in-place op (``func``, where known) writes, if it is traced."""
    if not isinstance(t, TracedTensor):
        raise TraceError(
            f"the step writes in place to a tensor that is not one of its inputs "
            f"({'a ' + str(func) + ' target' if func else 'shape ' + str(list(t.shape))}): "
            "a global, a closure variable or a tensor the tracer does not follow"
        )
    return t
