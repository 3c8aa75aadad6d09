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
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
from torch import fx

from optkernels.families import Arg, BatchedOp, Families, is_python
from optkernels.inplace import reinplace
from optkernels.reference import _LOW_PRECISION, _as_eager_ran

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
        slots = [self._new_slot(None) for _ in program.ops]
        for slot, op in zip(slots, program.ops, strict=True):
            if op.kind == "family":
                self._length[slot] = op.lanes
                for i, node in enumerate(op.nodes):
                    self._loc[node] = (slot, i)
                continue
            (node,) = op.nodes
            self._loc[node] = (slot, None)
            if op.kind == "foreach":
                self._length[slot] = len(node.meta["val"])
                for user in node.users:
                    if user.target is operator.getitem:
                        self._loc[user] = (slot, user.args[1])  # type: ignore[assignment]
        self.widest = max((self._length[s] for s in slots if s in self._length), default=1)
        forms = [_foreach_form(op) if op.kind == "family" else None for op in program.ops]
        self.inplace, dropped = reinplace(
            program,
            self._loc,
            slots,
            fresh=lambda k: program.ops[k].kind == "foreach" or forms[k] is not None,
            can=lambda k: _can_run_in_place(program.ops[k], forms[k]),
        )
        self._input_columns: dict[tuple[int, ...], int] = {}
        self._fill: list[tuple[int, Callable[[Env], Any]]] = []  # input columns, each call
        self._steps: list[tuple[int, Callable[[Env], Any]]] = []
        self._lines: list[str] = []
        for k, (slot, op) in enumerate(zip(slots, program.ops, strict=True)):
            self._steps.append((slot, self._runner(op, forms[k], k in self.inplace)))
        self.writes = [w for i, w in enumerate(program.writes) if i not in dropped]
        self._writes = self._writeback(self.writes)
        self._output = self._value(("seq", tuple, (_structure(program.output),)))
        # The per-tensor kernels run are the graph's, less the writes made no-ops.
        self.kernel_launches_per_step = -len(dropped) + sum(
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
        whole = self._length.get(slot) == len(nodes) and all(s == slot for s, _ in rest)
        if whole and [i for _, i in locs] == list(range(len(nodes))):
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

    def _runner(self, op: BatchedOp, form: Form | None, inplace: bool) -> Callable[[Env], Any]:
        node = op.nodes[0]
        if op.kind != "family":
            args = self._value(("seq", tuple, op.args))
            kwargs = self._kwargs(op.kwargs)
            if op.kind == "shared":
                return lambda env: op.target(*args(env), **kwargs(env))
            if inplace:
                self._lines.append(f"#   {node.name}: {_inplace_op(node)} (in place)")
                return _in_place(_inplace_op(node), args, kwargs)
            self._lines.append(f"#   {node.name}: {op.target}")
            target = _as_eager_ran(node)
            return lambda env: target(*args(env), **kwargs(env))
        loop = self._loop(op)
        head = f"#   {node.name} x{op.lanes}: {op.target}"
        if op.target is aten._local_scalar_dense.default:
            self._lines.append(f"{head} (.item() per lane)")
            return self._read(op)
        if not _is_tensor(node):
            self._lines.append(f"{head} (per lane, once if all lanes agree)")
            return self._scalar(op, loop)
        if form is not None:
            suffix = "_" if inplace else ""
            how = f"_foreach_{form.name}{suffix}.{form.overload}"
            self._lines.append(f"{head} ({how}{' (in place)' if inplace else ''})")
            return self._call(form, inplace)
        self._lines.append(f"{head} (loop)")
        return loop

    def _kwargs(self, kwargs: tuple[tuple[str, Arg], ...]) -> Callable[[Env], dict[str, Any]]:
        if not kwargs:
            return lambda env: {}
        names = [k for k, _ in kwargs]
        values = [self._value(a) for _, a in kwargs]
        return lambda env: {k: v(env) for k, v in zip(names, values, strict=True)}

    def _call(self, form: Form, inplace: bool) -> Callable[[Env], Any]:
        """The foreach call of ``form`` (in place: on its first tensor list, returned)."""
        packet = getattr(aten, f"_foreach_{form.name}{'_' if inplace else ''}")
        tensors = [
            self._value(a) if a[0] == "column" else _repeat(self._value(a), form.lanes)
            for a in form.tensors
        ]
        kwargs = self._kwargs(form.kwargs)
        if form.overload == "ScalarAndTensor":
            base = self._value(form.scalar)  # type: ignore[arg-type]
            (exponents,) = tensors
            return lambda env: packet.ScalarAndTensor(base(env), exponents(env))
        call: Callable[[Env], Any]
        if form.scalar is None:
            fn = getattr(packet, form.overload)

            def call(env: Env) -> Any:
                return fn(*(f(env) for f in tensors), **kwargs(env))

        elif form.scalar[0] != "column":
            value, one = self._value(form.scalar), packet.Scalar

            def call(env: Env) -> Any:
                return one(*(f(env) for f in tensors), value(env))

        else:
            column, one, per_lane = self._column(form.scalar[1]), packet.Scalar, packet.ScalarList

            def call(env: Env) -> Any:
                values = column(env)
                if isinstance(values, Same):
                    return one(*(f(env) for f in tensors), values.value)
                return per_lane(*(f(env) for f in tensors), values)

        if not inplace:
            return call
        first = tensors[0]

        def run(env: Env) -> Any:
            call(env)
            return first(env)

        return run

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

    def _writeback(self, writes: list[tuple[fx.Node, fx.Node]]) -> Callable[[Env], None] | None:
        """One ``_foreach_copy_`` of every written value into its input, in graph order."""
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

    def describe(self) -> str:
        written = len(self.program.writes)
        header = [
            f"# torch backend, batched over lanes: {len(self.program.ops)} calls per step "
            f"(up to {self.widest} lanes each), {len(self.inplace)} "
            f"of them in place; {len(self.writes)} of {written} writeback(s) left, in one "
            "_foreach_copy_:",
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


@dataclass(frozen=True)
class Form:
    """A family as one call of ``_foreach_{name}``: ``overload`` "List"/"default" (tensor
    lists, ``kwargs``), "Scalar" (then ``.Scalar`` or ``.ScalarList`` by whether ``scalar``
    is one number or one per lane) or "ScalarAndTensor" (``scalar`` first)."""

    name: str
    overload: str
    lanes: int
    tensors: tuple[Arg, ...]
    scalar: Arg | None = None
    kwargs: tuple[tuple[str, Arg], ...] = ()


def _foreach_form(op: BatchedOp) -> Form | None:
    """The family ``op`` as one foreach call; None where torch has no foreach op of the same
    semantics for these argument kinds."""
    name, _, overload = op.target.__name__.partition(".")
    kinds = [_kind(a) for a in op.args]
    kw = dict(op.kwargs)
    lanes, args = op.lanes, op.args
    tensor_args = len(kinds) == 2 and all(k in ("T", "t") for k in kinds) and "T" in kinds
    scalar_second = len(kinds) == 2 and kinds[0] == "T" and kinds[1] in ("c", "S")
    if name in _UNARY and overload == "default" and kinds == ["T"] and not kw:
        return Form(name, "default", lanes, args)
    if name in ("add", "sub", "mul", "div") and overload in ("Tensor", "Scalar"):
        alpha = kw.pop("alpha", None)
        if kw or (alpha is not None and _kind(alpha) != "c"):
            return None
        if tensor_args:
            extra = (("alpha", alpha),) if alpha is not None else ()
            return Form(name, "List", lanes, args, kwargs=extra)
        if scalar_second and alpha is None:
            return Form(name, "Scalar", lanes, args[:1], args[1])
        return None
    if name in ("addcmul", "addcdiv") and overload == "default":
        return _addc_form(op)
    if kw:
        return None
    if name in ("maximum", "minimum") and overload == "default" and tensor_args:
        return Form(name, "List", lanes, args)
    if name in ("clamp_min", "clamp_max", "pow"):
        if overload in ("Tensor", "Tensor_Tensor") and tensor_args:
            return Form(name, "List", lanes, args)
        if overload in ("default", "Tensor_Scalar") and scalar_second:
            return Form(name, "Scalar", lanes, args[:1], args[1])
        if name == "pow" and overload == "Scalar" and kinds == ["c", "T"]:
            return Form(name, "ScalarAndTensor", lanes, args[1:], args[0])
        return None
    if name == "lerp" and len(kinds) == 3 and kinds[:2] == ["T", "T"]:
        if overload == "Tensor" and kinds[2] in ("T", "t"):
            return Form(name, "List", lanes, args)
        if overload == "Scalar" and kinds[2] in ("c", "S"):
            return Form(name, "Scalar", lanes, args[:2], args[2])
        return None
    return None


def _addc_form(op: BatchedOp) -> Form | None:
    """``addcmul``/``addcdiv(self, t1, t2, value=v)`` as ``_foreach_addc*.Scalar``."""
    kinds = [_kind(a) for a in op.args]
    kw = dict(op.kwargs)
    value = kw.pop("value", ("const", 1))
    if kinds != ["T", "T", "T"] or kw or _kind(value) not in ("c", "S"):
        return None
    name = op.target.__name__.partition(".")[0]
    return Form(name, "Scalar", op.lanes, op.args, value)


# In-place foreach ops whose CPU kernels round float16/bfloat16 differently from their
# functional forms (a Scalar rounded to the dtype first). The node-by-node plan runs them
# where eager did (``reference._ROUNDS_DIFFERENTLY_IN_PLACE``, ``_as_eager_ran``); elsewhere
# the batched plan must not.
_ROUNDS_IN_PLACE = frozenset({aten._foreach_mul_.Scalar, aten._foreach_mul_.ScalarList})


def _can_run_in_place(op: BatchedOp, form: Form | None) -> bool:
    """Whether ``op`` has an in-place foreach form on its first argument that computes what
    the node-by-node plan computes for it."""
    low = any(getattr(v, "dtype", None) in _LOW_PRECISION for v in _vals(op))
    if op.kind == "foreach":
        node = op.nodes[0]
        name, _, overload = op.target.__name__.partition(".")
        packet = getattr(aten, f"{name}_", None)
        if packet is None or overload not in packet.overloads():
            return False
        rounds = getattr(packet, overload) in _ROUNDS_IN_PLACE and low
        # (unless the node-by-node plan runs that very op: what eager ran)
        return not rounds or _as_eager_ran(node) is not node.target
    if op.kind != "family" or form is None or form.overload == "ScalarAndTensor":
        return False
    packet = getattr(aten, f"_foreach_{form.name}_", None)
    needed = ("Scalar", "ScalarList") if form.overload == "Scalar" else (form.overload,)
    if packet is None or not all(o in packet.overloads() for o in needed):
        return False
    return not (low and any(getattr(packet, o) in _ROUNDS_IN_PLACE for o in needed))


def _vals(op: BatchedOp) -> list[Any]:
    """The values ``op`` computes (per lane, per item)."""
    out = []
    for node in op.nodes:
        val = node.meta.get("val")
        out.extend(val if isinstance(val, list | tuple) else [val])
    return out


def _inplace_op(node: fx.Node) -> Any:
    """The in-place form of a foreach node's op (what eager ran, where recorded)."""
    name, _, overload = node.target.__name__.partition(".")  # type: ignore[union-attr]
    return getattr(getattr(aten, f"{name}_"), overload)


def _in_place(fn: Any, args: Load, kwargs: Callable[[Env], dict[str, Any]]) -> Load:
    def run(env: Env) -> Any:
        values = args(env)
        fn(*values, **kwargs(env))
        return values[0]

    return run


def _kind(arg: Arg) -> str:
    """The kind of an argument: "T" a column of tensors, "S" a column of per-lane numbers,
    "t" one tensor for every lane, "c" one number (or constant) for every lane, "x" other."""
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
