"""The C++ checks of ``_native.cpp``: built ahead of time, loaded if present.

A hit of the fast tier (fast.py) still tests, per call, the metadata of every parameter and
gradient it guards, the fast gather (gather.py) reads every ``param.grad``, and a backend
that baked addresses in (optkernels) compares every input's ``data_ptr()``: ~100 ns per
tensor through dynamo's guard tree, torch or Python, tens of µs for 200 parameters.
``_native.cpp`` does each list in one C++ loop (a few ns per tensor).

The module is compiled against the installed torch ahead of time, never while a step runs:
``python -m optguard build`` (~15 s, once per torch, Python and source version; a
C++ compiler and ninja are needed). It lands in ``library_path()`` (under
``OPTCOMPILE_CACHE_DIR``, else ``TORCH_EXTENSIONS_DIR``, else torch's default extension
root). A process that finds it there loads it (``importlib``, no lock, a few ms); one that
does not runs the same checks in Python (the guard tree, ``attrgetter``, torch's compare):
results never depend on it, only speed, and ``status()`` (shown by ``explain()``) says
which path runs and why.

No build waits on a lock or can hang: each build runs torch's ``cpp_extension`` in a child
process with a timeout, in a fresh temporary directory of its own (so torch's build lock is
never shared), and moves the result into place with one atomic rename; two processes that
build at once both succeed, and the last rename wins with an identical file.

``OPTCOMPILE_NATIVE``: ``0`` never loads it; ``sync`` builds it in the foreground when it is
missing (tests, benchmarks, the GPU machine), then loads it; unset: loads it if built.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from optguard import _torch_compat as compat

SOURCE = Path(__file__).with_name("_native.cpp")
# Name of the built module: one per torch and Python version (ABI) and source text.
_NAME = "optguard_native_" + re.sub(
    r"\W",
    "_",
    f"{torch.__version__}_py{sys.version_info[0]}{sys.version_info[1]}_"
    + hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10],
)
# A build takes ~15 s (a minute on a loaded 2-core machine); past this it is abandoned.
BUILD_TIMEOUT_S = 600.0
BUILD_COMMAND = "python -m optguard build"

_lock = threading.Lock()
_module: Any = None
_status = "not loaded yet"
_tried = False
_callbacks: list[Callable[[Any], None]] = []


def module() -> Any:
    """The loaded C++ module, or None (not loaded yet, not built, off or failed)."""
    return _module


def status() -> str:
    """``"loaded (<path>)"``, ``"not loaded yet"``, ``"not built (...)"``, ``"off (...)"`` or
    ``"failed: ..."``: which checks run, and why."""
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
    """Load the module (once per process) and return it, or None.

    ``wait`` (default: ``OPTCOMPILE_NATIVE=sync``): build it first, in the foreground, when
    it is missing. Without it a missing module is never built here."""
    global _tried, _status
    mode = os.environ.get("OPTCOMPILE_NATIVE", "")
    if mode == "0":
        _status = "off (OPTCOMPILE_NATIVE=0): the checks run in Python"
        return None
    if wait is None:
        wait = mode == "sync"
    with _lock:
        if _module is not None or (_tried and not wait):
            return _module
        _tried = True
        path = library_path()
        if not path.exists():
            if not wait:
                _status = (
                    f"not built for torch {torch.__version__} (run `{BUILD_COMMAND}` once, "
                    "~15 s): the checks run in Python"
                )
                return None
            try:
                build()
            except Exception as exc:  # no compiler, no ninja, a header change, a timeout
                _status = f"failed: {_short(exc)}: the checks run in Python"
                return None
        try:
            loaded = _load(path)
        except Exception as exc:
            _status = f"failed: {_short(exc)}: the checks run in Python"
            return None
        _set_module(loaded, path)
        callbacks = _callbacks.copy()
        _callbacks.clear()
    for callback in callbacks:
        callback(loaded)
    return loaded


def _set_module(loaded: Any, path: Path) -> None:
    global _module, _status
    _module = loaded
    _status = f"loaded ({path})"


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def cache_directory() -> Path:
    """Where built modules are kept (see the module docstring)."""
    root = os.environ.get("OPTCOMPILE_CACHE_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root or compat.extension_root()) / "optguard"


def library_path() -> Path:
    """The built module for this torch, Python and source (present or not)."""
    return cache_directory() / f"{_NAME}.so"


def build(timeout: float = BUILD_TIMEOUT_S) -> Path:
    """Compile the module into ``library_path()`` and return that path (see the module
    docstring: a child process, a private build directory, an atomic rename)."""
    target = library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=target.parent) as tmp:
        script = (
            "import sys\n"
            "from torch.utils import cpp_extension\n"
            "m = cpp_extension.load(name=sys.argv[1], sources=[sys.argv[2]], "
            "build_directory=sys.argv[3], extra_cflags=['-O2'], extra_ldflags=['-ldl'], "
            "verbose=False)\n"  # (dlopen: in libc since glibc 2.34, in libdl before)
            "print(m.__file__)\n"
        )
        argv = [sys.executable, "-c", script, _NAME, str(SOURCE), tmp]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        built = Path(tmp) / f"{_NAME}.so"
        if done.returncode != 0 or not built.exists():
            output = f"{done.stdout}\n{done.stderr}".splitlines()
            errors = [line.strip() for line in output if "error:" in line]  # the compiler's
            detail = "; ".join(errors[:3]) or "\n".join(output[-3:])
            raise RuntimeError(f"building {SOURCE.name} failed: {detail}")
        os.replace(built, target)  # atomic: a loader sees the old file or the new one
    return target


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    loaded.plain(compat.plain_grad_types())
    names = (
        "spec",
        "match",
        "match_both",
        "take",
        "take_locals",
        "grads",
        "clear_grads",
        "count_grads",
        "held",
        "held_match",
    )
    for name in (*names, "addresses", "addresses_equal", "addresses_record", "h2d"):
        getattr(loaded, name)
    return loaded


def held_ptrs(tensors: list[Any], ptrs: Sequence[int | None]) -> Callable[[Any], bool]:
    """A check (of any one argument, ignored) that ``tensors[i]`` still has the data pointer
    ``ptrs[i]`` (None: any) and the metadata it has now, as TensorMatchGuard compares it
    (type, dtype, device, layout, shape, stride, requires_grad: an in-place ``t_()``,
    ``as_strided_()``, ``requires_grad_()`` or ``.data =`` keeps the object and may keep
    the address): one C++ loop over the tensors themselves (held by the check) once the
    module is loaded, else a Python one."""
    if _module is not None:
        return functools.partial(_module.held_match, _module.held(tensors, list(ptrs)))
    expected = [(t, ptr, _held_meta(t)) for t, ptr in zip(tensors, ptrs, strict=True)]

    def held_match(_: Any) -> bool:
        return all(
            (ptr is None or t.data_ptr() == ptr) and _held_meta(t) == meta
            for t, ptr, meta in expected
        )

    return held_match


def _held_meta(t: Any) -> tuple[Any, ...]:
    return (type(t), t.dtype, t.device, t.layout, t.shape, t.stride(), t.requires_grad)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m optguard build [--force] | status | path`` (optguard/__main__.py)."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "status"
    if command == "build":
        path = library_path()
        if path.exists() and "--force" not in args:
            print(f"already built: {path}")
            return 0
        print(f"building {SOURCE.name} against torch {torch.__version__} (~15 s) ...")
        try:
            print(f"built: {build()}")
        except Exception as exc:
            print(f"failed: {_short(exc)}; the checks will run in Python", file=sys.stderr)
            return 1
        return 0
    if command == "path":
        print(library_path())
        return 0
    if command == "status":
        start(wait=False)
        print(status())
        return 0
    print("usage: python -m optguard build [--force] | status | path", file=sys.stderr)
    return 2
