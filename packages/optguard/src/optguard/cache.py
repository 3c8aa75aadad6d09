"""The guarded cache: compiled entries of one compiled object, newest first, with a limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from optguard.check import CompiledCheck
from optguard.sources import Locals

T = TypeVar("T")

DEFAULT_RECOMPILE_LIMIT = 8


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One compiled version: valid while its check holds."""

    check: CompiledCheck
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
        entry = self.find(L)
        return entry.value if entry is not None else None

    def find(self, L: Locals) -> Entry[T] | None:
        """The newest entry whose check holds (its ``check.fast_hit`` says which tier)."""
        for entry in self.entries:
            if entry.check(L):
                return entry
        return None

    def miss_reason(self, L: Locals) -> str | None:
        """Why the newest entry does not match ``L`` (None when the cache is empty)."""
        if not self.entries:
            return None
        return self.entries[0].check.first_failure(L) or "guards failed while fetching inputs"

    def add(self, check: CompiledCheck, value: T) -> None:
        self.entries.insert(0, Entry(check, value))

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.limit

    def clear(self) -> None:
        self.entries.clear()
        self.misses.clear()
