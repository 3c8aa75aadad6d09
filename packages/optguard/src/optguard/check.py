"""Compile all guards of an entry into one check function, and explain its failures.

The fast path is one generated function ``check(L) -> bool`` that fetches each source once
and tests every guard in order. The slow path (after a miss) walks the guards one by one to
name the first that fails, with its old and new value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from optguard.codegen import SourceCode, build_function
from optguard.fast import FastCheck, build_fast_check
from optguard.guards import MISSING, Guard, describe_failure
from optguard.sources import Locals
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

    def add(self, guard: Guard) -> None:
        self._guards.setdefault(guard, None)

    def extend(self, guards: Iterable[Guard]) -> None:
        for g in guards:
            self.add(g)

    def build(self) -> GuardSet:
        return GuardSet(tuple(self._guards))


class CompiledCheck:
    """A guard set compiled to one function, with its source for explain(), and a fast tier
    (``fast.py``) armed the first time the full check passes."""

    # After this many rebuilds of the fast tier (its tree no longer matched although the
    # full check passed: a state entry replaced, a list item swapped for an equal one), each
    # within REBUILD_AFTER_HITS hits of the one before, the inputs are too changeable for
    # it: the full check alone runs. Rare changes (a checkpoint reload) rebuild freely.
    MAX_REBUILDS = 8
    REBUILD_AFTER_HITS = 1000

    def __init__(self, guards: GuardSet, fn: CheckFn, code: str, fast: bool = True) -> None:
        self.guards = guards
        self.fn = fn
        self.code = code
        self.fast: FastCheck | None = None
        self.fast_note: str | None = None if fast else "off"
        self.rebuilds = 0  # in a row, each soon after the one before
        self.hits = 0  # fast-tier hits since it was last built
        # Whether the last passing call passed on the fast tier (its pinned values held).
        self.fast_hit = False

    def __call__(self, L: Locals) -> bool:
        fast = self.fast
        if fast is not None and fast(L):
            self.fast_hit = True
            self.hits += 1
            return True
        self.fast_hit = False
        if not self.fn(L):
            if fast is not None and fast.stale(L):
                # The state it pinned was replaced: its old tensors must not stay alive
                # through it (re-armed if this entry matches again).
                self.fast = None
            return False
        if self.fast_note is None:
            self._arm(L)
        return True

    def _arm(self, L: Locals) -> None:
        try:
            if self.hits >= self.REBUILD_AFTER_HITS:
                self.rebuilds = 0
            if self.rebuilds >= self.MAX_REBUILDS:
                self.fast, self.fast_note = None, "off: its tree kept changing"
                return
            self.rebuilds += 1
            self.hits = 0
            self.fast = build_fast_check(self.guards.guards, L)
            if self.fast is None:
                self.fast_note = "off: not available with this torch"
            log.debug("fast tier %s", "built" if self.fast is not None else self.fast_note)
        except Exception as exc:  # never let the fast tier break a correct check
            self.fast, self.fast_note = None, f"off: {type(exc).__name__}: {exc}"

    def first_failure(self, L: Locals) -> str | None:
        """Readable reason for the first guard that fails on ``L``, or None if all hold."""
        return first_failure(self.guards.guards, L)

    def describe(self) -> str:
        """The generated check, and the fast tier when it is armed."""
        if self.fast is None:
            note = self.fast_note or "not armed yet"
            return f"{self.code}\n# fast tier: {note}"
        return f"{self.code}\n# fast tier (tried first):\n{self.fast.describe()}"


def compile_check(guards: GuardSet, fast: bool = True) -> CompiledCheck:
    """Generate ``check(L)``: True when every guard holds; any error while fetching is a miss."""
    body = SourceCode(indent="        ")
    for guard in guards.guards:
        var = body.var(guard.source)
        body.emit(f"if not {guard.test(var, body)}:")
        body.emit("    return False")
    body.emit("return True")
    lines = ["    try:", *body.lines, "    except Exception:", "        return False"]
    fn, code = build_function("check", "L", lines, body.constants)
    if log.isEnabledFor(logging.INFO):
        kinds = ", ".join(f"{count} {kind}" for kind, count in count_kinds(guards.guards))
        log.info("check compiled: %d guards (%s)", len(guards), kinds or "none")
        log.debug("%s", code)
    return CompiledCheck(guards, fn, code, fast)


def first_failure(guards: Sequence[Guard], L: Locals) -> str | None:
    for guard in guards:
        try:
            value = guard.fetch(L)
        except Exception:
            value = MISSING
        if value is MISSING or not _holds(guard, value):
            return describe_failure(guard, value)
    return None


def _holds(guard: Guard, value: object) -> bool:
    # The fast check treats any error as a miss; the explanation must do the same.
    try:
        return guard.holds(value)
    except Exception:
        return False
