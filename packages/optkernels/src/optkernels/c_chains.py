"""Elementwise chains of a node-by-node plan as generated C: one pass where ATen makes several.

A step the lanes do not cover (Adafactor's: its per-tensor step sizes are norms read with
``.item()``) runs node by node on the torch backend, its writes in place (``reinplace``).
Its elementwise work on one tensor is then a *chain*: an op making a tensor (Adafactor's
``row_var @ col_var``, an outer product; ``clone``; an out-of-place elementwise op) or an
in-place op on one, followed by in-place ops on that value (``div_``, ``clamp_``,
``rsqrt_``, ``mul_``) or by an in-place op on another tensor that reads it
(``variance.lerp_(g * g, w)``). ATen runs each op as a pass over memory and an OpenMP region;
``fuse_chains`` replaces a chain by one call of a generated C function (``lowering``'s
expressions in C, float32 or float64, each op rounded as ATen rounds it) that reads each operand
and writes the chain's tensor once, its other operands (a row, a column, a scalar tensor)
broadcast to its shape and Python numbers read at the call. Intermediate tensors no other
node reads are never made. Shapes are the graph's (the entry's guards fix them), read by
the C from a table at the call: one function per chain *structure* (its ops, rank and
broadcasts), shared by chains over tensors of other shapes (GPT-2's 346 chains: 10
functions), so the one library per graph is small; it is built in the background
(``c_kernel.build_async``) while the plan is made and run, cached on disk by its source:
until it is loaded, a chain runs its ATen ops (the same bits), as does a call whose tensors
are not contiguous or not of those shapes.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import fx

from optkernels.c_kernel import _C_TYPES, Compiler, _ctype, build_async, c_emitter, library_source
from optkernels.errors import KernelError
from optkernels.lane_program import _SINGLE, LaneOp, LaneProgram
from optkernels.lowering import expression

log = logging.getLogger(__name__)
aten = torch.ops.aten
_DTYPES = (torch.float32, torch.float64)
# ATen op base name (in-place or not) -> the per-element op of ``lowering.expression``: the
# lanes' single-tensor ops a chain takes (elementwise arithmetic; no comparison or select).
_CHAIN_OPS = [
    "add",
    "sub",
    "mul",
    "div",
    "addcmul",
    "addcdiv",
    "lerp",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "neg",
    "abs",
    "maximum",
    "minimum",
    "clamp_min",
    "clamp_max",
    "clamp",
    "clone",
]
_OPS = {name: _SINGLE[name] for name in _CHAIN_OPS}
# Values per OpenMP thread at least (as ``cpu_backend.BLOCK``'s grain).
_GRAIN = 1 << 15


@dataclass
class _Chain:
    """A chain being built: its nodes, operands, ops and the tensors it writes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nodes: list[fx.Node] = field(default_factory=list)
    tensors: list[fx.Node] = field(default_factory=list)  # operands, by first use
    scalars: list[fx.Node] = field(default_factory=list)  # Python numbers read at the call
    ops: list[LaneOp] = field(default_factory=list)  # var i = ops[i] over "lane" refs
    loads: dict[int, int] = field(default_factory=dict)  # var -> the operand it loads
    stores: list[tuple[int, int]] = field(default_factory=list)  # (var, operand; -1: fresh)
    storage: int = -1  # the operand holding the current value (-1: a tensor the chain makes)
    read_at: dict[fx.Node, int] = field(default_factory=dict)  # operand -> its last reader
    first_at: dict[fx.Node, int] = field(default_factory=dict)  # operand -> its first reader

    def operand(self, node: fx.Node, position: int) -> int:
        self.first_at.setdefault(node, position)
        if node not in self.tensors:
            self.tensors.append(node)
            var = len(self.ops)
            self.ops.append(LaneOp(var, "input", "", (len(self.tensors) - 1,), (), False))
            self.loads[var] = len(self.tensors) - 1
        self.read_at[node] = position
        k = self.tensors.index(node)
        return next(v for v, t in self.loads.items() if t == k)


def _base(node: fx.Node) -> str:
    return getattr(node.target, "__name__", "").partition(".")[0]


def _inplace(node: fx.Node) -> bool:
    base = _base(node)
    return base.endswith("_") and not base.startswith("_")


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _contiguous(val: torch.Tensor) -> bool:
    return val.is_contiguous() and val.device.type == "cpu"


def _broadcasts(val: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    if val.dtype != dtype or not _contiguous(val) or val.dim() > len(shape):
        return False
    padded = (1,) * (len(shape) - val.dim()) + tuple(val.shape)
    return all(a in (1, b) for a, b in zip(padded, shape, strict=True))


def _number(arg: Any) -> bool:
    if isinstance(arg, fx.Node):
        return _val(arg) is None and isinstance(arg.meta.get("val", 0.0), int | float)
    return isinstance(arg, int | float) and not isinstance(arg, bool)


def _ref(chain: _Chain, arg: Any, current: fx.Node | None, var: int, position: int) -> Any:
    """The LaneOp reference of an op's argument, or None where a chain cannot take it."""
    if arg is current and current is not None:
        return ("lane", var)
    if isinstance(arg, fx.Node):
        val = _val(arg)
        if val is None:
            if not _number(arg):
                return None
            if arg not in chain.scalars:
                chain.scalars.append(arg)
            return ("scalar", chain.scalars.index(arg))
        if not _broadcasts(val, chain.shape, chain.dtype):
            return None
        return ("lane", chain.operand(arg, position))
    if arg is None or _number(arg):
        return ("const", arg)
    return None


def _op(chain: _Chain, node: fx.Node, current: fx.Node | None, var: int, pos: int) -> bool:
    """Append ``node`` (reading the chain's value ``current`` as var ``var``); False (the
    chain unchanged but for operands) where it cannot be a chain op."""
    base = _base(node).rstrip("_")
    if base == "pow" and node.args[1:] == (2,):  # ATen squares as x * x
        node_args: tuple[Any, ...] = (node.args[0], node.args[0])
        base = "mul"
    else:
        node_args = tuple(node.args)
    if base not in _OPS or any(k not in ("alpha", "value", "min", "max") for k in node.kwargs):
        return False
    args = [_ref(chain, a, current, var, pos) for a in node_args]
    kwargs = [(k, _ref(chain, v, current, var, pos)) for k, v in sorted(node.kwargs.items())]
    if any(a is None for a in args) or any(v is None for _, v in kwargs):
        return False
    out = len(chain.ops)
    chain.ops.append(LaneOp(out, _OPS[base], "", tuple(args), tuple(kwargs), False))
    return True


def _start(node: fx.Node, position: int) -> _Chain | None:
    """A chain beginning at ``node``: a tensor it makes or writes in place, elementwise."""
    val = _val(node)
    if node.op != "call_function" or val is None or val.dtype not in _DTYPES:
        return None
    if not _contiguous(val) or val.numel() == 0:
        return None
    chain = _Chain(tuple(val.shape), val.dtype)
    if node.target is aten.mm.default:  # a column times a row: each element one product
        a, b = (_val(x) for x in node.args)
        if a is None or b is None or a.shape[1] != 1 or b.shape[0] != 1:
            return None
        refs = [_ref(chain, x, None, -1, position) for x in node.args]
        if None in refs:
            return None
        chain.ops.append(LaneOp(len(chain.ops), "mul", "", tuple(refs), (), False))
    elif _inplace(node):
        first = node.args[0]
        if not isinstance(first, fx.Node) or _val(first) is None:
            return None
        first_val = _val(first)
        assert first_val is not None
        if tuple(first_val.shape) != chain.shape or first_val.dtype != chain.dtype:
            return None
        var = chain.operand(first, position)
        chain.storage = chain.tensors.index(first)
        if not _op(chain, node, first, var, position):
            return None
    elif not _op(chain, node, None, -1, position):
        return None
    chain.nodes.append(node)
    return chain


def _writes(node: fx.Node) -> list[fx.Node]:
    """The nodes whose storage ``node`` writes (in-place ops: their first argument(s))."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    written: list[fx.Node] = []
    for a, arg in zip(node.target._schema.arguments, node.args, strict=False):
        if a.alias_info is not None and a.alias_info.is_write:
            items = arg if isinstance(arg, list | tuple) else [arg]
            written += [x for x in items if isinstance(x, fx.Node)]
    return written


def _root(node: fx.Node, roots: dict[fx.Node, fx.Node]) -> fx.Node:
    return roots.get(node, node)


def _storage_roots(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node's storage: an op returning an alias of its first argument (an in-place op,
    a view) shares that argument's."""
    roots: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        op = node.target
        if node.op == "call_function" and isinstance(op, torch._ops.OpOverload):
            returns = op._schema.returns
            if returns and returns[0].alias_info is not None and node.args:
                first = node.args[0]
                if isinstance(first, fx.Node):
                    roots[node] = _root(first, roots)
    return roots


def _extend(chain: _Chain, node: fx.Node, graph_order: dict[fx.Node, int]) -> bool:
    """Add ``node``, the only reader of the chain's last value, when it continues the chain:
    an in-place op on that value, or one on another whole tensor that reads it."""
    current = chain.nodes[-1]
    var = len(chain.ops) - 1
    position = graph_order[node]
    val = _val(node)
    if val is None or tuple(val.shape) != chain.shape or val.dtype != chain.dtype:
        return False
    if not _inplace(node) or not node.args:
        return False
    first = node.args[0]
    trial = _Chain(chain.shape, chain.dtype, list(chain.nodes), list(chain.tensors))
    trial.scalars, trial.ops = list(chain.scalars), list(chain.ops)
    trial.loads, trial.stores = dict(chain.loads), list(chain.stores)
    trial.storage, trial.read_at = chain.storage, dict(chain.read_at)
    trial.first_at = dict(chain.first_at)
    if first is current:
        if not _op(trial, node, current, var, position):
            return False
    elif isinstance(first, fx.Node) and current in node.args[1:]:
        if _val(first) is None or not _contiguous(_val(first)):  # type: ignore[arg-type]
            return False
        if chain.storage >= 0:  # the value written so far stays in its tensor if read later
            held = chain.tensors[chain.storage]
            if not set(held.users) <= {*chain.nodes, node}:
                trial.stores.append((var, chain.storage))
        target = trial.operand(first, position)
        trial.storage = trial.tensors.index(first)
        args = [_ref(trial, a, current, var, position) for a in node.args[1:]]
        kwargs = [(k, _ref(trial, v, current, var, position)) for k, v in node.kwargs.items()]
        base = _base(node).rstrip("_")
        if base not in _OPS or any(a is None for a in args) or any(v is None for _, v in kwargs):
            return False
        if any(k not in ("alpha", "value", "min", "max") for k in node.kwargs):
            return False
        out = len(trial.ops)
        refs = (("lane", target), *args)
        trial.ops.append(LaneOp(out, _OPS[base], "", refs, tuple(sorted(kwargs)), False))
    else:
        return False
    trial.nodes.append(node)
    chain.__dict__.update(trial.__dict__)
    return True


def _safe(chain: _Chain, graph_order: dict[fx.Node, int], roots: dict[fx.Node, fx.Node]) -> bool:
    """Whether the fused call, run at the chain's last node, reads what each op read: no node
    between an operand's reader and the end writes it, and the chain writes no tensor that
    another operand shares storage with."""
    end = graph_order[chain.nodes[-1]]
    members = set(chain.nodes)
    nodes = list(graph_order)
    written = {chain.tensors[k] for _, k in chain.stores if k >= 0}
    if chain.storage >= 0:
        written.add(chain.tensors[chain.storage])
    written_roots = {_root(n, roots) for n in written}
    for t in chain.tensors:
        if t not in written and _root(t, roots) in written_roots:
            return False
        if t in written:  # nothing else reads it before the chain's end (then written)
            for between in nodes[chain.first_at[t] + 1 : end]:
                if between not in members and any(
                    _root(i, roots) is _root(t, roots) for i in between.all_input_nodes
                ):
                    return False
        for between in nodes[chain.read_at[t] + 1 : end]:
            if between in members:
                continue
            if any(_root(w, roots) is _root(t, roots) for w in _writes(between)):
                return False
    return True


def find_chains(graph: fx.Graph) -> list[_Chain]:
    """The chains of ``graph`` (run in place already) of two ops or more."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    roots = _storage_roots(graph)
    taken: set[fx.Node] = set()
    chains = []
    for node in graph.nodes:
        if node in taken:
            continue
        chain = _start(node, order[node])
        if chain is None:
            continue
        while True:
            users = list(chain.nodes[-1].users)
            if len(users) != 1 or users[0] in taken or not _extend(chain, users[0], order):
                break
        while len(chain.nodes) >= 2 and not _safe(chain, order, roots):
            chain = _shorter(chain)
        if len(chain.nodes) >= 2:
            chains.append(chain)
            taken.update(chain.nodes)
    return chains


def _shorter(chain: _Chain) -> _Chain:
    """The chain without its last node (rebuilt: its refs are positional)."""
    order = {n: i for i, n in enumerate(chain.nodes[0].graph.nodes)}
    rebuilt = _start(chain.nodes[0], order[chain.nodes[0]])
    assert rebuilt is not None
    for node in chain.nodes[1:-1]:
        _extend(rebuilt, node, order)
    return rebuilt


def chain_source(chain: _Chain, name: str) -> tuple[str, list[int]]:
    """C source of ``void name(const int64_t *ptrs, const double *scalars, const int64_t
    *dims, int threads)`` and its ``dims``: ``ptrs`` holds the operands' addresses, then the
    made tensor's (if the chain makes one). The sizes (rows, a row's length, an operand's
    strides) are read from ``dims`` at the call, not compiled in: chains of one structure
    over tensors of different shapes (GPT-2's 148 parameters, 9 shapes) share a function,
    and the library to build is small. What stays in the source is the structure: the ops,
    the rank, which dimensions of each operand are broadcast."""
    shape = chain.shape
    inner = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    ctype = _C_TYPES[chain.dtype]
    emit = c_emitter(LaneProgram(lanes=1))
    made = chain.storage < 0
    rows_per_item = max(1, _GRAIN // max(inner, 1))
    dims = [rows, inner, rows_per_item, -(-rows // rows_per_item)]

    def dim(value: int) -> str:
        dims.append(value)
        return f"dims[{len(dims) - 1}]"

    pointers = []
    for k in range(len(chain.tensors)):
        pointers.append(f"    {ctype} *p{k} = ({ctype} *)(intptr_t)ptrs[{k}];")
    if made:
        pointers.append(f"    {ctype} *out = ({ctype} *)(intptr_t)ptrs[{len(chain.tensors)}];")
    offsets = []  # per operand: its element offset at row r, and its stride along the row
    strides = []
    for k, t in enumerate(chain.tensors):
        val = _val(t)
        assert val is not None
        padded = (1,) * (len(shape) - val.dim()) + tuple(val.shape)
        step, terms = 1, []
        elem = [0] * len(shape)
        for d in reversed(range(len(shape))):
            elem[d] = 0 if padded[d] == 1 else step
            step *= padded[d]
        strides.append(elem[-1] if shape else 0)
        div = 1
        for d in reversed(range(len(shape) - 1)):
            if elem[d]:
                index = "r" if d == len(shape) - 2 else f"(r / {dim(div)})"
                terms.append(f"({index} % {dim(shape[d])}) * {dim(elem[d])}")
            div *= shape[d]
        offsets.append(f"        const int64_t o{k} = {' + '.join(terms) or '0'};")
    body = []
    compute = chain.dtype
    names: dict[int, str] = {}
    for op in chain.ops:
        if op.op == "input":
            k = chain.loads[op.out]
            names[op.out] = f"p{k}[o{k} + j * {strides[k]}]"
            continue
        refs = {v: names[v] for v in op.lane_vars}
        expr = expression(op, refs, compute, emit)
        body.append(f"            const {_ctype(compute)} v{op.out} = {expr};")
        names[op.out] = f"v{op.out}"
    last = chain.ops[-1].out
    for var, k in chain.stores:
        body.append(f"            p{k}[o{k} + j] = v{var};")
    if made:
        body.append(f"            out[r * inner + j] = v{last};")
    else:
        k = chain.storage
        body.append(f"            p{k}[o{k} + j] = v{last};")
    lines = [
        f"void {name}(const int64_t *restrict ptrs, const double *restrict scalars,"
        " const int64_t *restrict dims, int threads) {",
        *pointers,
        *emit.scalars.lines,
        "    const int64_t rows = dims[0], inner = dims[1], per = dims[2], items = dims[3];",
        "    #pragma omp parallel for if(threads > 1 && items > 1) num_threads(threads)",
        "    for (int64_t item = 0; item < items; ++item) {",
        "        const int64_t first = item * per;",
        "        const int64_t last = first + per < rows ? first + per : rows;",
        "        for (int64_t r = first; r < last; ++r) {",
        *("    " + o for o in offsets),
        "            #pragma omp simd",
        "            for (int64_t j = 0; j < inner; ++j) {",
        *("    " + b for b in body),
        "            }",
        "        }",
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n", dims


class ChainCall:
    """The fused call replacing a chain: its C function, or its ATen ops where a call's
    tensors are not as the graph recorded them, while the library is being built in the
    background (``build_async``: no call waits for the compiler) or where it could not be
    built."""

    def __init__(
        self,
        chain: _Chain,
        library: concurrent.futures.Future[ctypes.CDLL],
        name: str,
        dims: Sequence[int],
    ) -> None:
        self.__name__ = f"c_{name}"
        self.__qualname__ = self.__name__
        self.chain = chain
        self.library = library
        self.symbol = name
        self.function: Any = None  # the C function, once the library is loaded
        self.build_error: str | None = None  # why the C is not used (its build failed)
        self.shapes = [tuple(_val(t).shape) for t in chain.tensors]  # type: ignore[union-attr]
        self.ptrs = np.zeros(len(chain.tensors) + 1, dtype=np.int64)
        self.scalars = np.zeros(max(len(chain.scalars), 1), dtype=np.float64)
        self._ptrs = int(self.ptrs.ctypes.data)
        self._scalars = int(self.scalars.ctypes.data)
        self.dims = np.array(dims, dtype=np.int64)
        self._dims = int(self.dims.ctypes.data)
        # The chain's ops (node, target, args, kwargs), kept before ``fuse_chains`` erases
        # the nodes (which clears their arguments).
        self.aten_ops: list[tuple[fx.Node, Any, Any, dict[str, Any]]] = [
            (n, n.target, n.args, dict(n.kwargs)) for n in chain.nodes
        ]

    def aten(self, *args: Any) -> torch.Tensor:
        """The chain's own ATen ops, over the call's arguments (operands, then numbers)."""
        chain = self.chain
        env: dict[fx.Node, Any] = dict(zip(chain.tensors, args[: len(chain.tensors)], strict=True))
        env.update(zip(chain.scalars, args[len(chain.tensors) :], strict=True))
        # (kwargs too hold nodes: a number computed in the step, e.g. Adafactor's weight
        # decay ``add_(p, alpha=-lr * wd)``, read at the call as the chain's scalars)
        for node, target, node_args, kwargs in self.aten_ops:
            called_args, called_kwargs = fx.map_arg((node_args, kwargs), env.__getitem__)
            env[node] = target(*called_args, **called_kwargs)
        return env[chain.nodes[-1]]  # type: ignore[no-any-return]

    def _ready(self) -> bool:
        """Whether the C function is there: never waits for its build (calls until it is
        done run the chain's ATen ops, which give the same bits)."""
        if self.function is None and self.build_error is None and self.library.done():
            try:
                function = getattr(self.library.result(), self.symbol)
            except KernelError as exc:
                self.build_error = str(exc)
                log.warning("c_chains: running the chains' ATen ops: %s", exc)
                return False
            function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
            function.restype = None
            self.function = function
        return self.function is not None

    def __call__(self, *args: Any) -> torch.Tensor:
        chain = self.chain
        n = len(chain.tensors)
        tensors: Sequence[torch.Tensor] = args[:n]
        for t, shape in zip(tensors, self.shapes, strict=True):
            if tuple(t.shape) != shape or t.dtype != chain.dtype or not t.is_contiguous():
                return self.aten(*args)
        if self.function is None and not self._ready():
            return self.aten(*args)
        made = chain.storage < 0
        out = torch.empty(chain.shape, dtype=chain.dtype) if made else tensors[chain.storage]
        self.ptrs[:n] = [t.data_ptr() for t in tensors]
        self.ptrs[n] = out.data_ptr()
        if chain.scalars:
            self.scalars[: len(chain.scalars)] = args[n:]
        self.function(self._ptrs, self._scalars, self._dims, torch.get_num_threads())
        return out


def fuse_chains(graph: fx.Graph, compiler: Compiler) -> int:
    """Replace each chain of ``graph`` by a call of its generated C (one library for the
    graph: one compile, in the background: calls before it is done run ATen's ops); return
    how many chains were fused."""
    chains = find_chains(graph)
    if not chains:
        return 0
    sources: dict[str, str] = {}  # source body -> function name (shared by equal chains)
    named = []
    for chain in chains:
        body, dims = chain_source(chain, "NAME")
        if body not in sources:
            sources[body] = f"chain{len(sources)}"
        named.append((sources[body], dims))
    source = library_source([b.replace("NAME", n) for b, n in sources.items()])
    library = build_async(compiler, source)  # compiles while the plan is made and run
    replaced: dict[fx.Node, fx.Node] = {}  # a fused chain's last node -> its call
    for chain, (name, dims) in zip(chains, named, strict=True):
        chain.tensors = [replaced.get(t, t) for t in chain.tensors]
        call = ChainCall(chain, library, name, dims)
        last = chain.nodes[-1]
        with graph.inserting_after(last):
            fused = graph.call_function(call, (*chain.tensors, *chain.scalars))
        fused.meta = dict(last.meta)
        last.replace_all_uses_with(fused)
        replaced[last] = fused
        for node in reversed(chain.nodes):
            graph.erase_node(node)
    return len(chains)
