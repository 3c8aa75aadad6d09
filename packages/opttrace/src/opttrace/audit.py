"""Stores a compiled step could not replay: to globals and closure cells of user code.

The tracer sees a step's inputs through trackers, so their mutations are recorded and
replayed. A store to a module global, a closure cell, or into a list/dict/set held there
would happen once, while tracing, and never again. Around each trace we snapshot what user
functions can reach that way (their globals and closure cells, and the contents of
containers held directly there), and afterwards compare: anything that changed is put back
and the trace is refused, naming it. Deeper mutations (an attribute of an object held in a
global) are not seen; the README says so. Draws from Python's and numpy's global random
generators are refused as they are attempted (patches.refuse_random_draws); the generators'
states are compared too, for draws through other paths.

Other threads run on during a trace. When there are any, a change the step's own code cannot
have made (a global no user function stores to, a generator the step did not call) is
theirs: it is left as it is and not held against the trace.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import operator
import random
import sys
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from opttrace.errors import TraceError
from opttrace.patches import RandomDraws

_LIBRARY_PREFIXES = ("torch", "opttrace", "optguard", "optsidefx", "optkernels", "optcompile")
_CONTAINERS = (list, dict, set)


def _is_user(fn: types.FunctionType) -> bool:
    module = fn.__globals__.get("__name__", "")
    return not any(module == p or module.startswith(p + ".") for p in _LIBRARY_PREFIXES)


def user_functions(roots: Iterable[Any]) -> list[types.FunctionType]:
    """User functions reachable from ``roots``: functions, methods, partials, decorators'
    ``__wrapped__``, closure cells holding functions, and the methods of objects' classes."""
    found: dict[int, types.FunctionType] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, types.MethodType):
            stack.append(obj.__func__)
        elif isinstance(obj, functools.partial):
            stack.append(obj.func)
        elif isinstance(obj, types.FunctionType):
            if id(obj) in found:
                continue
            found[id(obj)] = obj
            if hasattr(obj, "__wrapped__"):
                stack.append(obj.__wrapped__)
            for cell in obj.__closure__ or ():
                try:
                    stack.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
        elif isinstance(obj, torch.optim.Optimizer):
            for cls in type(obj).__mro__:
                stack.extend(v for v in vars(cls).values() if inspect.isfunction(v))
    return [f for f in found.values() if _is_user(f)]


CONSTANT_TYPES = (bool, int, float, str, type(None))
# Elements of a global container (or attributes of a global object) compared on each call at
# most: a larger one is not guarded (its contents could be baked into the graph unseen)
MAX_GUARDED_ITEMS = 256


def constant_globals(functions: list[types.FunctionType]) -> list[tuple[str, str, Any, str]]:
    """(module, name, value, kind) of each module global that the code of ``functions``
    names and that the trace may bake in, so that it is guarded:

    - ``"value"``: a Python constant (a number, a bool, a string, None), or a list, tuple,
      dict or set of such values (nested): ``constant_copy`` of it;
    - ``"attributes"``: a plain object (a ``SimpleNamespace``, a config class instance):
      ``{attribute: copy}`` of its attributes holding such values (the others, tensors and
      objects, are not guarded);
    - ``"identity"``: a function or a class (a helper the step calls, replaced later: its
      ops were traced into the graph).

    A name that is only an attribute elsewhere may be included."""
    found: dict[tuple[str, str], tuple[Any, str]] = {}
    for fn in functions:
        g = fn.__globals__
        module = g.get("__name__")
        if (
            not isinstance(module, str)
            or getattr(sys.modules.get(module), "__dict__", None) is not g
        ):
            continue  # not a module's namespace: cannot be fetched again
        for name in _names(fn.__code__):
            value = g.get(name, _EMPTY)
            if isinstance(value, types.FunctionType | type):
                found[(module, name)] = (value, "identity")
            elif _plain_object(value):
                budget = [MAX_GUARDED_ITEMS]
                copies = {k: _constant_copy(v, budget) for k, v in vars(value).items()}
                kept = {k: v for k, v in copies.items() if v is not _EMPTY}
                if kept:
                    found[(module, name)] = (kept, "attributes")
            elif value is not _EMPTY:
                copied = constant_copy(value)
                if copied is not _EMPTY:
                    found[(module, name)] = (copied, "value")
    return [(module, name, value, kind) for (module, name), (value, kind) in found.items()]


def constant_copy(value: Any) -> Any:
    """``value`` copied if it is a constant or a container of constants (at most
    ``MAX_GUARDED_ITEMS`` elements), else ``NOT_CONSTANT``."""
    return _constant_copy(value, [MAX_GUARDED_ITEMS])


def _constant_copy(value: Any, budget: list[int]) -> Any:
    """A copy of ``value`` if it is a constant or a container of constants (nested) within
    ``budget`` elements in all, else ``_EMPTY``."""
    budget[0] -= 1
    if budget[0] < 0:
        return _EMPTY
    if type(value) in CONSTANT_TYPES:
        return value
    if type(value) in (list, tuple, set, frozenset):
        items = [_constant_copy(v, budget) for v in value]
        return _EMPTY if any(v is _EMPTY for v in items) else type(value)(items)
    if type(value) is dict:
        pairs = [(_constant_copy(k, budget), _constant_copy(v, budget)) for k, v in value.items()]
        if any(k is _EMPTY or v is _EMPTY for k, v in pairs):
            return _EMPTY
        return dict(pairs)
    return _EMPTY


def _plain_object(value: Any) -> bool:
    """An instance of a user class or a ``SimpleNamespace``, with an instance dict (not a
    module, function, class, tensor, optimizer or module of torch)."""
    if isinstance(value, types.ModuleType | types.FunctionType | type | torch.Tensor):
        return False
    if isinstance(value, torch.optim.Optimizer | torch.nn.Module):
        return False
    return type(vars(value) if hasattr(value, "__dict__") else None) is dict


def _names(code: types.CodeType) -> set[str]:
    """Global (and attribute) names ``code`` and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


@dataclass
class Snapshot:
    """What user functions could store to, as it was before the trace."""

    globals_: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    cells: list[tuple[str, types.CellType, Any]] = field(default_factory=list)
    contents: list[tuple[str, Any, Any]] = field(default_factory=list)
    # Python's and numpy's global random generators: a draw while tracing would be baked
    # into the graph, the same number on every later call.
    random_states: list[tuple[_Generator, Any]] = field(default_factory=list)
    # Globals the functions' code stores to or deletes (other changes are other threads').
    stored_globals: set[str] = field(default_factory=set)
    draws: RandomDraws = field(default_factory=RandomDraws)


_EMPTY = object()
_EMPTY_MODULE = types.ModuleType("_none")


@dataclass(frozen=True)
class _Generator:
    """A global random generator a step could draw from, and how to save and compare it."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], Any]
    same: Callable[[Any, Any], bool]


def _generators() -> list[_Generator]:
    found = [_Generator("Python's random module", random.getstate, random.setstate, operator.eq)]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        found.append(
            _Generator(
                "numpy.random", numpy_random.get_state, numpy_random.set_state, _same_numpy_state
            )
        )
    return found


def snapshot(functions: list[types.FunctionType], draws: RandomDraws | None = None) -> Snapshot:
    snap = Snapshot(draws=draws or RandomDraws())
    snap.stored_globals = {name for fn in functions for name in _stored_globals(fn.__code__)}
    snap.random_states = [(generator, generator.get()) for generator in _generators()]
    seen_globals: set[int] = set()
    for fn in functions:
        g = fn.__globals__
        if id(g) not in seen_globals:
            seen_globals.add(id(g))
            snap.globals_.append((g, dict(g)))
            module = g.get("__name__", "?")
            for name, value in g.items():
                if type(value) in _CONTAINERS:
                    snap.contents.append((f"global {name!r} of {module}", value, _copy(value)))
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            value = _cell_value(cell)
            where = f"closure variable {name!r} of {fn.__qualname__}"
            snap.cells.append((where, cell, value))
            if type(value) in _CONTAINERS:
                snap.contents.append((where, value, _copy(value)))
    return snap


def check_and_restore(snap: Snapshot) -> None:
    """Raise TraceError naming the first store the replay could not repeat; undo them all."""
    changed: list[str] = []
    alone = threading.active_count() == 1
    for g, before in snap.globals_:
        module = before.get("__name__", "?")
        for name in set(g) | set(before):
            old, new = before.get(name, _EMPTY), g.get(name, _EMPTY)
            if old is not new and (alone or name in snap.stored_globals):
                changed.append(f"stores to global {name!r} of {module}")
                if old is _EMPTY:
                    del g[name]
                else:
                    g[name] = old
    for where, cell, old in snap.cells:
        if _cell_value(cell) is not old:
            changed.append(f"stores to {where}")
            cell.cell_contents = old
    for where, container, old in snap.contents:
        if _changed(container, old):
            changed.append(f"mutates the {type(container).__name__} in {where}")
            _restore(container, old)
    drew = list(dict.fromkeys(snap.draws.seen))  # refused before drawing: nothing to undo
    for generator, old in snap.random_states:
        if generator.name in drew or not alone:
            continue
        if not generator.same(generator.get(), old):
            drew.append(generator.name)
            generator.set(old)  # an eager fallback then draws what eager would have
    if drew and not changed:
        raise random_draw_refused(" and ".join(drew))
    changed.extend(f"draws random numbers from {name}" for name in drew)
    if changed:
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        raise TraceError(
            f"the step {'; '.join(changed[:3])}{more}: a compiled step cannot repeat that on "
            "later calls (it sees only its inputs); keep such state on the optimizer or in "
            "its state, or pass it as an argument"
        )


def random_draw_refused(generator: str) -> TraceError:
    """The refusal of a draw from a global random generator while tracing."""
    return TraceError(
        f"the step draws random numbers from {generator}: a compiled step would repeat the "
        "numbers drawn while tracing on every call; draw them with torch (torch.rand, "
        "torch.randn), which the graph runs each call, or let the step run eagerly"
    )


def _stored_globals(code: types.CodeType) -> set[str]:
    """Names ``code`` (and the code nested in it) stores to or deletes as globals."""
    names = {
        str(i.argval)
        for i in dis.get_instructions(code)
        if i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_globals(const)
    return names


def _same_numpy_state(a: Any, b: Any) -> bool:
    """numpy's legacy state tuples: ``(name, keys array, pos, has_gauss, cached)``."""
    return bool(a[0] == b[0] and (a[1] == b[1]).all() and tuple(a[2:]) == tuple(b[2:]))


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return list(value.items())
    return list(value)


def _changed(container: Any, old: list[Any]) -> bool:
    now = list(container.items()) if isinstance(container, dict) else list(container)
    if isinstance(container, set):
        return len(now) != len(old) or any(a is not b for a, b in zip(now, old, strict=False))
    return len(now) != len(old) or any(_differs(a, b) for a, b in zip(now, old, strict=True))


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2:
        return a[0] is not b[0] or a[1] is not b[1]
    return a is not b


def _restore(container: Any, old: list[Any]) -> None:
    if isinstance(container, dict):
        container.clear()
        container.update(old)
    elif isinstance(container, list):
        container[:] = old
    else:
        container.clear()
        container.update(old)


def restore_quietly(snap: Snapshot) -> None:
    """Undo what changed without raising (the trace failed for another reason)."""
    with contextlib.suppress(TraceError):
        check_and_restore(snap)


NOT_CONSTANT = _EMPTY  # (what constant_copy returns for anything else)
