"""``Kernel``: a generated ``@triton.jit`` function, launched directly from its compiled
kernel where the record or this process has one, else through Triton's JIT."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from optkernels._triton_compat.prefetch import (
    _await_driver,
    _await_runtime,
    _await_triton_key,
    _check_prefetched,
    _current_device,
    _current_target,
)
from optkernels._triton_compat.records import (
    _HEADER,
    _entry,
    _entry_name,
    _load,
    _read,
    _Recorded,
    _remember,
)
from optkernels._triton_compat.specialize import _bind, _constexpr_args, _fingerprint
from optkernels._triton_compat.stages import _compile
from optkernels._triton_compat.version import _MISMATCH

log = logging.getLogger("optcompile.kernels")


class Kernel:
    """A generated ``@triton.jit`` function, launched as ``kernel[grid](*args, **kwargs)``.

    On CUDA a launch finds its compiled kernel by the arguments' fingerprint (``_fingerprint``:
    what Triton's JIT specializes on, or finer) and launches it directly; the first launch of
    a fingerprint in a process looks it up in the record (see the module docstring), else
    goes through Triton's JIT, which compiles it, and records it.

    ``load`` returns the function (importing its module, whose ``@triton.jit`` builds a
    JITFunction from its source lines); it runs when Triton's JIT, the interpreter or an
    unrecorded fingerprint needs the function: a warm launch of a recorded kernel needs only
    what the record keeps of it (``_Recorded``)."""

    def __init__(self, record: str, load: Callable[[], Any], fn: Any = None) -> None:
        self.record = record
        self._load_fn = load
        self._fn = fn  # (given where its module is imported already)
        self._seen: Any = fn  # the function, or what the record keeps of it
        self._direct: bool | None = None  # (decided at the first launch)
        # (device, fingerprint) -> the compiled kernel, or None where Triton's JIT launches
        # it; shared by every Kernel of the same source and name (the same record's name).
        self._compiled = _COMPILED.setdefault(os.path.basename(record), {})

    @property
    def fn(self) -> Any:
        """The ``@triton.jit`` function (its module imported on first use)."""
        if self._fn is None:
            self._fn = self._seen = self._load_fn()
        return self._fn

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        if self._direct is None:  # (the interpreter's functions have no JIT cache)
            loaded = self._fn is not None
            self._direct = hasattr(self._fn, "device_caches") if loaded else not _interpreting()
        if not self._direct:
            return self.fn[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn = self._seen if self._seen is not None else self._recorded()
        key = _fingerprint(fn, args, kwargs)
        device = _current_device()
        compiled = self._compiled.get((device, key), _UNSEEN)
        if compiled is None:
            self.fn[grid](*args, **kwargs)
        elif compiled is _UNSEEN:
            self._first(grid, args, kwargs, device, key)
        else:
            compiled[(*grid, 1, 1)[:3]](*args, *_constexpr_args(fn, len(args), kwargs))

    def _recorded(self) -> Any:
        """What the record keeps of the function (``_Recorded``), else the function."""
        recorded = _Recorded.of(_read(self.record).get(_HEADER), lambda: self.fn)
        if recorded is None:
            return self.fn
        self._seen = recorded
        return recorded

    def _first(
        self,
        grid: tuple[int, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        device: int,
        key: Any,
    ) -> None:
        """A fingerprint's first launch in this process: recorded, or Triton's."""
        _await_driver()  # (loading, compiling, binding use Triton's driver, built there)
        compiled = None
        fn = self._seen
        if key is not None:
            name = _entry_name(_current_target(), key)
            compiled = _load(fn, self.record, name)
            if compiled is None:
                compiled = _compile(self.fn, self.record, name, key, args, kwargs)
        _await_runtime()  # (the launchers: built there, while this compiled)
        if compiled is not None:
            try:
                compiled[(*grid, 1, 1)[:3]](*args, *_constexpr_args(fn, len(args), kwargs))
            except _MISMATCH as exc:  # another Triton's launcher: its JIT launches it
                log.debug("%s: recorded kernel not launched (%r)", fn.__name__, exc)
            else:
                self._compiled[device, key] = compiled
                return
        self._compiled[device, key] = self._through_triton(grid, args, kwargs, key)

    def _through_triton(
        self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], key: Any
    ) -> Any:
        """Launch through Triton's JIT (which compiles, or loads from its cache) and record
        the compiled kernel under ``key``; it, where later launches may use it directly."""
        try:
            launch = _bind(self.fn, args, kwargs)
        except _MISMATCH:
            launch = None
        if launch is not None:
            _check_prefetched(self.fn, launch.specialization)
        if launch is None or launch.jit_key not in self.fn.device_caches[launch.device][0]:
            _await_triton_key()  # (Triton compiles: its key is computed, or being computed)
        self.fn[grid](*args, **kwargs)
        if launch is None or key is None:
            return None
        kernel_cache, _, _, backend, _ = self.fn.device_caches[launch.device]
        compiled = kernel_cache.get(launch.jit_key)
        entry = _entry(self.fn, backend, launch, compiled, key)
        if entry is None:
            return None
        _remember(self.record, _entry_name(launch.target, key), entry, self.fn)
        return compiled


_UNSEEN = object()
_COMPILED: dict[str, dict[Any, Any]] = {}  # a record's name -> its kernels (Kernel._compiled)


def _interpreting() -> bool:
    """Whether ``@triton.jit`` makes interpreted functions (TRITON_INTERPRET)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)
