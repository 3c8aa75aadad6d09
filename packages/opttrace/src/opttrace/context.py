"""The state of one trace: graph inputs by Source, guards, the ledger, graph outputs.

A trace runs in two phases. ``collect`` walks the real inputs before tracing and registers
every reachable tensor (parameters, their grads, optimizer state, tensors in param groups)
as a graph input with the Source it was found at. Inside the traced function, ``read`` turns
each value the step touches into what the step should see: a fake tensor bound to its
placeholder, a tracked container, or a Python constant with a guard on it.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from optguard import (
    AliasGuard,
    AttrSource,
    ConstantGuard,
    DataPtrGuard,
    DictLengthGuard,
    DisjointGuard,
    EqualGuard,
    FloatGuard,
    Guard,
    GuardSetBuilder,
    IdentityGuard,
    ItemSource,
    KeyedSource,
    KeysGuard,
    LengthGuard,
    NoneGuard,
    PredicateGuard,
    Source,
    TensorMatchGuard,
    TensorMeta,
    TypeGuard,
    ancestors,
    overlapping,
    variable_name,
)
from optsidefx import Apply, Build, CallResult, Const, Input, Ledger, Output, Ref
from torch import fx

from opttrace import _torch_compat as compat
from opttrace import audit, dtensor, meta
from opttrace.audit import CONSTANT_TYPES
from opttrace.errors import TraceError
from opttrace.recorder import Recorder
from opttrace.symbolic import ScalarNode, guard_template, node_of
from opttrace.traced_tensor import TracedTensor
from opttrace.trackers import TrackedDict, TrackedList, TrackedStateDict
from opttrace.view import (
    is_plain_object,
    object_view,
    optimizer_view,
    slot_values,
    view_source,
)


def is_constant(value: Any) -> bool:
    return type(value) in CONSTANT_TYPES


class Pending:
    """The result of a call the replay makes after the graph (``opt.step(closure)`` in a
    compiled function): the traced code may return it, not use it."""

    def __init__(self, result: CallResult, what: str) -> None:
        self.result = result
        self.what = what

    def __getattr__(self, name: str) -> Any:
        raise TraceError(
            f"the result of {self.what}(...) exists only after the compiled function's graph "
            f"ran; return it from the function instead of using it (it used .{name})"
        )

    def __bool__(self) -> bool:
        return bool(self.__getattr__("__bool__"))


def _is_float(value: Any) -> bool:
    """A Python float, or numpy's float64 (a subclass with the same arithmetic: an lr taken
    from a numpy computation), which the step then sees as a symbolic float."""
    return type(value) is float or (isinstance(value, float) and type(value).__module__ == "numpy")


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain_tensor_type(cls: type[torch.Tensor]) -> bool:
    """A tensor type whose ops are torch's own: Tensor, Parameter, or a subclass that
    overrides neither ``__torch_function__`` nor ``__torch_dispatch__``."""
    if cls in _PLAIN_TENSORS:
        return True
    base = torch.nn.Parameter if issubclass(cls, torch.nn.Parameter) else torch.Tensor
    return bool(
        getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
        is getattr(base.__torch_function__, "__func__", base.__torch_function__)
        and cls.__torch_dispatch__ is base.__torch_dispatch__
    )


def _chosen(real: torch.Tensor, chosen: dict[int, torch.Tensor]) -> bool:
    """A 0-dim float tensor among ``chosen`` (see trace())."""
    return id(real) in chosen and real.dim() == 0 and real.is_floating_point()


def _in_params_list(source: Source) -> bool:
    """An item of a param group's ``'params'``: its ``.grad`` decides whether it is stepped,
    even while it does not require grad (a frozen param may be given a grad later)."""
    return (
        isinstance(source, ItemSource)
        and isinstance(source.base, ItemSource)
        and source.base.key == "params"
    )


def _in_optimizer_state(source: Source) -> bool:
    """Whether ``source`` is inside an entry of an optimizer's ``state`` (keyed by a param)."""
    return any(isinstance(s, KeyedSource) for s in ancestors(source))


def _is_state_dict(value: dict[Any, Any]) -> bool:
    return isinstance(value, defaultdict) or any(isinstance(k, torch.Tensor) for k in value)


class TraceContext:
    """Inputs, guards, ledger and outputs of one trace."""

    def __init__(
        self,
        recorder: Recorder,
        capturable: bool = False,
        python_floats: Sequence[torch.Tensor] = (),
        float64_inputs: Sequence[torch.Tensor] = (),
    ) -> None:
        self.recorder = recorder
        self.capturable = capturable  # show optimizers capturable=True (see view.py)
        self.python_floats = {id(t): t for t in python_floats}  # (see trace())
        self.float64_inputs = {id(t): t for t in float64_inputs}
        self._converted: dict[int, fx.Node] = {}  # input index -> its float64 conversion
        self.guards = GuardSetBuilder()
        # ``guard(g)``: install a guard (the builder's own method: one call per guard, and a
        # trace installs several per tensor it reads)
        self.guard: Callable[[Guard], object] = self.guards.add
        self.ledger = Ledger()
        self.input_sources: list[Source] = []
        self.input_tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        self._fakes: dict[int, TracedTensor] = {}  # input index -> its traced tensor
        self._fake_index: dict[int, int] = {}  # id(traced tensor) -> input index
        self._dtensors: dict[int, torch.Tensor] = {}  # id(DTensor input) -> what the step sees
        self._dtensor_inputs: dict[int, tuple[Source, torch.Tensor]] = {}  # id(seen) -> input
        recorder.on_decision = self._decided
        recorder.on_grad_store = self._grad_stored
        recorder.on_attr_read = self._attr_read
        self._optimizer_sources: set[Source] = set()
        self._object_sources: dict[int, Source] = {}  # other objects read, for the replay
        self._object_views: dict[int, Any] = {}  # id(plain object) -> its view (view.py)
        self._grad_bound: set[int] = set()
        self._unpinned: set[int] = set()  # inputs without a data-pointer guard
        self._tensor_metas: dict[tuple[Any, ...], TensorMeta] = {}  # (see _fake)
        self.outputs: list[Any] = []  # tensors and symbolic scalars the replay needs
        self._output_index: dict[int, int] = {}

    # -- phase 1: before tracing ------------------------------------------------------------

    def collect(self, value: Any, source: Source, _seen: set[int] | None = None) -> None:
        """Register every tensor reachable from ``value`` as a graph input."""
        seen = set() if _seen is None else _seen
        if isinstance(value, torch.Tensor):
            self._register(value, source)
            if value.grad is not None:
                self._register(value.grad, AttrSource(source, "grad"))
            return
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.optim.Optimizer):
            # Params first: state is keyed by them and named through their sources.
            self.collect(value.param_groups, AttrSource(source, "param_groups"), seen)
            for name, attr in vars(value).items():
                self.collect(attr, AttrSource(source, name), seen)
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                self.collect(item, ItemSource(source, i), seen)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str | int):
                    self.collect(item, ItemSource(source, key), seen)
                elif isinstance(key, torch.Tensor) and id(key) in self._index:
                    key_source = self.input_sources[self._index[id(key)]]
                    self.collect(item, KeyedSource(source, key_source), seen)

    def _register(self, tensor: torch.Tensor, source: Source) -> None:
        if id(tensor) not in self._index:
            self._index[id(tensor)] = len(self.input_tensors)
            self.input_tensors.append(tensor)
            self.input_sources.append(source)

    # -- phase 2: inside the traced function ------------------------------------------------

    def source_of(self, fake: Any) -> Source | None:
        i = self._fake_index.get(id(fake))
        if i is None:
            found = self._dtensor_inputs.get(id(fake))
            return None if found is None else found[0]
        return self.input_sources[i]

    def real_of(self, fake: Any) -> Any:
        i = self._fake_index.get(id(fake))
        if i is None:
            found = self._dtensor_inputs.get(id(fake))
            return None if found is None else found[1]
        return self.input_tensors[i]

    def _is_counter(self, source: Source) -> bool:
        """Whether an int at ``source`` is state the step keeps (not a hyperparameter): inside
        an optimizer's ``state``, or an attribute of the optimizer itself."""
        if isinstance(source, AttrSource) and source.base in self._optimizer_sources:
            return source.attr not in ("defaults", "param_groups")
        return _in_optimizer_state(source)

    def _through_object_view(self, source: Source) -> bool:
        views = {self._object_sources[id(v)] for v in self._object_views.values()}
        return any(s in views for s in ancestors(source))

    def _is_static(self, source: Source) -> bool:
        """Whether a tensor keeps its address between steps: an optimizer's parameters and
        state (not grads, which backward makes anew, nor a function's tensor arguments)."""
        static, s, optimizers = False, source, self._optimizer_sources
        while True:  # (what ancestors() walks, without a call per step: asked per tensor)
            if isinstance(s, AttrSource):
                if s.attr == "grad":
                    return False  # (a grad, or a DTensor grad's local shard)
            elif not isinstance(s, ItemSource | KeyedSource):
                return static or (s is not source and s in optimizers)
            static = static or (s is not source and s in optimizers)
            s = s.base

    def _grad_stored(self, tensor: TracedTensor, value: Any) -> None:
        source = self.source_of(tensor)
        if source is None:
            raise TraceError(
                "the step assigns .grad of a tensor it created; only inputs' .grad can be set"
            )
        self.ledger.store_attr(Input(source), "grad", value)

    def _attr_read(self, fake: TracedTensor, name: str) -> Any:
        """``fake.name`` where the real input tensor holds ``name`` in its own dict (a
        per-parameter setting a custom step reads), read as any value there is."""
        i = self._fake_index.get(id(fake))
        attrs = None if i is None else getattr(self.input_tensors[i], "__dict__", None)
        if i is not None and (not attrs or name not in attrs):
            # (``getattr(p, "lr_scale", 1.0)`` took the default: one set later retraces)
            has = f"hasattr({{0}}, {name!r})"
            self.guard(PredicateGuard(self.input_sources[i], has, False))
        if i is None or not attrs or name not in attrs:
            raise AttributeError(f"'{type(fake).__name__}' object has no attribute '{name}'")
        value = self.read(attrs[name], AttrSource(self.input_sources[i], name))
        fake.__dict__[name] = value  # (the step's next read finds it)
        return value

    def _decided(self, node: ScalarNode, value: Any) -> None:
        """Guard the outcome of a Python decision on symbolic scalars."""
        assert node.expr is not None
        template, sources = guard_template(node.expr)
        if not sources:
            return
        self.guard(PredicateGuard(sources[0], template, value, tuple(sources[1:])))

    def call_after_graph(self, target: Source, method: str, args: tuple[Any, ...]) -> Any:
        """Record ``target.method(*args)`` for the replay; the trace sees a Pending result.

        The replay runs after the graph, so tensor work after this call would run before it:
        from here on the recorder refuses ops, with a message that says so."""
        self.recorder.closed_by = f"{target.name()}.{method}(...)"
        return Pending(self.ledger.call(Input(target), method, args), f"{target.name()}.{method}")

    def note_absent(self, source: Source) -> None:
        """The step looked for a dict entry that does not exist (e.g. state of a new param)."""
        self.guard(KeysGuard(source, None))

    def read(self, value: Any, source: Source) -> Any:
        """What the step sees for the input ``value`` found at ``source``; installs guards."""
        if type(value) in _PLAIN_TENSORS:  # (most reads: what follows, without its calls)
            return self._fake(value, source)
        if _is_float(value) or (type(value) is int and self._is_counter(source)):
            # A hyperparameter, or a count the step keeps in its state or on the optimizer
            # (state['step'] += 1, self.step_count += 1): a graph input, so a new value never
            # retraces.
            self.guard(FloatGuard(source) if _is_float(value) else TypeGuard(source, int))
            hint = float(value) if isinstance(value, float) else value  # (numpy's as float)
            return self.recorder.scalar_placeholder(variable_name(source), hint, source)
        if is_constant(value):
            self.guard(ConstantGuard(source, value))
            return value
        if isinstance(value, torch.Tensor):
            return self._fake(value, source)
        self.guard(TypeGuard(source, type(value)))
        self._object_sources[id(value)] = source
        if isinstance(value, torch.optim.Optimizer):
            self._optimizer_sources.add(source)
            return optimizer_view(self, value, source)
        if is_plain_object(value):  # (a config object): its attributes are read as inputs
            view = self._object_views.get(id(value))
            if view is None:
                view = self._object_views[id(value)] = object_view(self, value, source)
                self._object_sources[id(view)] = source
            elif self._object_sources[id(view)] != source:
                # Reached a second way: the view reads through the first.
                self.guard(AliasGuard(source, self._object_sources[id(view)]))
            return view
        if type(value) in (list, tuple):
            self.guard(LengthGuard(source, len(value)))
            items = [self.read(v, ItemSource(source, i)) for i, v in enumerate(value)]
            return TrackedList(self, source, items) if type(value) is list else tuple(items)
        if type(value) in (dict, OrderedDict, defaultdict):
            if _is_state_dict(value):
                self.guard(DictLengthGuard(source, len(value)))
                factory = value.default_factory if isinstance(value, defaultdict) else None
                return TrackedStateDict(self, source, value, factory)
            # Their order matters only if the step iterates (TrackedDict then guards it).
            self.guard(KeysGuard(source, tuple(value), ordered=False))
            return TrackedDict(self, source, value)
        if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
            # (an array changes in place under one identity: what the step read from it
            # would stay baked in)
            raise TraceError(
                f"{source.name()} is a numpy array; its values, read into Python numbers, "
                "would be baked into the graph and a change in place not seen. Use Python "
                "floats or a tensor"
            )
        # Anything else (a function, a frozen dataclass, a named tuple) is used as it is:
        # what the step reads from it is baked in, so another object there retraces.
        self.guard(IdentityGuard.of(source, value))
        for name, held in slot_values(value):  # (one with __slots__ may change in place)
            copied = audit.constant_copy(held)
            if copied is not audit.NOT_CONSTANT:
                self.guard_copy(AttrSource(source, name), copied)
        return value

    def guard_copy(self, source: Source, copied: Any) -> None:
        """Guard ``source`` to keep ``copied`` (``audit.constant_copy`` of what it held: a
        constant compared by identity or value, a container with ``==``)."""
        simple = type(copied) in CONSTANT_TYPES
        self.guard(ConstantGuard(source, copied) if simple else EqualGuard(source, copied))

    def _fake(self, real: torch.Tensor, source: Source) -> torch.Tensor:
        if type(real) in _PLAIN_TENSORS:
            pass  # (a tensor or a parameter: neither a DTensor nor a subclass of its own)
        elif dtensor.is_dtensor(real):
            return self._dtensor(real, source)
        elif not _plain_tensor_type(type(real)):
            raise TraceError(
                f"{source.name()} is a {type(real).__name__}, a tensor subclass with its own "
                "__torch_function__ or __torch_dispatch__ (a DTensor, a wrapper): the graph "
                "would run plain ops where it runs its own; only tensors and Parameters "
                "are traced"
            )
        if real.layout != torch.strided:
            layout = str(real.layout).removeprefix("torch.")
            raise TraceError(
                f"{source.name()} is a {layout} tensor; only dense (strided) tensors can be traced"
            )
        i = self._index.get(id(real))
        if i is None and self._through_object_view(source):
            # Inside a plain object (config.mask): registered when read, not collected
            # beforehand (an object can reach far: a trainer holding a dataset).
            self._register(real, source)
            i = self._index[id(real)]
        if i is None:
            raise TraceError(f"{source.name()} is a tensor the tracer did not collect as an input")
        first = self.input_sources[i]
        if source is not first and source == first:
            # The path collect() named it by, as an object of its own: one object for one
            # path from here on (the guards, the placeholder, the grad's source), so what
            # later looks them up compares by identity, not field by field along the path.
            source = first
        device = real.device
        spec, layout_id = meta.layout_of(real, device)
        meta_key = (type(real), layout_id, real.requires_grad)
        tensor_meta = self._tensor_metas.get(meta_key)
        if tensor_meta is None:  # (one per layout: inputs of one layout share it)
            tensor_meta = self._tensor_metas[meta_key] = TensorMeta.of(real)
        self.guard(TensorMatchGuard(source, tensor_meta))
        static = self._is_static(source)
        pinned = static and not (not spec.shape and device.type == "cpu")
        if pinned:
            # (A 0-dim CPU tensor, a step count, is read by value on the host, or through
            # an address table the backend re-checks each call: its address is free to
            # change, and the Triton backend moves all of them into one buffer.)
            self.guard(DataPtrGuard(source, real.data_ptr()))
        else:
            self._unpinned.add(i)
            if source is not first:  # (equal sources are one object: above)
                # One tensor reached two ways (one grad given to two params, f(x, x)): the
                # graph has one input for both, fetched from ``first``.
                self.guard(AliasGuard(source, first))
        fake = self._fakes.get(i)
        if fake is None:
            name = variable_name(source)
            fake = self.recorder.placeholder(name, real, source, static, (spec, layout_id))
            key = id(real)  # (_chosen asked only for the few chosen: a call per tensor else)
            if key in self.python_floats and _chosen(real, self.python_floats):
                self.recorder.node_of(fake).meta["python_float"] = True
            chosen = key in self.float64_inputs and _chosen(real, self.float64_inputs)
            if chosen and real.dtype != torch.float64:
                fake = torch.ops.aten._to_copy.default(fake, dtype=torch.float64)
                self._converted[i] = self.recorder.node_of(fake)
            self._fakes[i] = fake
            self._fake_index[id(fake)] = i
        wants_grad = real.requires_grad or real.grad is not None or _in_params_list(source)
        if wants_grad and i not in self._grad_bound:
            self._grad_bound.add(i)
            grad_source = AttrSource(source, "grad")
            self.guard(NoneGuard(grad_source, real.grad is None))
            if real.grad is not None:
                fake.__dict__["_grad_value"] = self._fake(real.grad, grad_source)
        return fake

    def _dtensor(self, real: torch.Tensor, source: Source) -> torch.Tensor:
        """A DTensor input: guarded on its global metadata, mesh and placements; the step
        sees a DTensor around the traced stand-in of its local shard (see dtensor.py)."""
        self.guard(TensorMatchGuard(source, TensorMeta.of(real)))
        for attr in ("device_mesh", "placements"):
            value = getattr(real, attr)
            self.guard(EqualGuard(AttrSource(source, attr), value))
        seen = self._dtensors.get(id(real))
        if seen is not None:
            first = self._dtensor_inputs[id(seen)][0]
            if source != first:
                self.guard(AliasGuard(source, first))
            return seen
        local = compat.local_tensor(real)
        local_source = AttrSource(source, compat.LOCAL_TENSOR)
        self._register(local, local_source)
        seen = dtensor.traced(self._fake(local, local_source), real)
        self._dtensors[id(real)] = seen
        self._dtensor_inputs[id(seen)] = (source, real)
        if real.requires_grad or real.grad is not None or _in_params_list(source):
            grad_source = AttrSource(source, "grad")
            self.guard(NoneGuard(grad_source, real.grad is None))
            if real.grad is not None:
                seen.__dict__["_grad_value"] = self._fake(real.grad, grad_source)
        return seen

    # -- after the step ran -----------------------------------------------------------------

    def input_writes(self) -> list[tuple[Source, Any]]:
        """(Source, graph node) for each input tensor the step wrote in place; refuses
        inputs it wrote that share memory, and guards those whose address is free to
        change against coming to share it (the graph reads every input before it writes
        any; eager writes one after another)."""
        writes = {}
        for i, fake in self._fakes.items():
            node = self.recorder.node_of(fake)
            if node.op != "placeholder" and node is not self._converted.get(i):
                writes[i] = (self.input_sources[i], node)  # (copy_ casts back)
        written = list(writes)
        shared = overlapping([self.input_tensors[i] for i in written])
        if shared is not None:
            first, second = (self.input_sources[written[k]].name() for k in shared)
            raise TraceError(
                f"the step writes in place to {first} and to {second}, which share memory; "
                "the compiled step reads all its inputs before it writes them, so give each "
                "its own storage"
            )
        unpinned = [self.input_sources[i] for i in writes if i in self._unpinned]
        if len(unpinned) > 1:
            self.guard(DisjointGuard(unpinned[0], tuple(unpinned[1:])))
        return list(writes.values())

    def output_nodes(self) -> list[Any]:
        nodes = []
        for value in self.outputs:
            scalar = node_of(value)
            nodes.append(self.recorder.node_of(value) if scalar is None else scalar.fx_node)
        return nodes

    def resolve(self, value: Any) -> Ref:
        """The Ref replay uses for a value the step stored or returned."""
        if isinstance(value, Pending):
            return value.result
        if id(value) in self._object_sources:
            return Input(self._object_sources[id(value)])
        scalar = node_of(value)
        if scalar is not None and scalar.fx_node is None:
            return Const(scalar.hint)
        if scalar is None and dtensor.is_dtensor(value) and self.source_of(value) is None:
            # A DTensor the step made (state created in step()): rebuilt around its local.
            local = self.resolve(dtensor.local_of(value))
            return Apply(dtensor.rebuilder(value), (local,), "as_dtensor")
        if isinstance(value, torch.Tensor) or scalar is not None:
            source = self.source_of(value) if scalar is None else None
            if source is not None:
                return Input(source)
            if id(value) not in self._output_index:
                self._output_index[id(value)] = len(self.outputs)
                self.outputs.append(value)
            return Output(self._output_index[id(value)])
        if is_constant(value) or isinstance(value, torch.dtype | torch.device):
            return Const(value)
        source = getattr(value, "source", None)
        if isinstance(value, TrackedDict | TrackedList | TrackedStateDict) and source is not None:
            return Input(source)
        optimizer = view_source(value)
        if optimizer is not None:
            return Input(optimizer)
        if type(value) in (list, tuple):
            return Build(type(value), tuple(self.resolve(v) for v in value))
        if type(value) is dict and all(is_constant(k) for k in value):
            return Build(dict, tuple(self.resolve(v) for v in value.values()), tuple(value))
        raise TraceError(
            f"the step keeps a value of type {type(value).__qualname__} that the compiled "
            "step cannot rebuild on each call (supported: tensors, Python scalars, and "
            "lists, tuples and str-keyed dicts of them)"
        )
