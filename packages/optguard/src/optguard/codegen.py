"""Emit straight-line Python that fetches many sources, sharing common prefixes.

Guard checks, input gathering and side-effect replay all fetch values by Source; this module
turns a set of sources into readable statements (one local per distinct source, named after
it) so the generated functions evaluate each access path once.
"""

from __future__ import annotations

import builtins
import keyword
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

from optguard.sources import Locals, Source, variable_name


class SourceCode:
    """Accumulates the statements that bind sources to local variables, in dependency order."""

    def __init__(self, indent: str = "    ") -> None:
        self.indent = indent
        self.lines: list[str] = []
        self.names: dict[Source, str] = {}
        self.constants: dict[str, Any] = {}
        # Generated locals must not shadow builtins the code calls (type, len, tuple) or be
        # keywords: an argument named ``type`` would otherwise break every check.
        self._taken: set[str] = {"L", "sys", *dir(builtins), *keyword.kwlist}
        self._constant_names: dict[Any, str] = {}
        self._next_suffix: dict[str, int] = {}

    def var(self, source: Source) -> str:
        """The local variable holding ``source``'s value, emitting its fetch if needed."""
        if source in self.names:
            return self.names[source]
        parents = tuple(self.var(p) for p in source.parents())
        name = self._fresh(variable_name(source))
        self.lines.append(f"{self.indent}{name} = {source.expr(parents)}")
        self.names[source] = name
        return name

    def constant(self, value: Any, hint: str) -> str:
        """A global name in the generated function's namespace bound to ``value``; equal
        values (two ``torch.device('cpu')`` objects) share one name."""
        try:
            key: Any = (type(value), value)
            hash(key)
        except TypeError:
            key = ("id", id(value))
        name = self._constant_names.get(key)
        if name is None:
            name = self._constant_names[key] = self._fresh(hint)
            self.constants[name] = value
        return name

    def literal(self, value: Any) -> str:
        """Source text for a constant: its repr where that evaluates back to it (not inf/nan
        or arbitrary objects), else a name bound to the value."""
        plain = type(value) in (bool, int, str, type(None))
        if plain or (type(value) is float and math.isfinite(value)):
            return repr(value)
        return self.constant(value, "const")

    def emit(self, line: str) -> None:
        self.lines.append(f"{self.indent}{line}")

    def _fresh(self, base: str) -> str:
        name, n = base, self._next_suffix.get(base, 1)
        if n > 1:
            name = f"{base}_{n}"
        while name in self._taken or name in self.constants:
            n += 1
            name = f"{base}_{n}"
        self._next_suffix[base] = n + 1
        self._taken.add(name)
        return name


def build_function(
    name: str, signature: str, lines: Iterable[str], constants: dict[str, Any]
) -> tuple[Callable[..., Any], str]:
    """Compile ``def name(signature):`` over indented ``lines``; return the function and source."""
    code = "\n".join([f"def {name}({signature}):", *lines]) + "\n"
    namespace: dict[str, Any] = {"sys": sys, **constants}  # GlobalSource fetches use sys
    exec(compile(code, f"<optguard:{name}>", "exec"), namespace)
    fn: Callable[..., Any] = namespace[name]
    return fn, code


def compile_fetch(
    sources: Iterable[Source], name: str = "gather"
) -> tuple[Callable[[Locals], list[Any]], str]:
    """Generate ``name(L) -> [value of each source]`` evaluating shared prefixes once."""
    body = SourceCode()
    values = [body.var(s) for s in sources]
    body.emit(f"return [{', '.join(values)}]")
    return build_function(name, "L", body.lines, body.constants)
