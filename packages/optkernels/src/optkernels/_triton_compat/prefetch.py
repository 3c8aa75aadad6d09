"""Triton's slow first steps, started in background threads while the caller traces:
its self-hash (``prefetch_triton_key``), its CUDA driver utilities, the launchers of the
kernels' signatures and its compiler's import (``prefetch_runtime``); what a first launch
waits for, and the current device and target (read once the driver is made)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from optkernels._triton_compat.version import _MISMATCH

log = logging.getLogger("optcompile.kernels")


def _current_device() -> int:
    from triton.runtime.driver import driver

    if _driver_pending:  # (Triton makes its driver on first use, in no thread-safe way)
        _await_driver()
    return driver.active.get_current_device()  # type: ignore[no-any-return]


def _current_target() -> Any:
    from triton.runtime.driver import driver

    return driver.active.get_current_target()


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
_compiler_threads: list[threading.Thread] = []  # (the one importing Triton's compiler)
_driver_pending = False  # a background thread is making Triton's driver (prefetch_runtime)
_prefetched: set[tuple[str, ...]] = set()


def prefetch_runtime(signatures: Sequence[tuple[str, ...]], compiler: bool = True) -> None:
    """Build (or, on a warm cache, load) Triton's CUDA driver utilities and the launchers of
    kernels whose arguments have the types ``signatures`` (as ``launch_signature`` gives
    them) and, with ``compiler``, import its compiler, in background threads; see the module
    docstring. Once per process; never under the interpreter."""
    global _driver_pending
    if _runtime_threads or os.environ.get("TRITON_INTERPRET") == "1":
        return
    _prefetched.update(signatures)
    launchers = [functools.partial(_build_launcher, s) for s in signatures]
    jobs = [_build_driver, *launchers, *([_import_compiler] if compiler else [])]
    for i, job in enumerate(jobs):
        name = f"optkernels-triton-runtime-{i}"
        thread = threading.Thread(target=_quietly, args=(job,), name=name, daemon=True)
        thread.start()
        _runtime_threads.append(thread)
        if job is _import_compiler:
            _compiler_threads.append(thread)
    _driver_pending = True


def _build_driver() -> None:
    from triton.runtime.driver import driver

    driver.active  # noqa: B018 (its first use builds the driver's C utilities)


def _import_compiler() -> None:
    """The modules the first compile imports (Triton's code generator, ~0.06 s, and the
    gluon language its code generation imports on first use, 0.13 s on an H100 host whose
    Triton has no bytecode for it): here while the main thread traces, which the first
    launch then waits for anyway."""
    import triton.compiler.code_generator

    with contextlib.suppress(ImportError):  # (a Triton without gluon)
        import triton.experimental.gluon.language  # noqa: F401


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


def _await_driver() -> None:
    """Wait for Triton's driver and compiler modules (prefetch_runtime's first and last
    jobs), not for the launchers, which the first launch waits for."""
    global _driver_pending
    for thread in _runtime_threads[:1] + _compiler_threads:
        thread.join()
    _driver_pending = False


def launch_signature(fn: Any, args: Sequence[Any]) -> tuple[str, ...]:
    """The argument types Triton's JIT gives a launch of ``fn`` with the positional ``args``
    (its other parameters being constexprs given by keyword): what a launcher is built for."""
    from triton.runtime.jit import mangle_type

    rest = fn.arg_names[len(args) :]
    return (*(mangle_type(a, True) for a in args), *("constexpr" for _ in rest))


def _check_prefetched(fn: Any, specialization: Any) -> None:
    """Say so when a first launch's signature (from its ``specialization``) was not among
    those prefetched (Triton 3.6 then builds its launcher in the foreground)."""
    if not _runtime_threads:
        return
    try:
        signature = tuple(kind for kind, _ in specialization)
    except _MISMATCH:
        return
    if signature not in _prefetched:
        log.info("%s: no launcher prefetched for its signature %s", fn.__name__, signature)
