"""torch.optim's for-loop steps traced once per kind of parameter, then replicated.

A for-loop step (``_single_tensor_adam`` and its kin) runs the same Python for every
parameter: with 10,000 tiny parameters the trace spent most of its time in torch's own
Python and the dispatch of ~20 ops per parameter, each recording nodes that differ from the
previous parameter's only in the tensors they read. Here the loop runs for the first
parameter of each *kind* (the metadata of its tensors in every per-parameter list, and which
of them are one object), recording the nodes it appends (its *template*); every later
parameter of that kind gets a copy of the template with its own tensors in place of the
first's, in the loop's order: the graph, its node names and the guards are those of the
full trace (tests/test_replicate.py compares them).

A template is replicated only where the body did nothing a copy would miss: every node it
appended is an op on the parameter's own tensors (no constant, placeholder, view, alias,
tuple result or value read into Python), or Python arithmetic on shared scalars that the
recorder's scalar cache would hand every parameter anyway, or a tensor made from shared
scalars alone (Rprop's ``torch.where(mask, etaplus, sign)`` makes a 0-dim ``etaplus`` for
every parameter: so does each replica); nothing it decided depends on the
parameter's values; it stored nothing into the lists or a ``.grad``. Anything else, or a
parameter whose tensors are views or aliases, runs the rest of the loop as torch wrote it.
opttrace's own for-loops of RAdam and ASGD (radam.py, asgd.py) are replicated alike.
``OPTTRACE_REPLICATE=0`` turns replication off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx

from opttrace import _torch_compat as compat
from opttrace.recorder import Recorder
from opttrace.traced_tensor import TracedTensor

aten = torch.ops.aten

# torch.optim modules whose ``_single_tensor_<module>`` is a loop over the parameters with
# nothing shared between iterations (RAdam's and ASGD's are opttrace's own: radam.py, asgd.py).
# (Rprop's eager path writes through boolean masks, a value read into Python: it runs as
# written; its capturable path, torch.where over fresh 0-dim etas, is replicated.)
MODULES = ("adam", "sgd", "adagrad", "rmsprop", "adamax", "nadam", "adadelta", "rprop")
# Fewer parameters than this: the loop runs as it is.
MIN_LANES = 8


@contextlib.contextmanager
def replicated() -> Iterator[None]:
    """The for-loops of MODULES replicated in the tracing thread (see the module doc)."""
    with contextlib.ExitStack() as stack:
        for module in MODULES:
            try:
                patch = compat.for_loop(module, run)
            except (ImportError, AttributeError):  # (a torch without that loop)
                continue
            stack.enter_context(patch)
        yield


def run(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)`` (a for-loop over ``args[0]``, the params), its
    per-parameter lists traced once per kind of parameter."""
    params: Any = args[0] if args else None
    n = len(params) if type(params) is list else 0
    lanes = [k for k, a in enumerate(args) if type(a) is list and len(a) == n]
    rec = params[0]._recorder if n and type(params[0]) is TracedTensor else None
    if n < MIN_LANES or rec is None or not _shared_args_plain(args, kwargs, lanes):
        return original(*args, **kwargs)
    if os.environ.get("OPTTRACE_REPLICATE", "") == "0":
        return original(*args, **kwargs)
    lists = [args[k] for k in lanes]
    templates: dict[Any, _Template] = {}
    result = None
    for i in range(n):
        kind = _kind(rec, lists, i)
        template = templates.get(kind) if kind is not None else None
        if template is not None:
            template.replicate(rec, [lst[i] for lst in lists])
            continue
        stop = i + 1 if kind is not None else n
        result, template = _record(rec, original, args, kwargs, lanes, i, stop)
        if template is None:  # (the loop ran to the end, as torch wrote it)
            if stop < n:
                result = _call(original, args, kwargs, lanes, stop, n)
            return result
        templates[kind] = template
    return result


def _shared_args_plain(args: Sequence[Any], kwargs: dict[str, Any], lanes: list[int]) -> bool:
    """Whether the arguments every parameter shares hold no tensor: a tensor hyperparameter
    may be converted once per call of the loop (a node a replica would not repeat)."""
    shared = [a for k, a in enumerate(args) if k not in lanes] + list(kwargs.values())
    for a in shared:
        if isinstance(a, torch.Tensor):
            return False
        if isinstance(a, list | tuple) and any(isinstance(x, torch.Tensor) for x in a):
            return False
    return True


def _plain(rec: Recorder, t: TracedTensor) -> bool:
    """A tensor of this trace bound to one node, with no views, aliases or list item."""
    return (
        t._recorder is rec
        and t._node is not None
        and t._item is None
        and t._view_of is None
        and not t._aliases
        and t._stale is None
        and id(t) not in rec._views
    )


def _kind(rec: Recorder, lists: list[list[Any]], i: int) -> Any:
    """What the loop body can see of parameter ``i`` (its tensors' metadata, its other
    values, which entries are one object, what its tensors' ``.grad`` is), or None where a
    copy could not stand for its trace."""
    items = [lst[i] for lst in lists]
    ids = [id(x) for x in items]
    key: list[Any] = []
    for x in items:
        if type(x) is TracedTensor:
            if not _plain(rec, x):
                return None
            grad = x.__dict__.get("_grad_value")
            where = -1 if grad is None else ids.index(id(grad)) if id(grad) in ids else None
            if where is None:
                return None
            key.append((x._spec, x._device, x._layout, x.requires_grad, where))
        elif x is None or type(x) in (bool, int, float, str):
            key.append((type(x), x))
        else:
            return None
    key.append(tuple(ids.index(k) for k in ids))
    return tuple(key)


def _call(
    original: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    lanes: list[int],
    start: int,
    stop: int,
) -> Any:
    """``original`` over parameters ``start:stop`` (the lists sliced); what the loop stored
    into the slices is stored into the lists."""
    sliced = list(args)
    for k in lanes:
        sliced[k] = args[k][start:stop]
    try:
        return original(*sliced, **kwargs)
    finally:
        for k in lanes:
            args[k][start:stop] = sliced[k]


def _record(
    rec: Recorder,
    original: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    lanes: list[int],
    start: int,
    stop: int,
) -> tuple[Any, _Template | None]:
    """Run the loop over ``start:stop``; when that is one parameter, its template (None
    where it cannot be replicated)."""
    items = [args[k][start] for k in lanes]
    before = [x._node if type(x) is TracedTensor else None for x in items]
    graph = rec.graph
    last, count = compat.last_node(graph), compat.graph_length(graph)
    state = (len(rec._views), len(rec._list_len), len(rec.constants), rec.closed_by)
    decided: list[Any] = []
    stored: list[Any] = []
    on_decision, on_grad_store, on_attr_read = rec.on_decision, rec.on_grad_store, rec.on_attr_read

    def decision(node: Any, value: Any) -> None:
        decided.append(node.fx_node)
        if on_decision is not None:
            on_decision(node, value)

    def grad_store(tensor: Any, value: Any) -> None:
        stored.append(tensor)
        if on_grad_store is not None:
            on_grad_store(tensor, value)

    def attr_read(tensor: Any, name: str) -> Any:
        stored.append(tensor)  # (a per-parameter value, or its absence: no template)
        if on_attr_read is None:
            raise AttributeError(name)
        return on_attr_read(tensor, name)

    rec.on_decision, rec.on_grad_store, rec.on_attr_read = decision, grad_store, attr_read
    try:
        result = _call(original, args, kwargs, lanes, start, stop)
    finally:
        rec.on_decision, rec.on_grad_store, rec.on_attr_read = (
            on_decision,
            on_grad_store,
            on_attr_read,
        )
    if stop - start != 1 or stored:
        return result, None
    after = [args[k][start] for k in lanes]
    if any(a is not b for a, b in zip(items, after, strict=True)):
        return result, None  # (the loop stored into a list)
    nodes = compat.nodes_after(graph, last)
    same_state = (len(rec._views), len(rec._list_len), len(rec.constants), rec.closed_by)
    if len(nodes) != compat.graph_length(graph) - count or same_state != state:
        return result, None
    return result, _Template.of(rec, items, before, nodes, decided)


class _Template:
    """The nodes one parameter's loop body appended, and how to copy them for another."""

    def __init__(
        self,
        inputs: dict[fx.Node, int],
        steps: list[tuple[fx.Node, bool]],
        items: list[Any],
        tensors: dict[int, TracedTensor],
    ) -> None:
        self.inputs = inputs  # the body's first tensors' nodes -> their position in the lists
        self.steps = steps  # (node, copied per parameter: it reads the parameter's tensors)
        self.items = [id(x) for x in items]  # (what stands at each position of the lists)
        # Every tensor the body saw or made, by id: where each ended (its node, the tensors
        # it is one value with, e.g. a detach()) is where its copy ends.
        self.tensors = tensors
        # The nodes whose arguments are nodes or plain constants (nothing nested).
        self.flat = {
            node
            for node, own in steps
            if own and all(type(a) in _FLAT for a in (*node.args, *node.kwargs.values()))
        }

    @staticmethod
    def of(
        rec: Recorder,
        items: list[Any],
        before: list[fx.Node | None],
        nodes: list[fx.Node],
        decided: list[Any],
    ) -> _Template | None:
        inputs = {node: k for k, node in enumerate(before) if node is not None}
        mine: set[fx.Node] = set()  # nodes that read the parameter's tensors
        appended = set(nodes)
        steps = []
        tensors = {id(x): x for x in items if type(x) is TracedTensor}
        for node in nodes:
            if node.op != "call_function":
                return None
            own = False
            for a in node.all_input_nodes:
                if a in inputs or a in mine:
                    own = True
                elif a not in appended and a.op != "get_attr" and _tensor_valued(a):
                    return None  # (a tensor of the trace that is not one of this parameter's)
            val = node.meta.get("val")
            if not own and isinstance(val, TracedTensor):
                own = True  # (a tensor made anew from shared scalars: made anew by each copy)
            if own:
                # (a tensor, or a number read from one with .item(): a symbolic scalar
                # without a hint, the same for every parameter)
                if isinstance(val, TracedTensor):
                    tensors[id(val)] = val
                elif _tensor_valued(node):
                    return None  # (a tuple)
                mine.add(node)
            elif _tensor_valued(node) or node.target is aten._assert_scalar.default:
                return None  # (made anew for every parameter by a full trace: not copied)
            steps.append((node, own))
        if any(node in mine for node in decided):
            return None
        for t in tensors.values():
            if t._view_of is not None or t._stale is not None or id(t) in rec._views:
                return None  # (a view, or a base with views)
            if t._item is not None or t._recorder is not rec:
                return None
            if t._aliases and any(id(a) not in tensors for a in t._aliases):
                return None  # (one value with a tensor from outside the body)
        return _Template(inputs, steps, items, tensors)

    def replicate(self, rec: Recorder, items: list[Any]) -> None:
        """Append the template's nodes for another parameter of its kind (``items``: its
        entries of the lists), binding its tensors to them as the body would have."""
        mapped: dict[Any, Any] = {node: items[k]._node for node, k in self.inputs.items()}
        copies: dict[int, TracedTensor] = {}  # the body's tensor (by id) -> this one's
        for k, first in enumerate(self.items):
            if type(items[k]) is TracedTensor:
                copies.setdefault(first, items[k])
        get = mapped.get

        def arg(a: Any) -> Any:
            return get(a, a)

        for node, own in self.steps:
            if not own:
                continue
            args, kwargs = node.args, node.kwargs
            if node in self.flat:  # (no nested argument: map_arg's walk, without its calls)
                args = tuple([get(a, a) for a in args])
                kwargs = {k: get(v, v) for k, v in kwargs.items()} if kwargs else {}
            else:
                args, kwargs = fx.node.map_arg(args, arg), fx.node.map_arg(kwargs, arg)
            copy = rec.call(node.target, args, kwargs)
            copy.meta.update(node.meta)
            mapped[node] = copy
            val = node.meta.get("val")  # (none on a runtime check: _assert_scalar)
            if type(val) is not TracedTensor:
                continue
            t = copies.get(id(val))
            if t is None:
                t = copies[id(val)] = TracedTensor(
                    rec, val._spec, val._device, val.requires_grad, val._layout
                )
            copy.meta["val"] = t
        groups: dict[int, list[TracedTensor]] = {}
        for key, body in self.tensors.items():
            t = copies[key]
            t._node, t._item = get(body._node, t._node), None
            if body._aliases:
                group = groups.get(id(body._aliases))
                if group is None:
                    group = groups[id(body._aliases)] = [copies[id(a)] for a in body._aliases]
                t._aliases = group


_FLAT = frozenset(
    {
        fx.Node,
        bool,
        int,
        float,
        str,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)


def _tensor_valued(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor | tuple | list)
