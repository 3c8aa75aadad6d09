"""An entry's prologue: whether the entry applies to the live inputs ``L`` and, if it does,
the inputs its plan runs on, in one call.

``prologue(L)`` returns the inputs (a list, in the order of the entry's input sources) or
None. Inside, two ways to the same answer:

- the generated check (check.py: every guard, in Python) and the full gather
  (``compile_fetch``: every input's access path), generated when first needed: an entry's
  first call tests and fetches its inputs one by one (``applies``, ``fetch``), and its
  later calls hit the fast tier until one misses;
- the fast tier (fast.py), armed from the live values the first time the generated check
  passes (``arm(L)``: a miss asks right after its first run): a C++ guard tree, native
  loops over lists of tensors, dict versions of the optimizer state, and its own gather
  (gather.py) that fetches only what can change (grads, hyperparameters) and reuses the
  objects the tree proved unchanged.

A caller that reads some inputs only for their data pointers (a plan writing grads'
addresses into its tables) says so once, before the tier is armed: ``read_by_address(slots,
link)``. A fast-tier hit then leaves those slots None where the tier's native check reads
them anyway, and ``link`` is handed, at each arming, where the native address check finds
each one (see gather.py). The generated check's path always gathers every input.

The fast tier answers first; when it fails, the generated check decides (a tier whose
pinned state was replaced is dropped; one whose check passes again is rebuilt, at most
``MAX_REBUILDS`` times in quick succession). The caller runs its plan on the inputs, then
``release()`` drops what the call fetched (the fast gather's list is reused: this step's
grads must not outlive it). ``first_failure(L)`` names the first failing guard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

from optguard.check import CompiledCheck, GuardSet, compile_check, fetch, first_failure
from optguard.codegen import compile_fetch
from optguard.fast import FastCheck, build_fast_check
from optguard.guard import MISSING
from optguard.sources import Locals, Source
from optguard.summary import count_kinds

log = logging.getLogger("optcompile.guards")


class Prologue:
    """See the module docstring. ``pin``: the entry owns what its inputs hold (a compiled
    optimizer: its params and state), so the fast tier may keep those objects and gather
    only the rest; a compiled function's prologue gathers in full after either check."""

    # After this many rebuilds of the fast tier (its tree no longer matched although the
    # generated check passed: a state entry replaced, a list item swapped for an equal one),
    # each within REBUILD_AFTER_HITS hits of the one before, the inputs are too changeable
    # for it: the generated check alone runs. Rare changes (a checkpoint reload) rebuild
    # freely.
    MAX_REBUILDS = 8
    REBUILD_AFTER_HITS = 1000

    def __init__(
        self,
        guards: GuardSet,
        input_sources: Sequence[Source] = (),
        pin: bool = False,
        fast: bool = True,
    ) -> None:
        self.guards = guards
        self.input_sources = tuple(input_sources)
        # The generated check and gather, made when first asked for (``check``,
        # ``gather``): a first call fetches and tests its inputs one by one (``arm``) and
        # later calls hit the fast tier, so they may never be needed.
        self._check: CompiledCheck | None = None
        self._gather: tuple[Callable[[Locals], list[Any]], str] | None = None
        if log.isEnabledFor(logging.INFO):
            kinds = ", ".join(f"{count} {kind}" for kind, count in count_kinds(guards.guards))
            log.info(
                "prologue: %d guards (%s), %d inputs",
                len(guards),
                kinds or "none",
                len(self.input_sources),
            )
        self.pin = pin
        self.fast: FastCheck | None = None
        self.fast_note: str | None = None if fast else "off"
        self.by_address: frozenset[int] = frozenset()  # see read_by_address
        self._link: Callable[[dict[int, tuple[Any, int]]], None] | None = None
        self.rebuilds = 0  # in a row, each soon after the one before
        self.hits = 0  # fast-tier hits since it was last built
        self.fast_hits = 0  # fast-tier hits in all (explain, tests)

    @property
    def check(self) -> CompiledCheck:
        """The generated check of every guard (check.py)."""
        if self._check is None:
            self._check = compile_check(self.guards)
        return self._check

    @property
    def gather(self) -> Callable[[Locals], list[Any]]:
        """The generated full gather: every input fetched along its path, no guard tested."""
        return self._generated_gather()[0]

    @property
    def gather_code(self) -> str:
        return self._generated_gather()[1]

    def _generated_gather(self) -> tuple[Callable[[Locals], list[Any]], str]:
        if self._gather is None:
            self._gather = compile_fetch(self.input_sources)
        return self._gather

    def _gather_all(self, L: Locals) -> list[Any]:
        return self.gather(L)  # (generated only if a hit needs it)

    def fetch(self, L: Locals, fetched: dict[Source, Any] | None = None) -> list[Any]:
        """The inputs from ``L`` (the full gather's answer): through the generated gather
        once it exists, else each input fetched along its path (an entry's first call;
        ``fetched``: values already fetched, see ``check.fetch``)."""
        if self._gather is not None:
            return self._gather[0](L)
        fetched = {} if fetched is None else fetched
        inputs = [fetch(source, L, fetched) for source in self.input_sources]
        for source, value in zip(self.input_sources, inputs, strict=True):
            if value is MISSING:  # (as the generated gather: it raises)
                raise LookupError(f"{source.name()} cannot be fetched")
        return inputs

    def applies(self, L: Locals, fetched: dict[Source, Any] | None = None) -> bool:
        """Whether every guard holds on ``L`` (the generated check's answer; guard by guard
        until it exists, adding what it fetches to ``fetched``)."""
        if self._check is not None:
            return self._check(L)
        return first_failure(self.guards.guards, L, fetched) is None

    def __call__(self, L: Locals) -> list[Any] | None:
        fast = self.fast
        if fast is not None:
            inputs = fast.inputs(L, self._gather_all)
            if inputs is not None:
                self.hits += 1
                self.fast_hits += 1
                return inputs
        if not self.check(L):
            if fast is not None and fast.stale(L):
                # The state it pinned was replaced: its old tensors must not stay alive
                # through it (rebuilt if this entry matches again).
                self.fast = None
            return None
        inputs = self.gather(L)
        if self.fast_note is None:
            self._arm(L, inputs)
        return inputs

    def arm(self, L: Locals) -> bool:
        """Arm the fast tier now, from ``L``, if the generated check passes on it (a miss
        calls this after its first run: the next call is then a plain hit); whether it is
        armed. Nothing fetched is kept but what the tier pins."""
        if self.fast is None and self.fast_note is None:
            try:  # (the call it follows is done: nothing here may fail it)
                fetched: dict[Source, Any] = {}
                inputs = self.fetch(L, fetched) if self.applies(L, fetched) else None
            except Exception:
                inputs = None
            if inputs is not None:
                self._arm(L, inputs)
        return self.fast is not None

    def read_by_address(
        self, slots: Collection[int], link: Callable[[dict[int, tuple[Any, int]]], None]
    ) -> None:
        """The caller reads the inputs at ``slots`` only for their data pointers: from the
        next arming of the fast tier on, a hit may leave them None and hand them over
        natively; ``link(slot -> (native spec, item))`` is called at each arming (see the
        module docstring)."""
        self.by_address = frozenset(slots)
        self._link = link

    def release(self) -> None:
        """Drop what the last call fetched into the fast tier's reused list."""
        if self.fast is not None:
            self.fast.release()

    def _arm(self, L: Locals, inputs: list[Any]) -> None:
        try:
            if self.hits >= self.REBUILD_AFTER_HITS:
                self.rebuilds = 0
            if self.rebuilds >= self.MAX_REBUILDS:
                self.fast, self.fast_note = None, "off: its tree kept changing"
                return
            self.rebuilds += 1
            self.hits = 0
            gathered = (self.input_sources, inputs) if self.pin else None
            self.fast = build_fast_check(self.guards.guards, L, gathered, self.by_address)
            if self.fast is None:
                self.fast_note = "off: not available with this torch"
            if self._link is not None:
                gather = self.fast.gather if self.fast is not None else None
                self._link(gather.links if gather is not None else {})
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
            return f"{self.check.code}\n# fast tier: {note}"
        return f"{self.check.code}\n# fast tier (tried first):\n{self.fast.describe()}"
