"""Every private torch API optguard uses, in one place (a torch upgrade edits this).

Both come from dynamo's C++ guard support: a bulk tensor-metadata check and CPython's dict
version tag. If either is missing, the fast tier of checks is off and every call runs the
full generated check (correct, slower).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
    from torch._C._dynamo.guards import dict_version as _dict_version
except ImportError:  # pragma: no cover - depends on the torch build
    _TensorGuards = None
    _dict_version = None


def available() -> bool:
    return _TensorGuards is not None and _dict_version is not None


def tensor_guards(tensors: Sequence[torch.Tensor]) -> Callable[..., bool]:
    """``check(*tensors) -> bool``: same type, dtype, device, shape, stride and
    requires_grad as ``tensors``, evaluated in C++ in one call."""
    assert _TensorGuards is not None
    dims = [[None] * t.dim() for t in tensors]
    guards = _TensorGuards(*tensors, dynamic_dims_sizes=dims, dynamic_dims_strides=dims)
    check: Callable[..., bool] = guards.check
    return check


def dict_version(d: dict[Any, Any]) -> int:
    """CPython's version tag of ``d``: changes whenever an entry is added, removed or set
    to a different object."""
    assert _dict_version is not None
    return int(_dict_version(d))


DICT_VERSION: Callable[[dict[Any, Any]], int] | None = _dict_version
