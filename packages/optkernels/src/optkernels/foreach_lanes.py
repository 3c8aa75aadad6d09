"""A foreach step read as a LaneProgram (``Builder``): its foreach ops are lane ops, the
single-item work between them (a step count read as a number, the writebacks) is grouped
by item into lane ops too."""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from optkernels.compressed import DEQUANTIZE, QUANTIZE
from optkernels.lane_program import (
    _FOREACH,
    _SINGLE,
    IGNORED_KWARGS,
    LaneOp,
    LaneProgram,
    NotLanes,
    check_numels,
    lane_vars,
    result_dtypes,
)
from optkernels.lane_scan import is_foreach
from optkernels.numbers import ASSERT, PYTHON_OPS, is_assert, scalar_constant

aten = torch.ops.aten


class Builder:
    def __init__(self, lanes: int, numbers: set[fx.Node]) -> None:
        # (the part's foreach lists tell the lane count before any op is visited: a per-item
        # op on graph inputs alone needs it to know where its lanes end)
        self.lanes: int | None = lanes if lanes > 0 else None
        self.numbers = numbers  # Python arithmetic on a lane's value (scan)
        self.program = LaneProgram(lanes=0)
        self.input_index: dict[tuple[fx.Node, ...], int] = {}
        self.value: dict[fx.Node, Any] = {}  # node -> ("lanes", var) | ("scalar", i) | ...
        self.small: dict[int, bool] = {}
        self.copies: dict[fx.Node, tuple[int, int]] = {}  # target placeholder -> (var, lane)
        # per-item op groups: [key, var, members so far, their recorded result dtypes, the
        # input columns their graph-input arguments fill, lane by lane]
        self.groups: list[list[Any]] = []
        self.columns: list[tuple[int, int, list[fx.Node]]] = []  # (input, var, nodes so far)
        self.free: dict[Any, int] = {}  # lane-independent per-item values -> their var
        # quantize node, and the payload it is written to -> (format, counter, salt)
        self.rounded: dict[fx.Node, tuple[str, int, int]] = {}
        self.rounded_writes: dict[fx.Node, tuple[str, int, int]] = {}
        # a free var's recorded result dtypes, one entry per use (lane by lane)
        self.free_dtypes: dict[int, list[tuple[torch.dtype, ...]]] = {}

    def visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                self.value[node] = ("tensor", node)
            elif isinstance(val, bool | int | float):
                self.value[node] = ("scalar", len(self.program.scalar_inputs))
                self.program.scalar_inputs.append(node)
            else:
                raise NotLanes(f"input {node.name} is neither a tensor nor a Python scalar")
            return
        if node.op == "get_attr":
            constant = scalar_constant(node)
            if constant is not None:  # the same 0-dim tensor in every lane
                value, dtype = constant
                self.value[node] = ("free", ("full", "", (("const", value),), ()), (dtype,))
            return
        if node.op == "output":
            outs = node.args[0]
            if outs:
                raise NotLanes("the graph returns values (only in-place steps are fused)")
            return
        if node.op != "call_function":
            raise NotLanes(f"{node.op} node {node.name}")
        target = node.target
        if target is operator.getitem:
            base = self.value.get(node.args[0])  # type: ignore[arg-type]
            if base is None or base[0] != "lanes":
                raise NotLanes(f"{node.name} takes an item of something that is not a lane list")
            self.value[node] = ("item", base[1], node.args[1])
            return
        if target is DEQUANTIZE or target is QUANTIZE:
            self._compressed(node)
            return
        if target is aten.copy_.default:
            dst, src = node.args
            if src in self.rounded:
                self.rounded_writes[dst] = self.rounded[src]  # type: ignore[index]
            item = self.value.get(src)  # type: ignore[arg-type]
            if (
                item is None
                or item[0] not in ("item", "peritem")
                or self.value.get(dst, ("",))[0] != "tensor"  # type: ignore[arg-type]
            ):
                raise NotLanes(f"{node.name} writes back something other than a lane value")
            self.copies[dst] = (item[1], item[2])  # type: ignore[index]
            return
        if node in self.numbers:  # Python arithmetic on a lane's value: one op per lane
            if is_assert(node):
                self._per_item(node, ASSERT, "")
            elif target in PYTHON_OPS:
                self._per_item(node, PYTHON_OPS[target], "")
            else:
                raise NotLanes(f"{node.name}: Python {target} on a value read with .item()")
            return
        if getattr(target, "__module__", None) == "_operator" or target in (min, max, abs):
            if any(self._kind(a) not in ("scalar", "const") for a in node.args):
                raise NotLanes(
                    f"{node.name} mixes Python arithmetic with tensors (a value read with "
                    ".item(), as a capturable=False path does)"
                )
            self.value[node] = ("scalar", -1 - len(self.program.scalar_nodes))
            self.program.scalar_nodes.append(node)
            return
        name = getattr(target, "__name__", "")  # e.g. "_foreach_add.Scalar"
        base, _, overload = name.partition(".")
        if base in _SINGLE:
            self._per_item(node, _SINGLE[base], overload)
            return
        if not base.startswith("_foreach_") or base[len("_foreach_") :] not in _FOREACH:
            raise NotLanes(f"{target} is not a foreach op the kernel generator knows")
        op = _FOREACH[base[len("_foreach_") :]]
        args = tuple(self._arg(a) for a in node.args)
        kwargs = tuple(sorted((k, self._arg(v)) for k, v in node.kwargs.items()))
        self.value[node] = ("lanes", self._emit((op, overload, args, kwargs), result_dtypes(node)))

    def _compressed(self, node: fx.Node) -> None:
        """Compressed state (optkernels.compressed): a dequantized payload is the payload
        itself (a kernel converts what it loads), and a quantized value is the value, which
        the kernel converts where it stores it into its column (bf16: stochastic rounding;
        int8: codes and block scales)."""
        payload_or_value, fmt = node.args[0], node.args[1]
        if node.target is DEQUANTIZE:
            self.value[node] = ("tensor", payload_or_value)
            return
        value = self.value.get(payload_or_value)  # type: ignore[arg-type]
        if value is None or value[0] not in ("item", "peritem"):
            raise NotLanes(f"{node.name} quantizes something other than a lane value")
        counter = -1
        if fmt == "bf16":
            ref = self.value.get(node.args[2])  # type: ignore[arg-type]
            if ref is None or ref[0] != "scalar":
                raise NotLanes(f"{node.name}: its counter is not a scalar input")
            counter = ref[1]
        self.value[node] = value
        self.rounded[node] = (fmt, counter, node.args[3])  # type: ignore[assignment]

    def _per_item(self, node: fx.Node, op: str, overload: str) -> None:
        """A single-tensor op (or Python arithmetic on a ``.item()``) applied to item i of
        lane lists (``[torch.where(r > 5, ...) for r in rs]``, ``[1 - beta1 ** s.item() for
        s in steps]``): the K ops of one shape, for i = 0..K-1, form one lane op ``op``. Its
        graph inputs (a prelude's per-tensor results: ``[n.pow(0.5) for n in all_reduced]``)
        form an input column lane by lane; an op on such inputs alone is the item after the
        last one of its kind (the first when that group is complete)."""
        index: set[int] = set()
        tensors: list[fx.Node] = []

        def template(a: Any) -> Any:
            if isinstance(a, fx.Node):
                v = self.value.get(a)
                if v is None:
                    raise NotLanes(f"{a.name} is used before it is computed")
                if v[0] in ("item", "peritem"):
                    index.add(v[2])
                    return ("lane", v[1])
                if v[0] == "scalar":
                    return v
                if v[0] == "free":
                    return ("lane", self._free_var(v[1], v[2]))
                if v[0] == "tensor":
                    tensors.append(v[1])
                    return ("column", len(tensors) - 1)
                raise NotLanes(f"{a.name} ({v[0]}) cannot be an argument of a per-item op")
            if isinstance(a, torch.dtype | torch.device | torch.layout | torch.memory_format):
                return ("ignore", a)
            if isinstance(a, bool | int | float | str) or a is None:  # (str: a check's message)
                return ("const", a)
            raise NotLanes(f"argument {a!r} of a per-item op")

        args = tuple(template(a) for a in node.args)
        kwargs = tuple(
            (k, template(v)) for k, v in sorted(node.kwargs.items()) if k not in IGNORED_KWARGS
        )
        key = (op, overload, args, kwargs)
        if not index and not tensors:  # same for every lane (a constant: scalar_tensor(0.0))
            self.value[node] = ("free", key, result_dtypes(node))
            return
        if not index and self.lanes is not None and _shared(node, tensors):
            # (``-lr`` of a Tensor lr, the one tensor argument of ``_foreach_mul(grads, -lr)``:
            # each lane computes it from the same input)
            shared = [("lane", self._input((t,) * self.lanes)) for t in tensors]
            key = _with_shared(key, shared)
            self.value[node] = ("lanes", self._emit(key, result_dtypes(node)))
            return
        if len(index) > 1:
            raise NotLanes(f"{node.name} mixes items of different lanes")
        i = index.pop() if index else self._next_item(key)
        if i == 0:
            columns = [self._column(t) for t in tensors]
            var = self._emit(_with_columns(key, [c[0] for c in columns]))
            self.groups.append([key, var, 1, [result_dtypes(node)], [c[1] for c in columns]])
            self.value[node] = ("peritem", var, 0)
            return
        for group in reversed(self.groups):
            if group[0] == key and group[2] == i:
                group[2] += 1
                group[3].append(result_dtypes(node))
                for column, tensor in zip(group[4], tensors, strict=True):
                    column.append(tensor)
                self.value[node] = ("peritem", group[1], i)
                return
        raise NotLanes(f"{node.name}: per-item ops are not the same for every lane")

    def _next_item(self, key: Any) -> int:
        for group in reversed(self.groups):
            if group[0] == key:
                return int(group[2]) if group[2] != self.lanes else 0
        return 0

    def _column(self, first: fx.Node) -> tuple[int, list[fx.Node]]:
        """A new input column whose lane 0 is ``first``; the group's later items fill it
        (``finish`` checks that they do, for every lane)."""
        small = first.meta["val"].dim() == 0
        var = self.program.num_vars
        self.program.num_vars += 1
        self.small[var] = small
        index = len(self.program.inputs)
        self.program.inputs.append(())
        self.program.input_small.append(small)
        self.program.ops.append(LaneOp(var, "input", "", (index,), (), small))
        nodes = [first]
        self.columns.append((index, var, nodes))
        return var, nodes

    def _emit(self, key: Any, dtypes: tuple[torch.dtype, ...] = ()) -> int:
        op, overload, args, kwargs = key
        small = all(self.small[v] for v in lane_vars(args, kwargs))
        var = self.program.num_vars
        self.program.num_vars += 1
        self.small[var] = small
        self.program.ops.append(LaneOp(var, op, overload, args, kwargs, small, dtypes))
        return var

    def _free_var(self, key: Any, dtypes: tuple[torch.dtype, ...]) -> int:
        if key not in self.free:
            self.free[key] = self._emit(key, dtypes)
        self.free_dtypes.setdefault(self.free[key], []).append(dtypes)
        return self.free[key]

    def _kind(self, a: Any) -> str:
        if isinstance(a, fx.Node):
            v = self.value.get(a)
            return v[0] if v else "?"
        return "const"

    def _arg(self, a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = self.value.get(a)
            if v is None:
                raise NotLanes(f"{a.name} is used before it is computed")
            if v[0] == "lanes":
                return ("lane", v[1])
            if v[0] == "scalar":
                return ("scalar", v[1])
            if v[0] == "free":  # (a 0-dim constant the step made)
                return ("lane", self._free_var(v[1], v[2]))
            if v[0] == "tensor" and self.lanes is not None:
                return ("lane", self._input((v[1],) * self.lanes))  # one tensor for all lanes
            raise NotLanes(f"{a.name} ({v[0]}) cannot be an argument of a lane op")
        if isinstance(a, list | tuple):
            refs = [self.value.get(x) if isinstance(x, fx.Node) else None for x in a]
            if a and all([r is not None and r[0] == "tensor" for r in refs]):
                return ("lane", self._input(tuple([r[1] for r in refs])))  # type: ignore[index]
            if a and all(r is not None and r[0] in ("item", "peritem") for r in refs):
                vars_ = {r[1] for r in refs}  # type: ignore[index]
                if len(vars_) == 1 and [r[2] for r in refs] == list(range(len(a))):  # type: ignore[index]
                    self._lanes(len(a))
                    return ("lane", vars_.pop())
                raise NotLanes("a list argument takes items of different lane values")
            if all(not isinstance(x, fx.Node) for x in a):
                return ("const_list", tuple(a))
            raise NotLanes("a list argument mixes tensors with other values")
        if isinstance(a, bool | int | float) or a is None:
            return ("const", a)
        raise NotLanes(f"argument {a!r} of a foreach op")

    def _input(self, nodes: tuple[fx.Node, ...], load: bool = True) -> int:
        self._lanes(len(nodes))
        if nodes not in self.input_index:
            # A list of 0-dim tensors only (step counts) is per-lane "small": read once per
            # lane. A 0-dim tensor among larger ones (a scalar parameter) is a lane of size 1.
            small = all(n.meta["val"].dim() == 0 for n in nodes)
            var = self.program.num_vars
            self.program.num_vars += 1
            self.small[var] = small
            self.input_index[nodes] = var
            self.program.inputs.append(nodes)
            self.program.input_small.append(small)
            if load:
                index = len(self.program.inputs) - 1
                self.program.ops.append(LaneOp(var, "input", "", (index,), (), small))
        return self.input_index[nodes]

    def _lanes(self, n: int) -> None:
        if self.lanes is None:
            self.lanes = n
        elif self.lanes != n:
            raise NotLanes(f"foreach lists of different lengths ({self.lanes} and {n})")

    def finish(self) -> LaneProgram:
        if self.lanes is None:
            raise NotLanes("the graph has no foreach ops")
        program = self.program
        program.lanes = self.lanes
        if any(group[2] != self.lanes for group in self.groups):
            raise NotLanes("a per-item op is applied to only some lanes")
        for index, var, filled in self.columns:
            if program.input_small[index] and any(n.meta["val"].dim() for n in filled):
                raise NotLanes("a per-item op takes 0-dim inputs in some lanes only")
            program.inputs[index] = tuple(filled)
            self.input_index.setdefault(tuple(filled), var)
        # A per-item op's lanes are separate nodes: their recorded dtypes, lane by lane.
        position = {op.out: j for j, op in enumerate(program.ops)}
        for _, var, _, recorded, _ in self.groups:
            if all(len(d) == 1 for d in recorded):
                j = position[var]
                program.ops[j] = replace(program.ops[j], dtypes=tuple(d[0] for d in recorded))
        # A value each lane makes alike (``scalar_tensor(eta)``) but in its own dtype (a
        # bfloat16 and a float32 param's): one var, the lanes' dtypes, used lane by lane.
        for var, uses in self.free_dtypes.items():
            if len(set(uses)) <= 1:
                continue
            if len(uses) != self.lanes or not all(len(d) == 1 for d in uses):
                raise NotLanes("a value the lanes share has a different dtype in each lane")
            j = position[var]
            program.ops[j] = replace(program.ops[j], dtypes=tuple(d[0] for d in uses))
        # Each written lane value must go to one input list, lane by lane.
        by_var: dict[int, dict[int, fx.Node]] = {}
        for dst, (var, lane) in self.copies.items():
            by_var.setdefault(var, {})[lane] = dst
        for var, targets in by_var.items():
            if sorted(targets) != list(range(self.lanes)):
                raise NotLanes("a lane value is written back to only some of its lanes")
            nodes = tuple([targets[i] for i in range(self.lanes)])
            self._input(nodes, load=False)
            column = program.inputs.index(nodes)
            program.writes.append((var, column))
            rounded = {
                i: self.rounded_writes[n] for i, n in enumerate(nodes) if n in self.rounded_writes
            }
            if rounded:
                if len(set(rounded.values())) != 1:
                    raise NotLanes("a column of bfloat16 state is rounded with different salts")
                fmt, counter, salt = next(iter(rounded.values()))
                program.rounding[column] = (fmt, counter, salt, frozenset(rounded))
        covered = {n for nodes in program.inputs for n in nodes}
        if set(self.copies) - covered:
            raise NotLanes("a write-back target is not part of a lane list")
        check_numels(program)
        return program


def _with_columns(key: Any, column_vars: list[int]) -> Any:
    """A per-item op's key with its ("column", k) arguments read from the k-th column."""

    def fill(a: Any) -> Any:
        return ("lane", column_vars[a[1]]) if isinstance(a, tuple) and a[:1] == ("column",) else a

    op, overload, args, kwargs = key
    return op, overload, tuple(fill(a) for a in args), tuple((k, fill(v)) for k, v in kwargs)


def _shared(node: fx.Node, tensors: list[fx.Node]) -> bool:
    """Whether a single-tensor op on 0-dim graph inputs alone makes the one tensor argument of
    foreach ops (every user takes it as such, not as a list item): a value every lane shares,
    not the first of a per-item group (``[n.pow(0.5) for n in norms]``, whose nodes each a
    lane's list item or per-item op reads)."""
    if not tensors or not node.users:
        return False
    if any(getattr(t.meta.get("val"), "dim", lambda: 1)() != 0 for t in tensors):
        return False
    return all(is_foreach(user) and node in user.args for user in node.users)


def _with_shared(key: Any, shared: list[Any]) -> Any:
    """``key`` with its ("column", j) arguments replaced by ``shared[j]``."""

    def put(a: Any) -> Any:
        if isinstance(a, tuple) and len(a) == 2 and a[0] == "column":
            return shared[a[1]]
        return a

    op, overload, args, kwargs = key
    return (op, overload, tuple(put(a) for a in args), tuple((k, put(v)) for k, v in kwargs))
