"""The private Triton APIs optkernels uses, in one place (a Triton upgrade is one edit here).

Triton's JIT keys its disk cache by a hash of Triton's own source files (``triton_key``),
computed once per process: about 0.4 s in a fresh process before any cached binary is
found. So each generated kernel keeps a small record next to its source: for each JIT
specialization it was launched with, Triton's cache entry (the hash and the files). A later
process builds the compiled kernel from those files and puts it straight into the JIT's
in-memory cache: Triton neither compiles nor hashes itself. Anything unexpected (another
Triton version or target, files gone, a JIT that looks different) falls back to Triton's
own path, which is always correct, only slower.

A process whose kernels are not recorded yet (a cold cache) still pays for the hash before
its first compile: most of it reading and hashing ``libtriton`` (hundreds of MB), which
runs without the GIL. ``prefetch_triton_key`` starts it in a background thread when the
backend is made (``compile()``), so the trace and lowering of the first call, and whatever
the caller does before its first step, overlap it; the first compile waits for it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("optcompile.kernels")

# What a Triton version whose JIT internals differ from the ones used below raises here.
_MISMATCH = (AttributeError, KeyError, TypeError, ValueError, IndexError)


class Kernel:
    """A generated ``@triton.jit`` function, launched as ``kernel[grid](*args, **kwargs)``;
    its first launch in a process goes through the record (see the module docstring)."""

    def __init__(self, fn: Any, record: str) -> None:
        self.fn = fn
        self.record = record
        self._ready = not hasattr(fn, "device_caches")  # the interpreter has no JIT cache

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        if self._ready:
            return self.fn[grid]
        return lambda *args, **kwargs: self._first(grid, args, kwargs)

    def _first(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        _await_runtime()  # (binding uses Triton's driver: built there, or being built)
        try:
            launch = _bind(self.fn, args, kwargs)
        except _MISMATCH:
            launch = None
        if launch is not None and _runtime_threads:
            _check_prefetched(self.fn, launch)
        seeded = launch is not None and _seed(self.fn, self.record, launch)
        if not seeded:
            _await_triton_key()  # (Triton compiles: its key is computed, or being computed)
        self.fn[grid](*args, **kwargs)
        if launch is not None and not seeded:
            _remember(self.fn, self.record, launch)
        self._ready = True


@dataclass(frozen=True)
class _Launch:
    """One launch bound as ``JITFunction.run`` binds it: its device, JIT cache key and
    target, and what building the compiled kernel's source needs."""

    device: int
    jit_key: Any
    target: Any
    kwargs: dict[str, Any]
    bound: Any
    specialization: Any
    options: Any

    @property
    def entry_name(self) -> str:
        import triton

        return f"{triton.__version__}|{self.target}|{self.jit_key}"


def _bind(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Launch:
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import compute_cache_key

    device = driver.active.get_current_device()
    _, key_cache, target, _, binder = fn.device_caches[device]
    kw = dict(kwargs)  # what JITFunction.run adds before binding
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kw)
    jit_key = compute_cache_key(key_cache, specialization, options)
    return _Launch(device, jit_key, target, kw, bound, specialization, options)


def _seed(fn: Any, record: str, launch: _Launch) -> bool:
    """Put the recorded compiled kernel into the JIT's cache; whether it was there to put."""
    kernel_cache, _, _, backend, _ = fn.device_caches[launch.device]
    if launch.jit_key in kernel_cache:
        return True
    entry = _read(record).get(launch.entry_name)
    if entry is None or not all(os.path.exists(p) for p in entry["group"].values()):
        return False
    try:
        _, signature, constexprs, attrs = fn._pack_args(
            backend, launch.kwargs, launch.bound, launch.specialization, launch.options
        )
        src = fn.ASTSource(fn, signature, constexprs, attrs)
        kernel_cache[launch.jit_key] = fn.CompiledKernel(src, entry["group"], entry["hash"])
    except (*_MISMATCH, OSError):
        return False
    return True


def _remember(fn: Any, record: str, launch: _Launch) -> None:
    """Record the cache entry Triton made for this launch (if it made one)."""
    kernel = fn.device_caches[launch.device][0].get(launch.jit_key)
    group = getattr(kernel, "metadata_group", None)
    if not group or not isinstance(getattr(kernel, "hash", None), str):
        return
    entries = _read(record)
    entries[launch.entry_name] = {"hash": kernel.hash, "group": dict(group)}
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


_key_thread: threading.Thread | None = None


def prefetch_triton_key() -> None:
    """Compute Triton's self-hash (``triton_key``, cached by Triton for the process) in a
    background thread; see the module docstring. Once per process; never under the
    interpreter (it compiles nothing)."""
    global _key_thread
    if _key_thread is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return
    key = _triton_key_function()
    if key is None:
        return
    _key_thread = threading.Thread(
        target=_quietly, args=(key,), name="optkernels-triton-key", daemon=True
    )
    _key_thread.start()


def _triton_key_function() -> Callable[[], Any] | None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return None
    return triton_key  # type: ignore[no-any-return]


def _quietly(fn: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):  # the first compile computes it again, and says why
        fn()


def _await_triton_key() -> None:
    if _key_thread is not None:
        _key_thread.join()


_runtime_threads: list[threading.Thread] = []
_prefetched: set[tuple[str, ...]] = set()


def prefetch_runtime(signatures: Sequence[tuple[str, ...]]) -> None:
    """Build Triton's CUDA driver utilities and the launchers of kernels whose arguments have
    the types ``signatures`` (as ``launch_signature`` gives them), and import its compiler,
    in background threads; see the module docstring. Once per process; never under the
    interpreter."""
    if _runtime_threads or os.environ.get("TRITON_INTERPRET") == "1":
        return
    _prefetched.update(signatures)
    launchers = [functools.partial(_build_launcher, s) for s in signatures]
    jobs = [_build_driver, *launchers, _import_compiler]
    for i, job in enumerate(jobs):
        name = f"optkernels-triton-runtime-{i}"
        thread = threading.Thread(target=_quietly, args=(job,), name=name, daemon=True)
        thread.start()
        _runtime_threads.append(thread)


def _build_driver() -> None:
    from triton.runtime.driver import driver

    driver.active  # noqa: B018 (its first use builds the driver's C utilities)


def _import_compiler() -> None:
    """The modules the first compile imports (Triton's code generator, ~0.06 s): here while
    the main thread traces, which the first launch then waits for anyway."""
    import triton.compiler.code_generator  # noqa: F401


def _build_launcher(signature: tuple[str, ...]) -> None:
    """What Triton 3.6's ``CudaLauncher`` builds for a kernel of ``signature`` (its module
    is cached by its source, which only the argument types shape). Later versions launch
    every kernel through one module of the driver's: nothing to build."""
    from triton.backends.nvidia import driver as cuda

    make_launcher = getattr(cuda, "make_launcher", None)
    if make_launcher is None:
        return
    cuda.compile_module_from_src(
        src=make_launcher({}, dict(enumerate(signature)), None),
        name="__triton_launcher",
        library_dirs=cuda.library_dirs(),
        include_dirs=cuda.include_dirs,
        libraries=cuda.libraries,
    )


def _await_runtime() -> None:
    for thread in _runtime_threads:
        thread.join()


def launch_signature(fn: Any, args: Sequence[Any]) -> tuple[str, ...]:
    """The argument types Triton's JIT gives a launch of ``fn`` with the positional ``args``
    (its other parameters being constexprs given by keyword): what a launcher is built for."""
    from triton.runtime.jit import mangle_type

    rest = fn.arg_names[len(args) :]
    return (*(mangle_type(a, True) for a in args), *("constexpr" for _ in rest))


def _check_prefetched(fn: Any, launch: _Launch) -> None:
    """Say so when a first launch's signature was not among those prefetched (Triton 3.6
    then builds its launcher in the foreground)."""
    try:
        signature = tuple(kind for kind, _ in launch.specialization)
    except _MISMATCH:
        return
    if signature not in _prefetched:
        log.info("%s: no launcher prefetched for its signature %s", fn.__name__, signature)
