"""Compile all guards of an entry into one check function, and explain its failures.

One generated function ``check(L) -> bool`` fetches each source once and tests every guard
(those of each item of a long list, a parameter's, as one loop: rows.py; an entry's
Prologue, prologue.py, runs it when its fast tier does not answer).
After a miss, ``first_failure`` walks the guards one by one to name the first that fails,
with its old and new value.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from optguard import rows
from optguard.codegen import SourceCode, build_function
from optguard.guard import single_test
from optguard.guards import MISSING, Guard, describe_failure, guard_sources
from optguard.sources import AttrSource, ItemSource, KeyedSource, Locals, Source
from optguard.summary import count_kinds

log = logging.getLogger("optcompile.guards")

CheckFn = Callable[[Locals], bool]


@dataclass(frozen=True)
class GuardSet:
    """The guards of one compiled entry, in the order they are checked."""

    guards: tuple[Guard, ...]

    def __len__(self) -> int:
        return len(self.guards)

    def describe(self) -> list[str]:
        return [g.describe() for g in self.guards]


class GuardSetBuilder:
    """Collects guards while tracing; duplicates are dropped, first insertion order kept."""

    def __init__(self) -> None:
        self._guards: dict[Guard, None] = {}
        # ``add(guard)``: the dict's own setdefault (a tracer adds several guards per tensor
        # it reads: no Python call for each)
        self.add: Callable[[Guard], object] = self._guards.setdefault

    def extend(self, guards: Iterable[Guard]) -> None:
        for g in guards:
            self.add(g)

    def build(self) -> GuardSet:
        return GuardSet(tuple(self._guards))


class CompiledCheck:
    """A guard set compiled to one function ``check(L) -> bool``, with its source for
    explain() (an entry's Prologue runs it when its fast tier does not answer)."""

    def __init__(self, guards: GuardSet, fn: CheckFn, code: str) -> None:
        self.guards = guards
        self.fn = fn
        self.code = code

    def __call__(self, L: Locals) -> bool:
        return self.fn(L)

    def first_failure(self, L: Locals) -> str | None:
        """Readable reason for the first guard that fails on ``L``, or None if all hold."""
        return first_failure(self.guards.guards, L)

    def describe(self) -> str:
        return self.code


def compile_check(guards: GuardSet) -> CompiledCheck:
    """Generate ``check(L)``: True when every guard holds; any error while fetching is a miss."""
    body = SourceCode(indent="        ")
    emitters = [functools.partial(_emit_guard, g) for g in guards.guards]
    rows.emit(body, list(zip(guard_sources(guards.guards), emitters, strict=True)))
    body.emit("return True")
    lines = ["    try:", *body.lines, "    except Exception:", "        return False"]
    fn, code = build_function("check", "L", lines, body.constants)
    if log.isEnabledFor(logging.INFO):
        kinds = ", ".join(f"{count} {kind}" for kind, count in count_kinds(guards.guards))
        log.info("check compiled: %d guards (%s)", len(guards), kinds or "none")
        log.debug("%s", code)
    return CompiledCheck(guards, fn, code)


def _emit_guard(guard: Guard, code: SourceCode) -> None:
    indent = code.indent
    test = guard.test(code.var(guard.source), code)
    code.lines.append(f"{indent}if not {test}:\n{indent}    return False")


def first_failure(
    guards: Sequence[Guard], L: Locals, fetched: dict[Source, Any] | None = None
) -> str | None:
    """The reason the first guard in ``guards`` that fails on ``L`` gives, or None if all
    hold (what the generated check answers, tested one guard at a time). ``fetched``: the
    values of sources fetched so far (each is fetched once; the caller may reuse them)."""
    fetched = {} if fetched is None else fetched
    for guard in guards:
        kind = type(guard)
        if kind.fetch is _FETCH:
            value = fetch(guard.source, L, fetched)
        else:
            try:
                value = guard.fetch(L)
            except Exception:
                value = MISSING
        if value is MISSING:
            return describe_failure(guard, value)
        try:
            holds = single_test(guard)(value) if kind.holds is _HOLDS else guard.holds(value)
        except Exception:  # (as the generated check: an error is a failure)
            holds = False
        if not holds:
            return describe_failure(guard, value)
    return None


def fetch(source: Source, L: Locals, fetched: dict[Source, Any]) -> Any:
    """The value at ``source`` (MISSING where it cannot be fetched), through the values of
    its bases in ``fetched``, which it joins: ``Source.fetch``, each path walked once."""
    value = fetched.get(source, _UNFETCHED)
    if value is not _UNFETCHED:
        return value
    try:
        if type(source) is AttrSource:
            base = fetch(source.base, L, fetched)
            value = MISSING if base is MISSING else getattr(base, source.attr)
        elif type(source) is ItemSource:
            base = fetch(source.base, L, fetched)
            value = MISSING if base is MISSING else base[source.key]
        elif type(source) is KeyedSource:  # (dict.get: a missing entry reads as None)
            base, key = fetch(source.base, L, fetched), fetch(source.key, L, fetched)
            value = MISSING if base is MISSING or key is MISSING else base.get(key)
        else:
            value = source.fetch(L)
    except Exception:
        value = MISSING
    fetched[source] = value
    return value


_UNFETCHED = object()
_FETCH, _HOLDS = Guard.fetch, Guard.holds
