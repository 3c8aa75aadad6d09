"""A traced foreach graph seen as one program applied to every tensor index (a "lane").

An optimizer's foreach step applies the same ops to the i-th param, grad and state tensors
for every i. ``analyze`` turns such a graph into a LaneProgram: its lane inputs (lists of
graph inputs, one per lane), its Python-scalar inputs and the scalar arithmetic on them,
its per-lane ops, and which lane values are written back into which inputs. A kernel
generator can then emit one elementwise kernel covering all lanes. Graphs that are not of
this form (per-tensor op sequences, reductions, data-dependent reads, graph outputs) are
refused with the reason, and the caller runs them another way.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from optkernels.compressed import DEQUANTIZE, QUANTIZE
from optkernels.numbers import (
    ASSERT,
    PICK,
    PYTHON_OPS,
    is_assert,
    reads_tensor,
    scalar_constant,
)

aten = torch.ops.aten


class NotLanes(Exception):
    """The graph is not a per-lane program; the message says why."""


@dataclass(frozen=True)
class LaneOp:
    """``out = op(args)`` for every lane. Args: ("lane", var) | ("scalar", index) | ("const",
    value) | ("scalar_list", vars_per_lane) ; kwargs likewise."""

    out: int
    op: str
    overload: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    small: bool  # every lane's value is a 0-dim tensor
    # The dtype of the op's result as the graph records it, per lane (one entry: the same for
    # every lane; none: not recorded, as in a hand-built graph). A kernel computes each lane
    # at its recorded dtype: a 0-dim float16 parameter's for-loop ops promote to float32.
    dtypes: tuple[torch.dtype, ...] = ()

    @property
    def lane_vars(self) -> list[int]:
        """The lane values this op reads (none for an input)."""
        return [] if self.op == "input" else lane_vars(self.args, self.kwargs)

    def dtype(self, lane: int) -> torch.dtype | None:
        """The recorded dtype of lane ``lane``'s result, or None."""
        if not self.dtypes:
            return None
        return self.dtypes[lane] if len(self.dtypes) > 1 else self.dtypes[0]


def lane_vars(args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]) -> list[int]:
    """The lane vars among an op's (args, kwargs) references."""
    refs = (*args, *(v for _, v in kwargs))
    return [a[1] for a in refs if isinstance(a, tuple) and a[0] == "lane"]


@dataclass
class LaneProgram:
    lanes: int
    inputs: list[tuple[fx.Node, ...]] = field(default_factory=list)  # per input: a node per lane
    input_small: list[bool] = field(default_factory=list)
    scalar_inputs: list[fx.Node] = field(default_factory=list)  # scalar placeholders
    scalar_nodes: list[fx.Node] = field(default_factory=list)  # host-side arithmetic, in order
    ops: list[LaneOp] = field(default_factory=list)
    writes: list[tuple[int, int]] = field(default_factory=list)  # (lane var, input index)
    num_vars: int = 0
    # Written input columns of compressed state (optkernels.compressed): column -> (format,
    # scalar index of bf16's rounding counter (-1 for int8), salt, the lanes whose payload
    # it is).
    rounding: dict[int, tuple[str, int, int, frozenset[int]]] = field(default_factory=dict)


# Foreach op base name -> per-element op name understood by the kernel generator.
_FOREACH = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "div": "div",
    "addcmul": "addcmul",
    "addcdiv": "addcdiv",
    "lerp": "lerp",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "reciprocal": "reciprocal",
    "neg": "neg",
    "abs": "abs",
    "sign": "sign",
    "exp": "exp",
    "log": "log",
    "pow": "pow",
    "maximum": "maximum",
    "minimum": "minimum",
    "clamp_min": "maximum",
    "clamp_max": "minimum",
    "copy": "copy",
    "zero": "zero",
}


# Single-tensor ATen op name -> per-element op name (same names as the foreach ones).
_SINGLE = {
    **_FOREACH,
    "rsub": "rsub",
    "clamp": "clamp",
    "where": "where",
    "gt": "gt",
    "lt": "lt",
    "ge": "ge",
    "le": "le",
    "eq": "eq",
    "ne": "ne",
    "clone": "identity",
    "detach": "identity",
    "alias": "identity",
    # A 0-dim lane value used as a Python number (Adagrad's for-loop ``-clr``): the lane
    # keeps it as a per-lane value, nothing leaves the device; ops read it as ATen reads a
    # Python scalar (in their compute dtype, not rounded to a float16 tensor's dtype).
    "_local_scalar_dense": "item",
    "scalar_tensor": "full",
    "ones_like": "ones",
    "zeros_like": "zero",
}


def fusible(node: fx.Node) -> bool:
    """Whether the kernel generator knows ``node``'s op (placeholders and outputs count;
    a constant the step made, ``torch.tensor(...)``, is handed over by the torch backend
    unless it is a 0-dim float, which the kernels take as a constant)."""
    if node.op == "get_attr":
        return scalar_constant(node) is not None
    if node.op != "call_function":
        return True
    target = node.target
    if target is operator.getitem or target is aten.copy_.default or _is_scalar(node):
        return True
    if is_assert(node):  # a check on a Python number (the host makes it)
        return True
    if target in (DEQUANTIZE, QUANTIZE):  # compressed state: converted where loaded/stored
        return node.args[1] in ("bf16", "int8")
    if target in (min, max, abs):
        return True
    base = getattr(target, "__name__", "").partition(".")[0]
    if base in _SINGLE:
        return True
    return base.startswith("_foreach_") and base[len("_foreach_") :] in _FOREACH


def analyze(graph: fx.Graph) -> LaneProgram:
    """The LaneProgram of ``graph``; raises NotLanes naming what does not fit."""
    programs = analyze_parts(graph)
    if len(programs) != 1:
        raise NotLanes(f"the graph has {len(programs)} independent parts (param groups)")
    return programs[0]


def analyze_parts(graph: fx.Graph) -> list[LaneProgram]:
    """One LaneProgram per independent part of ``graph``: a foreach step over several param
    groups runs one set of foreach ops per group, with lists of different lengths."""
    scan = _scan(graph)
    if not scan.foreach:
        return [_analyze_per_tensor(graph, scan)]
    numbers = scan.numbers
    programs = []
    for part in _parts(scan):
        builder = _Builder(_lane_count(part), numbers)
        for node in graph.nodes:
            if (
                node in part
                or node in scan.scalars
                or node.op in ("placeholder", "output", "get_attr")
            ):
                builder.visit(node)
        programs.append(builder.finish())
    return programs


def _parts(scan: _Scan) -> list[set[fx.Node]]:
    """Tensor ops connected through the tensors and lists they share, ignoring the Python
    scalars every part reads."""
    # Parts over the same number of tensors stay one program (a group's step increments are
    # not connected to its update but belong to the same lanes): one kernel per group size.
    by_lanes: dict[int, set[fx.Node]] = {}
    for component in scan.components:
        part = set(component)
        by_lanes.setdefault(_lane_count(part), set()).update(part)
    return list(by_lanes.values())


@dataclass
class _Scan:
    """What one pass over a step graph finds (``_scan``)."""

    foreach: bool  # it has foreach ops
    numbers: set[fx.Node]  # Python arithmetic on a lane's value
    scalars: frozenset[fx.Node]  # its Python scalars (``_is_scalar``)
    ordered: list[fx.Node]  # the same, in graph order
    # Its tensor ops grouped by the tensors and lists they share, and
    # each op's shape: its target (by id) and which of its inputs are Python scalars.
    components: list[list[fx.Node]]
    shapes: dict[fx.Node, tuple[int, tuple[bool, ...]]]


def _scan(graph: fx.Graph) -> _Scan:
    """The Python scalars of ``graph``, its lane numbers (Python arithmetic on a value read
    from a tensor, ``.item()``, directly or through other such arithmetic, and the checks on
    it: per-lane values, not scalars every lane shares) and its tensor ops grouped by the
    tensors and lists they share (Python scalars and 0-dim constants, which every op may
    read, do not connect them; lane numbers do), each group in graph order. One pass:
    the graph is in dataflow order, so each node's inputs are classified before it (a large
    for-loop step has tens of nodes per parameter, each looked at once here)."""
    numbers: set[fx.Node] = set()
    scalars: set[fx.Node] = set()
    ordered: list[fx.Node] = []
    # A node's component (an id, until merged: ``merged``); -1: a scalar every op may read
    # (not a lane number) or a 0-dim constant, which joins nothing; none: an unread input.
    comp: dict[fx.Node, int] = {}
    merged: dict[int, int] = {}
    ops: list[fx.Node] = []
    shapes: dict[fx.Node, tuple[int, tuple[bool, ...]]] = {}
    foreach = False
    kinds = _TARGET_KINDS
    is_scalar = scalars.__contains__
    for node in graph.nodes:
        op = node.op
        if op == "placeholder":
            if not isinstance(node.meta.get("val"), torch.Tensor):
                scalars.add(node)
                ordered.append(node)
                comp[node] = -1
            continue
        if op == "get_attr":
            if scalar_constant(node) is not None:
                comp[node] = -1
            continue
        if op != "call_function":
            continue
        target = node.target
        # (by id: an OpOverload hashes in Python; the entry keeps its target alive)
        known = kinds.get(id(target))
        if known is None or known[0] is not target:
            known = (target, *_target_kind(target))
            if len(kinds) < 4096:  # (a step's few distinct ops, asked per node)
                kinds[id(target)] = known
        _, scalar, checked, _, is_foreach = known
        foreach = foreach or is_foreach
        inputs = node.all_input_nodes
        if checked and (  # (a lane number; arithmetic on shared scalars: quickly not)
            not numbers.isdisjoint(inputs)
            or (not scalars.issuperset(inputs) and any(reads_tensor(a, numbers) for a in inputs))
        ):
            numbers.add(node)
        if scalar:
            scalars.add(node)
            ordered.append(node)
            if node not in numbers:
                comp[node] = -1
                continue
        mine = -1
        for a in inputs:
            c = comp.get(a)
            if c is None:  # an input's first read
                if mine < 0:
                    mine = len(ops)
                comp[a] = mine
            elif c >= 0:
                while c in merged:
                    c = merged[c]
                if mine < 0:
                    mine = c
                elif c != mine:
                    merged[c] = mine
        comp[node] = mine if mine >= 0 else len(ops)
        ops.append(node)
        shapes[node] = (id(target), tuple(map(is_scalar, inputs)))  # (alive as the graph is)
    components: dict[int, list[fx.Node]] = {}
    for node in ops:
        c = comp[node]
        if merged:
            while c in merged:
                c = merged[c]
        components.setdefault(c, []).append(node)
    return _Scan(foreach, numbers, frozenset(scalars), ordered, list(components.values()), shapes)


def _target_kind(target: Any) -> tuple[bool, bool, bool, bool]:
    """Of a call_function node with ``target``: (``_is_scalar``, ``is_python_op`` or
    ``is_assert`` (what may be a lane number), ``is_python_op``, ``_is_foreach``)."""
    getitem = target is operator.getitem
    operator_fn = not getitem and getattr(target, "__module__", "") == "_operator"
    python = operator_fn or (not getitem and target in (min, max, abs))
    checked = python or target is aten._assert_scalar.default
    return operator_fn, checked, python, getattr(target, "__name__", "").startswith("_foreach_")


_TARGET_KINDS: dict[int, tuple[Any, bool, bool, bool, bool]] = {}


def _lane_count(part: set[fx.Node]) -> int:
    for node in part:
        if _is_foreach(node):
            for arg in node.args:
                if isinstance(arg, list | tuple) and arg:
                    return len(arg)
    return -1


def _is_foreach(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    found = _FOREACH_TARGETS.get(target)
    if found is None:
        found = getattr(target, "__name__", "").startswith("_foreach_")
        if len(_FOREACH_TARGETS) < 4096:  # (a step's few distinct ops, asked per node)
            _FOREACH_TARGETS[target] = found
    return found


_FOREACH_TARGETS: dict[Any, bool] = {}


def _is_scalar(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "placeholder":
        return not isinstance(node.meta.get("val"), torch.Tensor)
    if node.op != "call_function":
        return False
    target = node.target
    found = _OPERATOR_TARGETS.get(target)
    if found is None:
        found = target is not operator.getitem and getattr(target, "__module__", "") == "_operator"
        if len(_OPERATOR_TARGETS) < 4096:  # (a step's few distinct ops, asked per node)
            _OPERATOR_TARGETS[target] = found
    return found


_OPERATOR_TARGETS: dict[Any, bool] = {}


def _analyze_per_tensor(graph: fx.Graph, scan: _Scan) -> LaneProgram:
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
    width = len(inputs_per_lane[0])
    for column in zip(*inputs_per_lane, strict=False):
        if len(program.inputs) == width:
            break
        program.inputs.append(column)
        program.input_small.append(all([n.meta["val"].dim() == 0 for n in column]))
    _lower_component(program, lanes, inputs_per_lane[0], scalar_ref, numbers, per_lane)
    _check_numels(program)
    return program


def _lanes_from_components(
    components: list[list[fx.Node]], shapes: dict[fx.Node, tuple[int, tuple[bool, ...]]]
) -> list[list[fx.Node]]:
    """Components with the same op sequence (each op's target, and which of its inputs are
    the shared Python scalars) are one family (e.g. the parameter updates, and separately
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
            if k not in _IGNORED_KWARGS
        )
        val = node.meta.get("val")
        small = base == "_local_scalar_dense" or (isinstance(val, torch.Tensor) and val.dim() == 0)
        dtypes = _lane_dtypes(positions[position])
        var_of[node] = program.num_vars
        program.ops.append(
            LaneOp(program.num_vars, _SINGLE[base], overload, args, kwargs, small, dtypes)
        )
        program.num_vars += 1


def _result_dtypes(node: fx.Node) -> tuple[torch.dtype, ...]:
    """The dtypes ``node``'s metadata records for its result: one per tensor (a foreach op's
    list gives one per lane); none where it records no tensors."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return (val.dtype,)
    if isinstance(val, list | tuple) and val and all(isinstance(t, torch.Tensor) for t in val):
        return tuple(t.dtype for t in val)
    return ()


def _lane_dtypes(nodes: Sequence[fx.Node]) -> tuple[torch.dtype, ...]:
    """One recorded result dtype per lane for ``nodes`` (one node per lane), or none when
    some node records none."""
    vals: list[Any] = [n.meta.get("val") for n in nodes]
    if all([isinstance(v, torch.Tensor) for v in vals]):  # (the usual case)
        return tuple([v.dtype for v in vals])
    dtypes = [_result_dtypes(n) for n in nodes]
    if not all(len(d) == 1 for d in dtypes):
        return ()
    return tuple(d[0] for d in dtypes)


_IGNORED_KWARGS = ("dtype", "device", "layout", "pin_memory", "memory_format", "non_blocking")


class _Builder:
    def __init__(self, lanes: int, numbers: set[fx.Node]) -> None:
        # (the part's foreach lists tell the lane count before any op is visited: a per-item
        # op on graph inputs alone needs it to know where its lanes end)
        self.lanes: int | None = lanes if lanes > 0 else None
        self.numbers = numbers  # Python arithmetic on a lane's value (_scan)
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
        self.value[node] = ("lanes", self._emit((op, overload, args, kwargs), _result_dtypes(node)))

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
            (k, template(v)) for k, v in sorted(node.kwargs.items()) if k not in _IGNORED_KWARGS
        )
        key = (op, overload, args, kwargs)
        if not index and not tensors:  # same for every lane (a constant: scalar_tensor(0.0))
            self.value[node] = ("free", key, _result_dtypes(node))
            return
        if len(index) > 1:
            raise NotLanes(f"{node.name} mixes items of different lanes")
        i = index.pop() if index else self._next_item(key)
        if i == 0:
            columns = [self._column(t) for t in tensors]
            var = self._emit(_with_columns(key, [c[0] for c in columns]))
            self.groups.append([key, var, 1, [_result_dtypes(node)], [c[1] for c in columns]])
            self.value[node] = ("peritem", var, 0)
            return
        for group in reversed(self.groups):
            if group[0] == key and group[2] == i:
                group[2] += 1
                group[3].append(_result_dtypes(node))
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
            if a and all(isinstance(x, fx.Node) and self._kind(x) == "tensor" for x in a):
                return ("lane", self._input(tuple(self.value[x][1] for x in a)))
            refs = [self.value.get(x) if isinstance(x, fx.Node) else None for x in a]
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
            nodes = tuple(targets[i] for i in range(self.lanes))
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
        _check_numels(program)
        return program


def _with_columns(key: Any, column_vars: list[int]) -> Any:
    """A per-item op's key with its ("column", k) arguments read from the k-th column."""

    def fill(a: Any) -> Any:
        return ("lane", column_vars[a[1]]) if isinstance(a, tuple) and a[:1] == ("column",) else a

    op, overload, args, kwargs = key
    return op, overload, tuple(fill(a) for a in args), tuple((k, fill(v)) for k, v in kwargs)


def _check_numels(program: LaneProgram) -> None:
    columns = [  # (column by column: a step of 10,000 parameters has 10,000 lanes)
        [
            int(stored[2]) if (stored := n.meta.get("dequantized")) else n.meta["val"].numel()
            for n in nodes
        ]
        for nodes, small in zip(program.inputs, program.input_small, strict=True)
        if not small
    ]
    if len(columns) < 2:
        return
    first = columns[0]
    for other in columns[1:]:
        if other != first:
            break
    else:
        return
    for lane, numels in enumerate(zip(*columns, strict=True)):
        if len(set(numels)) > 1:
            raise NotLanes(f"lane {lane} mixes tensors of different sizes {sorted(set(numels))}")


def logical_numel(node: fx.Node) -> int:
    """The elements input ``node`` holds (a compressed payload: those it stores)."""
    stored = node.meta.get("dequantized")
    return int(stored[2]) if stored else int(node.meta["val"].numel())
