"""optguard: sources, guards, the compiled check function and the guarded cache.

A Source names where a value lives (``L['opt'].param_groups[0]['lr']``); a Guard is a fact
about that value that a compiled entry relies on; all guards of an entry compile into one
generated ``check(L)`` function; an entry's Prologue decides whether the entry applies and
returns its inputs in one call (the generated check and gather, or the fast tier); a
GuardedCache holds the entries of one compiled object.
"""

from optguard.cache import DEFAULT_RECOMPILE_LIMIT, Entry, GuardedCache
from optguard.check import CompiledCheck, GuardSet, GuardSetBuilder, compile_check, first_failure
from optguard.codegen import SourceCode, build_function, compile_fetch
from optguard.fast import FastCheck
from optguard.gather import FastGather
from optguard.guards import (
    AliasGuard,
    AutocastGuard,
    ConstantGuard,
    DataPtrGuard,
    DictLengthGuard,
    DisjointGuard,
    EqualGuard,
    FloatGuard,
    Guard,
    IdentityGuard,
    KeysGuard,
    LengthGuard,
    NoneGuard,
    PredicateGuard,
    TensorMatchGuard,
    TensorMeta,
    TypeGuard,
    WeakrefAliveGuard,
    autocast_guard,
    overlapping,
)
from optguard.prologue import Prologue
from optguard.sources import (
    AttrSource,
    AutocastSource,
    DictKeySource,
    GlobalSource,
    ItemSource,
    KeyedSource,
    Locals,
    LocalSource,
    Source,
    WeakRefSource,
    ancestors,
    variable_name,
)
from optguard.summary import GuardGroup, count_kinds, group_guards, guard_kind

__all__ = [
    "DEFAULT_RECOMPILE_LIMIT",
    "AliasGuard",
    "AttrSource",
    "AutocastGuard",
    "AutocastSource",
    "CompiledCheck",
    "ConstantGuard",
    "DataPtrGuard",
    "DictKeySource",
    "DictLengthGuard",
    "DisjointGuard",
    "Entry",
    "EqualGuard",
    "FastCheck",
    "FastGather",
    "FloatGuard",
    "GlobalSource",
    "Guard",
    "GuardGroup",
    "GuardSet",
    "GuardSetBuilder",
    "GuardedCache",
    "IdentityGuard",
    "ItemSource",
    "KeyedSource",
    "KeysGuard",
    "LengthGuard",
    "LocalSource",
    "Locals",
    "NoneGuard",
    "PredicateGuard",
    "Prologue",
    "Source",
    "SourceCode",
    "TensorMatchGuard",
    "TensorMeta",
    "TypeGuard",
    "WeakRefSource",
    "WeakrefAliveGuard",
    "ancestors",
    "autocast_guard",
    "build_function",
    "compile_check",
    "compile_fetch",
    "count_kinds",
    "first_failure",
    "group_guards",
    "guard_kind",
    "overlapping",
    "variable_name",
]

__version__ = "0.1.0"
