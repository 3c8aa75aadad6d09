"""The torch backend's batched plan: each op a step repeats over lanes runs as one call.

``families.py`` reads the graph as BatchedOps. A family (one ATen op applied to every lane)
runs as the ``_foreach_*`` op of the same semantics where one exists (``foreach_forms.py``:
on the CPU a foreach op runs the per-tensor op on each tensor, so results are those of the
node-by-node plan, bit for bit), otherwise as a loop over the lanes inside one prepared
function. Python arithmetic on per-lane values (a step count read with ``.item()``) runs per
lane as the graph computes it, once when every lane holds the same value (the usual case:
``Same``). Ops run in place where nothing reads what they overwrite (``batched_inplace.py``);
the other writebacks into the inputs run as one ``_foreach_copy_``, in the graph's order.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import fx

from optkernels._torch_compat import direct_call
from optkernels.batched_inplace import in_place_ops
from optkernels.families import Arg, BatchedOp, Families
from optkernels.foreach_forms import (
    Form,
    can_run_in_place,
    eager_op,
    foreach_form,
    is_tensor,
    self_inplace_op,
    strided_eager_op,
)

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
        forms = [foreach_form(op) if op.kind == "family" else None for op in program.ops]
        self.inplace, dropped = in_place_ops(
            program,
            self._loc,
            slots,
            fresh=lambda k: program.ops[k].kind == "foreach" or forms[k] is not None,
            can=lambda k: can_run_in_place(program.ops[k], forms[k]),
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
            if any(is_tensor(n) for n in arg[1]):
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
            target = eager_op(node)
            how = " (on copies, as eager ran it)" if target is not node.target else ""
            self._lines.append(f"#   {node.name}: {op.target}{how}")
            return lambda env: target(*args(env), **kwargs(env))
        loop = self._loop(op)
        head = f"#   {node.name} x{op.lanes}: {op.target}"
        if op.target is aten._local_scalar_dense.default:
            self._lines.append(f"{head} (.item() per lane)")
            return self._read(op)
        if not is_tensor(node):
            self._lines.append(f"{head} (per lane, once if all lanes agree)")
            return self._scalar(op, loop)
        strided = [strided_eager_op(n) for n in op.nodes]
        if any(strided):
            if inplace:  # (on the tensors themselves: each lane runs the op eager ran)
                strided = [_on_self(self_inplace_op(n) or _inplace_op(n)) for n in op.nodes]
            where = "the tensors" if inplace else "copies of strided lanes"
            self._lines.append(f"{head} (loop; in place on {where}, as eager)")
            return self._loop(op, strided)
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
        loads = [
            self._value(a) if a[0] == "column" else _repeat(self._value(a), form.lanes)
            for a in form.tensors
        ]
        kwargs = self._kwargs(form.kwargs)
        if form.overload == "ScalarAndTensor":
            base = self._value(form.scalar)  # type: ignore[arg-type]
            (exponents,) = loads
            return lambda env: packet.ScalarAndTensor(base(env), exponents(env))
        call: Callable[[Env, list[Any]], Any]
        if form.scalar is None:
            fn = getattr(packet, form.overload)

            def call(env: Env, tensors: list[Any]) -> Any:
                return fn(*tensors, **kwargs(env))

        elif form.scalar[0] != "column":
            value, one = self._value(form.scalar), packet.Scalar

            def call(env: Env, tensors: list[Any]) -> Any:
                return one(*tensors, value(env))

        else:
            column, one, per_lane = self._column(form.scalar[1]), packet.Scalar, packet.ScalarList

            def call(env: Env, tensors: list[Any]) -> Any:
                values = column(env)
                if isinstance(values, Same):
                    return one(*tensors, values.value)
                return per_lane(*tensors, values)

        if inplace:

            def run(env: Env) -> Any:
                tensors = [f(env) for f in loads]
                call(env, tensors)
                return tensors[0]

            return run
        return lambda env: call(env, [f(env) for f in loads])

    def _loop(self, op: BatchedOp, strided: Sequence[Any] = ()) -> Callable[[Env], Any]:
        """``[target(lane's args) for each lane]`` (one call when no argument differs between
        lanes: every lane reads the same tensor, which nothing writes in place). ``strided``:
        per lane, the callable to run instead (strided_eager_op), or None."""
        target, lanes = direct_call(op.target), op.lanes
        if any(strided):
            targets = [t or target for t in strided]
            args = [self._per_lane(a, lanes) for a in op.args]
            kwargs = [(k, self._per_lane(a, lanes)) for k, a in op.kwargs]

            def run_strided(env: Env) -> list[Any]:
                rows = zip(*(f(env) for f in args), strict=True)
                kws = zip(*(f(env) for _, f in kwargs), strict=True) if kwargs else repeat(())
                names = [k for k, _ in kwargs]
                return [
                    t(*a, **dict(zip(names, kw, strict=True)))
                    for t, a, kw in zip(targets, rows, kws, strict=False)
                ]

            return run_strided
        args = [self._per_lane(a, lanes) for a in op.args]
        same = tuple((k, a) for k, a in op.kwargs if not _has_column(a))
        varying = [(k, a) for k, a in op.kwargs if _has_column(a)]
        fixed = self._kwargs(same)
        if not varying and not any(_has_column(a) for a in op.args) and not op.returned:
            values = self._value(("seq", tuple, op.args))
            return lambda env: [target(*values(env), **fixed(env))] * lanes
        if not varying:

            def run(env: Env) -> list[Any]:
                kw = fixed(env)
                return [target(*a, **kw) for a in zip(*(f(env) for f in args), strict=True)]

            return run
        names = [k for k, _ in varying]
        per_lane = [self._per_lane(a, lanes) for _, a in varying]

        def run_kwargs(env: Env) -> list[Any]:
            kw = fixed(env)
            rows = zip(*(f(env) for f in per_lane), strict=True)
            return [
                target(*a, **kw, **dict(zip(names, k, strict=True)))
                for a, k in zip(zip(*(f(env) for f in args), strict=True), rows, strict=True)
            ]

        return run_kwargs

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


def _has_column(arg: Arg) -> bool:
    """Whether ``arg`` differs between lanes."""
    if arg[0] == "column":
        return True
    return arg[0] == "seq" and any(_has_column(a) for a in arg[2])


def _structure(arg: Any) -> Arg:
    """An output structure (nodes in lists/tuples) as an Arg read whole."""
    if isinstance(arg, fx.Node):
        return ("node", arg)
    if isinstance(arg, list | tuple):
        return ("seq", type(arg), tuple(_structure(a) for a in arg))
    return ("const", arg)


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


def _on_self(fn: Any) -> Callable[..., Any]:
    def run(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        fn(t, *args, **kwargs)
        return t

    return run


def _repeat(load: Load, lanes: int) -> Load:
    return lambda env: [load(env)] * lanes
