"""The guarded cache: compiled entries of one compiled object, newest first, with a limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from optguard.prologue import Prologue
from optguard.sources import Locals

T = TypeVar("T")

DEFAULT_RECOMPILE_LIMIT = 8


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One compiled version: valid while its prologue finds it applies."""

    prologue: Prologue
    value: T


class GuardedCache(Generic[T]):
    """Entries tried newest first; ``full`` once ``limit`` entries have been added."""

    def __init__(self, limit: int = DEFAULT_RECOMPILE_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"recompile limit must be at least 1, got {limit}")
        self.limit = limit
        self.entries: list[Entry[T]] = []
        self.misses: list[str] = []

    def lookup(self, L: Locals) -> T | None:
        found = self.find(L)
        if found is None:
            return None
        found[0].prologue.release()
        return found[0].value

    def find(self, L: Locals) -> tuple[Entry[T], list[Any]] | None:
        """The newest entry that applies to ``L``, with the inputs its prologue gathered
        (``entry.prologue.release()`` once they are used)."""
        for entry in self.entries:
            inputs = entry.prologue(L)
            if inputs is not None:
                return entry, inputs
        return None

    def miss_reason(self, L: Locals) -> str | None:
        """Why the newest entry does not match ``L`` (None when the cache is empty)."""
        if not self.entries:
            return None
        return self.entries[0].prologue.first_failure(L) or "guards failed while fetching inputs"

    def add(self, prologue: Prologue, value: T) -> None:
        self.entries.insert(0, Entry(prologue, value))

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.limit

    def clear(self) -> None:
        self.entries.clear()
        self.misses.clear()
