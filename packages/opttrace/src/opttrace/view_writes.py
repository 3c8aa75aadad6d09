"""Writes through views: how a trace turns an in-place write to a view into a new value of
the view's base.

The recorder keeps, for each view that does not show all of its root, the chain of view ops
from the root (``ViewStep``: slice, select, transpose/permute, view/reshape, diagonal,
split/unbind, view_as_real/view_as_complex, and chains of them). A write through the view
gives the root a new value: each step ``scatter``s the new value of its view into its base
(``slice_scatter``, the transpose undone, ...), from the view back to the root. Other views
(``as_strided``, ``expand``) are refused, and so is a small part of a large tensor (see
``_refuse_costly_scatter``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from opttrace import meta
from opttrace.errors import TraceError

if TYPE_CHECKING:
    from opttrace.recorder import Recorder
    from opttrace.traced_tensor import TracedTensor

aten = torch.ops.aten


def bound(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``func``'s arguments after ``self`` by name, defaults filled in."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments[1:], start=1):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


# View ops that show all of their input in another shape: writing the view writes all of the
# base, the view's new value reshaped back (transposes are undone by their inverse).
_RESHAPING = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.unsqueeze.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.alias.default,
        aten.detach.default,
    }
)


# View ops that show all of their input as another dtype (a complex parameter's optimizer
# works on its real view, torch.optim does): undone by the other.
_REINTERPRETING = {
    aten.view_as_real.default: aten.view_as_complex.default,
    aten.view_as_complex.default: aten.view_as_real.default,
}


class ViewStep:
    """One view op between a base and a view of it: redone on the base's current value,
    and undone (``scatter``) to write a new value of the view back into the base."""

    def __init__(self, func: Any, bound: dict[str, Any], index: int | None) -> None:
        self.func = func
        self.bound = bound
        self.index = index  # the output's position, for ops returning several views

    def apply(
        self, recorder: Recorder, base_node: fx.Node, base: TracedTensor
    ) -> tuple[fx.Node, TracedTensor]:
        """This view of the base's current value: its node and tensor."""
        values = self.bound.values()
        node = recorder.call(self.func, (base_node, *values))
        made = recorder._wrap(node, meta.infer(self.func, [base._spec, *values], {}), base.device)
        view: TracedTensor = made if self.index is None else made[self.index]
        return recorder.node_of(view), view

    def scatter(
        self,
        recorder: Recorder,
        base_node: fx.Node,
        base: TracedTensor,
        src: fx.Node,
        view: TracedTensor,
    ) -> fx.Node:
        """The base's value with ``src`` (a new value of ``view``) written where this view
        shows it."""
        func, b = self.func, self.bound
        if func is aten.permute.default:
            dims = [d % base.dim() for d in b["dims"]]
            inverse = sorted(range(len(dims)), key=dims.__getitem__)
            node = recorder.call(aten.permute.default, (src, inverse))
        elif func is aten.transpose.int:
            node = recorder.call(aten.transpose.int, (src, b["dim0"], b["dim1"]))
        elif func is aten.t.default:
            node = recorder.call(aten.t.default, (src,))
        elif func in _RESHAPING:
            node = recorder.call(aten.reshape.default, (src, list(base.shape)))
        elif func in _REINTERPRETING:  # complex <-> (real, imag) pairs: each other's inverse
            node = recorder.call(_REINTERPRETING[func], (src,))
        else:
            node = self._scatter_part(recorder, base_node, base, src, view)
        node.meta["val"] = type(base)(recorder, base._spec, base.device)
        return node

    def _scatter_part(
        self,
        recorder: Recorder,
        base_node: fx.Node,
        base: TracedTensor,
        src: fx.Node,
        view: TracedTensor,
    ) -> fx.Node:
        """``scatter`` for a view that shows part of its base: a ``*_scatter`` op."""
        func, b = self.func, self.bound
        if func not in _SCATTERS:
            raise TraceError(
                f"the step writes in place through a view made by {func} (shape "
                f"{list(view.shape)}) of another tensor; only views made by "
                "slicing, indexing, transposing or reshaping can be written through: write "
                "to the tensor itself"
            )
        _refuse_costly_scatter(func, base, view)
        scatter: Any
        if func is aten.slice.Tensor:
            scatter = (aten.slice_scatter, b["dim"], b["start"], b["end"], b["step"])
        elif func is aten.select.int:
            scatter = (aten.select_scatter, b["dim"], b["index"])
        elif func is aten.diagonal.default:
            scatter = (aten.diagonal_scatter, b["offset"], b["dim1"], b["dim2"])
        elif func is aten.unbind.int:  # the index-th of several views
            scatter = (aten.select_scatter, b["dim"], self.index)
        else:  # split, split_with_sizes: the index-th part along dim
            assert self.index is not None
            dim = b["dim"] % base.dim()
            if func is aten.split.Tensor:
                start = self.index * b["split_size"]
            else:
                start = sum(b["split_sizes"][: self.index])
            scatter = (aten.slice_scatter, dim, start, start + view.shape[dim], 1)
        op, *args = scatter
        return recorder.call(op.default, (base_node, src, *args))


# View ops that show part of their input: a write through one scatters into the base.
_SCATTERS = frozenset(
    {
        aten.slice.Tensor,
        aten.select.int,
        aten.diagonal.default,
        aten.unbind.int,
        aten.split.Tensor,
        aten.split_with_sizes.default,
    }
)

# A write through a part of a tensor becomes a new value of all of it (``slice_scatter``):
# fine for small tensors and large parts; a small slice of a large tensor (a flat buffer
# written piece by piece) would copy the whole tensor per write, far slower than eager.
_SCATTER_MIN_NUMEL = 1 << 16


def _refuse_costly_scatter(func: Any, base: TracedTensor, view: TracedTensor) -> None:
    if base.numel() > max(2 * view.numel(), _SCATTER_MIN_NUMEL):
        raise TraceError(
            f"the step writes in place through a view made by {func} ({view.numel()} of "
            f"{base.numel()} elements): traced, each such write would copy the whole tensor; "
            "write to the tensor itself, or let this step run eagerly"
        )
