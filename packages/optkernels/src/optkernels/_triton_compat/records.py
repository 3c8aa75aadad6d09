"""A generated kernel's record, a JSON file beside its source: per fingerprint, Triton's
cache entry of the compiled kernel (its hash and files) and what its launcher is built from;
and, once, what a launch needs of the function itself (``_Recorded``)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from optkernels._triton_compat.specialize import _agrees, _Launch
from optkernels._triton_compat.version import _MISMATCH, _installation

log = logging.getLogger("optcompile.kernels")

_HEADER = "function"  # the record's entry for what it keeps of the function (_Recorded)


@dataclass(frozen=True)
class _Param:
    name: str
    has_default: bool
    default: Any


class _Recorded:
    """What a warm launch of a recorded kernel needs of its ``@triton.jit`` function, kept
    in its record by the process that compiled it: its name, debug setting and parameters
    (the fingerprint, the constexpr arguments, the compiled kernel's source). Anything else
    is asked of the function itself (``load``), built on first use."""

    def __init__(self, header: dict[str, Any], load: Callable[[], Any]) -> None:
        self._load = load
        self.__name__: str = header["name"]
        self.debug = header["debug"]
        self.arg_names: list[str] = list(header["arg_names"])
        self.params = [_Param(str(n), bool(d), v) for n, d, v in header["params"]]
        # (Triton's launcher asks for it where a launch-enter hook is set: a profiler's;
        # only functions without one are recorded)
        self.launch_metadata = None

    def __getattr__(self, name: str) -> Any:
        if name == "_load":  # (not set yet)
            raise AttributeError(name)
        return getattr(self._load(), name)

    @staticmethod
    def header(fn: Any) -> dict[str, Any] | None:
        """What ``_Recorded`` keeps of ``fn``; None where JSON would not keep it as it is."""
        try:
            if fn.launch_metadata is not None:  # (a callable: JSON would not keep it)
                return None
            header = {
                "name": fn.__name__,
                "debug": fn.debug,
                "arg_names": list(fn.arg_names),
                "params": [
                    [p.name, p.has_default, p.default if p.has_default else None] for p in fn.params
                ],
            }
            kept = json.loads(json.dumps(header)) == header
        except (*_MISMATCH, ValueError):
            return None
        return header if kept else None

    @classmethod
    def of(cls, header: Any, load: Callable[[], Any]) -> _Recorded | None:
        """The function as ``header`` (from a record) keeps it; None where it is no header."""
        try:
            return cls(header, load)
        except (*_MISMATCH, ValueError):
            return None


def _entry(
    fn: Any, backend: Any, launch: _Launch, compiled: Any, key: Any
) -> dict[str, Any] | None:
    """The record of a compiled kernel: Triton's cache entry (hash, files) and the source
    its launcher is built from (signature, constexprs); None where it does not hold
    (another JIT's specialization, values JSON does not keep)."""
    group = getattr(compiled, "metadata_group", None)
    if not group or not isinstance(getattr(compiled, "hash", None), str):
        return None
    if not _agrees(key, launch.specialization):
        return None
    _, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, launch.bound, launch.specialization, launch.options
    )
    return _entry_of(compiled, signature, constexprs, attrs)


def _entry_of(compiled: Any, signature: Any, constexprs: Any, attrs: Any) -> dict[str, Any] | None:
    """A record entry: where the compiled kernel's files are, and what its launcher is
    built from; None where JSON would not keep it as it is."""
    entry = {
        "hash": compiled.hash,
        "group": dict(compiled.metadata_group),
        "signature": dict(signature),
        "constexprs": [[list(path), value] for path, value in constexprs.items()],
        "attrs": [[list(path), value] for path, value in attrs.items()],
    }
    try:
        kept = json.loads(json.dumps(entry)) == entry
    except (TypeError, ValueError):
        return None
    plain = all(isinstance(v, int | float | str | None) for _, v in entry["constexprs"])
    return entry if kept and plain else None


def _load(fn: Any, record: str, name: str) -> Any:
    """The compiled kernel recorded as ``name``, from Triton's cache files; None where
    there is none (or it cannot be read)."""
    from triton.compiler import ASTSource, CompiledKernel

    try:
        entry = _read(record).get(name)
        if entry is None or not all(os.path.exists(p) for p in entry["group"].values()):
            return None
        constexprs = {tuple(path): value for path, value in entry["constexprs"]}
        attrs = {tuple(path): value for path, value in entry["attrs"]}
        src = ASTSource(fn, entry["signature"], constexprs, attrs)
        return CompiledKernel(src, entry["group"], entry["hash"])
    except (*_MISMATCH, OSError, StopIteration) as exc:
        log.debug("%s: recorded kernel not loaded (%r)", fn.__name__, exc)
        return None


def _entry_name(target: Any, key: Any) -> str:
    return f"{_installation()}|{target}|{key!r}"


def _remember(record: str, name: str, entry: dict[str, Any], fn: Any) -> None:
    """Record ``entry`` as ``name``, and what a later process needs of ``fn`` to launch it
    without building ``fn`` (``_Recorded``)."""
    entries = _read(record)
    entries[name] = entry
    header = _Recorded.header(fn)
    if header is not None:
        entries[_HEADER] = header
    tmp = f"{record}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f)
    os.replace(tmp, record)


def _read(record: str) -> dict[str, Any]:
    try:
        with open(record) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}
