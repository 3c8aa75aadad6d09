"""The Guard base: one fact about the value at a Source, and how one guard is tested alone.

Each guard kind (guards.py, tensor_guards.py) knows three things: the Python expression that
tests it (so all guards of an entry compile into one function, check.py), how to print itself,
and how to say what changed when it fails ("keys changed (148 entries -> 0)"). Tested alone
(``holds``: a miss's reason, tests), a guard runs the same expression, compiled once per
kind of guard and cached here.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from optguard.codegen import SourceCode
from optguard.sources import Source

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
        return f"expected {self.expected()}, found {short(value)}"

    def describe(self) -> str:
        return f"{self.source.name()} {self.expected()}"

    def holds(self, value: Any) -> bool:
        """Evaluate this guard alone (slow path: reasons, tests); same code as the fast check."""
        return bool(single_test(self)(value))

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


def single_test(guard: Guard) -> Callable[[Any], Any]:
    kind = _kind_of(guard)  # (hashing it is cheaper than hashing the guard: no source)
    if kind is not None:
        fn = _TESTS_OF_KIND.get(kind)
        if fn is None:
            fn = _bounded(_TESTS_OF_KIND)[kind] = _compiled_test(guard)
        return fn
    fn = _TESTS.get(guard)
    if fn is None:
        fn = _bounded(_TESTS)[guard] = _compiled_test(guard)
    return fn


def _bounded(cache: dict[Any, Any]) -> dict[Any, Any]:
    """``cache``, emptied when it has grown past what a few large optimizers need (guards
    are evaluated one by one only to explain a miss)."""
    if len(cache) >= 200_000:
        cache.clear()
    return cache


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}  # a guard type's fields but ``source``


def _kind_of(guard: Guard) -> tuple[Any, ...] | None:
    """The guard's type and its fields but ``source``, or None where another field holds a
    Source (its test names that source) or a field is not hashable."""
    names = _FIELD_NAMES.get(type(guard))
    if names is None:
        found = [f.name for f in dataclasses.fields(guard) if f.name != "source"]
        names = _FIELD_NAMES[type(guard)] = tuple(found)
    values = []
    for name in names:
        value = getattr(guard, name)
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


def type_hint(cls: type) -> str:
    return f"{cls.__name__}_type"


def short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor({str(value.dtype).replace('torch.', '')}, shape={list(value.shape)})"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_failure(guard: Guard, value: Any) -> str:
    """``"<source>: <what changed>"`` for a guard that failed on ``value``."""
    if value is MISSING:
        return f"{guard.source.name()}: no longer reachable"
    return f"{guard.source.name()}: {guard.changed(value)}"
