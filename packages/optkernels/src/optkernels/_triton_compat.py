"""The private Triton APIs optkernels uses, in one place (a Triton upgrade is one edit here).

Triton's JIT keys its disk cache by a hash of Triton's own source files (``triton_key``),
computed once per process: about 0.4 s in a fresh process before any cached binary is
found. So each generated kernel keeps a small record next to its source: for each JIT
specialization it was launched with, Triton's cache entry (the hash and the files). A later
process builds the compiled kernel from those files and puts it straight into the JIT's
in-memory cache: Triton neither compiles nor hashes itself. Anything unexpected (another
Triton version or target, files gone, a JIT that looks different) falls back to Triton's
own path, which is always correct, only slower.
"""

from __future__ import annotations

import json
import os
from typing import Any

# What a Triton version whose JIT internals differ from the ones used below raises here.
_MISMATCH = (AttributeError, KeyError, TypeError, ValueError, IndexError)


class Kernel:
    """A generated ``@triton.jit`` function, launched as ``kernel[grid](*args, **kwargs)``;
    its first launch in a process goes through the record (see the module docstring)."""

    def __init__(self, fn: Any, record: str) -> None:
        self.fn = fn
        self.record = record
        self.seeded: bool | None = None  # True: built from the record; False: Triton compiled
        self._ready = not hasattr(fn, "device_caches")  # the interpreter has no JIT cache

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        if self._ready:
            return self.fn[grid]
        return lambda *args, **kwargs: self._first(grid, args, kwargs)

    def _first(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            key = _jit_key(self.fn, args, kwargs)
        except _MISMATCH:
            key = None
        if key is not None:
            self.seeded = _seed(self.fn, self.record, key, args, kwargs)
        self.fn[grid](*args, **kwargs)
        if key is not None and not self.seeded:
            _remember(self.fn, self.record, key)
        self._ready = True


def _jit_key(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """(device, JIT cache key, target) for this launch, as ``JITFunction.run`` computes it."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    device = driver.active.get_current_device()
    _, key_cache, target, _, binder = fn.device_caches[device]
    kw = _run_kwargs(fn, kwargs, knobs)
    _, specialization, options = binder(*args, **kw)
    return device, compute_cache_key(key_cache, specialization, options), target


def _run_kwargs(fn: Any, kwargs: dict[str, Any], knobs: Any) -> dict[str, Any]:
    kw = dict(kwargs)  # what JITFunction.run adds before binding
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    return kw


def _entry_name(key: tuple[Any, ...]) -> str:
    import triton

    _, jit_key, target = key
    return f"{triton.__version__}|{target}|{jit_key}"


def _seed(
    fn: Any, record: str, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Put the recorded compiled kernel into the JIT's cache; whether it was there to put."""
    from triton import knobs

    device, jit_key, _ = key
    kernel_cache, _, _, backend, binder = fn.device_caches[device]
    if jit_key in kernel_cache:
        return True
    entry = _read(record).get(_entry_name(key))
    if entry is None or not all(os.path.exists(p) for p in entry["group"].values()):
        return False
    try:
        kw = _run_kwargs(fn, kwargs, knobs)
        bound, specialization, options = binder(*args, **kw)
        _, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
        src = fn.ASTSource(fn, signature, constexprs, attrs)
        kernel_cache[jit_key] = fn.CompiledKernel(src, entry["group"], entry["hash"])
    except (*_MISMATCH, OSError):
        return False
    return True


def _remember(fn: Any, record: str, key: tuple[Any, ...]) -> None:
    """Record the cache entry Triton made for this launch (if it made one)."""
    device, jit_key, _ = key
    kernel = fn.device_caches[device][0].get(jit_key)
    group = getattr(kernel, "metadata_group", None)
    if not group or not isinstance(getattr(kernel, "hash", None), str):
        return
    entries = _read(record)
    entries[_entry_name(key)] = {"hash": kernel.hash, "group": dict(group)}
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
