"""Sources: where a value the trace read lives, as a readable path from the call's inputs.

A Source prints as the access path a user would write (``L['opt'].param_groups[0]['lr']``),
fetches its value from live inputs, and emits the Python expression that fetches it, so
guard, gather and replay code can be generated from the same objects.

Sources are interned: constructing one for a path that already has a Source returns that
object, so two sources are equal exactly when they are the same object, and hashing or
comparing one is CPython's identity hash, not a Python call (building the guards of 10,000
parameters hashes sources as dict keys about half a million times).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

from optguard._torch_compat import autocast_state

Locals = Mapping[str, Any]

# Every Source made in this process, by its class and fields: one object per path. Paths
# are shared between optimizers (every compiled optimizer's params are under ``L['opt']``),
# so this grows with the largest set of paths one entry guards, not with the entries.
_INTERNED: dict[tuple[Any, ...], Source] = {}
_FIELDS: dict[type, tuple[str, ...]] = {}


class _Interning(type):
    """Makes ``SomeSource(*fields)`` return the one Source of that path (module docstring)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # (the key lists the fields in order, however they were given)
            names = _FIELDS.get(cls)
            if names is None:
                names = _FIELDS[cls] = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
            args = (*args, *(kwargs.pop(n) for n in names[len(args) :] if n in kwargs))
            if kwargs:
                raise TypeError(f"{cls.__name__}() got unexpected arguments {sorted(kwargs)}")
        key = (cls, *args)
        found = _INTERNED.get(key)
        if found is None:
            # (setdefault: two threads making one path at once get one object)
            found = _INTERNED.setdefault(key, super().__call__(*args))
        return found


@dataclass(frozen=True, eq=False)
class Source(metaclass=_Interning):
    """Base of all sources: a path from the call's locals ``L`` to one value. Equal paths
    are one object (see the module docstring): ``==`` and ``hash`` are identity's."""

    def name(self) -> str:
        raise NotImplementedError(type(self).__name__)

    def __reduce__(self) -> tuple[Any, ...]:
        # Copies and unpickled sources are made through the constructor: interned.
        return (type(self), tuple(getattr(self, f.name) for f in fields(self)))

    def fetch(self, L: Locals) -> Any:
        raise NotImplementedError(type(self).__name__)

    def parents(self) -> tuple[Source, ...]:
        """Sources whose values this one's expression reads (evaluated first)."""
        return ()

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        """Python expression for this value, given variables holding the parents' values."""
        raise NotImplementedError(type(self).__name__)

    def __str__(self) -> str:
        return self.name()

    def __repr__(self) -> str:
        return self.name()


@dataclass(frozen=True, eq=False, repr=False)
class LocalSource(Source):
    """An argument of the compiled call: ``L['opt']``."""

    local: str

    def name(self) -> str:
        return f"L[{self.local!r}]"

    def fetch(self, L: Locals) -> Any:
        return L[self.local]

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"L[{self.local!r}]"


@dataclass(frozen=True, eq=False, repr=False)
class AttrSource(Source):
    """An attribute of another source's value: ``L['opt'].param_groups``, ``p.grad``."""

    base: Source
    attr: str

    def name(self) -> str:
        return f"{self.base.name()}.{self.attr}"

    def fetch(self, L: Locals) -> Any:
        return getattr(self.base.fetch(L), self.attr)

    def parents(self) -> tuple[Source, ...]:
        return (self.base,)

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"{parent_vars[0]}.{self.attr}"


@dataclass(frozen=True, eq=False, repr=False)
class ItemSource(Source):
    """An item of a list, tuple or dict with a constant key: ``group['lr']``, ``params[3]``."""

    base: Source
    key: int | str

    def name(self) -> str:
        return f"{self.base.name()}[{self.key!r}]"

    def fetch(self, L: Locals) -> Any:
        return self.base.fetch(L)[self.key]

    def parents(self) -> tuple[Source, ...]:
        return (self.base,)

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"{parent_vars[0]}[{self.key!r}]"


@dataclass(frozen=True, eq=False, repr=False)
class KeyedSource(Source):
    """A dict entry keyed by another source's value: ``L['opt'].state[<param>]``.

    Fetching uses ``dict.get`` so that a missing entry reads as None instead of raising
    or, on a defaultdict such as ``Optimizer.state``, creating the entry.
    """

    base: Source
    key: Source

    def name(self) -> str:
        return f"{self.base.name()}[{self.key.name()}]"

    def fetch(self, L: Locals) -> Any:
        return self.base.fetch(L).get(self.key.fetch(L))

    def parents(self) -> tuple[Source, ...]:
        return (self.base, self.key)

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"{parent_vars[0]}.get({parent_vars[1]})"


@dataclass(frozen=True, eq=False, repr=False)
class GlobalSource(Source):
    """A module global the step reads: ``G['torch.optim.adam'].some_name``.

    Fetched from ``sys.modules`` by module name, so a source never holds the module dict.
    """

    module: str
    global_name: str

    def name(self) -> str:
        return f"G[{self.module!r}].{self.global_name}"

    def fetch(self, L: Locals) -> Any:
        return getattr(sys.modules[self.module], self.global_name)

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"sys.modules[{self.module!r}].{self.global_name}"


@dataclass(frozen=True, eq=False, repr=False)
class AutocastSource(Source):
    """The ``torch.autocast`` state around the call (``_torch_compat.autocast_state``)."""

    def name(self) -> str:
        return "torch.autocast"

    def fetch(self, L: Locals) -> Any:
        return autocast_state()

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return "sys.modules['optguard._torch_compat'].autocast_state()"


@dataclass(frozen=True, eq=False, repr=False)
class WeakRefSource(Source):
    """The object a weak reference points to: ``L['ref']()`` (None once it is dead)."""

    base: Source

    def name(self) -> str:
        return f"{self.base.name()}()"

    def fetch(self, L: Locals) -> Any:
        return self.base.fetch(L)()

    def parents(self) -> tuple[Source, ...]:
        return (self.base,)

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"{parent_vars[0]}()"


@dataclass(frozen=True, eq=False, repr=False)
class DictKeySource(Source):
    """The ``index``-th key of a dict, in insertion order: ``list(L['d'].keys())[0]``."""

    base: Source
    index: int

    def name(self) -> str:
        return f"list({self.base.name()}.keys())[{self.index}]"

    def fetch(self, L: Locals) -> Any:
        return list(self.base.fetch(L).keys())[self.index]

    def parents(self) -> tuple[Source, ...]:
        return (self.base,)

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"list({parent_vars[0]}.keys())[{self.index}]"


def _cache_name(cls: type[Source]) -> None:
    """Keep each source's name once computed: a source is named (generated variables are
    named after it) again and again while guards and gathers are generated, tens of
    thousands of times for a large optimizer, and naming walks the whole path each time."""
    plain_name = cls.name

    def name(self: Source) -> str:
        try:
            return self.__dict__["_name"]  # type: ignore[no-any-return]
        except KeyError:
            n = self.__dict__["_name"] = plain_name(self)
            return n

    cls.name = name  # type: ignore[method-assign]


for _cls in (
    LocalSource,
    AttrSource,
    ItemSource,
    KeyedSource,
    GlobalSource,
    AutocastSource,
    WeakRefSource,
    DictKeySource,
):
    _cache_name(_cls)


def ancestors(source: Source) -> Iterator[Source]:
    """``source`` and the sources it is reached through (attributes, items, keyed entries),
    innermost first: ``...params[0].grad``, ``...params[0]``, ``...params``, ..."""
    while True:
        yield source
        if not isinstance(source, AttrSource | ItemSource | KeyedSource):
            return
        source = source.base


_NOT_IDENT = re.compile(r"[^0-9a-zA-Z]+")


def variable_name(source: Source) -> str:
    """An identifier for a source: ``L['opt'].param_groups[0]`` -> ``opt_param_groups_0``
    (kept on the source once computed, like its name: generated guards ask again and
    again)."""
    cached = source.__dict__.get("_variable_name")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    ident = None
    kind = type(source)
    if kind is AttrSource or kind is ItemSource or kind is KeyedSource:
        # The base's name and the last step's, joined: the same identifier as the whole
        # path's (the punctuation between them is one "_"), without rescanning the path
        # for each of 10,000 params' sources.
        base = variable_name(source.base)  # type: ignore[attr-defined]
        if kind is AttrSource:
            last = _ident(source.attr)  # type: ignore[attr-defined]
        elif kind is ItemSource:
            last = _ident(repr(source.key))  # type: ignore[attr-defined]
        else:
            last = variable_name(source.key)  # type: ignore[attr-defined]
        if not base.startswith("v_") and not last.startswith("v_"):
            ident = f"{base}_{last}" if last else base
    if ident is None:
        ident = _ident(source.name().replace("L[", "["))
        if not ident or ident[0].isdigit():
            ident = f"v_{ident}"
    source.__dict__["_variable_name"] = ident
    return ident


def _ident(text: str) -> str:
    return _NOT_IDENT.sub("_", text).strip("_")
