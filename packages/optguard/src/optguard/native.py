"""The C++ checks of ``_native.cpp``, built on first use (in the background) and cached.

A hit of the fast tier (fast.py) still tests, per call, the metadata of every parameter and
gradient it guards, the fast gather (gather.py) reads every ``param.grad``, and a backend
that baked addresses in (optkernels) compares every input's ``data_ptr()``: ~100 ns per
tensor through dynamo's guard tree, torch or Python, tens of µs for 200 parameters.
``_native.cpp`` does each list in one C++ loop (a few ns per tensor). It is compiled
against the installed torch with ``torch.utils.cpp_extension.load`` (a C++ compiler and
ninja are needed; ~15 s, once per torch and Python version: the build is cached under
``TORCH_EXTENSIONS_DIR``), in a daemon thread started by the first fast tier, so no call
waits for it. No build ever waits on a lock: one process claims the build (``claim``);
others meanwhile run the Python checks, and a claim left by a process that died is
removed when stale. Until it is loaded, or when it cannot be built, the same checks run as
before (the guard tree, ``attrgetter``, torch's compare): results never depend on it,
only speed.

``OPTCOMPILE_NATIVE``: ``0`` never builds it; ``sync`` builds it in the calling thread (tests,
benchmarks); unset: in the background.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from optguard import _torch_compat as compat
from optguard.guards import DataPtrGuard

SOURCE = Path(__file__).with_name("_native.cpp")
# Name of the built module: one build per torch and Python version (ABI), and source.
_NAME = "optguard_native_" + re.sub(
    r"\W", "_", f"{torch.__version__}_py{sys.version_info[0]}{sys.version_info[1]}"
)

_lock = threading.Lock()
_module: Any = None
_status = "not built yet"
_thread: threading.Thread | None = None
_callbacks: list[Callable[[Any], None]] = []


def module() -> Any:
    """The loaded C++ module, or None (not built yet, building, off or failed)."""
    return _module


def status() -> str:
    """``"loaded"``, ``"building"``, ``"not built yet"``, ``"off (...)"`` or ``"failed: ..."``."""
    return _status


def when_loaded(callback: Callable[[Any], None]) -> None:
    """Call ``callback(module)`` once the module is loaded (now, if it is): how a layer that
    does not depend on optguard (optkernels' address checks) is handed its functions."""
    with _lock:
        if _module is None:
            _callbacks.append(callback)
            return
    callback(_module)


def start(wait: bool | None = None) -> Any:
    """Build and load the module unless that was done or tried; return it (or None).

    ``wait``: block until it is loaded (default: only when ``OPTCOMPILE_NATIVE=sync``)."""
    global _thread, _status
    mode = os.environ.get("OPTCOMPILE_NATIVE", "")
    if mode == "0":
        _status = "off (OPTCOMPILE_NATIVE=0)"
        return None
    if wait is None:
        wait = mode == "sync"
    with _lock:
        if _thread is None and _module is None and not _status.startswith("failed"):
            _status = "building"
            _thread = threading.Thread(target=_build, name="optguard-native-build", daemon=True)
            _thread.start()
        thread = _thread
    if wait and thread is not None:
        thread.join()
    return _module


def held_ptrs(tensors: list[Any], guards: Sequence[DataPtrGuard]) -> Callable[[Any], bool]:
    """A check (of any one argument, ignored) that ``tensors[i]`` still has the data pointer
    ``guards[i]`` expects, and the dtype, shape and stride it has now (an in-place ``t_()``,
    ``as_strided_()`` or ``.data =`` keeps the object and may keep the address): one C++
    loop over the tensors themselves (held by the check) once the module is loaded, else a
    Python one."""
    ptrs = [g.ptr for g in guards]
    if _module is not None:
        return functools.partial(_module.held_match, _module.held(tensors, ptrs))
    expected = [
        (t, (ptr, t.dtype, t.shape, t.stride())) for t, ptr in zip(tensors, ptrs, strict=True)
    ]

    def held_match(_: Any) -> bool:
        return all((t.data_ptr(), t.dtype, t.shape, t.stride()) == e for t, e in expected)

    return held_match


# A build takes ~15 s (a minute on a loaded 2-core machine); a claim older than this was
# left by a process that died while building.
STALE_AFTER_S = 300.0


def build_directory() -> Path:
    """Where the module is built and cached (one per torch and Python version)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / _NAME


def claim(directory: Path, stale_after: float = STALE_AFTER_S) -> str | None:
    """Claim the build in ``directory`` for this process; None if claimed, else why not.

    Never waits: torch's own build lock (``lock``, waited on with no timeout by
    ``cpp_extension.load``) is only ever taken by the holder of our claim
    (``optcompile.claim``, created atomically), and a claim or lock left by a process that
    died is removed once ``stale_after`` seconds old. Another process building now means
    this one runs the Python checks."""
    directory.mkdir(parents=True, exist_ok=True)
    ours = directory / "optcompile.claim"
    for _ in range(2):
        try:
            fd = os.open(ours, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                age = time.time() - ours.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile: try again
            if age < stale_after:
                return f"another process is building it ({ours}, {age:.0f} s old)"
            ours.unlink(missing_ok=True)  # its builder died
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        (directory / "lock").unlink(missing_ok=True)  # torch's, left by a dead builder
        return None
    return f"could not claim {ours}"


def _build() -> None:
    global _module, _status
    try:
        from torch.utils import cpp_extension

        directory = build_directory()
        busy = claim(directory)
        if busy is not None:
            _status = f"off ({busy}; this process runs the same checks in Python)"
            return
        try:
            built = cpp_extension.load(
                name=_NAME,
                sources=[str(SOURCE)],
                extra_cflags=["-O2"],
                build_directory=str(directory),
                verbose=False,
            )
        finally:
            (directory / "optcompile.claim").unlink(missing_ok=True)
        built.plain(compat.plain_grad_types())
        names = ("spec", "match", "match_both", "take", "grads", "held", "held_match")
        for name in (*names, "addresses", "addresses_equal", "addresses_record"):
            getattr(built, name)
    except Exception as exc:  # no compiler, no ninja, a header change: stay on Python
        _status = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}"
        return
    with _lock:
        _module = built
        _status = "loaded"
        callbacks = _callbacks.copy()
        _callbacks.clear()
    for callback in callbacks:
        callback(built)
