"""The torch backend's batched plan: each op a step repeats over lanes runs as one call.

``families.py`` reads the graph as BatchedOps. A family (one ATen op applied to every lane)
runs as the ``_foreach_*`` op of the same semantics where one exists: on the CPU a foreach op
runs the per-tensor op on each tensor, so results are those of the node-by-node plan, bit for
bit; otherwise as a loop over the lanes inside one prepared function. Python arithmetic on
per-lane values (a step count read with ``.item()``) runs per lane as the graph computes it,
once when every lane holds the same value (the usual case: ``Same``). The writebacks into
the inputs run as one ``_foreach_copy_``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import fx

from optkernels.families import Arg, BatchedOp, Families, is_python
from optkernels.reference import _as_eager_ran

aten = torch.ops.aten
Env = list[Any]
Load = Callable[[Env], Any]


class Same:
    """One value standing for every lane's: a per-lane Python scalar that all lanes share."""

    __slots__ = ("lanes", "value")

    def __init__(self, value: Any, lanes: int) -> None:
        self.value = value
        self.lanes = lanes

    def __getitem__(self, i: int) -> Any:
        return self.value

    def __len__(self) -> int:
        return self.lanes

    def __iter__(self) -> Any:
        return repeat(self.value, self.lanes)

    def list(self) -> list[Any]:
        return [self.value] * self.lanes


def _as_list(values: Any) -> Any:
    return values.list() if isinstance(values, Same) else values


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class BatchedPlan:
    """A graph of ops repeated over lanes, run one call per BatchedOp (see the module doc)."""

    backend = "torch"

    def __init__(self, gm: fx.GraphModule, program: Families) -> None:
        self.gm = gm
        self.program = program
        self.num_inputs = len(program.placeholders)
        self._loc: dict[fx.Node, tuple[int, int | None]] = {}
        self._length: dict[int, int] = {}  # slot -> lanes of the column it holds
        for slot, node in enumerate(program.placeholders):
            self._loc[node] = (slot, None)
        self._template: list[Any] = []  # env slots after the inputs: constants, then results
        for node in program.constants:
            self._loc[node] = (self._new_slot(getattr(gm, str(node.target))), None)
        self._input_columns: dict[tuple[int, ...], int] = {}
        self._fill: list[tuple[int, Callable[[Env], Any]]] = []  # input columns, each call
        self._steps: list[tuple[int, Callable[[Env], Any]]] = []
        self._lines: list[str] = []
        for op in program.ops:
            slot = self._new_slot(None)
            self._steps.append((slot, self._runner(op, slot)))
            if op.kind == "family":
                self._length[slot] = op.lanes
                for i, node in enumerate(op.nodes):
                    self._loc[node] = (slot, i)
            else:
                (node,) = op.nodes
                self._loc[node] = (slot, None)
                if op.kind == "foreach":
                    self._length[slot] = len(node.meta["val"])
                    for user in node.users:
                        if user.target is operator.getitem:
                            self._loc[user] = (slot, user.args[1])  # type: ignore[assignment]
        self._writes = self._writeback()
        self._output = self._value(("seq", tuple, (_structure(program.output),)))
        self.kernel_launches_per_step = sum(
            1
            for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        )

    def _new_slot(self, value: Any) -> int:
        self._template.append(value)
        return self.num_inputs + len(self._template) - 1

    # -- loaders -------------------------------------------------------------------------

    def _column(self, nodes: tuple[fx.Node, ...]) -> Load:
        """A loader of the list of ``nodes``' values."""
        locs = [self._loc[n] for n in nodes]
        if all(i is None for _, i in locs):  # inputs and constants: gathered once per call
            slots = tuple(s for s, _ in locs)
            slot = self._input_columns.get(slots)
            if slot is None:
                slot = self._input_columns[slots] = self._new_slot(None)
                self._length[slot] = len(slots)
                if len(slots) == 1:
                    only = slots[0]
                    self._fill.append((slot, lambda env: [env[only]]))
                else:
                    getter = operator.itemgetter(*slots)
                    self._fill.append((slot, lambda env: list(getter(env))))
            return operator.itemgetter(slot)
        (slot, _), *rest = locs
        if [i for _, i in locs] == list(range(len(nodes))) and all(s == slot for s, _ in rest):
            if self._length.get(slot) == len(nodes):
                return operator.itemgetter(slot)  # a whole column, in order
        return lambda env: [env[s] if i is None else env[s][i] for s, i in locs]

    def _node(self, node: fx.Node) -> Load:
        slot, i = self._loc[node]
        if i is None:
            return operator.itemgetter(slot)
        return lambda env: env[slot][i]

    def _value(self, arg: Arg) -> Load:
        """A loader of ``arg``'s value as one call sees it (a column: one list)."""
        tag = arg[0]
        if tag == "const":
            value = arg[1]
            return lambda env: value
        if tag == "node":
            return self._node(arg[1])
        if tag == "column":
            load = self._column(arg[1])
            if any(_is_tensor(n) for n in arg[1]):
                return load
            return lambda env: _as_list(load(env))  # a ScalarList of per-lane values
        kind, parts = arg[1], [self._value(a) for a in arg[2]]
        return lambda env: kind(p(env) for p in parts)

    def _per_lane(self, arg: Arg, lanes: int) -> Load:
        """A loader of ``arg``'s values lane by lane (an iterable of ``lanes`` values)."""
        tag = arg[0]
        if tag == "column":
            return self._column(arg[1])
        if tag == "seq":
            kind, parts = arg[1], [self._per_lane(a, lanes) for a in arg[2]]
            return lambda env: [kind(v) for v in zip(*(p(env) for p in parts), strict=True)]
        load = self._value(arg)
        return lambda env: repeat(load(env), lanes)

    # -- runners -------------------------------------------------------------------------

    def _runner(self, op: BatchedOp, slot: int) -> Callable[[Env], Any]:
        if op.kind != "family":
            target = _as_eager_ran(op.nodes[0]) if op.kind == "foreach" else op.target
            args = self._value(("seq", tuple, op.args))
            names = [k for k, _ in op.kwargs]
            values = [self._value(a) for _, a in op.kwargs]
            self._describe(slot, op, op.kind)
            if not names:
                return lambda env: target(*args(env))
            return lambda env: target(*args(env), **dict(zip(names, (v(env) for v in values))))
        loop = self._loop(op)
        if op.target is aten._local_scalar_dense.default:
            self._describe(slot, op, "read")
            return self._read(op)
        if not _is_tensor(op.nodes[0]):
            self._describe(slot, op, "scalar")
            return self._scalar(op, loop)
        foreach = _foreach_form(op, self, loop)
        if foreach is not None:
            runner, name = foreach
            self._describe(slot, op, name)
            return runner
        self._describe(slot, op, "loop")
        return loop

    def _loop(self, op: BatchedOp) -> Callable[[Env], Any]:
        """``[target(lane's args) for each lane]``."""
        target, lanes = op.target, op.lanes
        args = [self._per_lane(a, lanes) for a in op.args]
        names = [k for k, _ in op.kwargs]
        kwargs = [self._per_lane(a, lanes) for _, a in op.kwargs]
        if not names:
            return lambda env: [target(*a) for a in zip(*(f(env) for f in args), strict=True)]

        def run(env: Env) -> list[Any]:
            per_lane = zip(*(f(env) for f in kwargs), strict=True)
            return [
                target(*a, **dict(zip(names, k, strict=True)))
                for a, k in zip(zip(*(f(env) for f in args), strict=True), per_lane, strict=True)
            ]

        return run

    def _scalar(self, op: BatchedOp, loop: Callable[[Env], Any]) -> Callable[[Env], Any]:
        """Python arithmetic (or a check) on per-lane numbers: once when all lanes agree."""
        target, lanes = op.target, op.lanes
        if op.kwargs or any(a[0] == "seq" for a in op.args):
            return loop
        loads = [
            (True, self._column(a[1])) if a[0] == "column" else (False, self._value(a))
            for a in op.args
        ]

        def run(env: Env) -> Any:
            values = []
            for is_column, load in loads:
                value = load(env)
                if is_column:
                    if not isinstance(value, Same):
                        return loop(env)
                    value = value.value
                values.append(value)
            return Same(target(*values), lanes)

        return run

    def _read(self, op: BatchedOp) -> Callable[[Env], Any]:
        """Each lane's 0-dim tensor read as a Python number (``.item()``, as the graph's
        ``_local_scalar_dense``); ``Same`` when every lane holds the same number."""
        (arg,) = op.args
        lanes = op.lanes
        if arg[0] != "column":
            load = self._value(arg)
            return lambda env: Same(load(env).item(), lanes)
        column = self._column(arg[1])
        one_type = len({n.meta["val"].dtype for n in arg[1]}) == 1

        def read(env: Env) -> Any:
            values = [t.item() for t in column(env)]
            first = values[0]
            if one_type and values.count(first) == lanes:
                if first != 0 or not isinstance(first, float):
                    return Same(first, lanes)
                if len({math.copysign(1.0, v) for v in values}) == 1:  # 0.0 and -0.0
                    return Same(first, lanes)
            return values

        return read

    def _writeback(self) -> Callable[[Env], None] | None:
        """One ``_foreach_copy_`` of every written value into its input, in graph order."""
        writes = self.program.writes
        if not writes:
            return None
        dsts = self._column(tuple(dst for dst, _ in writes))
        srcs = self._column(tuple(src for _, src in writes))
        return lambda env: torch._foreach_copy_(dsts(env), srcs(env))

    # -- calls ---------------------------------------------------------------------------

    def guarded_addresses(self, indices: Collection[int]) -> None:
        """Nothing to skip: torch ops take the tensors themselves, not their addresses."""

    def __call__(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        if len(inputs) != self.num_inputs:
            raise ValueError(f"graph takes {self.num_inputs} inputs, got {len(inputs)}")
        env = [*inputs, *self._template]
        for slot, fill in self._fill:
            env[slot] = fill(env)
        with torch.no_grad():
            for slot, run in self._steps:
                env[slot] = run(env)
            if self._writes is not None:
                self._writes(env)
            out = self._output(env)[0]
        return tuple(out) if isinstance(out, list | tuple) else (out,)

    def _describe(self, slot: int, op: BatchedOp, how: str) -> None:
        node = op.nodes[0]
        if op.kind == "family":
            self._lines.append(f"#   {node.name} x{op.lanes}: {op.target} ({how})")
        elif op.kind == "foreach":
            self._lines.append(f"#   {node.name}: {op.target}")

    def describe(self) -> str:
        writes = len(self.program.writes)
        lanes = self.program.largest
        header = [
            f"# torch backend, batched over lanes: {len(self.program.ops)} calls per step "
            f"(families of up to {lanes} lanes) instead of one per node, "
            f"then {writes} writeback(s) in one _foreach_copy_:",
            *self._lines,
        ]
        return "\n".join(header) + "\n" + self.gm.code.strip()


def _structure(arg: Any) -> Arg:
    """An output structure (nodes in lists/tuples) as an Arg read whole."""
    if isinstance(arg, fx.Node):
        return ("node", arg)
    if isinstance(arg, list | tuple):
        return ("seq", type(arg), tuple(_structure(a) for a in arg))
    return ("const", arg)


# -- ATen ops as foreach ops --------------------------------------------------------------

# Per-tensor unary ops whose foreach form runs them tensor by tensor.
_UNARY = {
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "erfc", "exp", "expm1",
    "floor", "frac", "lgamma", "log", "log10", "log1p", "log2", "neg", "reciprocal", "round",
    "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
}  # fmt: skip


def _foreach_form(
    op: BatchedOp, plan: BatchedPlan, loop: Callable[[Env], Any]
) -> tuple[Callable[[Env], Any], str] | None:
    """The family ``op`` as one foreach call, and its name; None where torch has no foreach
    op of the same semantics for these argument kinds."""
    name, _, overload = op.target.__name__.partition(".")
    kinds = [_kind(a) for a in op.args]
    kw = dict(op.kwargs)
    lanes = op.lanes

    def tensors(args: Sequence[Arg]) -> list[Load]:
        out = []
        for a in args:
            load = plan._value(a)
            out.append(load if a[0] == "column" else _repeat(load, lanes))
        return out

    def packet(suffix: str) -> Any:
        return getattr(getattr(aten, f"_foreach_{name}"), suffix, None)

    if name in _UNARY and overload == "default" and kinds == ["T"] and not kw:
        return _call(packet("default"), tensors(op.args)), f"_foreach_{name}"
    t_args = all(k in ("T", "t") for k in kinds) and "T" in kinds
    if name in ("add", "sub", "mul", "div") and overload in ("Tensor", "Scalar"):
        alpha = kw.get("alpha")
        if set(kw) - {"alpha"} or (alpha is not None and _kind(alpha) != "c"):
            return None
        if t_args and len(kinds) == 2:
            extra = {"alpha": plan._value(alpha)} if alpha is not None else {}
            return _call(packet("List"), tensors(op.args), extra), f"_foreach_{name}.List"
        if kinds[0] == "T" and kinds[1] in ("c", "S") and alpha is None:
            return _scalar_call(name, plan, op.args[:1], op.args[1], loop, lanes)
        return None
    if name in ("maximum", "minimum") and overload == "default" and t_args and not kw:
        return _call(packet("List"), tensors(op.args)), f"_foreach_{name}.List"
    if name in ("clamp_min", "clamp_max") and not kw:
        if overload == "Tensor" and t_args:
            return _call(packet("List"), tensors(op.args)), f"_foreach_{name}.List"
        if overload == "default" and kinds[0] == "T" and kinds[1] in ("c", "S"):
            return _scalar_call(name, plan, op.args[:1], op.args[1], loop, lanes)
        return None
    if name == "pow" and not kw:
        if overload == "Tensor_Tensor" and t_args:
            return _call(packet("List"), tensors(op.args)), "_foreach_pow.List"
        if overload == "Tensor_Scalar" and kinds[0] == "T" and kinds[1] in ("c", "S"):
            return _scalar_call(name, plan, op.args[:1], op.args[1], loop, lanes)
        if overload == "Scalar" and kinds == ["c", "T"]:
            base = plan._value(op.args[0])
            (exponents,) = tensors(op.args[1:])
            pow_ = aten._foreach_pow.ScalarAndTensor
            return (lambda env: pow_(base(env), exponents(env))), "_foreach_pow.ScalarAndTensor"
        return None
    if name == "lerp" and not kw:
        if overload == "Tensor" and t_args:
            return _call(packet("List"), tensors(op.args)), "_foreach_lerp.List"
        if overload == "Scalar" and kinds[:2] == ["T", "T"] and kinds[2] in ("c", "S"):
            return _scalar_call(name, plan, op.args[:2], op.args[2], loop, lanes)
        return None
    if name in ("addcmul", "addcdiv") and overload == "default" and kinds == ["T", "T", "T"]:
        value = kw.pop("value", ("const", 1))
        if kw or _kind(value) not in ("c", "S"):
            return None
        return _scalar_call(name, plan, op.args, value, loop, lanes)
    return None


def _kind(arg: Arg) -> str:
    """"T": a column of tensors, "S": a column of per-lane numbers, "t": one tensor for every
    lane, "c": one number (or constant) for every lane, "x": anything else."""
    tag = arg[0]
    if tag == "column":
        return "T" if all(_is_tensor(n) for n in arg[1]) else "S"
    if tag == "node":
        val = arg[1].meta.get("val")
        if isinstance(val, torch.Tensor):
            return "t"
        return "c" if isinstance(val, bool | int | float) or is_python(arg[1]) else "x"
    if tag == "const":
        return "c" if isinstance(arg[1], bool | int | float) else "x"
    return "x"


def _repeat(load: Load, lanes: int) -> Load:
    return lambda env: [load(env)] * lanes


def _call(fn: Any, loads: list[Load], kwargs: dict[str, Load] | None = None) -> Load:
    if not kwargs:
        if len(loads) == 1:
            (only,) = loads
            return lambda env: fn(only(env))
        return lambda env: fn(*(f(env) for f in loads))
    names, values = list(kwargs), list(kwargs.values())
    return lambda env: fn(
        *(f(env) for f in loads), **{k: v(env) for k, v in zip(names, values, strict=True)}
    )


def _scalar_call(
    name: str,
    plan: BatchedPlan,
    tensor_args: Sequence[Arg],
    scalar: Arg,
    loop: Callable[[Env], Any],
    lanes: int,
) -> tuple[Callable[[Env], Any], str]:
    """``_foreach_{name}.Scalar(tensors..., s)`` for one number, ``.ScalarList`` for a number
    per lane (the loop where torch has no such overload)."""
    packet = getattr(aten, f"_foreach_{name}")
    one, per_lane = packet.Scalar, getattr(packet, "ScalarList", None)
    loads = [plan._value(a) for a in tensor_args]
    if scalar[0] != "column":
        value = plan._value(scalar)
        return (lambda env: one(*(f(env) for f in loads), value(env))), f"_foreach_{name}.Scalar"
    column = plan._column(scalar[1])

    def run(env: Env) -> Any:
        values = column(env)
        if isinstance(values, Same):
            return one(*(f(env) for f in loads), values.value)
        if per_lane is None:
            return loop(env)
        return per_lane(*(f(env) for f in loads), values)

    return run, f"_foreach_{name}.Scalar/ScalarList"
