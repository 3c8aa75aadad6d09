"""The driver: check guards, and on a miss trace, lower and cache; then run and replay.

One Compiled object serves one compiled optimizer or function. Each call builds the locals
``L`` (``{'opt': optimizer}`` or the function's bound arguments) and reads top-down: the
newest entry whose prologue applies to ``L`` returns the graph's inputs (optguard's
Prologue: guards checked and inputs gathered in one call) -> the backend's plan runs on
them -> the side effects are replayed. A miss traces anew, unless the recompile limit is
reached, in which case the call runs eagerly (with one warning saying why). A trace that
fails runs that call eagerly; a later miss traces again (a transiently bad input, an
exception the user fixed), and every failed trace counts against the recompile limit, so
a step that can never be traced stops trying.

A Ctrl-C (SIGINT in the main thread) during a miss is held until the miss has traced, built
and run the step, then raised: an interrupt never leaves a trace, the real state
initialization it runs, or a CUDA graph capture half done.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from optguard import DataPtrGuard, Guard, GuardedCache, Locals, Prologue, native
from optkernels import Backend, Plan, use_native_addresses
from optsidefx import Replay, generate_replay
from opttrace import TRACE_LOCK, TracedStep, TraceError, clear_cache

from optcompile import logs
from optcompile.errors import FallbackWarning, warn_user

# The backends' per-call address checks and staged host-to-device copies use optguard's C++
# module once it is built.
native.when_loaded(use_native_addresses)

Tracer = Callable[[Locals], TracedStep]
Eager = Callable[[Locals], Any]


@dataclass
class CompiledEntry:
    """Everything one cache entry runs: its prologue (guards and gather), the backend plan,
    the replay code.

    With ``pin_inputs`` (a compiled optimizer: it owns what its steps read) the prologue's
    fast tier keeps the params and state tensors it proved unchanged and fetches only grads
    and hyperparameters; a compiled function's entries hold none of its arguments."""

    traced: TracedStep
    prologue: Prologue
    plan: Plan
    replay: Replay

    @property
    def gather(self) -> Callable[[Locals], list[Any]]:
        """The full gather (every input fetched along its path; no guard checked)."""
        return self.prologue.gather

    @property
    def gather_code(self) -> str:
        return self.prologue.gather_code

    def read_by_address(self) -> None:
        """After the plan's first call: the inputs it reads only by address (grads, for
        its tables) are handed over natively by the prologue's fast tier from its arming
        on, instead of gathered (a compiled optimizer's entries only: they pin the rest)."""
        plan: Any = self.plan
        found = getattr(plan, "address_only_inputs", None)
        slots = found() if found is not None and self.prologue.pin else frozenset()
        if slots:
            self.prologue.read_by_address(slots, plan.link_addresses)

    def run(self, L: Locals, inputs: list[Any]) -> Any:
        """Run the plan on the prologue's ``inputs`` and replay the side effects."""
        try:
            outputs = self.plan(inputs)
        finally:
            self.prologue.release()  # its reused list must not keep this step's grads
        return self.replay(L, outputs)


@dataclass
class Stats:
    """What happened to one compiled object, for explain()."""

    traces: int = 0
    retrace_reasons: list[str] = field(default_factory=list)
    fallback_reason: str | None = None  # why the latest eager call ran eagerly
    failed_traces: int = 0  # count against the recompile limit
    eager_for_good: bool = False  # the limit is reached, or the object cannot be traced
    warned: bool = False


_ALL: weakref.WeakSet[Compiled] = weakref.WeakSet()


class Compiled:
    """A compiled callable over locals ``L``; see the module docstring."""

    def __init__(
        self,
        name: str,
        tracer: Tracer,
        eager: Eager,
        backend: Backend,
        fullgraph: bool,
        recompile_limit: int,
        pin_inputs: bool = False,
    ) -> None:
        self.name = name
        self.pin_inputs = pin_inputs
        self.tracer = tracer
        self.eager = eager
        self.backend = backend
        self.fullgraph = fullgraph
        self.cache: GuardedCache[CompiledEntry] = GuardedCache(recompile_limit)
        self.stats = Stats()
        self.released = False
        # Its caller's usual call needs nothing around ``__call__`` (a compiled optimizer's
        # step without closure, hooks, in-backward update or rounding counter: optimizer.py)
        self.direct = False
        # The entry of the latest call that ran compiled (what its next call likely hits)
        self.last: CompiledEntry | None = None
        self._lock = threading.RLock()
        _ALL.add(self)

    def __call__(self, L: Locals) -> Any:
        # One call at a time per compiled object: an entry's plan and buffers, the cache and
        # the state it updates are shared by every thread that calls it.
        with self._lock:
            hit = self.cache.find(L)
            if hit is not None:
                entry, inputs = hit
                self.last = entry.value
                return entry.value.run(L, inputs)
        # A miss traces: traces are serialized process-wide (opttrace.TRACE_LOCK), taken
        # before this object's lock so no thread waits for it while holding an object's.
        with TRACE_LOCK, self._lock:
            hit = self.cache.find(L)  # another thread may have traced it meanwhile
            if hit is not None:
                entry, inputs = hit
                self.last = entry.value
                return entry.value.run(L, inputs)
            return self._miss(L)

    def _miss(self, L: Locals) -> Any:
        """Trace, lower and run a new entry, or run eagerly; interrupts wait until done."""
        with interrupts_held():
            entry, outputs = self._traced_run(L)
            self.last = entry
            return self.eager(L) if entry is None else outputs

    def _traced_run(self, L: Locals) -> tuple[CompiledEntry | None, Any]:
        """A new entry and what its first run returned, or (None, None): eager instead.

        Tracing and lowering build tens of thousands of long-lived objects at 1,000 params;
        the cyclic collector would rescan them again and again (up to half the time), so it
        is off until they (and the fast tier, armed after the first run: the next call is a
        plain hit) are in its oldest generation."""
        collecting = gc.isenabled()
        gc.disable()
        entry = None
        try:
            entry = self._trace_and_lower(L)
            if entry is None:
                return None, None
            # The first run gathers in full (the trace has just read these very inputs).
            outputs = entry.run(L, entry.prologue.fetch(L))
            entry.read_by_address()
            entry.prologue.arm(L)
            return entry, outputs
        finally:
            if entry is not None:
                as_long_lived()
            if collecting:
                gc.enable()

    def _trace_and_lower(self, L: Locals) -> CompiledEntry | None:
        if self.stats.eager_for_good:
            return None
        reason = self.cache.miss_reason(L)
        failed = self.stats.failed_traces
        if len(self.cache.entries) + failed >= self.cache.limit:
            cause = (
                f"the guard that keeps failing: {reason}. Raise recompile_limit= or keep that "
                "input stable"
                if reason is not None
                else f"{failed} traces failed, the last: {self.stats.fallback_reason}"
            )
            self.fall_back(f"recompile limit ({self.cache.limit}) reached; {cause}")
            return None
        try:
            traced = self.tracer(L)
        except TraceError as exc:
            if self.fullgraph:
                raise
            where = f" at {exc.where}" if exc.where else ""
            self.stats.failed_traces += 1
            self.fall_back(f"tracing failed{where}: {exc.reason}", for_good=False)
            return None
        start = time.perf_counter()
        entry = lower(traced, self.backend, self.pin_inputs)
        self._drop_superseded(traced)
        self.cache.add(entry.prologue, entry)
        self.stats.traces += 1
        self.stats.fallback_reason = None
        if reason is not None:
            self.stats.retrace_reasons.append(reason)
        logs.entry_added(self, traced, reason, time.perf_counter() - start)
        return entry

    def _drop_superseded(self, traced: TracedStep) -> None:
        """Drop entries that differ from ``traced`` only in the data pointers they expect:
        the same step over tensors that were replaced (a checkpoint loaded into the live
        optimizer). Kept, they would pile up to the recompile limit, holding the old
        tensors."""
        shape = _shape_of(traced.guards.guards)
        kept = [e for e in self.cache.entries if _shape_of(e.value.traced.guards.guards) != shape]
        self.cache.entries[:] = kept

    def fall_back(self, reason: str, for_good: bool = True) -> None:
        """Run eagerly (from now on, unless not ``for_good``: then this call only; a later
        miss traces again), saying why once (a FallbackWarning)."""
        self.stats.fallback_reason = reason
        self.stats.eager_for_good = self.stats.eager_for_good or for_good
        later = "" if for_good else " (a later call traces again)"
        logs.recompiles.info("%s runs eagerly%s: %s", self.name, later, reason)
        if not self.stats.warned:
            self.stats.warned = True
            warn_user(f"optcompile: {self.name} runs eagerly{later}: {reason}", FallbackWarning)

    def reset(self) -> None:
        self.cache.clear()
        self.last = None
        self.stats = Stats()

    def release(self) -> None:
        """Drop every entry and what it owns (graphs, plans, generated code); the object it
        was compiled for is gone."""
        self.cache.clear()
        self.last = None
        self.released = True


def _shape_of(guards: tuple[Guard, ...]) -> tuple[Any, ...]:
    """The guards with the addresses left out (see Compiled._drop_superseded)."""
    return tuple(("address", g.source) if isinstance(g, DataPtrGuard) else g for g in guards)


def as_long_lived() -> None:
    """Move every object the cyclic collector tracks into its oldest generation, without
    scanning any: what a miss built (an entry: graph, guards, plan; ~250 objects a param)
    lives as long as its optimizer. Left young, the next collections would scan them all
    once per generation (2 s at 10,000 params, and a full collection the call after: 1.7
    s). Objects frozen by someone else (``gc.freeze()``) stay frozen: then nothing moves."""
    if gc.get_freeze_count() == 0:
        gc.freeze()  # (all generations into the permanent one: a list splice, no scan)
        gc.unfreeze()  # (back into the oldest generation)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) until the block is done, then deliver it as it would have been.

    Only the main thread receives signals in Python, so elsewhere this does nothing; nor
    where the handler was not installed from Python (None)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None:
        yield
        return
    received: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[0])  # the default raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def lower(traced: TracedStep, backend: Backend, pin_inputs: bool = False) -> CompiledEntry:
    """Turn a TracedStep into a runnable entry on ``backend`` (see CompiledEntry)."""
    # The module is loaded (once per process) before the entry's first run, not at its first
    # hit (the prologue's fast tier): that run's staged copies and address tables go through
    # it like every later call's, and the next call need not record its tables again.
    native.start()
    prologue = Prologue(traced.guards, traced.input_sources, pin=pin_inputs)
    plan = backend.compile(traced.graph_module)
    # Every application of the prologue (either tier) has tested these inputs' data pointers.
    guarded = {g.source for g in traced.guards.guards if isinstance(g, DataPtrGuard)}
    plan.guarded_addresses([i for i, s in enumerate(traced.input_sources) if s in guarded])
    return CompiledEntry(
        traced=traced,
        prologue=prologue,
        plan=plan,
        replay=generate_replay(traced.effects),
    )


def reset_all() -> None:
    for compiled in list(_ALL):
        compiled.reset()
    clear_cache()


def newest(compiled: Compiled) -> CompiledEntry | None:
    entries = compiled.cache.entries
    return entries[0].value if entries else None
