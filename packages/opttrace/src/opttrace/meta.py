"""Output metadata of ATen ops during tracing: shape, stride and dtype, without running them.

Tracing records thousands of ops; running each through its meta kernel costs ~100 us. Almost
all optimizer ops are pointwise over tensors of one layout, where the output takes that layout
and only the dtype needs computing, so results are cached by a signature that leaves the
common shape out. Anything else is cached by its full signature, and a miss runs the op on
meta tensors: exact, just slower.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opttrace.errors import TraceError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    """Shape, stride and dtype of one tensor value (its device is decided by the recorder)."""

    shape: Shape
    stride: Shape
    dtype: torch.dtype


def clear_cache() -> None:
    """Forget cached op metadata (``optcompile.reset()`` calls this)."""
    _CACHE.clear()
    PLANS.clear()
    _LAYOUT_IDS.clear()
    _INPUT_LAYOUTS.clear()


# The recorder's per-signature plans of ops (see plans.py): what one op does to its
# inputs' metadata, keyed by the op and its arguments' kinds (tensors by ``layout_id``).
PLANS: dict[tuple[Any, ...], Any] = {}
_LAYOUT_IDS: dict[tuple[Spec, torch.device], int] = {}
_NEXT_LAYOUT_ID = itertools.count()  # (not reset with the caches: an id is never reused)


# (shape, stride, dtype, device) of an input tensor -> its Spec and layout id: one Spec object
# for the many inputs of one layout, found without building a Spec to hash.
_INPUT_LAYOUTS: dict[tuple[Any, ...], tuple[Spec, int]] = {}


def layout_of(t: torch.Tensor, device: torch.device) -> tuple[Spec, int]:
    """The Spec of the tensor ``t`` (on ``device``, its device) and its ``layout_id``."""
    key = (t.shape, t.stride(), t.dtype, device)
    found = _INPUT_LAYOUTS.get(key)
    if found is None:
        spec = spec_of(t)
        found = _INPUT_LAYOUTS[key] = (spec, layout_id(spec, device))
    return found


def layout_id(spec: Spec, device: torch.device) -> int:
    """A small int naming a tensor's (Spec, device): hashed per op in place of the Spec.
    Never reused for another layout, so a tensor of a trace still running when the caches
    are cleared cannot match another's plan."""
    key = (spec, device)
    found = _LAYOUT_IDS.get(key)
    if found is None:
        found = _LAYOUT_IDS[key] = next(_NEXT_LAYOUT_ID)
    return found


@functools.lru_cache(maxsize=4096)
def contiguous_stride(shape: Shape) -> Shape:
    """The strides of a contiguous tensor of ``shape`` (asked for by every pointwise op:
    cached, and computed without ``max``, which a trace patches)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size if size > 1 else 1
    return tuple(reversed(stride))


@functools.lru_cache(maxsize=4096)
def contiguous_spec(shape: Shape, dtype: torch.dtype) -> Spec:
    """The Spec of a contiguous tensor (one shared object per shape and dtype: a Spec is
    immutable, and a pointwise op's result asks for one each time)."""
    return Spec(shape, contiguous_stride(shape), dtype)


def spec_of(t: torch.Tensor) -> Spec:
    return Spec(tuple(t.shape), tuple(t.stride()), t.dtype)


# A tensor argument in a cache key: the Spec itself, or for pointwise ops over one contiguous
# shape, just (dtype, is-0-dim) with the common shape kept out of the key.
_SAME = "same-layout"
_CACHE: dict[Any, Any] = {}
_MISSING = object()


def infer(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any], pointwise: bool | None = None
) -> Any:
    """Output Specs of ``func`` (a Spec, a list of Specs, or a tuple of those).

    Tensor arguments are given as Specs; everything else as the Python values the op gets.
    A foreach op is given one item's arguments (lists of one) with ``pointwise=True``.
    """
    if pointwise is None:
        pointwise = torch.Tag.pointwise in func.tags
    common = _common_contiguous_shape(args, kwargs) if pointwise else None
    key = (
        func,
        tuple([_key(a, common) for a in args]),
        tuple([(k, _key(v, common)) for k, v in kwargs.items()]) if kwargs else (),
    )
    out = _CACHE.get(key, _MISSING)
    if out is _MISSING:
        out = _CACHE[key] = _run_meta(func, args, kwargs)
    if common is not None:
        return _with_shape(out, common)
    return out


def _common_contiguous_shape(args: Sequence[Any], kwargs: dict[str, Any]) -> Shape | None:
    """The one non-scalar shape all tensor arguments share, if they are all contiguous."""
    shape: Shape | None = None
    for spec in _specs(args, kwargs):
        if not spec.shape:
            continue
        if spec.stride != contiguous_stride(spec.shape):
            return None
        if shape is None:
            shape = spec.shape
        elif spec.shape != shape:
            return None
    return shape


def _specs(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Spec]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Spec):
            found.append(a)
        elif isinstance(a, list | tuple):
            found.extend(x for x in a if isinstance(x, Spec))
    return found


def _key(value: Any, common: Shape | None) -> Any:
    """One argument in a cache key (an op's arguments: a tuple of these)."""
    kind = type(value)
    if kind is Spec:
        if common is not None:
            return (_SAME, value.dtype, bool(value.shape))
        return value
    if kind is float:
        return float  # values never change output metadata; their types can (promotion)
    if kind is list or kind is tuple:
        return tuple([_key(v, common) for v in value])
    return (kind, value)


def _with_shape(out: Any, shape: Shape) -> Any:
    if isinstance(out, Spec):
        return contiguous_spec(shape, out.dtype) if out.shape else out
    if isinstance(out, list | tuple):
        return type(out)(_with_shape(o, shape) for o in out)
    return out


def _run_meta(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    def to_meta(a: Any) -> Any:
        if isinstance(a, Spec):
            return torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device="meta")
        if isinstance(a, list | tuple):
            return type(a)(to_meta(x) for x in a)
        if isinstance(a, torch.device):
            return torch.device("meta")
        return a

    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    try:
        out = func(*(to_meta(a) for a in args), **meta_kwargs)
    except (NotImplementedError, RuntimeError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        missing = isinstance(exc, NotImplementedError) or "fake impl" in detail
        if missing:
            raise TraceError(
                f"{func} has no meta kernel (a shape/dtype rule), so the tracer cannot run "
                f"it: {detail}. Register one (for a custom op: register_fake) or run the "
                "step eagerly"
            ) from exc
        raise TraceError(f"{func} fails on these inputs: {detail}") from exc
    return _to_specs(out)


def _to_specs(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return spec_of(out)
    if isinstance(out, list | tuple):
        return type(out)(_to_specs(o) for o in out)
    return out
