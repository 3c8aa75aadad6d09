"""How a launch is specialized: its arguments' fingerprint (``_fingerprint``, at least as
fine as Triton's JIT), the specialization Triton's binder gives it (``_bind``) or that is
made from the fingerprint (``_specialization``), and the options ``JITFunction.run`` adds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from optkernels._triton_compat.prefetch import _current_device

# Python types of kernel arguments a fingerprint covers, and the one Triton's JIT gives them.
_INT_RANGES = (("i32", -(2**31), 2**31), ("i64", -(2**63), 2**63), ("u64", 0, 2**64))


def _fingerprint(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What picks a launch's compiled kernel, at least as finely as Triton's JIT picks it
    (``native_specialize_impl``): per positional argument, a tensor's dtype and whether its
    address is 16-byte aligned; an int's type (i32, i64, u64), whether it is 1 (a constexpr)
    and whether it is a multiple of 16; floats and bools by type; then the keyword arguments
    (constexprs, launch options) and the debug settings the JIT adds to them. None for
    other arguments (Triton's JIT launches those)."""
    parts: list[Any] = []
    for arg in args:
        kind = type(arg)
        if isinstance(arg, torch.Tensor):
            parts.append((arg.dtype, arg.data_ptr() & 15 == 0))
        elif kind is int:
            if arg == 1:
                parts.append(1)
                continue
            ranges = [name for name, low, high in _INT_RANGES if low <= arg < high]
            if not ranges:
                return None
            parts.append((ranges[0], arg & 15 == 0))
        elif kind is float or kind is bool:
            parts.append(kind.__name__)
        else:
            return None
    try:
        options = tuple(sorted(kwargs.items()))
        hash(options)
    except TypeError:
        return None
    return (tuple(parts), options, _debug_settings(fn))


def _debug_settings(fn: Any) -> tuple[Any, ...]:
    """What ``JITFunction.run`` adds to a launch's options from Triton's knobs."""
    from triton import knobs

    compilation = knobs.compilation
    return (
        getattr(fn, "debug", None),
        getattr(knobs.runtime, "debug", None),
        getattr(compilation, "instrumentation_mode", None),
        getattr(compilation, "fpsan_homomorphic_casts", None),
    )


def _agrees(key: Any, specialization: Any) -> bool:
    """Whether Triton's JIT specialized the launch fingerprinted ``key`` as ``_fingerprint``
    expects (its vocabulary: "D" for 16-byte alignment, a constexpr for an int equal to 1):
    only then is the fingerprint recorded."""
    parts = key[0]
    if len(specialization) < len(parts):
        return False
    for part, (kind, spec) in zip(parts, specialization, strict=False):
        if part == 1:
            if kind != "constexpr" or spec != 1:
                return False
        elif isinstance(part, tuple):
            dtype_or_kind, aligned = part
            pointer = isinstance(dtype_or_kind, torch.dtype)
            if pointer != kind.startswith("*") or (not pointer and kind != dtype_or_kind):
                return False
            if spec not in (None, "D" if aligned else ""):
                return False
        elif kind != {"float": "fp32", "bool": "u1"}[part]:
            return False
    return True


def _constexpr_args(fn: Any, given: int, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The values of ``fn``'s parameters after the ``given`` positional arguments, by keyword
    or default: a compiled kernel takes every argument, constexprs included."""
    out = []
    for param in fn.params[given:]:
        if param.name in kwargs:
            out.append(kwargs[param.name])
        elif param.has_default:
            out.append(param.default)
        else:
            raise TypeError(f"{fn.__name__}: no value for {param.name}")
    return tuple(out)


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


def _bind(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Launch:
    from triton.runtime.jit import compute_cache_key

    device = _current_device()
    _, key_cache, target, _, binder = fn.device_caches[device]
    kw = _jit_options(fn, kwargs)
    bound, specialization, options = binder(*args, **kw)
    jit_key = compute_cache_key(key_cache, specialization, options)
    return _Launch(device, jit_key, target, kw, bound, specialization, options)


def _specialization(fn: Any, key: Any, bound: dict[str, Any]) -> list[Any] | None:
    """The specialization Triton's binder gives the launch fingerprinted ``key`` with the
    arguments ``bound`` (by parameter name), made from the fingerprint; None for a kernel
    whose parameters carry settings beyond constexpr-ness (annotations, const pointers,
    do_not_specialize): the binder's own rules apply to those."""
    from triton._utils import canonicalize_ptr_dtype

    parts = iter(key[0])
    out: list[Any] = []
    for param in fn.params:
        if param.is_constexpr:
            out.append(("constexpr", bound[param.name]))
            continue
        plain = not (param.annotation_type or param.is_const or param.do_not_specialize)
        if not plain or param.do_not_specialize_on_alignment:
            return None
        part = next(parts, None)
        if part is None:
            return None
        if part == 1:
            out.append(("constexpr", 1))
        elif part in ("float", "bool"):
            out.append(({"float": "fp32", "bool": "u1"}[part], None))
        else:
            dtype_or_kind, aligned = part
            pointer = isinstance(dtype_or_kind, torch.dtype)
            kind = canonicalize_ptr_dtype(dtype_or_kind, False) if pointer else dtype_or_kind
            out.append((kind, "D" if aligned else ""))
    return out if next(parts, None) is None else None


def _jit_options(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A launch's keyword arguments with what ``JITFunction.run`` adds before binding."""
    from triton import knobs

    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kw
