"""Guards: facts about the inputs that a compiled entry depends on.

This module holds the guard kinds on Python values (type, float, constant, equality, the
autocast state, length, dict keys, None-ness, identity, aliasing, weakref alive, predicates
over scalars) and is where every kind is imported from: the base is in guard.py, the guards
on tensors in tensor_guards.py.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from optguard._torch_compat import autocast_state
from optguard.codegen import SourceCode
from optguard.guard import MISSING, Guard, describe_failure, guard_sources, short, type_hint
from optguard.sources import AutocastSource, Source
from optguard.tensor_guards import (
    DataPtrGuard,
    DisjointGuard,
    TensorMatchGuard,
    TensorMeta,
    disjoint,
    memory_span,
    overlapping,
)

__all__ = [
    "MISSING",
    "AliasGuard",
    "AutocastGuard",
    "ConstantGuard",
    "DataPtrGuard",
    "DictLengthGuard",
    "DisjointGuard",
    "EqualGuard",
    "FloatGuard",
    "Guard",
    "IdentityGuard",
    "KeysGuard",
    "LengthGuard",
    "NoneGuard",
    "PredicateGuard",
    "TensorMatchGuard",
    "TensorMeta",
    "TypeGuard",
    "WeakrefAliveGuard",
    "autocast_guard",
    "describe_failure",
    "disjoint",
    "float_types",
    "guard_sources",
    "memory_span",
    "overlapping",
]


@dataclass(frozen=True)
class TypeGuard(Guard):
    """``type(value) is cls``."""

    cls: type

    def test(self, var: str, code: SourceCode) -> str:
        return f"type({var}) is {code.constant(self.cls, type_hint(self.cls))}"

    def expected(self) -> str:
        return f"has type {self.cls.__qualname__}"

    def changed(self, value: Any) -> str:
        return f"type changed ({self.cls.__qualname__} -> {type(value).__qualname__})"


def float_types() -> tuple[type, ...]:
    """Python's float and, once numpy is imported, numpy's float64: the same IEEE double
    arithmetic, so a hyperparameter may switch between them without a retrace."""
    numpy = sys.modules.get("numpy")
    return (float,) if numpy is None else (float, numpy.float64)


@dataclass(frozen=True)
class FloatGuard(Guard):
    """``value`` is a float (Python's, or numpy's float64): a hyperparameter read as a
    symbolic scalar, whose value may change freely."""

    def test(self, var: str, code: SourceCode) -> str:
        return f"type({var}) in {code.constant(float_types(), 'float_types')}"

    def expected(self) -> str:
        return "is a float"

    def changed(self, value: Any) -> str:
        return f"type changed (float -> {type(value).__qualname__})"


@dataclass(frozen=True)
class ConstantGuard(Guard):
    """A Python constant the trace baked in: same type and equal value."""

    value: bool | int | float | str | None
    # Part of equality and hashing: 1, 1.0 and True are equal in Python but not to a trace.
    value_type: type = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "value_type", type(self.value))

    def test(self, var: str, code: SourceCode) -> str:
        if self.value is None or isinstance(self.value, bool):
            return f"{var} is {self.value!r}"
        cls = code.constant(type(self.value), type_hint(type(self.value)))
        if isinstance(self.value, float) and math.isnan(self.value):
            return f"(type({var}) is {cls} and {var} != {var})"
        return f"(type({var}) is {cls} and {var} == {code.literal(self.value)})"

    def expected(self) -> str:
        return f"== {self.value!r}"

    def changed(self, value: Any) -> str:
        return f"value changed ({self.value!r} -> {short(value)})"


@dataclass(frozen=True)
class EqualGuard(Guard):
    """A value compared with ``==`` to the one seen while tracing, for objects that are
    neither constants nor worth pinning by identity: a DTensor's ``device_mesh`` and
    ``placements`` (a new but equal mesh keeps the entry; another layout retraces)."""

    value: Any = field(hash=False)
    text: str = ""  # how the value prints in a reason (its repr by default)

    def test(self, var: str, code: SourceCode) -> str:
        return f"({var} == {code.constant(self.value, 'expected')})"

    def expected(self) -> str:
        return f"== {self.text or short(self.value)}"

    def changed(self, value: Any) -> str:
        return f"value changed ({self.text or short(self.value)} -> {short(value)})"


@dataclass(frozen=True)
class AutocastGuard(Guard):
    """The ``torch.autocast`` regions around the call are those seen while tracing (the
    casts autocast made are in the graph). ``state`` as ``_torch_compat.autocast_state``."""

    state: str

    def test(self, var: str, code: SourceCode) -> str:
        return f"{var} == {self.state!r}"

    def expected(self) -> str:
        return f"is {_autocast(self.state)}"

    def changed(self, value: Any) -> str:
        return f"changed ({_autocast(self.state)} -> {_autocast(value)})"


def autocast_guard() -> AutocastGuard:
    """The guard on the autocast state around the call being traced now."""
    return AutocastGuard(AutocastSource(), autocast_state())


def _autocast(state: Any) -> str:
    return f"on ({state})" if state else "off"


@dataclass(frozen=True)
class LengthGuard(Guard):
    """``len(value) == length`` for lists, tuples and dicts."""

    length: int

    def test(self, var: str, code: SourceCode) -> str:
        return f"len({var}) == {self.length}"

    def expected(self) -> str:
        return f"has length {self.length}"

    def changed(self, value: Any) -> str:
        try:
            return f"length changed ({self.length} -> {len(value)})"
        except TypeError:
            return super().changed(value)


@dataclass(frozen=True)
class DictLengthGuard(LengthGuard):
    """The number of entries of a dict whose keys are objects (e.g. ``Optimizer.state``)."""

    def expected(self) -> str:
        return f"has {self.length} entries"

    def changed(self, value: Any) -> str:
        try:
            return f"keys changed ({self.length} entries -> {len(value)})"
        except TypeError:
            return super().changed(value)


@dataclass(frozen=True)
class KeysGuard(Guard):
    """A dict with exactly these string keys, in this order (``ordered``; else in any
    order: ``load_state_dict`` puts ``'params'`` last); ``keys=None`` means absent."""

    keys: tuple[str, ...] | None
    ordered: bool = True

    def test(self, var: str, code: SourceCode) -> str:
        if self.keys is None:
            return f"{var} is None"
        if not self.ordered:
            keys = code.constant(frozenset(self.keys), "keys")
            return f"({var} is not None and {var}.keys() == {keys})"
        return f"({var} is not None and tuple({var}) == {self.keys!r})"

    def expected(self) -> str:
        if self.keys is None:
            return "is absent"
        return f"has keys {list(self.keys)}" + ("" if self.ordered else " (in any order)")

    def changed(self, value: Any) -> str:
        found = None if value is None else list(value)
        before = "absent" if self.keys is None else list(self.keys)
        return f"keys changed ({before} -> {'absent' if found is None else found})"


@dataclass(frozen=True)
class NoneGuard(Guard):
    """``value is None`` (``is_none=True``) or ``value is not None``."""

    is_none: bool

    def test(self, var: str, code: SourceCode) -> str:
        return f"{var} is None" if self.is_none else f"{var} is not None"

    def expected(self) -> str:
        return "is None" if self.is_none else "is not None"

    def changed(self, value: Any) -> str:
        return "became a tensor (was None)" if self.is_none else "became None"


@dataclass(frozen=True)
class IdentityGuard(Guard):
    """The very object seen while tracing. Held by weak reference where the object allows
    it (a dead referent fails the guard); otherwise by ``id`` (containers cannot be weakly
    referenced: use it only where another guard keeps the object alive or checks it)."""

    ref: Any = field(compare=False, hash=False, repr=False)
    object_id: int = 0

    @staticmethod
    def of(source: Source, obj: Any) -> IdentityGuard:
        try:
            ref: Any = weakref.ref(obj)
        except TypeError:
            ref = None
        return IdentityGuard(source, ref, id(obj))

    def test(self, var: str, code: SourceCode) -> str:
        if self.ref is not None:
            ref = code.constant(self.ref, "ref")
            return f"({ref}() is not None and {var} is {ref}())"
        return f"id({var}) == {code.constant(self.object_id, 'obj_id')}"

    def expected(self) -> str:
        return f"is the object seen while tracing (id {self.object_id:#x})"

    def changed(self, value: Any) -> str:
        return f"a different object (id {self.object_id:#x} -> {id(value):#x})"


@dataclass(frozen=True)
class AliasGuard(Guard):
    """The value at ``source`` is the very object found at ``other`` (one tensor reached
    two ways: a parameter listed twice, one grad tensor given to two parameters). The trace
    read it once; the guard keeps a later call from handing two different objects to one
    graph input."""

    other: Source

    def test(self, var: str, code: SourceCode) -> str:
        return f"({var} is {code.var(self.other)})"

    def expected(self) -> str:
        return f"is {self.other.name()}"

    def fetch(self, L: Any) -> Any:
        return (self.source.fetch(L), self.other.fetch(L))

    def sources(self) -> tuple[Source, ...]:
        return (self.source, self.other)

    def holds(self, value: Any) -> bool:
        return bool(value[0] is value[1])

    def changed(self, value: Any) -> str:
        return f"is no longer the same object as {self.other.name()}"


@dataclass(frozen=True)
class WeakrefAliveGuard(Guard):
    """A weak reference the step follows still points to a live object."""

    def test(self, var: str, code: SourceCode) -> str:
        return f"{var}() is not None"

    def expected(self) -> str:
        return "is alive"

    def changed(self, value: Any) -> str:
        return "the referenced object was freed"


@dataclass(frozen=True)
class PredicateGuard(Guard):
    """A Python decision the trace took on input scalars keeps its outcome.

    ``template`` is Python text over ``{0}`` (``source``), ``{1}``... (``others``), e.g.
    ``({0} != 0)``; the guard holds while it evaluates to ``outcome``. The step may read the
    scalars' values freely otherwise: they are graph inputs, not constants.
    """

    template: str
    outcome: bool | int | float
    others: tuple[Source, ...] = ()

    def test(self, var: str, code: SourceCode) -> str:
        names = [var, *(code.var(o) for o in self.others)]
        if "math." in self.template:
            code.constant(math, "math")
        expr = self.template.format(*names)
        if isinstance(self.outcome, bool):
            return f"(bool({expr}) is {self.outcome})"
        return f"(({expr}) == {code.literal(self.outcome)})"

    def text(self) -> str:
        return self.template.format(*(s.name() for s in (self.source, *self.others)))

    def describe(self) -> str:
        return f"{self.text()} {self.expected()}"

    def expected(self) -> str:
        return f"is {self.outcome!r}"

    def fetch(self, L: Any) -> Any:
        return tuple(s.fetch(L) for s in self.sources())

    def sources(self) -> tuple[Source, ...]:
        return (self.source, *self.others)

    def _evaluate(self, values: Any) -> Any:
        # The values are bound to names, not printed: numpy 2's repr (np.float64(0.9)) or an
        # object's would not evaluate back.
        names = {f"_v{i}": v for i, v in enumerate(values)}
        return eval(self.template.format(*names), {"math": math, **names})

    def holds(self, value: Any) -> bool:
        try:
            found = self._evaluate(value)
        except Exception:
            return False
        if isinstance(self.outcome, bool):
            return bool(found) is self.outcome
        return bool(found == self.outcome)

    def changed(self, value: Any) -> str:
        try:
            found = self._evaluate(value)
            if isinstance(self.outcome, bool):
                found = bool(found)
        except Exception as exc:
            found = f"error: {exc}"
        return f"{self.text()} changed ({self.outcome!r} -> {found!r})"
