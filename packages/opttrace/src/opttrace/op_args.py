"""What an ATen op's arguments tell the Recorder: their Specs (what ``meta.infer`` takes),
one foreach item's arguments, the device of the op's outputs, an argument by its schema
name, and symbolic ints specialized where they can decide a shape.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from opttrace import meta, symbolic
from opttrace.errors import TraceError
from opttrace.meta import Spec
from opttrace.traced_tensor import TracedTensor


def specialize_ints(values: Any) -> list[Any]:
    out = []
    for v in values:
        if isinstance(v, torch.SymInt | torch.SymBool):
            v = int(v) if isinstance(v, torch.SymInt) else bool(v)
        elif isinstance(v, list | tuple) and any(isinstance(x, torch.SymInt) for x in v):
            v = type(v)(int(x) if isinstance(x, torch.SymInt) else x for x in v)
        out.append(v)
    return out


def single_spec(s: Any) -> Spec:
    if isinstance(s, list | tuple):
        return s[0]  # type: ignore[no-any-return]
    return s  # type: ignore[no-any-return]


def arg_specs(args: Sequence[Any]) -> list[Any]:
    return [a._spec if type(a) is TracedTensor else _spec_arg(a) for a in args]


def kwarg_specs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: _spec_arg(v) for k, v in kwargs.items()} if kwargs else {}


def _spec_arg(a: Any) -> Any:
    if isinstance(a, TracedTensor):
        return a._spec
    if isinstance(a, torch.Tensor):
        return meta.spec_of(a)
    if isinstance(a, list | tuple):
        return type(a)(_spec_arg(x) for x in a)
    return symbolic.hint_of(a)


def item_arg(a: Any, i: int) -> Any:
    if isinstance(a, list | tuple) and len(a) > 0:
        return [a[i]]
    return a


def output_device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device:
    """The device of an op's outputs: an explicit ``device=``, else its tensors' device
    (a 0-dim CPU tensor next to CUDA tensors does not count, as in TensorIterator)."""
    device = kwargs.get("device")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        return torch.device(device)
    first = args[0] if args else None
    if type(first) is TracedTensor and (first._spec.shape or first._device.type != "cpu"):
        return first._device  # (the common case: the first tensor found below)
    fallback = None
    for a in (*args, *kwargs.values()):
        if type(a) is TracedTensor:  # (as below, from what it keeps)
            if a._spec.shape or a._device.type != "cpu":
                return a._device
            fallback = fallback or a._device
            continue
        for t in a if isinstance(a, list | tuple) else (a,):
            if isinstance(t, torch.Tensor):
                if t.device.type != "cpu" or t.dim() > 0:
                    return t.device
                fallback = fallback or t.device
    return fallback or _CPU


_CPU = torch.device("cpu")


def lookup(func: Any, args: Sequence[Any], kwargs: dict[str, Any], name: str) -> Any:
    i = _position(func, name)
    return kwargs[name] if name in kwargs or i >= len(args) else args[i]


@functools.cache
def _position(func: Any, name: str) -> int:
    """The position of the argument ``name`` in ``func``'s schema."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return i
    raise TraceError(f"{func} has no argument {name!r}")
