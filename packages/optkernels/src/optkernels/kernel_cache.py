"""The on-disk cache of generated kernel sources: each kernel's module written to a file
named by a hash of its text, and imported only when its function is needed."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from typing import Any

from optkernels._triton_compat import Kernel
from optkernels.kernel_prelude import prelude_for


def source_dir() -> str:
    """Where generated kernel sources live: $OPTKERNELS_CACHE_DIR, else a per-user folder
    in the temp dir."""
    configured = os.environ.get("OPTKERNELS_CACHE_DIR")
    if configured:
        return configured
    user = os.getuid() if hasattr(os, "getuid") else os.getlogin()
    return os.path.join(tempfile.gettempdir(), f"optkernels-src-{user}")


def load_kernel(source: str, name: str) -> Kernel:
    """The kernel ``name`` of the generated ``source``, written to a module file (Triton's
    JIT needs real source files), which is imported when the kernel's function is needed.

    The on-disk kernel cache: a module's file is named by a hash of its text, which the graph
    structure and dtypes determine, so a second process compiling the same optimizer finds
    the same file, and the record of the kernels compiled from it (Triton's files, keyed by
    that source, the Triton version, the target and the compile options): it launches them
    without running the compiler or Triton's per-process self-hash, and without importing
    the module, whose ``@triton.jit`` functions Triton builds from their source lines
    (``_triton_compat.Kernel``)."""
    text, digest = _module_text(source)
    directory = source_dir()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"k_{digest}.py")
    _write_module(path, text)
    module_name = f"optkernels_generated_{digest}"
    record = os.path.join(directory, f"k_{digest}.{name}.json")
    module = sys.modules.get(module_name)
    load = functools.partial(_import_kernel, module_name, path, text, name)
    return Kernel(record, load, getattr(module, name, None))


@functools.lru_cache(maxsize=64)
def _module_text(source: str) -> tuple[str, str]:
    """The module text of a kernel's ``source`` (the prelude's helpers it uses first) and its
    hash (a kernel and its ``_small`` kernel share the module)."""
    text = prelude_for(source) + source
    return text, hashlib.sha256(text.encode()).hexdigest()[:16]


_IMPORTING = threading.Lock()  # (a module's first launches on two threads import it once)


def _import_kernel(module_name: str, path: str, text: str, name: str) -> Any:
    with _IMPORTING:
        return getattr(_import_module(module_name, path, text), name)


def _write_module(path: str, text: str) -> None:
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def _import_module(module_name: str, path: str, text: str) -> Any:
    module = sys.modules.get(module_name)
    if module is None:
        _write_module(path, text)  # (again, where the cache was emptied since)
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return module
