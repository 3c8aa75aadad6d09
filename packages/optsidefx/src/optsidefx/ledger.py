"""The side-effect ledger: what a traced step did to the world besides computing tensors.

While tracing, tracked containers report stores (item and attribute) to existing objects, the
tracer reports in-place writes to input tensors and the returned value. Values are recorded
raw (fake tensors, constants, containers created during the step) and resolved to Refs when
the trace ends, so a container the step created is rebuilt from its final contents on each
call and one it dropped never appears. Overwritten stores are pruned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optguard import Source


@dataclass(frozen=True)
class Output:
    """The ``index``-th output of the compiled graph."""

    index: int


@dataclass(frozen=True)
class Input:
    """A value that already lives in the inputs, fetched by its source on each call."""

    source: Source


@dataclass(frozen=True)
class Const:
    """A Python constant (int, float, bool, str, None, or a type)."""

    value: Any


@dataclass(frozen=True)
class Build:
    """A tuple/list/dict the step created and kept (stored or returned), built fresh per call."""

    kind: type
    items: tuple[Ref, ...]
    keys: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Apply:
    """A value made each call by a function the trace fixed, applied to refs: a DTensor
    the step created, rebuilt around its local tensor (an Output) with its mesh and
    placements."""

    fn: Callable[..., Any] = field(compare=False)
    args: tuple[Ref, ...]
    name: str = "apply"  # what the generated code calls ``fn``


@dataclass(frozen=True)
class CallResult:
    """What the ``index``-th recorded Call returned, on this run."""

    index: int


Ref = Output | Input | Const | Build | Apply | CallResult


@dataclass(frozen=True)
class ItemStore:
    """``target[key] = value``."""

    target: Input
    key: Any
    value: Any


@dataclass(frozen=True)
class AttrStore:
    """``target.attr = value``."""

    target: Input
    attr: str
    value: Any


@dataclass(frozen=True)
class TensorWrite:
    """An in-place write to an input tensor; ``value`` is the graph node holding its new data."""

    target: Source
    value: Any


@dataclass(frozen=True)
class Call:
    """``target.method(*args)``, run by the replay in program order (e.g. ``opt.step(closure)``
    inside a compiled function: the optimizer runs its own, separately compiled step)."""

    target: Input
    method: str
    args: tuple[Any, ...]
    index: int


@dataclass(frozen=True)
class Return:
    """The value the compiled call returns."""

    value: Any


Effect = ItemStore | AttrStore | TensorWrite | Call | Return


class Ledger:
    """Records effects in program order while a step is traced."""

    def __init__(self) -> None:
        self._effects: list[Effect] = []

    def store_item(self, target: Input, key: Any, value: Any) -> None:
        self._effects.append(ItemStore(target, key, value))

    def store_attr(self, target: Input, attr: str, value: Any) -> None:
        self._effects.append(AttrStore(target, attr, value))

    def write_tensor(self, target: Source, value: Any) -> None:
        self._effects.append(TensorWrite(target, value))

    def call(self, target: Input, method: str, args: tuple[Any, ...]) -> CallResult:
        """Record a call the replay makes; returns the Ref of its result."""
        index = sum(isinstance(e, Call) for e in self._effects)
        self._effects.append(Call(target, method, args, index))
        return CallResult(index)

    def returned(self, value: Any) -> None:
        self._effects.append(Return(value))

    @property
    def effects(self) -> tuple[Effect, ...]:
        return tuple(self._effects)

    def finalize(self, resolve: Callable[[Any], Ref]) -> tuple[Effect, ...]:
        """Drop stores that a later store to the same slot overwrote, then resolve raw values.

        ``resolve`` maps a raw value (a fake tensor, a constant, a created container) to the
        Ref replay uses; it runs only for surviving values, so graph outputs are assigned to
        exactly the tensors that are still needed.
        """
        overwritten: set[int] = set()
        pending: dict[tuple[Any, ...], int] = {}  # slot -> index of its latest store
        for i, e in enumerate(self._effects):
            if isinstance(e, ItemStore | AttrStore):
                slot = _slot(e)
                if slot in pending:
                    overwritten.add(pending[slot])
                pending[slot] = i
            elif isinstance(e, Call):
                # A call on the target (append, pop, ...) may move or read its slots: stores
                # before it are kept even if the same slot is stored again after it.
                for slot in [s for s in pending if s[1] == e.target]:
                    del pending[slot]
        kept = [e for i, e in enumerate(self._effects) if i not in overwritten]
        return tuple(_resolve(e, resolve) for e in kept)


def _slot(e: ItemStore | AttrStore) -> tuple[Any, ...]:
    if isinstance(e, AttrStore):
        return ("attr", e.target, e.attr)
    # Tensor keys (Optimizer.state is keyed by params) hash by identity.
    key = e.key if isinstance(e.key, str | int | float | bool) else ("id", id(e.key))
    return ("item", e.target, key)


def _resolve(e: Effect, resolve: Callable[[Any], Ref]) -> Effect:
    if isinstance(e, ItemStore):
        return ItemStore(e.target, resolve(e.key), resolve(e.value))
    if isinstance(e, AttrStore):
        return AttrStore(e.target, e.attr, resolve(e.value))
    if isinstance(e, Return):
        return Return(resolve(e.value))
    if isinstance(e, Call):
        return Call(e.target, e.method, tuple(resolve(a) for a in e.args), e.index)
    return e
