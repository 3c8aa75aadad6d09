"""The optimizer seen through a tracking view while its step is traced.

The view is an instance of a subclass of the optimizer's class sharing its attributes, so
``step`` and every helper it calls run unchanged; attribute reads go through the
TraceContext (guards, traced tensors, tracked containers) and attribute stores go to the
ledger. ``foreach=None`` is shown as the path eager would take. A capturable trace shows
param groups with ``capturable=True``: torch.optim then keeps step counts and bias
corrections as tensors and never reads them back into Python.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from optguard import AttrSource, ItemSource, LengthGuard, Source, TypeGuard
from optsidefx import Input

from opttrace._torch_compat import default_foreach
from opttrace.trackers import TrackedDict, TrackedList

if TYPE_CHECKING:
    from opttrace.context import TraceContext

_INFO = "_opttrace_view"
TRACE_OVERRIDES = {"capturable": True}
_VIEW_CLASSES: dict[type, type] = {}


@dataclass
class ViewInfo:
    """What the view tracks: where the real optimizer is, what was read and written."""

    ctx: TraceContext
    source: Source
    owner: type = object  # the class of the object viewed (its step decides foreach=None)
    cache: dict[str, Any] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)

    def read(self, name: str, raw: Any) -> Any:
        if name in self.written:
            return raw
        if name not in self.cache:
            source = AttrSource(self.source, name)
            if name == "param_groups":
                self.cache[name] = self._param_groups(raw, source)
            else:
                self.cache[name] = self.ctx.read(raw, source)
        return self.cache[name]

    def _param_groups(self, groups: list[dict[str, Any]], source: Source) -> TrackedList:
        self.ctx.guard(TypeGuard(source, type(groups)))
        self.ctx.guard(LengthGuard(source, len(groups)))
        items = []
        for i, group in enumerate(groups):
            group_source = ItemSource(source, i)
            self.ctx.read(group, group_source)  # installs the group's type and key guards
            overrides = _overrides(group, self.ctx.capturable, self.owner)
            items.append(TrackedDict(self.ctx, group_source, group, overrides))
        return TrackedList(self.ctx, source, items)


def _overrides(group: dict[str, Any], capturable: bool, owner: type) -> dict[str, Any]:
    """What the step should see instead of the user's values for some options."""
    overrides = {}
    if capturable and "capturable" in group:
        overrides.update(TRACE_OVERRIDES)
    if "foreach" in group and group["foreach"] is None:
        # Eager decides from the parameters' types and devices; traced tensors would
        # mislead that decision, so show the step the one eager takes.
        params = [p for p in group["params"] if isinstance(p, torch.Tensor)]
        overrides["foreach"] = default_foreach(params, owner)
    return overrides


def _getattribute(self: Any, name: str) -> Any:
    d = object.__getattribute__(self, "__dict__")
    if name != _INFO and name in d:
        info: ViewInfo = d[_INFO]
        return info.read(name, d[name])
    value = object.__getattribute__(self, name)
    if name.startswith("__") or name == _INFO or not _class_data(d[_INFO].owner, name):
        return value
    # A value a class of user code holds (``SCALE = 0.5`` in the optimizer's class body),
    # read as an instance attribute is: a float an input, another constant a guard
    return d[_INFO].read(name, value)


# What a class body's value read through the instance is read as data for: numbers and
# strings, and containers (their items read as the instance's are)
_CLASS_DATA = frozenset({bool, int, float, str, type(None), list, tuple, dict, set, frozenset})


def _class_data(owner: type, name: str) -> bool:
    """Whether ``name`` is data (no function, descriptor or class) that a class of user
    code in ``owner``'s MRO holds: the step reads it through the instance, and a change
    to it must reach the compiled step (a float) or retrace it (a constant)."""
    for cls in owner.__mro__:
        if name in vars(cls):
            raw = vars(cls)[name]  # (a method's function, not the bound method it gives)
            if type(raw) not in _CLASS_DATA:
                return False  # (a function, descriptor, class, tensor: used as it is)
            return _user_class(cls)
    return False


def _setattr(self: Any, name: str, value: Any) -> None:
    d = object.__getattribute__(self, "__dict__")
    info: ViewInfo = d[_INFO]
    info.ctx.ledger.store_attr(Input(info.source), name, value)
    info.written.add(name)
    d[name] = value


def _step(self: Any, closure: Any = None) -> Any:
    """``opt.step(closure)`` called by a traced function: not traced into this graph but
    replayed as a call, so the optimizer runs its own step (compiled separately) after the
    function's tensor work, and the closure runs eagerly, as it must, each time."""
    info: ViewInfo = object.__getattribute__(self, "__dict__")[_INFO]
    return info.ctx.call_after_graph(info.source, "step", () if closure is None else (closure,))


def _view_class(cls: type) -> type:
    view = _VIEW_CLASSES.get(cls)
    if view is None:
        namespace: dict[str, Any] = {"__getattribute__": _getattribute, "__setattr__": _setattr}
        if issubclass(cls, torch.optim.Optimizer):
            namespace["step"] = _step
        view = _VIEW_CLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return view


def optimizer_view(ctx: TraceContext, opt: torch.optim.Optimizer, source: Source) -> Any:
    """A tracking view of ``opt`` for the step to run on."""
    view = object_view(ctx, opt, source)
    # An instance-level step (ours, or an LR scheduler's) must not shadow the class's.
    object.__getattribute__(view, "__dict__").pop("step", None)
    return view


def object_view(ctx: TraceContext, obj: Any, source: Source) -> Any:
    """A tracking view of ``obj`` (an optimizer, or a plain object: ``is_plain_object``):
    reads of its attributes go through the TraceContext (a float becomes a graph input,
    another constant a guard), stores go to the ledger, as for an optimizer."""
    cls = type(obj)
    view: Any = (types.SimpleNamespace if cls is types.SimpleNamespace else object).__new__(
        _view_class(cls)
    )
    d = object.__getattribute__(view, "__dict__")
    d.update(vars(obj))
    d[_INFO] = ViewInfo(ctx, source, cls)
    return view


# A class defining one of these lays out or reaches its attributes its own way.
_OWN_LAYOUT = (
    "__slots__",
    "__new__",
    "__getattribute__",
    "__getattr__",
    "__setattr__",
    "__delattr__",
)


def is_plain_object(value: Any) -> bool:
    """An object holding its data in its ``__dict__``, which a view can stand in for: an
    instance of a class of user code (a config dataclass) or a ``SimpleNamespace``; not a
    module, function, class or tensor, nor one whose class has ``__slots__``, its own
    ``__new__`` or attribute hooks."""
    cls = type(value)
    if cls is types.SimpleNamespace:
        return True
    if not _user_class(cls):
        return False
    if isinstance(value, type | types.FunctionType | types.MethodType | torch.Tensor):
        return False
    if isinstance(value, torch.nn.Module) or not hasattr(value, "__dict__"):
        return False
    return not any(name in vars(c) for c in cls.__mro__[:-1] for name in _OWN_LAYOUT)


# Packages whose objects are not user data (their internals are not the step's inputs).
_LIBRARIES = frozenset(
    {"torch", "numpy", "opttrace", "optguard", "optsidefx", "optkernels", "optcompile"}
)


def _user_class(cls: type) -> bool:
    """Whether ``cls`` is defined by user code (neither a builtin nor a library's)."""
    module = getattr(cls, "__module__", "") or ""
    return module != "builtins" and module.split(".")[0] not in _LIBRARIES


def slot_values(value: Any) -> list[tuple[str, Any]]:
    """The (name, value) of each ``__slots__`` attribute set on an object of a user class
    (``@dataclass(slots=True)``): the step reads them off the object itself, which may
    change them in place under one identity. Empty for other objects."""
    cls = type(value)
    if not _user_class(cls):
        return []
    found = []
    for c in cls.__mro__:
        slots = vars(c).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") or not hasattr(value, name):
                continue
            found.append((name, getattr(value, name)))
    return found


def view_source(value: Any) -> Source | None:
    """The Source of the optimizer behind a view, or None if ``value`` is not a view."""
    if type(value) not in _VIEW_CLASSES.values():
        return None
    info: ViewInfo = object.__getattribute__(value, "__dict__")[_INFO]
    return info.source
