"""The recorder: run tensor code on traced tensors and record it as a functional ATen graph.

A TracedTensor carries a tensor's metadata (shape, stride, dtype, device) and the graph
value it currently holds, no data. While a Recorder is active every ATen op goes through
it: the op becomes a graph node, its output metadata comes from ``meta.infer``, and its
outputs are new TracedTensors. In-place and ``out=`` ops are recorded as their functional
forms and the written tensor is rebound to the new value, so the graph has no mutation and
the Python objects the step holds (parameters keying ``state``) keep their identity. After
the step, an input whose value changed is an in-place write the caller turns into a
writeback.

Foreach ops return one list node; an item becomes its own ``getitem`` node only when
something uses it alone, and a list that is exactly a previous op's output is passed as
that node.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from opttrace import _torch_compat as compat
from opttrace import meta, symbolic
from opttrace.errors import TraceError
from opttrace.meta import Spec
from opttrace.symbolic import ScalarNode
from opttrace.view_writes import ViewStep, bound

aten = torch.ops.aten

_SCALAR_TYPES = {True: float, False: int}
# id(target) -> (target, its node name stem): an OpOverload hashes in Python.
_NAMES: dict[int, tuple[Any, str]] = {}
_NOT_IDENT = re.compile("[^0-9a-zA-Z_]+")
# View ops whose output, when it has its input's shape and strides, is all of its input.
_FULL_ALIAS = {aten.alias.default, aten.detach.default, aten.view.default, aten.expand.default}


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}, {value.dtype} on {value.device}"
    return f"a {type(value).__name__}"


class TracedTensor(torch.Tensor):
    """A tensor of a traced step: metadata and the graph value it holds, no storage."""

    _recorder: Recorder | None
    _spec: Spec
    _device: torch.device  # (as ``device``, without a call into torch per op)
    _layout: int  # meta.layout_id(_spec, _device): what an op's plan key holds for it
    # (The rest start as these class defaults: a tensor per op need not set them.)
    _node: fx.Node | None = None
    _item: tuple[fx.Node, int] | None = None  # (list node, index) for foreach outputs
    # Aliasing: tensors sharing all of one value (detach, alias) share one list; a partial
    # view (slice, select, reshape) knows its base and goes stale when the base is written.
    _aliases: list[TracedTensor] | None = None
    _view_of: TracedTensor | None = None
    _view_chain: tuple[ViewStep, ...] = ()  # the view ops from ``_view_of`` to this tensor
    _stale: str | None = None

    # No torch-function layer: every method call on a traced tensor would otherwise pay for
    # re-wrapping its results, and the dispatch mode records ops below it anyway.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls,
        recorder: Recorder,
        spec: Spec,
        device: torch.device,
        requires_grad: bool = False,
        layout: int | None = None,
    ) -> TracedTensor:
        t: TracedTensor = compat.MAKE_WRAPPER(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=device,
            requires_grad=requires_grad,
        )
        t._recorder = recorder
        t._spec = spec
        t._device = device
        t._layout = meta.layout_id(spec, device) if layout is None else layout
        return t

    # (no __init__ of its own: Tensor's is object's, a C call that ignores the arguments
    # __new__ took; a Python one would cost a frame for each of a step's tensors)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise TraceError(
            f"{func} was called on a traced tensor outside its trace; a traced step must not "
            "keep tensors it received (or made) past its own return"
        )

    # ``.grad`` lives in the instance dict, not autograd's slot: a store to it is a side
    # effect the recorder reports (replayed on the real tensor), and the cyclic collector can
    # see the reference (autograd's slot would hide it and leak the whole trace).
    @property
    def grad(self) -> Any:
        return self.__dict__.get("_grad_value")

    @grad.setter
    def grad(self, value: Any) -> None:
        recorder = self._recorder
        if recorder is not None and recorder.on_grad_store is not None:
            recorder.on_grad_store(self, value)
        self.__dict__["_grad_value"] = value

    @property
    def data(self) -> Any:
        return compat.TENSOR_DATA.__get__(self, type(self))

    @data.setter
    def data(self, value: Any) -> None:
        """``t.data = v`` (older optimizers write a step's result so): traced as writing
        ``v``'s values into ``t``. Eager makes ``t`` share ``v``'s storage instead; only a
        later in-place write to ``v`` would tell the two apart."""
        if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
            self.shape,
            self.dtype,
            self.device,
        ):
            raise TraceError(
                f"the step assigns .data of a tensor ({list(self.shape)} {self.dtype}) "
                f"{_described(value)}: a tensor of the same shape, dtype and device can be "
                "traced (its values are written in place)"
            )
        with torch.no_grad():
            self.copy_(value)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        dtype = str(self.dtype).replace("torch.", "")
        return f"TracedTensor({dtype}, shape={list(self.shape)}, device={self.device})"


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
        self.closed_by: str | None = None  # set when no more ops may be recorded, and why
        self._views: dict[int, list[TracedTensor]] = {}  # id(tensor) -> its partial views

    # -- values -------------------------------------------------------------------------

    def detach_hooks(self) -> None:
        """Drop the callbacks into the trace's context (which holds the real inputs): the
        graph keeps this recorder, and must not keep parameters alive through it."""
        self.on_decision = None
        self.on_grad_store = None

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
            key, node_args = _plan_key(self, id(func), args)
            if key is not None and kwargs:
                key, node_kwargs = _plan_key_kw(self, key, kwargs)
            else:
                node_kwargs = {}
            plan = None if key is None else meta.PLANS.get(key)
            if plan is not None:
                return self._run_plan(plan, args, node_args, node_kwargs)
        return self._dispatch(func, types, args, kwargs or {}, key)

    def _run_plan(
        self, plan: _Plan, args: Sequence[Any], node_args: list[Any], node_kwargs: dict[str, Any]
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
            target._node, target._item = node, None  # (_set_value's work for a plain tensor)
        else:
            self._set_value(target, node, None)
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
            return self._foreach(func, args, kwargs, info.written)
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
                _specialize_ints(args),
                dict(zip(kwargs, _specialize_ints(kwargs.values()), strict=True)),
            )
        specs = meta.infer(func, _specs(args), _specs_kw(kwargs), info.pointwise)
        written = info.written
        device = _device(args, kwargs)
        # (what a plan covers: a pointwise op making one tensor of a layout its key fixes)
        plan_key = key if info.pointwise and not info.view and isinstance(specs, Spec) else None
        if not written:
            node = self._record(func, args, kwargs)
            out = self._wrap(node, specs, device)
            if info.view and isinstance(args[0], TracedTensor):
                self._note_view(func, args, kwargs, out)
            if plan_key is not None:
                meta.PLANS[plan_key] = _Plan(func, None, specs, device, out._layout)
            return out
        functional = compat.functional_variant(func)
        if functional is None:
            raise TraceError(f"{func} writes to its input and has no functional form to trace")
        targets = [_lookup(func, args, kwargs, name) for name in written]
        pure_args, pure_kwargs = compat.drop_out_args(func, args, kwargs)
        out_specs = [specs] if isinstance(specs, Spec) else list(specs)
        node = self._record(functional, pure_args, pure_kwargs)
        promoted = self._promoted(functional, pure_args, pure_kwargs, out_specs)
        if not any(promoted):
            node.meta["inplace"] = func  # what eager ran: a backend may run it in place too
        if len(targets) == 1:
            self._rebind(targets[0], self._cast_back(node, promoted[0], targets[0]), out_specs[0])
            if (
                plan_key is not None
                and promoted[0] is None
                and written == ("self",)
                and pure_args is args
                and pure_kwargs is kwargs
                and targets[0] is args[0]
            ):
                meta.PLANS[plan_key] = _Plan(functional, func, specs, device, -1)
            return targets[0]
        for i, (target, spec) in enumerate(zip(targets, out_specs, strict=True)):
            item = self._cast_back(self.call(operator.getitem, (node, i)), promoted[i], target)
            self._rebind(target, item, spec)
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
        found = meta.infer(functional, _specs(args), _specs_kw(kwargs))
        found_specs = [found] if isinstance(found, Spec) else list(found)
        return [
            f.dtype if f.dtype != s.dtype else None for f, s in zip(found_specs, specs, strict=True)
        ]

    def _cast_back(self, node: fx.Node, computed: torch.dtype | None, target: Any) -> fx.Node:
        """An in-place op stores its result in the tensor's dtype: round it as eager does."""
        if computed is None:
            return node
        written = _written_tensor(None, target)
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

    def _foreach(
        self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], written: tuple[str, ...]
    ) -> Any:
        first_list = next(a for a in args if isinstance(a, list | tuple))
        n = len(first_list)
        if not written:
            pointwise = func.overloadpacket.__name__ not in _FOREACH_REDUCTIONS
            items = _foreach_items(func, args, kwargs, first_list, pointwise)
            node = self._record(func, args, kwargs)
            return self._wrap_list(node, items)
        functional = compat.functional_variant(func)
        if functional is None or len(written) != 1:
            raise TraceError(f"{func} writes to its inputs and has no functional form to trace")
        targets = _lookup(func, args, kwargs, written[0])
        written_tensors = list(targets)
        for t in written_tensors:  # (a call per item only for the one that fails)
            if not isinstance(t, TracedTensor):
                _written_tensor(func, t)
        _refuse_repeats(func, written_tensors)
        pure_args, pure_kwargs = compat.drop_out_args(func, args, kwargs)
        node = self._record(functional, pure_args, pure_kwargs)
        self._list_len[node] = n
        promoted = self._foreach_promoted(functional, pure_args, pure_kwargs, written_tensors)
        if not any(promoted):
            node.meta["inplace"] = func  # what eager ran: a backend may run it in place too
        node.meta["val"] = tuple(written_tensors)
        views = self._views
        for i, (t, computed) in enumerate(zip(written_tensors, promoted, strict=True)):
            if computed is None:
                if t._view_of is None and not t._aliases and id(t) not in views:
                    t._node, t._item = None, (node, i)  # (_set_value's work for a plain item)
                else:
                    self._set_value(t, None, (node, i))
                continue
            # (e.g. a 0-dim float16 param times a 0-dim float32: eager stores it rounded)
            item = self.call(operator.getitem, (node, i))
            spec = Spec(tuple(t.shape), tuple(t.stride()), computed)
            item.meta["val"] = TracedTensor(self, spec, t.device)
            cast = self.call(aten._to_copy.default, (item,), {"dtype": t.dtype})
            self._set_value(t, cast, None)
            cast.meta["val"] = t
        return None if not func._schema.returns else targets

    def _foreach_promoted(
        self,
        functional: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        targets: list[TracedTensor],
    ) -> list[torch.dtype | None]:
        """Per written item, the dtype the functional foreach op computes it in where that
        differs from the item's own (see ``_promoted``), else None."""
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
            item_args = _specs([_item_arg(a, i) for a in args])
            item_kwargs = _specs_kw({k: _item_arg(v, i) for k, v in kwargs.items()})
            spec = _single(meta.infer(functional, item_args, item_kwargs))
            found.append(spec.dtype if spec.dtype != t.dtype else None)
        return found

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

    def _wrap_list(
        self, node: fx.Node, items: list[tuple[Spec, torch.device, int]]
    ) -> list[TracedTensor]:
        self._list_len[node] = len(items)
        outs = []
        for i, (spec, device, layout) in enumerate(items):
            t = TracedTensor(self, spec, device, False, layout)
            t._item = (node, i)
            outs.append(t)
        node.meta["val"] = tuple(outs)  # what each item is (shape, dtype, device)
        return outs

    def _rebind(self, target: Any, node: fx.Node, spec: Spec) -> None:
        target = _written_tensor(None, target)
        if spec.shape != target._spec.shape or spec.dtype != target._spec.dtype:
            raise TraceError(
                f"an in-place op changes a tensor's shape or dtype ({list(target.shape)} "
                f"{target.dtype} -> {list(spec.shape)} {spec.dtype}); resize in place "
                "cannot be traced"
            )
        self._set_value(target, node, None)
        node.meta["val"] = target

    def _set_value(
        self, target: TracedTensor, node: fx.Node | None, item: tuple[fx.Node, int] | None
    ) -> None:
        """Bind ``target`` (and every full alias of it) to a new value; views of it go stale.
        A write through a view writes its base: the base's new value scatters the view's
        into the old one (``slice_scatter``, a transpose undone, ...)."""
        if target._view_of is not None:
            self._write_through_view(target, node, item)
            return
        for t in target._aliases or (target,):
            t._node, t._item = node, item
            for view in self._views.pop(id(t), ()):
                view._stale = (
                    f"the step uses a view (shape {list(view.shape)}) of a tensor after writing "
                    "that tensor in place; take the view again after the write"
                )

    def _note_view(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
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
                self._register_view(root, view)

    def _register_view(self, root: TracedTensor, view: TracedTensor) -> None:
        for alias in root._aliases or (root,):
            self._views.setdefault(id(alias), []).append(view)

    def _write_through_view(
        self, view: TracedTensor, node: fx.Node | None, item: tuple[fx.Node, int] | None
    ) -> None:
        root = view._view_of
        assert root is not None
        if node is None:  # an item of a foreach result
            assert item is not None
            node = self.call(operator.getitem, item)
            node.meta["val"] = view
        # The tensors along the chain, as they are now: root, root's view, ..., the view's base.
        bases: list[tuple[fx.Node, TracedTensor]] = [(self.node_of(root), root)]
        for step in view._view_chain[:-1]:
            bases.append(step.apply(self, *bases[-1]))
        levels = [b for _, b in bases[1:]] + [view]  # what each step made of its base
        new = node
        for step, (base_node, base), made in zip(
            reversed(view._view_chain), reversed(bases), reversed(levels), strict=True
        ):
            new = step.scatter(self, base_node, base, new, made)
        self._set_value(root, new, None)  # every other view of root goes stale
        new.meta["val"] = root
        view._node, view._item, view._stale = node, None, None
        self._register_view(root, view)


def _stem(graph: fx.Graph, target: Any) -> str:
    """The name stem of ``target``'s nodes (``mul_Tensor``)."""
    known = _NAMES.get(id(target))
    if known is not None and known[0] is target:
        return known[1]
    # (an identifier already: fx would otherwise clean ``mul.tensor`` per node)
    name = _NOT_IDENT.sub("_", graph._target_to_str(target))
    _NAMES[id(target)] = (target, name)
    return name


@dataclass(frozen=True)
class _Plan:
    """What a pointwise op does, given its arguments' kinds (its key): the node it records
    (calling ``target``) and either the new tensor it makes (``spec`` on
    ``device``, of layout id ``layout``) or, for an in-place op, that it rebinds its
    ``self`` (``inplace``: the op eager ran, kept in the node's meta)."""

    target: Any
    inplace: Any
    spec: Spec
    device: torch.device
    layout: int


def _plan_key(rec: Recorder, head: Any, args: Sequence[Any]) -> tuple[Any, list[Any]]:
    """An op's plan key (``head``, then its arguments' kinds) and its node's arguments, or
    (None, []) where the op's arguments are of a kind a plan does not cover (the op is then
    recorded step by step). An op is keyed by its id (an OpOverload hashes in Python): its
    plan holds it, so no other op takes that id while the plan exists."""
    key: list[Any] = [head]
    node_args: list[Any] = []
    for a in args:
        kind = type(a)
        if kind is TracedTensor:
            node = a._node
            if node is None or a._recorder is not rec or a._stale is not None:
                return None, []
            key.append(a._layout)
            node_args.append(node)
        elif kind is float:
            key.append(float)  # (as meta.infer: a float's value never changes metadata)
            node_args.append(a)
        elif kind is int or kind is bool:
            key += (kind, a)
            node_args.append(a)
        elif kind is torch.SymFloat:
            scalar = a.node
            if type(scalar) is not ScalarNode:
                return None, []
            key.append(kind)
            node_args.append(scalar.fx_node if scalar.fx_node is not None else scalar.hint)
        else:
            return None, []
    return tuple(key), node_args


def _plan_key_kw(
    rec: Recorder, key: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """``key`` extended by the keyword arguments (as ``_plan_key``), and their node values."""
    names = tuple(kwargs)
    kw_key, values = _plan_key(rec, names, list(kwargs.values()))
    if kw_key is None:
        return None, {}
    return (*key, *kw_key), dict(zip(names, values, strict=True))


def _specialize_ints(values: Any) -> list[Any]:
    out = []
    for v in values:
        if isinstance(v, torch.SymInt | torch.SymBool):
            v = int(v) if isinstance(v, torch.SymInt) else bool(v)
        elif isinstance(v, list | tuple) and any(isinstance(x, torch.SymInt) for x in v):
            v = type(v)(int(x) if isinstance(x, torch.SymInt) else x for x in v)
        out.append(v)
    return out


# Foreach ops whose items are reductions (a 0-dim result per tensor), not pointwise.
_FOREACH_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})


def _written_tensor(func: Any, t: Any) -> TracedTensor:
    if not isinstance(t, TracedTensor):
        raise TraceError(
            f"the step writes in place to a tensor that is not one of its inputs "
            f"({'a ' + str(func) + ' target' if func else 'shape ' + str(list(t.shape))}): "
            "a global, a closure variable or a tensor the tracer does not follow"
        )
    return t


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
            item_args = _specs([_item_arg(a, i) for a in args])
            item_kwargs = _specs_kw({k: _item_arg(v, i) for k, v in kwargs.items()})
            spec = _single(meta.infer(func, item_args, item_kwargs, pointwise))
            first = first_list[i]
            device = first._device if type(first) is TracedTensor else first.device
            item = (spec, device, meta.layout_id(spec, device))
            if -1 not in key:
                found[key] = item
        items.append(item)
    return items


def _single(s: Any) -> Spec:
    if isinstance(s, list | tuple):
        return s[0]  # type: ignore[no-any-return]
    return s  # type: ignore[no-any-return]


def _specs(args: Sequence[Any]) -> list[Any]:
    return [a._spec if type(a) is TracedTensor else _spec_arg(a) for a in args]


def _specs_kw(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: _spec_arg(v) for k, v in kwargs.items()} if kwargs else {}


def _spec_arg(a: Any) -> Any:
    if isinstance(a, TracedTensor):
        return a._spec
    if isinstance(a, torch.Tensor):
        return meta.spec_of(a)
    if isinstance(a, list | tuple):
        return type(a)(_spec_arg(x) for x in a)
    return symbolic.hint_of(a)


def _item_arg(a: Any, i: int) -> Any:
    if isinstance(a, list | tuple) and len(a) > 0:
        return [a[i]]
    return a


def _device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device:
    """The device of an op's outputs: an explicit ``device=``, else its tensors' device
    (a 0-dim CPU tensor next to CUDA tensors does not count, as in TensorIterator)."""
    device = kwargs.get("device")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        return torch.device(device)
    first = args[0] if args else None
    if type(first) is TracedTensor and (first._spec.shape or first._device.type != "cpu"):
        return first._device  # (the common case: the first tensor found below)
    fallback = None
    for a in (*args, *kwargs.values()):
        if type(a) is TracedTensor:  # (as below, from what it keeps)
            if a._spec.shape or a._device.type != "cpu":
                return a._device
            fallback = fallback or a._device
            continue
        for t in a if isinstance(a, list | tuple) else (a,):
            if isinstance(t, torch.Tensor):
                if t.device.type != "cpu" or t.dim() > 0:
                    return t.device
                fallback = fallback or t.device
    return fallback or _CPU


_CPU = torch.device("cpu")


def _lookup(func: Any, args: Sequence[Any], kwargs: dict[str, Any], name: str) -> Any:
    i = _position(func, name)
    return kwargs[name] if name in kwargs or i >= len(args) else args[i]


@functools.cache
def _position(func: Any, name: str) -> int:
    """The position of the argument ``name`` in ``func``'s schema."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return i
    raise TraceError(f"{func} has no argument {name!r}")
