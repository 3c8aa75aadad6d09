"""Every private or unstable torch API opttrace uses, in one place (a torch upgrade edits this)."""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from opttrace.patches import patched


class DispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """torch's dispatch mode base, without the ``torch._disable_dynamo`` wrapper it puts
    around a subclass's ``__torch_dispatch__`` (a trace never runs under torch.compile,
    and the wrapper costs two Python frames per recorded op)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


_PLAIN_STEMS: dict[str, bool] = {}


def _plain_stem(stem: str) -> bool:
    """Whether fx names ``stem`` as it is: an identifier not ending in ``_<digits>`` (which
    fx reads as a count), remembered for the few stems of recorded ops (placeholders' names,
    each used once, never come here: 10,000 of them would fill the memo before the first op)."""
    plain = _PLAIN_STEMS.get(stem)
    if plain is None:
        plain = bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", stem)) and not re.search(
            r"_\d+$", stem
        )
        if len(_PLAIN_STEMS) < 4096:
            _PLAIN_STEMS[stem] = plain
    return plain


def append_node(
    graph: fx.Graph,
    op: str,
    stem: str,
    target: Any = None,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> fx.Node:
    """A node at the graph's insert point, named after ``stem`` (made unique), as
    ``graph.create_node`` makes it, less what a recorder need not pay for on each of its
    nodes: the pytree scan of the arguments for stray SymInts and the node's
    ``__setattr__`` bookkeeping when its arguments are set after creation. A placeholder's
    target is ``stem``. The graph must have no owning module yet (no creation hooks)."""
    if op == "call_function":
        return append_call(graph, call_kind(graph, target, stem), args, kwargs or {})
    target = stem if op == "placeholder" else target
    name = graph._graph_namespace.create_name(stem, None)
    return _append(graph, name, op, target, args, kwargs or {}, _table(graph, op, None))


def append_placeholder(graph: fx.Graph, name: str, after: fx.Node | None) -> fx.Node:
    """``append_node`` of a placeholder, inserted after ``after`` (None: first in the graph)
    whatever the graph's insert point (without ``inserting_after``'s context per input)."""
    namespace = graph._graph_namespace
    used = namespace._used_names
    if name in used or not (name.isascii() and name.isidentifier()):
        unique = namespace.create_name(name, None)
    else:
        # What create_name gives a fresh identifier (an input's name, from its Source),
        # without its regular expression (slow on long names: state[...] paths): the name
        # itself, counted as ``<base>_<num>`` when it ends so (``params_0``).
        base, _, num = name.rpartition("_")
        if base and num.isdigit():
            unique = name
            namespace._base_count[base] = int(num)
            used.add(name)
        elif _ILLEGAL_NAMES is None or name in _ILLEGAL_NAMES:
            unique = namespace.create_name(name, None)
        else:
            unique = name
            namespace._base_count[name] = namespace._base_count.get(name, 0)
            used.add(name)
    where = graph._root if after is None else after
    return _append(
        graph, unique, "placeholder", name, (), {}, _table(graph, "placeholder", None), where.append
    )


# What append_call needs of one target in one graph, looked up once: (the target, its name
# stem, whether fx takes the stem as it is, the graph's lookup-table entry of the target).
CallKind = tuple[Any, str, bool, dict[fx.Node, None]]


def call_kind(graph: fx.Graph, target: Any, stem: str) -> CallKind:
    plain = _PLAIN_STEMS.get(stem)
    if plain is None:
        plain = _plain_stem(stem)
    return (target, stem, plain, _table(graph, "call_function", target))


def append_call(
    graph: fx.Graph, kind: CallKind, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> fx.Node:
    """``append_node`` of a ``call_function`` node, its target's ``call_kind`` given."""
    target, stem, plain, table = kind
    namespace = graph._graph_namespace
    used = namespace._used_names
    last = namespace._base_count.get(stem) if plain and stem in used else None
    if last is None:
        name = namespace.create_name(stem, None)
    else:
        # What create_name does for a stem already taken (a node per parameter of each
        # op), without matching and cleaning the stem again each time.
        num = last + 1
        name = f"{stem}_{num}"
        while name in used:
            num += 1
            name = f"{stem}_{num}"
        used.add(name)
        namespace._base_count[stem] = num
    return _append(graph, name, "call_function", target, args, kwargs, table)


def _table(graph: fx.Graph, op: str, target: Any) -> dict[fx.Node, None]:
    """The graph's find_nodes lookup-table entry of nodes of this op (and target)."""
    table: dict[fx.Node, None] = graph._find_nodes_lookup_table.table[(op, target)]
    return table


# Names fx never gives a node (keywords, builtins).
_ILLEGAL_NAMES: Any = getattr(fx.graph, "_illegal_names", None)

# fx.Node's C base: a recorded node is made through it, without ``Node.__init__``'s checks of
# its op and target (the recorder's are always legal) and its Python frame.
_NODE_BASE: Any = getattr(fx.node, "_NodeBase", None)


def _append(
    graph: fx.Graph,
    name: str,
    op: str,
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    table: dict[fx.Node, None],
    insert: Callable[[fx.Node], None] | None = None,
) -> fx.Node:
    """Make a node and link it in at ``insert`` (None: the graph's insert point)."""
    if _NODE_BASE is not None:
        node = fx.Node.__new__(fx.Node)
        _NODE_BASE.__init__(node, graph, name, op, target, None)
        node._update_args_kwargs(args, kwargs)
    else:
        node = fx.Node(graph, name, op, target, args, kwargs)
    graph._graph_namespace._obj_to_name[node] = name  # (associate_name_with_obj's work)
    (graph._insert if insert is None else insert)(node)
    table[node] = None  # (the lookup table's insert, without its two calls)
    graph._len += 1
    return node


def last_node(graph: fx.Graph) -> fx.Node:
    """The graph's last node (its root sentinel when it has none)."""
    last: fx.Node = graph._root._prev
    return last


def nodes_after(graph: fx.Graph, node: fx.Node) -> list[fx.Node]:
    """The nodes after ``node`` (``last_node``'s answer earlier), in graph order."""
    out = []
    node = node._next
    while node is not graph._root:
        out.append(node)
        node = node._next
    return out


def graph_length(graph: fx.Graph) -> int:
    length: int = graph._len
    return length


# ``MAKE_WRAPPER(cls, shape, strides=, dtype=, device=, requires_grad=)``: a tensor of class
# ``cls`` with this metadata and no storage (its ops dispatch to Python). Called directly (one
# per tensor a step makes: hundreds of thousands for a large for-loop step).
MAKE_WRAPPER: Any = torch.Tensor._make_wrapper_subclass


def compiling() -> contextlib.AbstractContextManager[None]:
    """Make ``torch.compiler.is_compiling()`` report True in the tracing thread, so
    torch.optim takes its compile paths (no ``.item()`` syncs, no per-device grouping)."""
    return patched(torch.compiler, "is_compiling", _true)


def _true() -> bool:
    return True


def for_loop(
    module: str, replacement: Callable[..., Any]
) -> contextlib.AbstractContextManager[None]:
    """Make ``torch.optim.<module>`` call ``replacement(original, *args, **kwargs)`` for its
    for-loop (``_single_tensor_<module>``) in the tracing thread (see opttrace.asgd)."""
    import importlib

    functional = importlib.import_module(f"torch.optim.{module}")
    name = f"_single_tensor_{module}"
    original = getattr(functional, name)
    return patched(vars(functional), name, functools.partial(replacement, original))


def raw_step(cls: type) -> Callable[..., Any]:
    """``cls.step`` without torch.optim's profiling/hook wrapper (hooks run outside the trace)."""
    step: Callable[..., Any] = cls.step  # type: ignore[attr-defined]
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        inner: Callable[..., Any] = step.__wrapped__
        return inner
    return step


def rename_placeholder(graph: fx.Graph, node: fx.Node, name: str) -> None:
    """Give a placeholder a readable name (fx has no public API to rename nodes)."""
    node._rename(name)
    node.target = node.name


@dataclass(frozen=True)
class OpInfo:
    """What the recorder needs to know about an ATen op, looked up once per op."""

    kind: str  # "foreach", "read" (a tensor's value into Python), "refused" or "op"
    pointwise: bool
    written: tuple[str, ...]
    view: bool
    recorded_as: Any = None  # the op the graph holds instead (see _RECORDED_AS), or None


# id(op) -> (op, its OpInfo): an OpOverload hashes in Python, and the recorder asks per op.
_OP_INFO: dict[int, tuple[Any, OpInfo]] = {}
_READ_OPS = {"aten::_local_scalar_dense"}
_REFUSED_OPS = {"aten::nonzero", "aten::equal"}  # results read back into Python


def op_info(func: Any) -> OpInfo:
    known = _OP_INFO.get(id(func))
    if known is not None and known[0] is func:
        return known[1]
    name = func.name()
    base = name.split(".")[0]
    kind = (
        "foreach"
        if name.startswith("aten::_foreach_")
        else "read"
        if base in _READ_OPS
        else "refused"
        if base in _REFUSED_OPS
        else "op"
    )
    pointwise = torch.Tag.pointwise in func.tags
    recorded_as = _RECORDED_AS.get(name)
    info = OpInfo(kind, pointwise, written_args(func), is_view(func), recorded_as and recorded_as())
    _OP_INFO[id(func)] = (func, info)
    return info


# Functional collectives (what DTensor's redistribution runs) return their result wrapped by
# ``_wrap_tensor_autograd`` in an AsyncCollectiveTensor, which waits for the collective on its
# first use. A graph must say where it waits: a backend hands the result to a kernel by
# address, and no subclass dispatch runs there. Traced (``_maybe_wrap_tensor`` under
# dynamo), torch records ``wait_tensor`` in its place; the recorder does the same.
_RECORDED_AS: dict[str, Callable[[], Any]] = {
    "_c10d_functional::_wrap_tensor_autograd": lambda: (
        torch.ops._c10d_functional.wait_tensor.default
    ),
}


@functools.cache
def written_args(func: Any) -> tuple[str, ...]:
    """Names of the arguments an ATen op writes to (``self`` of ``add_``, ``out`` of ``.out``)."""
    return tuple(
        a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    )


@functools.cache
def is_view(func: Any) -> bool:
    """Whether an op's output aliases an input (``view``, ``squeeze``, ``t``, ...)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@functools.cache
def functional_variant(func: Any) -> Any:
    """The out-of-place overload computing what an in-place or ``out=`` op writes, or None."""
    schema = func._schema
    name = schema.name.split("::")[-1]
    written = set(written_args(func))
    if name.endswith("_") and not name.endswith("__") and "self" in written:
        # The same arguments, ``self`` read instead of written. Overload names do not always
        # agree: ``pow_.Scalar(Tensor self, Scalar exponent)`` is ``pow.Tensor_Scalar``
        # (``pow.Scalar`` takes a Scalar base).
        packet = getattr(torch.ops.aten, name[:-1], None)
        wanted = [(a.name, str(a.type)) for a in schema.arguments]
        preferred = func._overloadname
    else:
        packet = getattr(torch.ops.aten, name, None)
        wanted = [(a.name, str(a.type)) for a in schema.arguments if a.name not in written]
        preferred = None
    if packet is None:
        return None
    overloads = sorted(packet.overloads(), key=lambda overload: overload != preferred)
    for overload in overloads:
        candidate = getattr(packet, overload)
        args = [(a.name, str(a.type)) for a in candidate._schema.arguments]
        if args == wanted and not written_args(candidate):
            return candidate
    return None


def drop_out_args(
    func: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Sequence[Any], dict[str, Any]]:
    """The arguments of ``functional_variant(func)``: ``out=`` arguments removed."""
    name = func._schema.name.split("::")[-1]
    if name.endswith("_"):
        return args, kwargs
    written = set(written_args(func))
    return args, {k: v for k, v in kwargs.items() if k not in written}


def lazy_graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that generates its Python code only when asked (``.code``, a call):
    backends that interpret or lower the graph never pay for codegen."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph)


def default_foreach(params: list[torch.Tensor], cls: type | None = None) -> bool:
    """Whether torch.optim takes its foreach path for these parameters when foreach=None
    (in ``cls``'s step, if given: see none_means_for_loop)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    if cls is not None and none_means_for_loop(cls):
        return False
    _, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(foreach)


def none_means_for_loop(cls: type) -> bool:
    """Whether ``cls.step`` is one of torch.optim's that never defaults to foreach: its
    module does not call torch's device-based choice (Adafactor tests ``if foreach:``, so
    foreach=None is its for-loop on every device). A step of another library decides
    itself, or through torch.optim's functional API (which makes the device-based choice)."""
    step = raw_step(cls)
    module = sys.modules.get(getattr(step, "__module__", "") or "")
    if module is None or not module.__name__.startswith("torch.optim."):
        return False
    return "_default_to_fused_or_foreach" not in vars(module)


# ``Tensor.data``'s getter and setter (a C descriptor): TracedTensor wraps the setter.
TENSOR_DATA: Any = torch._C.TensorBase.data


# -- DTensor (torch.distributed.tensor): its private spec and local-tensor slots ------------

# The attribute holding a DTensor's local shard; read through a Source each call, so the
# graph's input is the shard itself (``to_local()`` would go through autograd each time).
LOCAL_TENSOR = "_local_tensor"


def dtensor_class() -> type | None:
    """``DTensor`` when torch.distributed.tensor has been imported (no DTensor can exist
    before that), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    cls: type | None = getattr(module, "DTensor", None)
    return cls


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    local: torch.Tensor = getattr(t, LOCAL_TENSOR)
    return local


def make_dtensor(cls: type, local: torch.Tensor, like: torch.Tensor) -> Any:
    """A DTensor of class ``cls`` (a DTensor subclass) around ``local``, with ``like``'s
    mesh, placements and global shape (its spec)."""
    return cls(local, like._spec, requires_grad=like.requires_grad)  # type: ignore[attr-defined]


def clear_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches (Python and C++): entries made during a
    trace hold its symbolic scalars (and through them its graph), and a later trace must
    not compare its scalars with those."""
    cls = dtensor_class()
    if cls is None:
        return
    # What torch.distributed.tensor.debug._clear_sharding_prop_cache does, without importing
    # that package (its CommDebugMode and visualizer: 0.06 s, in every process that imported
    # DTensor, on the first trace of any step).
    try:
        propagate = cls._op_dispatcher.sharding_propagator.propagate_op_sharding  # type: ignore[attr-defined]
        clear_fast_path = torch._C._clear_DTensor_sharding_propagator_cache
    except AttributeError:  # another torch: its own way
        from torch.distributed.tensor import debug

        debug._clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
        return
    propagate.cache_clear()
    clear_fast_path()
