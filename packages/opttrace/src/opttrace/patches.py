"""Process-wide patches a trace needs, confined to the tracing thread and the trace.

A trace changes a few process-wide names (``torch.compiler.is_compiling``, ``builtins.min``
and ``max``, the global random generators' functions). Each is replaced for the duration of
one trace by a dispatcher that runs the trace's version only in the tracing thread and the
original everywhere else, and is put back when the trace ends. Traces are serialized by one
process-wide lock, so patches never interleave: two threads compiling at once cannot leave
a patch behind, and another thread running eager code meanwhile sees nothing change.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

# One trace at a time in a process (re-entrant: a trace may trace a nested compiled step).
TRACE_LOCK = threading.RLock()


class _Confined:
    """Which thread the current trace runs in (0: none)."""

    thread = 0


def tracing_here() -> bool:
    """Whether the calling thread is running a trace."""
    return _Confined.thread == threading.get_ident()


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Hold the trace lock and mark this thread as the tracing one."""
    with TRACE_LOCK:
        outer = _Confined.thread
        _Confined.thread = threading.get_ident()
        try:
            yield
        finally:
            _Confined.thread = outer


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``owner.name`` (``owner[name]`` for a dict: a module's globals) runs ``replacement``
    in the tracing thread, the original elsewhere.

    Put back at exit unless someone replaced it meanwhile (their wrapper then calls ours,
    which forwards to the original once the trace is over)."""
    if isinstance(owner, dict):
        get: Callable[[], Any] = functools.partial(owner.__getitem__, name)
        put: Callable[[Any], Any] = functools.partial(owner.__setitem__, name)
    else:
        get = functools.partial(getattr, owner, name)
        put = functools.partial(setattr, owner, name)
    original = get()
    live = [True]

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if live[0] and tracing_here():
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    put(dispatch)
    try:
        yield
    finally:
        live[0] = False
        if get() is dispatch:
            put(original)


# -- the global random generators --------------------------------------------------------------


class RandomDraws:
    """Draws the tracing thread made from Python's or numpy's global random generator.

    While a trace runs, the module-level functions of ``random`` and ``numpy.random`` refuse
    in the tracing thread before drawing, so the generator's state is never consumed by a
    trace and no other thread's draws need undoing. ``seen`` names the generators a draw was
    attempted from (kept even if the step swallowed the exception)."""

    def __init__(self) -> None:
        self.seen: list[str] = []


def _generator_name(value: Any) -> str | None:
    """Which global random generator ``value`` draws from, if it is one of its methods."""
    owner = getattr(value, "__self__", None)
    if owner is None:
        return None
    if owner is random._inst:
        return "Python's random module"
    mtrand = sys.modules.get("numpy.random.mtrand")
    if mtrand is not None and owner is getattr(mtrand, "_rand", None):
        return "numpy.random"
    return None


def _drawing_names(namespaces: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str, str]]:
    """(namespace, name, generator) of every name bound to a global generator's method, in
    ``random``, ``numpy.random`` and ``namespaces`` (user modules that imported one:
    ``from random import random``)."""
    spaces = [vars(random), *namespaces]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        spaces.append(vars(numpy_random))
    found: dict[tuple[int, str], tuple[dict[str, Any], str, str]] = {}
    for space in spaces:
        for name, value in list(space.items()):
            generator = _generator_name(value)
            if generator is not None:
                found[(id(space), name)] = (space, name, generator)
    return list(found.values())


@contextlib.contextmanager
def refuse_random_draws(
    draws: RandomDraws,
    refuse: Callable[[str], BaseException],
    namespaces: list[dict[str, Any]],
) -> Iterator[None]:
    """Within a trace, a call of a global generator's function raises ``refuse(name)``."""
    with contextlib.ExitStack() as stack:
        for module, name, generator in _drawing_names(namespaces):

            def refused(*args: Any, _generator: str = generator, **kwargs: Any) -> Any:
                draws.seen.append(_generator)
                raise refuse(_generator)

            stack.enter_context(patched(module, name, refused))
        yield
