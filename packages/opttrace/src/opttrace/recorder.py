"""The recorder: run tensor code on traced tensors and record it as a functional ATen graph.

While a Recorder is active every ATen op on a TracedTensor (``traced_tensor.py``) goes
through it: the op becomes a graph node, its output metadata comes from ``meta.infer`` (or
from the op's plan, ``plans.py``), and its outputs are new TracedTensors. In-place and
``out=`` ops are recorded as their functional forms and the written tensor is rebound to
the new value (``aliasing.py``), so the graph has no mutation and the Python objects the
step holds (parameters keying ``state``) keep their identity. After the step, an input
whose value changed is an in-place write the caller turns into a writeback.

Foreach ops return one list node (``foreach.py``); a list that is exactly a previous op's
output is passed as that node.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from opttrace import _torch_compat as compat
from opttrace import meta, symbolic
from opttrace.aliasing import note_view, rebind, set_value, written_tensor
from opttrace.errors import TraceError
from opttrace.foreach import record_foreach
from opttrace.meta import Spec
from opttrace.op_args import arg_specs, kwarg_specs, lookup, output_device, specialize_ints
from opttrace.plans import Plan, plan_key, plan_key_kw
from opttrace.symbolic import ScalarNode
from opttrace.traced_tensor import TracedTensor

__all__ = ["Recorder", "TracedTensor"]

aten = torch.ops.aten

_SCALAR_TYPES = {True: float, False: int}
# id(target) -> (target, its node name stem): an OpOverload hashes in Python.
_NAMES: dict[int, tuple[Any, str]] = {}
_NOT_IDENT = re.compile("[^0-9a-zA-Z_]+")


_TRACED_ONLY = (TracedTensor,)  # the types of an op on traced tensors alone


class Recorder(compat.DispatchMode):  # type: ignore[no-untyped-call]
    """Records every ATen op run while it is active into ``graph``."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.graph = fx.Graph()
        self.constants: dict[str, torch.Tensor] = {}
        self._list_len: dict[fx.Node, int] = {}
        self._last_placeholder: fx.Node | None = None
        self._scalar_ops: dict[tuple[Any, ...], fx.Node] = {}  # one node per scalar expression
        self._kinds: dict[int, compat.CallKind] = {}  # id(target) -> its call_kind
        # Told of each Python decision taken on a symbolic scalar (the context guards it).
        self.on_decision: Callable[[ScalarNode, Any], None] | None = None
        # Told of each store to a traced tensor's ``.grad`` (the context records it).
        self.on_grad_store: Callable[[TracedTensor, Any], None] | None = None
        # Asked for an attribute a traced tensor lacks (one its real tensor holds: a
        # per-parameter ``lr_scale``); raises AttributeError where there is none.
        self.on_attr_read: Callable[[TracedTensor, str], Any] | None = None
        self.closed_by: str | None = None  # set when no more ops may be recorded, and why
        self._views: dict[int, list[TracedTensor]] = {}  # id(tensor) -> its partial views

    # -- values -------------------------------------------------------------------------

    def detach_hooks(self) -> None:
        """Drop the callbacks into the trace's context (which holds the real inputs): the
        graph keeps this recorder, and must not keep parameters alive through it."""
        self.on_decision = None
        self.on_grad_store = None
        self.on_attr_read = None

    def placeholder(
        self,
        name: str,
        real: torch.Tensor,
        source: Any,
        static: bool = False,
        layout: tuple[Spec, int] | None = None,
    ) -> TracedTensor:
        """A traced stand-in for the input tensor ``real``, bound to a new placeholder.
        ``static``: the entry's guards fix its address (``meta["static_address"]``), so a
        backend may bake it in; other tensor inputs (grads) may move every call. ``layout``:
        ``meta.layout_of(real)``, where the caller has it."""
        device = real.device
        spec, layout_id = meta.layout_of(real, device) if layout is None else layout
        t = TracedTensor(self, spec, device, real.requires_grad, layout_id)
        t._node = self._placeholder(name, source, t)
        t._node.meta["static_address"] = static
        return t

    def scalar_placeholder(self, name: str, value: float, source: Any) -> symbolic.SymScalar:
        """A symbolic Python scalar for the input ``value``, bound to a new placeholder."""
        node = ScalarNode(self, type(value), value, None, ("source", source))
        node.fx_node = self._placeholder(name, source, value)
        return symbolic.wrap(node)

    def _placeholder(self, name: str, source: Any, val: Any) -> fx.Node:
        # Placeholders stay ahead of every op, in the order the step first read them.
        node = compat.append_placeholder(self.graph, name, self._last_placeholder)
        self._last_placeholder = node
        node.meta["val"] = val
        node.meta["source"] = source
        return node

    def scalar_op(self, fn: Any, args: tuple[Any, ...], example: Any) -> fx.Node:
        """A graph node computing a Python scalar from other scalars."""
        key = (fn, args, tuple(type(a) for a in args))  # 1 - x and 1.0 - x differ
        node = self._scalar_ops.get(key)
        if node is None:
            node = self._scalar_ops[key] = self.call(fn, args)
            node.meta["val"] = example
        return node

    def call(self, target: Any, args: tuple[Any, ...], kwargs: Any = None) -> fx.Node:
        """Append a ``call_function`` node (not through fx's ``create_node``: its checks
        of each node's arguments cost more than everything else it does, for the
        hundreds of thousands of nodes of a large step)."""
        kind = self._kinds.get(id(target))
        if kind is None or kind[0] is not target:
            stem = _stem(self.graph, target)
            kind = self._kinds[id(target)] = compat.call_kind(self.graph, target, stem)
        return compat.append_call(self.graph, kind, args, kwargs or {})

    def assert_true(self, node: ScalarNode, where: str) -> None:
        """A runtime check in the graph that a scalar condition holds (``torch._check``)."""
        cond = node.fx_node if node.fx_node is not None else node.hint
        self.call(aten._assert_scalar.default, (cond, f"torch._check failed at {where}"))

    def decided(self, node: ScalarNode, value: Any) -> None:
        if self.on_decision is not None:
            self.on_decision(node, value)

    def node_of(self, t: TracedTensor) -> fx.Node:
        if t._recorder is not self:
            raise TraceError("a tensor from another trace reached this one")
        if t._stale is not None:
            raise TraceError(t._stale)
        if t._node is None:
            assert t._item is not None
            lst, i = t._item
            t._node = self.call(operator.getitem, (lst, i))
            t._node.meta["val"] = t
        return t._node

    def _arg(self, a: Any) -> Any:
        """The graph argument for one op argument (a node, a list of nodes, a constant)."""
        if isinstance(a, TracedTensor):
            return self.node_of(a)
        if isinstance(a, torch.Tensor):
            return self._constant(a)
        scalar = symbolic.node_of(a)
        if scalar is not None:
            return scalar.fx_node if scalar.fx_node is not None else scalar.hint
        if isinstance(a, list | tuple) and a and isinstance(a[0], TracedTensor):
            whole = self._whole_list(a)
            if whole is not None:
                return whole
            return type(a)(self._arg(x) for x in a)
        if isinstance(a, list | tuple):
            return type(a)(self._arg(x) for x in a)
        return a

    def _whole_list(self, items: Sequence[Any]) -> fx.Node | None:
        first = items[0]._item if isinstance(items[0], TracedTensor) else None
        if first is None or first[1] != 0 or self._list_len.get(first[0]) != len(items):
            return None
        lst = first[0]
        for i, t in enumerate(items):
            if not isinstance(t, TracedTensor) or t._item != (lst, i):
                return None
        return lst

    def _constant(self, t: torch.Tensor, fresh: bool = False) -> fx.Node:
        if (t.numel() > 1 and not fresh) or t.requires_grad:
            raise TraceError(
                f"the step uses a tensor of shape {list(t.shape)} that is not one of its "
                "inputs (a global, a closure variable or an attribute the tracer does not "
                "follow); pass it as an argument or store it in the optimizer's state"
            )
        name = f"_const{len(self.constants)}"
        self.constants[name] = t.detach().clone()
        node = self.graph.get_attr(name)
        node.meta["val"] = TracedTensor(self, meta.spec_of(t), t.device)
        return node

    # -- ops ----------------------------------------------------------------------------

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        key = None
        if types == _TRACED_ONLY and self.closed_by is None and not symbolic.SUBCLASS_DISPATCH[0]:
            # The plan of an op seen before with arguments of the same kinds (most ops of a
            # step: each parameter of a shape class repeats its ops): what it does to the
            # metadata is known, only the graph values are new.
            key, node_args = plan_key(self, id(func), args)
            if key is not None and kwargs:
                key, node_kwargs = plan_key_kw(self, key, kwargs)
            else:
                node_kwargs = {}
            plan = None if key is None else meta.PLANS.get(key)
            if plan is not None:
                return self._run_plan(plan, args, node_args, node_kwargs)
        return self._dispatch(func, types, args, kwargs or {}, key)

    def _run_plan(
        self, plan: Plan, args: Sequence[Any], node_args: list[Any], node_kwargs: dict[str, Any]
    ) -> Any:
        op = plan.target
        kind = self._kinds.get(id(op))  # (``call``'s work, inline: a call per op less)
        if kind is None or kind[0] is not op:
            kind = self._kinds[id(op)] = compat.call_kind(self.graph, op, _stem(self.graph, op))
        node = compat.append_call(self.graph, kind, tuple(node_args), node_kwargs)
        if plan.inplace is None:
            t = TracedTensor(self, plan.spec, plan.device, False, plan.layout)
            t._node = node
            node.meta["val"] = t
            return t
        node.meta["inplace"] = plan.inplace
        target: TracedTensor = args[0]
        if target._view_of is None and not target._aliases and id(target) not in self._views:
            target._node, target._item = node, None  # (set_value's work for a plain tensor)
        else:
            set_value(self, target, node, None)
        node.meta["val"] = target
        return target

    def _dispatch(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        key: tuple[Any, ...] | None,
    ) -> Any:
        """An op without a plan: recorded step by step (and planned, where it can be)."""
        if types != _TRACED_ONLY and any(t is not TracedTensor for t in types):
            # A subclass with its own dispatch (a DTensor, an AsyncCollectiveTensor) decides;
            # the local ops and collectives it runs on traced tensors come back here. Until
            # its first one on a traced tensor does, symbolic scalars hash by identity (see
            # symbolic.py).
            symbolic.subclass_dispatch(True)
            return NotImplemented
        if types and symbolic.SUBCLASS_DISPATCH[0]:
            symbolic.subclass_dispatch(False)
        if self.closed_by is not None:
            raise TraceError(
                f"the function runs {func} after calling {self.closed_by}, which runs after "
                "the compiled graph; move this work into the closure, or before the call"
            )
        if func is aten.lift_fresh.default and not isinstance(args[0], TracedTensor):
            # torch.tensor(...) inside the step: made from Python data on every call, so a
            # constant of the graph whatever its size.
            fresh: torch.Tensor = args[0]
            node = self._constant(fresh, fresh=True)
            return self._wrap(node, meta.spec_of(fresh), fresh.device)
        info = compat.op_info(func)
        if info.recorded_as is not None:
            func, info = info.recorded_as, compat.op_info(info.recorded_as)
            key = None  # (a plan holds the op its key names: not this one)
        if info.kind == "foreach":
            return record_foreach(self, func, args, kwargs, info.written)
        if info.kind == "read":
            return self._read_scalar(args[0])
        if info.kind == "refused":
            raise TraceError(
                f"the step reads a tensor's value ({func}): Python control flow on tensor "
                "values, .item() and bool(tensor) cannot be traced"
            )
        if not info.pointwise:
            # An int argument of a view, reduction or factory can decide output shapes:
            # symbolic ints are specialized there (a guard on their value).
            args, kwargs = (
                specialize_ints(args),
                dict(zip(kwargs, specialize_ints(kwargs.values()), strict=True)),
            )
        specs = meta.infer(func, arg_specs(args), kwarg_specs(kwargs), info.pointwise)
        written = info.written
        device = output_device(args, kwargs)
        # (what a plan covers: a pointwise op making one tensor of a layout its key fixes)
        key_to_plan = key if info.pointwise and not info.view and isinstance(specs, Spec) else None
        if not written:
            node = self._record(func, args, kwargs)
            out = self._wrap(node, specs, device)
            if info.view and isinstance(args[0], TracedTensor):
                note_view(self, func, args, kwargs, out)
            if key_to_plan is not None:
                meta.PLANS[key_to_plan] = Plan(func, None, specs, device, out._layout)
            return out
        functional = compat.functional_variant(func)
        if functional is None:
            raise TraceError(f"{func} writes to its input and has no functional form to trace")
        targets = [lookup(func, args, kwargs, name) for name in written]
        pure_args, pure_kwargs = compat.drop_out_args(func, args, kwargs)
        out_specs = [specs] if isinstance(specs, Spec) else list(specs)
        node = self._record(functional, pure_args, pure_kwargs)
        promoted = self._promoted(functional, pure_args, pure_kwargs, out_specs)
        if not any(promoted):
            node.meta["inplace"] = func  # what eager ran: a backend may run it in place too
        if len(targets) == 1:
            rebind(self, targets[0], self._cast_back(node, promoted[0], targets[0]), out_specs[0])
            if (
                key_to_plan is not None
                and promoted[0] is None
                and written == ("self",)
                and pure_args is args
                and pure_kwargs is kwargs
                and targets[0] is args[0]
            ):
                meta.PLANS[key_to_plan] = Plan(functional, func, specs, device, -1)
            return targets[0]
        for i, (target, spec) in enumerate(zip(targets, out_specs, strict=True)):
            item = self._cast_back(self.call(operator.getitem, (node, i)), promoted[i], target)
            rebind(self, target, item, spec)
        return tuple(targets)

    def _promoted(
        self, functional: Any, args: Sequence[Any], kwargs: dict[str, Any], specs: list[Spec]
    ) -> list[torch.dtype | None]:
        """Per written tensor, the dtype the functional form computes where it differs from
        the tensor's own (``x.mul_(b)``, x a 0-dim bfloat16 and b a 0-dim float32: ``mul``
        gives float32), else None. Only then is it worth inferring."""
        if len(specs) == 1:  # (the common case, without building sets)
            dtype = specs[0].dtype
            for a in args:
                if type(a) is TracedTensor:
                    if a._spec.dtype is not dtype:
                        break
                elif isinstance(a, torch.Tensor):
                    break
            else:
                if not kwargs or not any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                    return [None]
        dtypes = {s.dtype for s in specs}
        others = {
            a.dtype for a in (*args, *kwargs.values()) if isinstance(a, TracedTensor | torch.Tensor)
        }
        if others <= dtypes:
            return [None] * len(specs)
        found = meta.infer(functional, arg_specs(args), kwarg_specs(kwargs))
        found_specs = [found] if isinstance(found, Spec) else list(found)
        return [
            f.dtype if f.dtype != s.dtype else None for f, s in zip(found_specs, specs, strict=True)
        ]

    def _cast_back(self, node: fx.Node, computed: torch.dtype | None, target: Any) -> fx.Node:
        """An in-place op stores its result in the tensor's dtype: round it as eager does."""
        if computed is None:
            return node
        written = written_tensor(None, target)
        spec = Spec(tuple(written.shape), tuple(written.stride()), computed)
        node.meta["val"] = TracedTensor(self, spec, written.device)
        return self.call(aten._to_copy.default, (node,), {"dtype": written.dtype})

    def _read_scalar(self, t: Any) -> symbolic.SymScalar:
        """A tensor's value used as a Python number (``.item()``, a 0-dim tensor passed
        where a Scalar is expected): a symbolic scalar read in the graph, never a constant."""
        if not isinstance(t, TracedTensor) or t.numel() != 1:
            raise TraceError(f"the step reads the value of a tensor of shape {list(t.shape)}")
        pytype = bool if t.dtype is torch.bool else _SCALAR_TYPES[t.dtype.is_floating_point]
        node = self.call(aten._local_scalar_dense.default, (self.node_of(t),))
        node.meta["val"] = pytype()
        return symbolic.wrap(ScalarNode(self, pytype, None, node, None))

    def _record(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> fx.Node:
        node_args = tuple(
            [
                a._node  # (the common case, without a call)
                if type(a) is TracedTensor
                and a._node is not None
                and a._recorder is self
                and a._stale is None
                else self._arg(a)
                for a in args
            ]
        )
        node_kwargs = {k: self._arg(v) for k, v in kwargs.items()} if kwargs else {}
        return self.call(func, node_args, node_kwargs)

    def _wrap(self, node: fx.Node, specs: Any, device: torch.device) -> Any:
        if isinstance(specs, Spec):
            t = TracedTensor(self, specs, device)
            t._node = node
            node.meta["val"] = t
            return t
        if isinstance(specs, list | tuple):
            outs = []
            for i, s in enumerate(specs):
                item = self.call(operator.getitem, (node, i))
                outs.append(self._wrap(item, s, device))
            node.meta["val"] = tuple(outs)
            return type(specs)(outs)
        return specs


def _stem(graph: fx.Graph, target: Any) -> str:
    """The name stem of ``target``'s nodes (``mul_Tensor``)."""
    known = _NAMES.get(id(target))
    if known is not None and known[0] is target:
        return known[1]
    # (an identifier already: fx would otherwise clean ``mul.tensor`` per node)
    name = _NOT_IDENT.sub("_", graph._target_to_str(target))
    _NAMES[id(target)] = (target, name)
    return name
