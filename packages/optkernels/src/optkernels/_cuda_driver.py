"""Host-to-device copies through the CUDA driver (ctypes), without torch's dispatch.

``buffer.copy_(pinned, non_blocking=True)`` costs a plan's call ~10 µs of host time on an
H100 host: dispatch, a TensorIterator, and an event that torch's pinned-memory allocator
records after every copy from its memory. A plan's staging (staging.py) copies one small
buffer per call and knows by itself when the device has read its pinned sources, so
``cuMemcpyHtoDAsync`` queues the same copy on the same stream for ~1 µs.

It is used only when the calling thread's current context is the primary context of the
buffer's device (the one torch's runtime calls use), so the stream and the addresses belong
to it; otherwise, or where ``libcuda`` cannot be loaded, ``copy`` returns False and the
caller copies with torch. Not torch's API: no ``_torch_compat`` entry.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

_lock = threading.Lock()
_tried = False
_lib: Any = None
_copy: Any = None
_current: Any = None
_primary: dict[int, int] = {}  # device index -> its primary context (retained for good)


def _load() -> Any:
    global _tried, _lib, _copy, _current
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            copy = lib.cuMemcpyHtoDAsync_v2
            current = lib.cuCtxGetCurrent
        except (OSError, AttributeError):
            return None
        copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        copy.restype = ctypes.c_int
        current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        current.restype = ctypes.c_int
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceGet.restype = ctypes.c_int
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.restype = ctypes.c_int
        _lib, _copy, _current = lib, copy, current
        return lib


def _primary_context(device: int) -> int:
    """The primary context of ``device`` (0 if the driver cannot give it)."""
    ctx = _primary.get(device)
    if ctx is None:
        lib = _load()
        handle, out = ctypes.c_int(), ctypes.c_void_p()
        ok = (
            lib is not None
            and lib.cuDeviceGet(ctypes.byref(handle), device) == 0
            and lib.cuDevicePrimaryCtxRetain(ctypes.byref(out), handle) == 0
        )
        ctx = _primary[device] = (out.value or 0) if ok else 0
    return ctx


def copy(dst: int, src: int, nbytes: int, stream: int, device: int) -> bool:
    """Queue a copy of ``nbytes`` from host address ``src`` (pinned) to device address
    ``dst`` on ``stream`` (a ``cudaStream_t``) of ``device``; False when it was not queued
    (the caller copies another way)."""
    expected = _primary_context(device)
    if not expected:
        return False
    ctx = ctypes.c_void_p()
    if _current(ctypes.byref(ctx)) != 0 or ctx.value != expected:
        return False
    return bool(_copy(dst, src, nbytes, stream) == 0)
