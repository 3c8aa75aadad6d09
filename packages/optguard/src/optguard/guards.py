"""Guards: facts about the inputs that a compiled entry depends on.

Each guard kind knows three things: the Python expression that tests it (so all guards of an
entry compile into one function), how to print itself, and how to say what changed when it
fails ("keys changed (148 entries -> 0)").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from optguard._torch_compat import autocast_state
from optguard.codegen import SourceCode
from optguard.sources import AutocastSource, Source

MISSING = object()  # a source that could not be fetched (structure changed)


@dataclass(frozen=True)
class Guard:
    """Base of all guards: one fact about the value at ``source``."""

    source: Source

    def test(self, var: str, code: SourceCode) -> str:
        """A Python expression over ``var`` that is true when the guard holds."""
        raise NotImplementedError(type(self).__name__)

    def expected(self) -> str:
        """The fact, printed after the source: ``== 0.001``, ``is None``."""
        raise NotImplementedError(type(self).__name__)

    def changed(self, value: Any) -> str:
        """What differs in ``value``, for a failing guard: ``(1e-3 -> 2e-3)``."""
        return f"expected {self.expected()}, found {_short(value)}"

    def describe(self) -> str:
        return f"{self.source.name()} {self.expected()}"

    def holds(self, value: Any) -> bool:
        """Evaluate this guard alone (slow path: reasons, tests); same code as the fast check."""
        return bool(_single_test(self)(value))

    def fetch(self, L: Any) -> Any:
        """The value(s) this guard tests, from live inputs (slow path)."""
        return self.source.fetch(L)

    def sources(self) -> tuple[Source, ...]:
        """Every source the guard reads (``source`` first)."""
        return (self.source,)


def guard_sources(guards: Sequence[Guard]) -> list[tuple[Source, ...]]:
    """Each guard's ``sources()``, without a call for the guards of one source (most)."""
    one = Guard.sources
    return [(g.source,) if type(g).sources is one else g.sources() for g in guards]


_TESTS: dict[Guard, Callable[[Any], Any]] = {}
# The compiled ``def test`` per test text: guards of one kind differ in their constants
# (bound by name in each test's namespace), so 10,000 params' tests compile a few texts
# (a miss's reason tests guards one by one until one fails).
_COMPILED: dict[str, types.CodeType] = {}


# Tests by what they depend on: a guard's fields but its source (a TensorMatchGuard of
# 10,000 params of one shape has one test, rendered once).
_TESTS_OF_KIND: dict[tuple[Any, ...], Callable[[Any], Any]] = {}


def _single_test(guard: Guard) -> Callable[[Any], Any]:
    fn = _TESTS.get(guard)
    if fn is not None:
        return fn
    kind = _kind_of(guard)
    fn = _TESTS_OF_KIND.get(kind) if kind is not None else None
    if fn is None:
        fn = _compiled_test(guard)
        if kind is not None:
            _bounded(_TESTS_OF_KIND)[kind] = fn
    _bounded(_TESTS)[guard] = fn
    return fn


def _bounded(cache: dict[Any, Any]) -> dict[Any, Any]:
    """``cache``, emptied when it has grown past what a few large optimizers need (guards
    are evaluated one by one only to explain a miss)."""
    if len(cache) >= 200_000:
        cache.clear()
    return cache


def _kind_of(guard: Guard) -> tuple[Any, ...] | None:
    """The guard's type and its fields but ``source``, or None where another field holds a
    Source (its test names that source) or a field is not hashable."""
    values = []
    for f in dataclasses.fields(guard):
        if f.name == "source":
            continue
        value = getattr(guard, f.name)
        if isinstance(value, Source) or (
            isinstance(value, tuple) and any(isinstance(v, Source) for v in value)
        ):
            return None
        values.append(value)
    kind = (type(guard), *values)
    try:
        hash(kind)
    except TypeError:
        return None
    return kind


def _compiled_test(guard: Guard) -> Callable[[Any], Any]:
    code = SourceCode()
    expr = guard.test("value", code)
    compiled = _COMPILED.get(expr)
    if compiled is None:
        text = f"def test(value):\n    return {expr}\n"
        compiled = _bounded(_COMPILED)[expr] = compile(text, "<guard test>", "exec")
    namespace = dict(code.constants)
    exec(compiled, namespace)
    fn: Callable[[Any], Any] = namespace["test"]
    return fn


@dataclass(frozen=True)
class TypeGuard(Guard):
    """``type(value) is cls``."""

    cls: type

    def test(self, var: str, code: SourceCode) -> str:
        return f"type({var}) is {code.constant(self.cls, _type_hint(self.cls))}"

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
        cls = code.constant(type(self.value), _type_hint(type(self.value)))
        if isinstance(self.value, float) and math.isnan(self.value):
            return f"(type({var}) is {cls} and {var} != {var})"
        return f"(type({var}) is {cls} and {var} == {code.literal(self.value)})"

    def expected(self) -> str:
        return f"== {self.value!r}"

    def changed(self, value: Any) -> str:
        return f"value changed ({self.value!r} -> {_short(value)})"


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
        return f"== {self.text or _short(self.value)}"

    def changed(self, value: Any) -> str:
        return f"value changed ({self.text or _short(self.value)} -> {_short(value)})"


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
class DisjointGuard(Guard):
    """The tensors at ``source`` and ``others`` occupy disjoint memory. A graph reads all its
    inputs before it writes any, where eager writes them one after another: inputs it
    writes must not share memory (two arguments ``f(x, x)``, a view of another)."""

    others: tuple[Source, ...]

    def test(self, var: str, code: SourceCode) -> str:
        return f"{code.constant(disjoint, 'disjoint')}({code.tuple_of(self.sources())})"

    def expected(self) -> str:
        return f"shares no memory with {self._others()}"

    def _others(self) -> str:
        names = [o.name() for o in self.others[:3]]
        more = len(self.others) - len(names)
        return ", ".join(names) + (f" or {more} more" if more else "")

    def fetch(self, L: Any) -> Any:
        return tuple(s.fetch(L) for s in self.sources())

    def sources(self) -> tuple[Source, ...]:
        return (self.source, *self.others)

    def holds(self, value: Any) -> bool:
        return disjoint(value)

    def changed(self, value: Any) -> str:
        return f"shares memory with one of {self._others()}"


def disjoint(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no two of ``tensors`` reach a common byte (see ``overlapping``)."""
    return overlapping(tensors) is None


def overlapping(tensors: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """The positions of two of ``tensors`` that reach a common byte (lower address first),
    or None. Conservatively: by the span from each one's first to its last element, so interleaved
    views count as sharing. Spans are compared as addresses: distinct allocations never
    overlap (CUDA's unified addressing keeps device and host pointers apart)."""
    spans = sorted(
        [(span, i) for i, span in enumerate(map(memory_span, tensors)) if span[0] < span[1]]
    )
    for (a, i), (b, j) in itertools.pairwise(spans):
        if b[0] < a[1]:
            return (i, j)
    return None


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) of what ``t`` reaches; empty for no elements."""
    start = t.data_ptr()
    if t.dim() == 0:
        return (start, start + t.element_size())
    if t.numel() == 0:
        return (start, start)
    stride = t.stride()  # (sum of (n - 1) * s, without a Python call per dimension)
    extent = sum(map(operator.mul, t.shape, stride)) - sum(stride) + 1
    return (start, start + extent * t.element_size())


@dataclass(frozen=True)
class DataPtrGuard(Guard):
    """A tensor's storage address is unchanged: graphs that bake addresses in (CUDA graphs,
    static kernel tables) depend on it."""

    ptr: int

    def test(self, var: str, code: SourceCode) -> str:
        # A named constant, not a literal: the generated text (and its compiled code, cached
        # on disk by text) is then the same in every process.
        return f"{var}.data_ptr() == {code.constant(self.ptr, 'ptr')}"

    def expected(self) -> str:
        return f"has data pointer {self.ptr:#x}"

    def changed(self, value: Any) -> str:
        try:
            return f"data pointer changed ({self.ptr:#x} -> {value.data_ptr():#x})"
        except Exception:
            return super().changed(value)


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


@dataclass(frozen=True)
class TensorMeta:
    """What a compiled entry assumes about a tensor input."""

    cls: type
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    layout: torch.layout = field(default=torch.strided)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(
            type(t),
            t.dtype,
            t.device,
            tuple(t.shape),
            tuple(t.stride()),
            t.requires_grad,
            t.layout,
        )

    def diff(self, t: Any) -> str | None:
        """The first field where ``t`` differs, as ``"dtype (float32 -> bfloat16)"``."""
        if not isinstance(t, torch.Tensor):
            return f"is no longer a tensor ({type(t).__qualname__})"
        found = TensorMeta.of(t)
        for name in ("cls", "dtype", "device", "layout", "shape", "stride", "requires_grad"):
            old, new = getattr(self, name), getattr(found, name)
            if old != new:
                show = (lambda c: c.__qualname__) if name == "cls" else str
                return f"{'type' if name == 'cls' else name} changed ({show(old)} -> {show(new)})"
        return None


@dataclass(frozen=True)
class TensorMatchGuard(Guard):
    """A tensor with the same type, dtype, device, layout, shape, stride and requires_grad."""

    meta: TensorMeta

    def test(self, var: str, code: SourceCode) -> str:
        m = self.meta
        hints = _META_HINTS.get((m.cls, m.dtype, m.device, m.layout))
        if hints is None:
            hints = _meta_hints(m)
        cls = code.constant(m.cls, hints[0])
        dtype = code.constant(m.dtype, hints[1])
        device = code.constant(m.device, hints[2])
        layout = code.constant(m.layout, hints[3])
        return (
            f"(type({var}) is {cls} and {var}.dtype is {dtype} and {var}.device == {device}"
            f" and {var}.shape == {code.inline(m.shape, 'shape')}"
            f" and {var}.stride() == {code.inline(m.stride, 'stride')}"
            f" and {var}.requires_grad is {m.requires_grad} and {var}.layout is {layout})"
        )

    def expected(self) -> str:
        m = self.meta
        grad = ", requires_grad" if m.requires_grad else ""
        return (
            f"is {m.cls.__name__}({str(m.dtype).replace('torch.', '')}, {m.device}, "
            f"shape={list(m.shape)}, stride={list(m.stride)}{grad})"
        )

    def changed(self, value: Any) -> str:
        return self.meta.diff(value) or super().changed(value)


# The names of a tensor metadata's constants in generated code, by (cls, dtype, device,
# layout): 10,000 params' metadata guards name the same few.
_META_HINTS: dict[tuple[Any, ...], tuple[str, str, str, str]] = {}


def _meta_hints(m: TensorMeta) -> tuple[str, str, str, str]:
    hints = (
        _type_hint(m.cls),
        str(m.dtype).replace("torch.", ""),
        f"{m.device.type}_device",
        str(m.layout).replace("torch.", ""),
    )
    return _META_HINTS.setdefault((m.cls, m.dtype, m.device, m.layout), hints)


def _type_hint(cls: type) -> str:
    return f"{cls.__name__}_type"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor({str(value.dtype).replace('torch.', '')}, shape={list(value.shape)})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_failure(guard: Guard, value: Any) -> str:
    """``"<source>: <what changed>"`` for a guard that failed on ``value``."""
    if value is MISSING:
        return f"{guard.source.name()}: no longer reachable"
    return f"{guard.source.name()}: {guard.changed(value)}"
