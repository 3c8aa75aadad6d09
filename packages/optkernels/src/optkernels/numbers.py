"""Python numbers a step computes per tensor, and the 0-dim constants it makes.

An optimizer's capturable=False path reads each step count with ``.item()`` and computes its
bias corrections and step sizes with Python floats (``1 - beta1 ** step``, ``lr / bc * -1``):
one number per parameter, in double, by Python's own arithmetic. In a lane program these are
*lane numbers*: per-lane ops named ``py_<operator>`` that only the host computes (exactly as
eager does: the same operators on the same Python floats), and that the kernels read as ATen
reads a Python scalar. ``torch.tensor(1.0)`` made inside the step (a graph constant, 0-dim)
is a per-lane constant of its dtype. A Python number that the step computes for each
tensor from its shape (Muon's ``lr * sqrt(max(1, rows / cols))``) is one of the step's scalar
values chosen per lane (``PICK``), which the host gathers for every lane.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

# Python operators on numbers -> the lane op computing them (host only).
PYTHON_OPS: dict[Any, str] = {
    operator.add: "py_add",
    operator.sub: "py_sub",
    operator.mul: "py_mul",
    operator.truediv: "py_truediv",
    operator.pow: "py_pow",
    operator.neg: "py_neg",
    operator.ge: "py_ge",
    operator.gt: "py_gt",
    operator.le: "py_le",
    operator.lt: "py_lt",
    operator.eq: "py_eq",
    operator.ne: "py_ne",
}
# The lane op -> the Python function (applied to Python floats, lane by lane).
PYTHON_FUNCTIONS: dict[str, Callable[..., Any]] = {op: fn for fn, op in PYTHON_OPS.items()}
# ``torch._check`` on a lane number (``bc ** 0.5`` checks ``bc >= 0``): the host raises
# as the torch backend does where it fails.
ASSERT = "assert"
# One of the step's Python numbers per lane: ``(("const", refs),)`` with one ref per lane,
# ("scalar", index) or ("const", number); the host gathers them (host.host_function).
PICK = "pick"
HOST_ONLY = frozenset({*PYTHON_FUNCTIONS, ASSERT, PICK})

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_python_op(node: fx.Node) -> bool:
    """Whether ``node`` is Python arithmetic (``operator``'s functions but getitem,
    min/max/abs)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    return getattr(node.target, "__module__", None) == "_operator" or node.target in (min, max, abs)


def is_assert(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default


def assert_scalar(condition: Any, message: str) -> None:
    """``aten._assert_scalar`` of a condition the step computed from numpy numbers (a numpy
    float hyperparameter makes its Python comparisons numpy bools: ATen takes no such
    Scalar): what the torch backend runs for an assert node."""
    torch.ops.aten._assert_scalar.default(bool(condition), message)


def eager_target(node: fx.Node) -> Any:
    """What the torch backend calls for ``node``: its target, or ``assert_scalar``."""
    return assert_scalar if is_assert(node) else node.target


def scalar_constant(node: Any) -> tuple[float, torch.dtype] | None:
    """The value and dtype of a 0-dim floating constant the step made (``torch.tensor(1.0)``,
    a get_attr node), or None for any other node."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    module = node.graph.owning_module
    value: Any = module
    for name in str(node.target).split("."):
        value = getattr(value, name, None)
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.dtype not in _FLOATS:
        return None
    if value.device.type == "meta" or type(value) is not torch.Tensor:
        return None
    return float(value.item()), value.dtype


def reads_tensor(arg: fx.Node, numbers: set[fx.Node]) -> bool:
    """Whether Python arithmetic on ``arg`` computes with a tensor's value: ``arg`` is a
    tensor, a tensor op's result or one of ``numbers`` (arithmetic on such values)."""
    if arg in numbers:
        return True
    if arg.op == "placeholder":
        return isinstance(arg.meta.get("val"), torch.Tensor)
    return arg.op == "call_function" and not is_python_op(arg)
