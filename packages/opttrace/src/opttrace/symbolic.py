"""Symbolic Python scalars: hyperparameters that enter the graph as inputs, not constants.

A float read from the inputs (``group['lr']``, ``betas[0]``) reaches the step as a
``torch.SymFloat`` whose node is a ScalarNode: arithmetic on it (``1 - beta1``,
``lr * weight_decay``) records graph nodes over Python operators, and passing it to a torch
op puts that node into the op's arguments, so changing the hyperparameter never retraces.
A Python decision on it (``if weight_decay != 0``) is taken on the value seen while tracing
and becomes a guard on the decision's outcome, so the entry is reused until the outcome flips.
A tensor used where a Python number is required (``value=-clr`` with a 0-dim tensor) becomes
a scalar read in the graph; a decision on such a value cannot be guarded and is refused.

torch calls the methods below from ``SymInt``/``SymFloat``/``SymBool`` magic methods and from
C++; names and signatures follow ``torch.fx.experimental.sym_node.SymNode``.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import operator
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from optguard import Source
from torch import fx

from opttrace.errors import TraceError
from opttrace.patches import patched

if TYPE_CHECKING:
    from opttrace.recorder import Recorder

Scalar = bool | int | float
SymScalar = torch.SymInt | torch.SymFloat | torch.SymBool

# name -> (Python function, its text with {0}/{1} for operands, result type or None = promote)
_BINARY: dict[str, tuple[Callable[[Any, Any], Any], str, type | None]] = {
    "add": (operator.add, "({0} + {1})", None),
    "sub": (operator.sub, "({0} - {1})", None),
    "mul": (operator.mul, "({0} * {1})", None),
    "mod": (operator.mod, "({0} % {1})", None),
    "float_truediv": (operator.truediv, "({0} / {1})", float),
    "int_truediv": (operator.truediv, "({0} / {1})", float),
    "truediv": (operator.truediv, "({0} / {1})", float),
    "int_floordiv": (operator.floordiv, "({0} // {1})", int),
    "float_pow": (operator.pow, "({0} ** {1})", float),
    "pow_by_natural": (operator.pow, "({0} ** {1})", int),
    "pow": (operator.pow, "({0} ** {1})", None),
    "sym_min": (min, "min({0}, {1})", None),
    "sym_max": (max, "max({0}, {1})", None),
    "eq": (operator.eq, "({0} == {1})", bool),
    "ne": (operator.ne, "({0} != {1})", bool),
    "lt": (operator.lt, "({0} < {1})", bool),
    "le": (operator.le, "({0} <= {1})", bool),
    "gt": (operator.gt, "({0} > {1})", bool),
    "ge": (operator.ge, "({0} >= {1})", bool),
    "sym_and": (operator.and_, "({0} and {1})", bool),
    "sym_or": (operator.or_, "({0} or {1})", bool),
}
_UNARY: dict[str, tuple[Callable[[Any], Any], str, type | None]] = {
    "neg": (operator.neg, "(-{0})", None),
    "pos": (operator.pos, "(+{0})", None),
    "abs": (abs, "abs({0})", None),
    "sym_float": (float, "float({0})", float),
    "sym_int": (int, "int({0})", int),
    "sym_not": (operator.not_, "(not {0})", bool),
    "ceil": (math.ceil, "math.ceil({0})", int),
    "floor": (math.floor, "math.floor({0})", int),
    "trunc": (math.trunc, "math.trunc({0})", int),
    "sym_sqrt": (math.sqrt, "math.sqrt({0})", float),
    "sym_log2": (math.log2, "math.log2({0})", float),
}

# What a guard expression may use, besides the operators: the functions named above.
GUARD_GLOBALS = {"math": math, "min": min, "max": max, "abs": abs, "float": float, "int": int}


class ScalarNode:
    """The node behind one symbolic Python scalar of a trace."""

    def __init__(
        self,
        recorder: Recorder,
        pytype: type,
        hint: Scalar | None,
        node: fx.Node | None,
        expr: tuple[Any, ...] | None,
    ) -> None:
        self.recorder = recorder
        self.pytype = pytype
        self.hint = hint  # the value while tracing; None for a tensor's data
        self.fx_node = node  # None for constants wrapped by arithmetic with Python numbers
        # How to recompute the value from the inputs, for guards: ("source", Source),
        # ("const", value), ("op", template, operands), or None (depends on tensor data).
        self.expr = expr
        # For (a == b) / (a != b): whether a and b are one node (what a C++ cache key
        # comparison is answered with, see _decide); None for any other node.
        self.identical: bool | None = None

    # -- constructors -------------------------------------------------------------------

    def _wrap_const(self, value: Scalar) -> ScalarNode:
        return ScalarNode(self.recorder, type(value), value, None, ("const", value))

    def wrap_int(self, num: int) -> ScalarNode:
        return self._wrap_const(num)

    def wrap_float(self, num: float) -> ScalarNode:
        return self._wrap_const(num)

    def wrap_bool(self, num: bool) -> ScalarNode:
        return self._wrap_const(num)

    def _apply(
        self, name: str, fn: Callable[..., Any], text: str, rtype: type | None, *others: Any
    ) -> ScalarNode:
        operands = (self, *others)
        # (one pass over the operands: a step applies the same few operations per param)
        hints, exprs, args, types = [], [], [], set()
        for o in operands:
            hints.append(o.hint)
            exprs.append(o.expr)
            args.append(o.fx_node if o.fx_node is not None else o.hint)
            types.add(o.pytype)
        hint = None if None in hints else fn(*hints)
        if rtype is None:
            rtype = float if float in types else int
            if types == {bool} and name in ("sym_min", "sym_max"):
                rtype = bool
        if hint is not None and rtype is not type(hint):
            hint = rtype(hint)
        assert hint is None or isinstance(hint, bool | int | float)
        expr = None if None in exprs else ("op", text, tuple(exprs))
        node = self.recorder.scalar_op(fn, tuple(args), hint if hint is not None else rtype())
        result = ScalarNode(self.recorder, rtype, hint, node, expr)
        if name in ("eq", "ne") and len(others) == 1:
            result.identical = (self is others[0]) == (name == "eq")
        return result

    # -- what torch asks of a node --------------------------------------------------------

    def is_int(self) -> bool:
        return self.pytype is int

    def is_float(self) -> bool:
        return self.pytype is float

    def is_bool(self) -> bool:
        return self.pytype is bool

    def is_nested_int(self) -> bool:
        return False

    def is_symbolic(self) -> bool:
        return True

    def is_constant(self) -> bool:
        return False

    def has_hint(self) -> bool:
        return self.hint is not None

    @property
    def constant(self) -> None:
        return None

    def maybe_as_int(self) -> None:
        return None

    def nested_int(self) -> None:
        return None

    def _graph_repr(self) -> builtins.str:
        return self._text()

    def __str__(self) -> builtins.str:
        return self._text()

    def _text(self) -> builtins.str:
        if self.expr is None:
            return f"a {self.pytype.__name__} read from a tensor"
        template, sources = guard_template(self.expr)
        return template.format(*(s.name() for s in sources))

    # -- decisions: take the traced value, guard its outcome --------------------------------

    def _decide(self, file: str | None = None, line: int | None = None) -> Scalar:
        if self.identical is not None and self.hint is None and _is_key_comparison(file):
            # C++ comparing two scalars read from tensors as parts of two cache keys whose
            # hashes are equal (DTensor's native sharding cache, whose key does not hash a
            # symbolic scalar's value): what it caches never depends on the value, so they
            # are the same key only if they are the same node. Nothing is decided on a value.
            return self.identical
        if self.hint is None or self.expr is None:
            raise TraceError(
                f"the step makes a Python decision on a tensor's value ({self._text()}): "
                "Python control flow on tensor values, .item() and bool(tensor) cannot be traced"
            )
        self.recorder.decided(self, self.hint)
        return self.hint

    def bool_(self) -> bool:
        return bool(self._decide())

    def guard_bool(self, file: str, line: int) -> bool:
        return bool(self._decide(file, line))

    def expect_true(self, file: str, line: int) -> bool:
        # torch._check(cond): on a value read from a tensor, a runtime assertion in the graph
        # (as eager would raise there); on inputs' scalars, a guarded decision.
        if self.hint is None or self.expr is None:
            self.recorder.assert_true(self, f"{file}:{line}")
            return True
        return bool(self._decide(file, line))

    def guard_or_false(self, file: str, line: int) -> bool:
        return bool(self._decide(file, line))

    def guard_or_true(self, file: str, line: int) -> bool:
        return bool(self._decide(file, line))

    def statically_known_true(self, file: str, line: int) -> bool:
        return bool(self._decide(file, line))

    def guard_size_oblivious(self, file: str, line: int) -> bool:
        return bool(self._decide(file, line))

    def guard_float(self, file: str, line: int) -> float:
        return float(self._decide(file, line))

    def guard_int(self, file: str, line: int) -> int:
        return int(self._decide(file, line))

    def int_(self) -> int:
        return int(self._decide())


# c10's ``SymFloat::operator==`` and ``SymInt::operator==`` (their headers): what C++ caches
# call on the scalars of two keys whose hashes are equal.
_KEY_COMPARISON_HEADERS = ("c10/core/SymFloat.h", "c10/core/SymInt.h")


def _is_key_comparison(file: str | None) -> bool:
    return file is not None and file.replace("\\", "/").endswith(_KEY_COMPARISON_HEADERS)


def _install_methods() -> None:
    ScalarNode.str = ScalarNode._text  # type: ignore[attr-defined]  # torch calls node.str()
    for name, (fn, text, _) in _BINARY.items():

        def binary(
            self: ScalarNode, other: ScalarNode, _n: str = name, _f: Any = fn, _t: str = text
        ) -> ScalarNode:
            return self._apply(_n, _f, _t, _BINARY[_n][2], other)

        setattr(ScalarNode, name, binary)
    for name, (ufn, text, _) in _UNARY.items():

        def unary(self: ScalarNode, _n: str = name, _f: Any = ufn, _t: str = text) -> ScalarNode:
            return self._apply(_n, _f, _t, _UNARY[_n][2])

        setattr(ScalarNode, name, unary)


_install_methods()


def wrap(node: ScalarNode) -> SymScalar:
    """The torch symbolic scalar (SymFloat, SymInt or SymBool) for ``node``."""
    if node.pytype is float:
        return torch.SymFloat(node)  # type: ignore[no-untyped-call]
    if node.pytype is bool:
        return torch.SymBool(node)  # type: ignore[no-untyped-call]
    return torch.SymInt(node)  # type: ignore[no-untyped-call]


def node_of(value: Any) -> ScalarNode | None:
    """The ScalarNode behind a symbolic scalar of this tracer, or None."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        node = value.node
        return node if isinstance(node, ScalarNode) else None
    return None


def hint_of(value: Any) -> Any:
    """A plain Python value standing in for ``value`` where only its type matters (metadata)."""
    node = node_of(value)
    if node is None:
        return value
    return node.hint if node.hint is not None else node.pytype(1)


def guard_template(expr: tuple[Any, ...]) -> tuple[str, list[Source]]:
    """Python text of ``expr`` with ``{i}`` for the i-th distinct Source, and those Sources."""
    sources: list[Source] = []

    def text(e: tuple[Any, ...]) -> str:
        kind = e[0]
        if kind == "source":
            if e[1] not in sources:
                sources.append(e[1])
            return "{" + str(sources.index(e[1])) + "}"
        if kind == "const":
            value = e[1]
            if isinstance(value, float):  # (numpy's float64 too: its repr is not Python)
                value = float(value)
                return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
            if isinstance(value, bool | int) and type(value) not in (bool, int):
                value = int(value) if not isinstance(value, bool) else bool(value)
            return repr(value)
        template, operands = e[1], e[2]
        return str(template.format(*(text(o) for o in operands)))

    return text(expr), sources


# -- min() and max() over values read from tensors -------------------------------------------

_MIN, _MAX = builtins.min, builtins.max


def _read_from_tensor(value: Any) -> bool:
    node = node_of(value)
    return node is not None and node.hint is None


def _extremum(pick: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``pick`` (the builtin min or max), except over plain numbers where one was read from a
    tensor (``max(eps, p.norm().item())``): there Python would decide on the tensor's value,
    so the result becomes a graph node (``pick`` itself, on the values, in the same order:
    ``max(eps, nan)`` is eps, ``max(nan, eps)`` nan) instead."""

    def pair(a: Any, b: Any) -> Any:
        known = node_of(a) or node_of(b)
        assert known is not None
        first = node_of(a) or known._wrap_const(a)
        second = node_of(b) or known._wrap_const(b)
        return wrap(getattr(first, name)(second))

    def extremum(*args: Any, **kwargs: Any) -> Any:
        values = args[0] if len(args) == 1 and type(args[0]) in (list, tuple) else args
        if (
            kwargs
            or len(values) < 2
            or not any(_read_from_tensor(v) for v in values)
            or not all(node_of(v) is not None or type(v) in (int, float) for v in values)
        ):
            return pick(*args, **kwargs)
        result = values[0]
        for value in values[1:]:
            result = pair(result, value)
        return result

    return extremum


@contextlib.contextmanager
def extrema_in_graph() -> Iterator[None]:
    """While tracing: ``min`` and ``max`` over a value read from a tensor record a graph node
    instead of a decision the tracer would have to refuse (in the tracing thread only).
    Every other call goes to the builtin unchanged."""
    with (
        patched(builtins, "min", _extremum(_MIN, "sym_min")),
        patched(builtins, "max", _extremum(_MAX, "sym_max")),
    ):
        yield


# -- hashing inside a tensor subclass's dispatch ------------------------------------------------

SUBCLASS_DISPATCH = [False]  # whether a subclass's dispatch (a DTensor's) is deciding
_HASH: dict[type, Callable[[Any], int]] = {
    torch.SymFloat: torch.SymFloat.__hash__,
    torch.SymInt: torch.SymInt.__hash__,
}


def subclass_dispatch(pending: bool) -> None:
    """Whether a subclass's dispatch (DTensor's sharding rules) runs now: the recorder sets
    it when it hands an op to one and clears it at the next op it records itself (the first
    local op). Meanwhile symbolic scalars hash by identity: DTensor's rules hash an op's
    arguments to cache a decision that depends on the op and the placements, never on a
    scalar's value, and hashing by value would decide on it (a guard on the learning rate,
    or a refusal for a value read from a tensor)."""
    SUBCLASS_DISPATCH[0] = pending


def _identity_hash(self: Any) -> int:
    node = self.node
    if isinstance(node, ScalarNode) and (SUBCLASS_DISPATCH[0] or _called_from_dtensor()):
        return hash(id(node))
    return _HASH[type(self)](self)


def _called_from_dtensor(depth: int = 8) -> bool:
    """Whether DTensor's Python (its sharding propagation's slow path) is hashing."""
    frame: Any = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith(_DTENSOR_MODULES):
            return True
        frame = frame.f_back
    return False


_DTENSOR_MODULES = "torch.distributed.tensor"


@contextlib.contextmanager
def hashable_in_subclass_dispatch() -> Iterator[None]:
    """Install ``_identity_hash`` on SymFloat and SymInt for one trace (tracing thread only)."""
    try:
        with (
            patched(torch.SymFloat, "__hash__", _identity_hash),
            patched(torch.SymInt, "__hash__", _identity_hash),
        ):
            yield
    finally:
        SUBCLASS_DISPATCH[0] = False
