"""Emit straight-line Python that fetches many sources, sharing common prefixes.

Guard checks, input gathering and side-effect replay all fetch values by Source; this module
turns a set of sources into readable statements (one local per distinct source, named after
it) so the generated functions evaluate each access path once.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import importlib.util
import keyword
import linecache
import marshal
import math
import os
import sys
import tempfile
import types
from collections.abc import Callable, Iterable
from typing import Any

from optguard.sources import Locals, Source, variable_name

# Generated locals must not shadow builtins the code calls (type, len, tuple) or be
# keywords: an argument named ``type`` would otherwise break every check.
_RESERVED = frozenset({"L", "sys", *dir(builtins), *keyword.kwlist})


class SourceCode:
    """Accumulates the statements that bind sources to local variables, in dependency order."""

    def __init__(self, indent: str = "    ") -> None:
        self.indent = indent
        self.lines: list[str] = []
        self.names: dict[Source, str] = {}
        self.constants: dict[str, Any] = {}
        self._taken: set[str] = set(_RESERVED)
        self._constant_names: dict[Any, str] = {}
        self._next_suffix: dict[str, int] = {}
        # Lists the generated code fills with many sources' values, in order (rows.py).
        self.lists: dict[tuple[Source, ...], str] = {}

    def var(self, source: Source) -> str:
        """The local variable holding ``source``'s value, emitting its fetch if needed."""
        known = self.names.get(source)
        if known is not None:
            return known
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

    def inline(self, value: Any, hint: str = "value") -> str:
        """Source text for a value written out (a shape, a position): its repr here; a
        row template (rows.py) makes it a slot that may differ between rows."""
        return repr(value)

    def tuple_of(self, sources: Iterable[Source]) -> str:
        """An expression for the sequence of ``sources``' values."""
        sources = tuple(sources)
        filled = self.lists.get(sources)
        if filled is not None:
            return filled
        return f"({', '.join(self.var(s) for s in sources)},)"

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
    """Compile ``def name(signature):`` over indented ``lines``; return the function and source.

    The source is registered in ``linecache`` under its own file name, so a traceback
    through generated code shows the generated line."""
    code = "\n".join([f"def {name}({signature}):", *lines]) + "\n"
    namespace: dict[str, Any] = {"sys": sys, **constants}  # GlobalSource fetches use sys
    filename = register_source(f"optguard:{name}", code)
    exec(code_object(code, filename), namespace)
    fn: Callable[..., Any] = namespace[name]
    return fn, code


def register_source(kind: str, code: str) -> str:
    """A file name for generated ``code`` (``<kind:hash>``), its text put in ``linecache``."""
    filename = f"<{kind}:{hashlib.sha256(code.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    return filename


# Compiled generated code, by hash of its text and file name. A guard check over a large
# model is a long function: compiling it is most of the guard-building time (70 ms for
# GPT-2's 148 parameters), so compiled code is kept in this process and on disk.
_CODE: dict[str, types.CodeType] = {}


def code_object(code: str, filename: str) -> types.CodeType:
    """``compile(code, filename, "exec")``, from the in-process or on-disk cache when the
    same text was compiled before (by this Python version)."""
    key = hashlib.sha256(f"{filename}\0{code}".encode()).hexdigest()
    compiled = _CODE.get(key)
    if compiled is not None:
        return compiled
    path = os.path.join(code_dir(), f"{key[:32]}.{importlib.util.MAGIC_NUMBER.hex()}.bin")
    try:
        with open(path, "rb") as f:
            loaded = marshal.load(f)
        if isinstance(loaded, types.CodeType) and loaded.co_filename == filename:
            compiled = loaded
    except (OSError, EOFError, ValueError, TypeError):
        pass
    if compiled is None:
        compiled = compile(code, filename, "exec")
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                marshal.dump(compiled, f)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only or full disk: the next process compiles again
    _CODE[key] = compiled
    return compiled


def code_dir() -> str:
    """Where compiled generated code is kept: $OPTGUARD_CACHE_DIR, else a per-user folder
    in the temp dir."""
    configured = os.environ.get("OPTGUARD_CACHE_DIR")
    if configured:
        return configured
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return os.path.join(tempfile.gettempdir(), f"optguard-code-{user}")


def compile_fetch(
    sources: Iterable[Source], name: str = "gather"
) -> tuple[Callable[[Locals], list[Any]], str]:
    """Generate ``name(L) -> [value of each source]`` evaluating shared prefixes once (the
    items of a long list in one loop: rows.py)."""
    from optguard import rows  # (rows builds on this module)

    sources = list(sources)
    body = SourceCode()
    body.emit(f"out = [None] * {len(sources)}")
    statements = [((s,), functools.partial(_emit_item, j, s)) for j, s in enumerate(sources)]
    if rows.emit(body, statements):
        body.emit("return out")
        return build_function(name, "L", body.lines, body.constants)
    body = SourceCode()
    values = [body.var(s) for s in sources]
    body.emit(f"return [{', '.join(values)}]")
    return build_function(name, "L", body.lines, body.constants)


def _emit_item(position: int, source: Source, code: SourceCode) -> None:
    code.emit(f"out[{code.inline(position, 'at')}] = {code.var(source)}")
