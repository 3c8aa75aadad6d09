"""Sources: where a value the trace read lives, as a readable path from the call's inputs.

A Source prints as the access path a user would write (``L['opt'].param_groups[0]['lr']``),
fetches its value from live inputs, and emits the Python expression that fetches it, so
guard, gather and replay code can be generated from the same objects.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from optguard._torch_compat import autocast_state

Locals = Mapping[str, Any]


@dataclass(frozen=True)
class Source:
    """Base of all sources: a path from the call's locals ``L`` to one value."""

    def name(self) -> str:
        raise NotImplementedError(type(self).__name__)

    def __getstate__(self) -> dict[str, Any]:
        # (the cached hash is this process's: string hashes differ between processes)
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_name")}

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


@dataclass(frozen=True, repr=False)
class LocalSource(Source):
    """An argument of the compiled call: ``L['opt']``."""

    local: str

    def name(self) -> str:
        return f"L[{self.local!r}]"

    def fetch(self, L: Locals) -> Any:
        return L[self.local]

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return f"L[{self.local!r}]"


@dataclass(frozen=True, repr=False)
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


@dataclass(frozen=True, repr=False)
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


@dataclass(frozen=True, repr=False)
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


@dataclass(frozen=True, repr=False)
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


@dataclass(frozen=True, repr=False)
class AutocastSource(Source):
    """The ``torch.autocast`` state around the call (``_torch_compat.autocast_state``)."""

    def name(self) -> str:
        return "torch.autocast"

    def fetch(self, L: Locals) -> Any:
        return autocast_state()

    def expr(self, parent_vars: tuple[str, ...]) -> str:
        return "sys.modules['optguard._torch_compat'].autocast_state()"


@dataclass(frozen=True, repr=False)
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


@dataclass(frozen=True, repr=False)
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


def _cache_hash_and_name(cls: type[Source]) -> None:
    """Keep each source's hash and name once computed: a source is hashed as a dict key and
    named (generated variables are named after it) again and again while guards and gathers
    are generated, tens of thousands of times for a large optimizer, and both walk the
    whole path each time."""
    fields_hash, plain_name = cls.__hash__, cls.name

    def __hash__(self: Source) -> int:
        try:
            return self.__dict__["_hash"]  # type: ignore[no-any-return]
        except KeyError:
            h = self.__dict__["_hash"] = fields_hash(self)
            return h

    def name(self: Source) -> str:
        try:
            return self.__dict__["_name"]  # type: ignore[no-any-return]
        except KeyError:
            n = self.__dict__["_name"] = plain_name(self)
            return n

    cls.__hash__ = __hash__  # type: ignore[method-assign,assignment]
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
    _cache_hash_and_name(_cls)


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
    text = source.name().replace("L[", "[")
    ident = _NOT_IDENT.sub("_", text).strip("_")
    if not ident or ident[0].isdigit():
        ident = f"v_{ident}"
    source.__dict__["_variable_name"] = ident
    return ident
