"""Tracked containers: inputs seen through objects that guard what the step reads from them
and record into the ledger what it writes to them.

Each tracker knows its Source (where replay finds the real object) and reads values through
the TraceContext, which turns tensors into fake tensors bound to graph inputs and Python
constants into guards. Containers the step creates itself stay plain Python objects: the
ledger resolves their final contents when the trace ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

from optguard import ItemSource, KeyedSource, KeysGuard, Source
from optsidefx import Input

from opttrace.errors import TraceError

if TYPE_CHECKING:
    from opttrace.context import TraceContext


def _unsupported(what: str, where: Source) -> NoReturn:
    raise TraceError(f"{what} on {where.name()} is not supported by the tracer yet")


class TrackedDict(dict[Any, Any]):
    """A dict with constant keys (a param group, a per-parameter state dict, ``defaults``).

    Values are wrapped on first read; reading a Python constant installs a guard on it,
    unless the step wrote it first. ``overrides`` replace what the step sees for some keys
    while the guard stays on the real value (``capturable=True`` during tracing).
    """

    def __init__(
        self,
        ctx: TraceContext,
        source: Source,
        raw: dict[Any, Any],
        overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(raw)
        self.ctx = ctx
        self.source = source
        self.overrides = overrides or {}
        self._read: set[Any] = set()
        self._written: set[Any] = set()
        self._keys = tuple(raw)

    def _in_order(self) -> list[Any]:
        """The keys, for a step that iterates: their order now matters, so it is guarded."""
        if all(type(k) is str for k in self._keys):
            self.ctx.guard(KeysGuard(self.source, self._keys))
        return list(dict.keys(self))

    def __getitem__(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        if key in self._written:
            return value
        if key not in self._read:
            self._read.add(key)
            value = self.ctx.read(value, ItemSource(self.source, key))
            dict.__setitem__(self, key, value)
        return self.overrides.get(key, value)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default  # noqa: SIM401 (self.get is this)

    def __iter__(self) -> Iterator[Any]:
        # Overriding __iter__ makes CPython's dict merging (``{**d}``, ``dict(d)``) go
        # through keys() and __getitem__, so those reads install guards too.
        return iter(self._in_order())

    def keys(self) -> Any:
        return self._in_order()

    def values(self) -> Any:
        return [self[k] for k in self._in_order()]

    def items(self) -> Any:
        return [(k, self[k]) for k in self._in_order()]

    def copy(self) -> dict[Any, Any]:
        return {k: self[k] for k in self._in_order()}

    def __setitem__(self, key: Any, value: Any) -> None:
        self.ctx.ledger.store_item(Input(self.source), key, value)
        self._written.add(key)
        dict.__setitem__(self, key, value)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __delitem__(self, key: Any) -> None:
        if key not in self:
            raise KeyError(key)
        self.pop(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        value = self[key]
        dict.pop(self, key)
        self._read.discard(key)
        self._written.discard(key)
        self.ctx.ledger.call(Input(self.source), "pop", (key,))
        return value

    def popitem(self) -> Any:
        _unsupported("dict.popitem", self.source)

    def clear(self) -> None:
        dict.clear(self)
        self._read.clear()
        self._written.clear()
        self.ctx.ledger.call(Input(self.source), "clear", ())


class TrackedStateDict(dict[Any, Any]):
    """``Optimizer.state``: keyed by parameters, missing entries created like a defaultdict.

    Lookups take the fake parameter, find the real entry through the parameter's Source, and
    wrap it with a ``state[<param source>]`` Source. Creating an entry is recorded as a store.
    """

    def __init__(
        self,
        ctx: TraceContext,
        source: Source,
        raw: dict[Any, Any],
        default_factory: Callable[[], Any] | None,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.source = source
        self.raw = raw
        self.default_factory = default_factory
        self._added = 0

    def _key_source(self, key: Any) -> Source:
        source = self.ctx.source_of(key)
        if source is None:
            raise TraceError(
                f"{self.source.name()} was indexed with a tensor that is not an input "
                "of the step; only parameters reachable from the inputs can key optimizer state"
            )
        return source

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        return self._lookup(key) is not None

    def _lookup(self, key: Any) -> Any:
        source = KeyedSource(self.source, self._key_source(key))
        real = self.raw.get(self.ctx.real_of(key))
        if real is None:
            self.ctx.note_absent(source)
            return None
        wrapped = self.ctx.read(real, source)
        dict.__setitem__(self, key, wrapped)
        return wrapped

    def __getitem__(self, key: Any) -> Any:
        if dict.__contains__(self, key) or self._lookup(key) is not None:
            return dict.__getitem__(self, key)
        if self.default_factory is None:
            raise KeyError(key)
        created = self.default_factory()
        self[key] = created
        return created

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default  # noqa: SIM401 (self.get is this)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._key_source(key)
        if key not in self:
            self._added += 1
        self.ctx.ledger.store_item(Input(self.source), key, value)
        dict.__setitem__(self, key, value)

    def __len__(self) -> int:
        return len(self.raw) + self._added

    def __iter__(self) -> Iterator[Any]:
        _unsupported("iterating over optimizer state", self.source)

    def keys(self) -> Any:
        _unsupported("iterating over optimizer state", self.source)

    def values(self) -> Any:
        _unsupported("iterating over optimizer state", self.source)

    def items(self) -> Any:
        _unsupported("iterating over optimizer state", self.source)

    def __delitem__(self, key: Any) -> None:
        _unsupported("deleting optimizer state", self.source)

    def pop(self, *args: Any) -> Any:
        _unsupported("deleting optimizer state", self.source)

    def clear(self) -> None:
        _unsupported("clearing optimizer state", self.source)


class TrackedList(list[Any]):
    """A list from the inputs (``param_groups``, a group's ``params``, a list the step keeps);
    items wrapped eagerly because iteration cannot be intercepted. Item stores and calls
    that change its length are recorded and replayed in program order."""

    def __init__(self, ctx: TraceContext, source: Source, items: list[Any]) -> None:
        super().__init__(items)
        self.ctx = ctx
        self.source = source

    def _record(self, method: str, *args: Any) -> None:
        self.ctx.ledger.call(Input(self.source), method, args)

    def __setitem__(self, index: Any, value: Any) -> None:
        if not isinstance(index, int):
            _unsupported("slice assignment", self.source)
        self.ctx.ledger.store_item(Input(self.source), index, value)
        list.__setitem__(self, index, value)

    def append(self, value: Any) -> None:
        self._record("append", value)
        list.append(self, value)

    def extend(self, values: Any) -> None:
        values = list(values)
        self._record("extend", values)
        list.extend(self, values)

    def __iadd__(self, values: Any) -> TrackedList:  # type: ignore[misc]
        self.extend(values)
        return self

    def insert(self, index: Any, value: Any) -> None:
        self._record("insert", index, value)
        list.insert(self, index, value)

    def pop(self, index: Any = -1) -> Any:
        value = list.pop(self, index)
        self._record("pop", index)
        return value

    def __delitem__(self, index: Any) -> None:
        if not isinstance(index, int):
            _unsupported("deleting a slice", self.source)
        list.__delitem__(self, index)
        self._record("pop", index)

    def clear(self) -> None:
        list.clear(self)
        self._record("clear")

    def reverse(self) -> None:
        list.reverse(self)
        self._record("reverse")

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("sorting or removing by value from a list", self.source)

    remove = sort = __imul__ = _refuse
