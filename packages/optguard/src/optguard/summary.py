"""Guards grouped for a reader: by where their sources sit, with the kinds of fact per group.

An optimizer over 148 params has about 1,000 guards; a person wants "148 params: metadata,
data pointer". Sources that differ only in list indices or keyed entries share a pattern
(``L['opt'].param_groups[*]['params'][*]``); string keys under such a pattern are merged
into one group that lists them (``L['opt'].state[*][key]``: 'exp_avg', 'step').
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from optguard.guards import (
    AliasGuard,
    AutocastGuard,
    ConstantGuard,
    DataPtrGuard,
    DictLengthGuard,
    DisjointGuard,
    Guard,
    IdentityGuard,
    KeysGuard,
    LengthGuard,
    NoneGuard,
    PredicateGuard,
    TensorMatchGuard,
    TypeGuard,
    WeakrefAliveGuard,
)
from optguard.sources import (
    AttrSource,
    DictKeySource,
    ItemSource,
    KeyedSource,
    Source,
    WeakRefSource,
)

KINDS: dict[type[Guard], str] = {
    TypeGuard: "type",
    ConstantGuard: "value",
    AutocastGuard: "autocast state",
    LengthGuard: "length",
    DictLengthGuard: "length",
    KeysGuard: "keys",
    NoneGuard: "None or not",
    IdentityGuard: "identity",
    AliasGuard: "same object",
    DisjointGuard: "no shared memory",
    DataPtrGuard: "data pointer",
    WeakrefAliveGuard: "alive",
    PredicateGuard: "predicate",
    TensorMatchGuard: "metadata",
}


def guard_kind(guard: Guard) -> str:
    """A short name for the kind of fact ``guard`` checks ("metadata", "data pointer")."""
    for cls in type(guard).__mro__:
        if cls in KINDS:
            return KINDS[cls]
    return type(guard).__name__.removesuffix("Guard").lower() or "guard"


@dataclass(frozen=True)
class GuardGroup:
    """Guards whose sources share one pattern."""

    pattern: str  # L['opt'].param_groups[*]['params'][*]
    keys: tuple[str, ...]  # the string keys merged into a trailing [key], in first-seen order
    sources: int  # distinct sources
    guards: int
    kinds: tuple[tuple[str, int], ...]  # (kind, guards of that kind), in first-seen order


def pattern(source: Source) -> str:
    """``source``'s path with list indices and keyed entries as ``*``."""
    if isinstance(source, AttrSource):
        return f"{pattern(source.base)}.{source.attr}"
    if isinstance(source, ItemSource):
        key = "*" if isinstance(source.key, int) else repr(source.key)
        return f"{pattern(source.base)}[{key}]"
    if isinstance(source, KeyedSource):
        return f"{pattern(source.base)}[*]"
    if isinstance(source, WeakRefSource):
        return f"{pattern(source.base)}()"
    if isinstance(source, DictKeySource):
        return f"list({pattern(source.base)}.keys())[*]"
    return source.name()


def _group_key(source: Source) -> tuple[str, str | None]:
    if isinstance(source, ItemSource) and isinstance(source.key, str):
        base = pattern(source.base)
        if "[*]" in base:
            return f"{base}[key]", source.key
    return pattern(source), None


def group_guards(guards: tuple[Guard, ...] | list[Guard]) -> list[GuardGroup]:
    """The guards grouped by source pattern, groups in the order their first guard comes."""
    keys: dict[str, dict[str, None]] = {}
    sources: dict[str, set[Source]] = {}
    counts: dict[str, Counter[str]] = {}
    for guard in guards:
        group, key = _group_key(guard.source)
        keys.setdefault(group, {})
        if key is not None:
            keys[group].setdefault(key, None)
        sources.setdefault(group, set()).add(guard.source)
        counts.setdefault(group, Counter())[guard_kind(guard)] += 1
    return [
        GuardGroup(
            pattern=group,
            keys=tuple(keys[group]),
            sources=len(sources[group]),
            guards=sum(counts[group].values()),
            kinds=tuple(counts[group].items()),
        )
        for group in keys
    ]


def count_kinds(guards: tuple[Guard, ...] | list[Guard]) -> list[tuple[str, int]]:
    """How many guards of each kind, most first."""
    return Counter(guard_kind(g) for g in guards).most_common()
