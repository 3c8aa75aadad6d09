"""A for-loop step read as a LaneProgram: the same op sequence once per parameter, each on
its own tensors; component i of the graph's tensor dataflow is lane i."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from optkernels.lane_program import (
    _SINGLE,
    IGNORED_KWARGS,
    LaneOp,
    LaneProgram,
    NotLanes,
    check_numels,
    result_dtypes,
)
from optkernels.lane_scan import Scan
from optkernels.numbers import ASSERT, PICK, PYTHON_OPS, is_assert, scalar_constant

aten = torch.ops.aten


def analyze_per_tensor(graph: fx.Graph, scan: Scan) -> LaneProgram:
    """A for-loop step: the same op sequence once per parameter, each on its own tensors.
    Tensor dataflow splits the graph into independent components; if they all have the same
    signature, component i is lane i."""
    if graph.output_node().args[0]:
        raise NotLanes("the graph returns values (only in-place steps are fused)")
    # (Python arithmetic on a value read with .item() from a lane's tensor is per lane: it
    # joins that lane's component)
    numbers = scan.numbers
    if not scan.components:
        raise NotLanes("the graph has no tensor ops")
    lanes = _lanes_from_components(scan.components, scan.shapes)
    scalars = [n for n in scan.ordered if n not in numbers]
    program = LaneProgram(lanes=len(lanes))
    program.scalar_inputs = [n for n in scalars if n.op == "placeholder"]
    program.scalar_nodes = [n for n in scalars if n.op == "call_function"]
    scalar_ref = {n: ("scalar", i) for i, n in enumerate(program.scalar_inputs)}
    scalar_ref.update({n: ("scalar", -1 - i) for i, n in enumerate(program.scalar_nodes)})
    signatures = _signatures(lanes, scalar_ref)
    per_lane = _per_lane_numbers([sig for sig, _ in signatures])
    inputs_per_lane = [placeholders for _, placeholders in signatures]
    for column in zip(*inputs_per_lane, strict=True):
        program.inputs.append(column)
        program.input_small.append(all([n.meta["val"].dim() == 0 for n in column]))
    _lower_component(program, lanes, inputs_per_lane[0], scalar_ref, numbers, per_lane)
    check_numels(program)
    return program


def _lanes_from_components(
    components: list[list[fx.Node]], shapes: dict[fx.Node, tuple[int, tuple[bool, ...]]]
) -> list[list[fx.Node]]:
    """Components with the same op sequence (each op's target, and which of its inputs are
    Python scalars) are one family (e.g. the parameter updates, and separately
    the step-count increments); the i-th member of every family is lane i."""
    families: dict[Any, list[list[fx.Node]]] = {}
    for component in components:
        families.setdefault(tuple(map(shapes.__getitem__, component)), []).append(component)
    counts = {len(members) for members in families.values()}
    if len(counts) != 1:
        raise NotLanes("the per-tensor op sequences differ between parameters")
    (count,) = counts
    return [[n for members in families.values() for n in members[i]] for i in range(count)]


def _signatures(
    lanes: list[list[fx.Node]], scalar_ref: dict[fx.Node, Any]
) -> list[tuple[tuple[Any, ...], list[fx.Node]]]:
    """What each lane computes, with its own nodes and inputs numbered by first use (equal
    lanes have equal signatures), and its inputs in that order. (Asked for every argument of
    every lane's ops: the refs are made once and shared by the lanes.)"""
    width = max(len(lane) for lane in lanes)
    locals_ = [("local", i) for i in range(width)]
    inputs: list[tuple[str, int]] = []
    return [_signature(lane, locals_, inputs, scalar_ref) for lane in lanes]


def _signature(
    lane: list[fx.Node],
    locals_: list[tuple[str, int]],
    inputs: list[tuple[str, int]],
    scalar_ref: dict[fx.Node, Any],
) -> tuple[tuple[Any, ...], list[fx.Node]]:
    """One lane's ``_signatures`` entry (``locals_``, ``inputs``: the refs of its nodes and
    inputs by number, ``inputs`` extended as needed)."""
    local = dict(zip(lane, locals_, strict=False))
    placeholders: dict[fx.Node, Any] = {}  # (in order of first use)

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            found = local.get(a) or scalar_ref.get(a) or placeholders.get(a)
            if found is not None:
                return found
            if a.op == "placeholder":
                if len(placeholders) == len(inputs):
                    inputs.append(("input", len(inputs)))
                found = placeholders[a] = inputs[len(placeholders)]
                return found
            constant = scalar_constant(a)
            if constant is not None:
                return ("constant", *constant)
            # a constant the step made (get_attr): the torch backend's
            raise NotLanes(f"{a.name} is a tensor the step made from Python data")
        if isinstance(a, list | tuple):
            return tuple(ref(x) for x in a)
        return ("const", a)

    sig = []
    get_local, get_scalar = local.get, scalar_ref.get
    for node in lane:
        args = tuple(
            [
                (get_local(a) or get_scalar(a) or ref(a))
                if isinstance(a, fx.Node)
                else ref(a)
                if isinstance(a, list | tuple)
                else ("const", a)
                for a in node.args
            ]
        )
        kwargs = node.kwargs
        if kwargs:  # (as ref(tuple(sorted(kwargs.items()))) reads them)
            pairs = tuple([(("const", k), ref(a)) for k, a in sorted(kwargs.items())])
            sig.append((node.target, args, pairs))
        else:
            sig.append((node.target, args, ()))
    return tuple(sig), list(placeholders)


def _per_lane_numbers(signatures: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Where the lanes' signatures differ only in a Python number an op reads (Muon's lr,
    scaled by each matrix's shape: ``lr * sqrt(max(1, rows / cols))``, a scalar node per
    shape), the number each lane reads there: (op position, "args" or "kwargs", index or
    name) -> one ref per lane, ("scalar", index) or ("const", number). Raises NotLanes
    where they differ otherwise."""
    first = signatures[0]
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    if all(sig == first for sig in signatures):  # (the usual case: one comparison a lane)
        return out
    if any(len(sig) != len(first) for sig in signatures):
        raise NotLanes("the per-tensor op sequences differ between parameters")
    for position, ops in enumerate(zip(*signatures, strict=True)):
        if any(op[0] != ops[0][0] for op in ops):
            raise NotLanes("the per-tensor op sequences differ between parameters")
        for where, slot in (("args", 1), ("kwargs", 2)):
            values = [op[slot] for op in ops]
            if all(v == values[0] for v in values):
                continue
            if any(len(v) != len(values[0]) for v in values):
                raise NotLanes("the per-tensor op sequences differ between parameters")
            for j, refs in enumerate(zip(*values, strict=True)):
                if all(r == refs[0] for r in refs):
                    continue
                if where == "kwargs":  # (("const", name), ref) pairs
                    if any(r[0] != refs[0][0] for r in refs):
                        raise NotLanes("the per-tensor op sequences differ between parameters")
                    key, refs = refs[0][0][1], tuple(r[1] for r in refs)
                else:
                    key = j
                if not all(_number_ref(r) for r in refs):
                    raise NotLanes("the per-tensor op sequences differ between parameters")
                out[(position, where, key)] = tuple(refs)
    return out


def _number_ref(ref: Any) -> bool:
    """Whether a signature's ref is a Python number: a scalar of the step, a constant."""
    if not isinstance(ref, tuple) or len(ref) != 2:
        return False
    kind, value = ref
    if kind == "scalar":
        return True
    return kind == "const" and isinstance(value, int | float) and not isinstance(value, bool)


def _lower_component(
    program: LaneProgram,
    lanes: list[list[fx.Node]],
    placeholders: list[fx.Node],
    scalar_ref: dict[fx.Node, Any],
    numbers: set[fx.Node],
    per_lane: dict[tuple[Any, ...], tuple[Any, ...]],
) -> None:
    """Lane 0's component as the program; the other lanes' (same ops, by _signature) give
    each op's per-lane result dtypes, and the numbers they read where those differ
    (``per_lane``: one PICK op for each)."""
    component = lanes[0]
    positions = list(zip(*lanes, strict=False))  # each position's node in every lane
    var_of: dict[fx.Node, int] = {}
    picks: dict[tuple[Any, ...], int] = {}

    def emit(op: str, args: tuple[Any, ...], small: bool, dtypes: tuple[Any, ...] = ()) -> int:
        var = program.num_vars
        program.ops.append(LaneOp(var, op, "", args, (), small, dtypes))
        program.num_vars += 1
        return var

    for j, node in enumerate(placeholders):
        var_of[node] = emit("input", (j,), program.input_small[j])

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a in scalar_ref:
                return scalar_ref[a]
            constant = scalar_constant(a)
            if constant is not None and a not in var_of:  # a 0-dim tensor of every lane
                var_of[a] = emit("full", (("const", constant[0]),), True, (constant[1],))
            return ("lane", var_of[a])
        if isinstance(a, torch.dtype | torch.device | torch.layout | torch.memory_format):
            return ("ignore", a)
        if isinstance(a, bool | int | float) or a is None:
            return ("const", a)
        raise NotLanes(f"argument {a!r} of a per-tensor op")

    def lane_arg(position: int, where: str, key: Any, a: Any) -> Any:
        refs = per_lane.get((position, where, key))
        if refs is None:
            return arg(a)
        if refs not in picks:
            picks[refs] = emit(PICK, (("const", refs),), True)
        return ("lane", picks[refs])

    for position, node in enumerate(component):
        target = node.target
        if target is aten.copy_.default:
            dst, src = node.args
            if not isinstance(dst, fx.Node) or not isinstance(src, fx.Node):
                raise NotLanes(f"{node.name} copies something that is not a graph value")
            if dst not in placeholders:
                raise NotLanes(f"{node.name} writes to something that is not an input")
            program.writes.append((var_of[src], placeholders.index(dst)))
            continue
        if is_assert(node):
            check = lane_arg(position, "args", 0, node.args[0])
            var_of[node] = emit(ASSERT, (check, ("const", str(node.args[1]))), True)
            continue
        args = tuple(lane_arg(position, "args", j, a) for j, a in enumerate(node.args))
        if node in numbers:
            if target not in PYTHON_OPS:
                raise NotLanes(f"{node.name}: Python {target} on a value read with .item()")
            var_of[node] = emit(PYTHON_OPS[target], args, True)
            continue
        name = getattr(target, "__name__", "")
        base, _, overload = name.partition(".")
        if base not in _SINGLE:
            raise NotLanes(f"{target} is not an op the kernel generator knows")
        kwargs = tuple(
            (k, lane_arg(position, "kwargs", k, v))
            for k, v in sorted(node.kwargs.items())
            if k not in IGNORED_KWARGS
        )
        val = node.meta.get("val")
        small = base == "_local_scalar_dense" or (isinstance(val, torch.Tensor) and val.dim() == 0)
        dtypes = _lane_dtypes(positions[position])
        var_of[node] = program.num_vars
        program.ops.append(
            LaneOp(program.num_vars, _SINGLE[base], overload, args, kwargs, small, dtypes)
        )
        program.num_vars += 1


def _lane_dtypes(nodes: Sequence[fx.Node]) -> tuple[torch.dtype, ...]:
    """One recorded result dtype per lane for ``nodes`` (one node per lane), or none when
    some node records none."""
    vals: list[Any] = [n.meta.get("val") for n in nodes]
    if all([isinstance(v, torch.Tensor) for v in vals]):  # (the usual case)
        return tuple([v.dtype for v in vals])
    dtypes = [result_dtypes(n) for n in nodes]
    if not all(len(d) == 1 for d in dtypes):
        return ()
    return tuple(d[0] for d in dtypes)
