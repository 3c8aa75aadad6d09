"""The torch reference backend: runs the graph's ATen ops eagerly on the real tensors.

It is the ground truth for kernel tests and the default on CPU. Like ``fx.Interpreter`` it
walks the nodes in order, but the walk is prepared once: each node becomes a step that reads
its arguments from numbered slots, so a call costs little beyond the ops themselves and no
Python code is generated for large graphs. Trailing ``copy_`` nodes write updates into the
inputs.

A functional foreach node recorded from an in-place op (``node.meta["inplace"]``, the op
eager ran) whose CPU kernel rounds float16/bfloat16 differently in place runs as that op on
copies of its inputs, so the result is eager's to the bit.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import fx

from optkernels._torch_compat import direct_call
from optkernels.backend import Plan
from optkernels.lanes import NotLanes
from optkernels.numbers import assert_scalar, is_assert
from optkernels.reinplace import reinplace

log = logging.getLogger("optcompile.kernels")

Load = Callable[[list[Any]], Any]


def _loader(arg: Any, slots: dict[fx.Node, int]) -> Load:
    """A function reading ``arg`` (a node, a constant, or lists/dicts of them) from slots.

    What holds no node is the constant itself, not rebuilt each call (ATen ops do not
    mutate their list arguments; ``**kwargs`` unpacks a copy)."""
    if not _holds_node(arg):
        return lambda env: arg
    if isinstance(arg, fx.Node):
        i = slots[arg]
        return operator.itemgetter(i)
    if isinstance(arg, list | tuple):
        kind = type(arg)
        if all(isinstance(a, fx.Node) for a in arg) and arg:
            getter = operator.itemgetter(*(slots[a] for a in arg))
            if len(arg) == 1:
                return lambda env: kind((getter(env),))
            return lambda env: kind(getter(env))
        parts = [_loader(a, slots) for a in arg]
        return lambda env: kind(p(env) for p in parts)
    if isinstance(arg, dict):
        loaders = {k: _loader(v, slots) for k, v in arg.items()}
        return lambda env: {k: f(env) for k, f in loaders.items()}
    return lambda env: arg


def _holds_node(arg: Any) -> bool:
    if isinstance(arg, fx.Node):
        return True
    if isinstance(arg, list | tuple):
        return any(_holds_node(a) for a in arg)
    if isinstance(arg, dict):
        return any(_holds_node(a) for a in arg.values())
    return False


# In-place foreach ops whose CPU kernels round float16/bfloat16 differently from their
# functional forms (torch 2.13, every foreach op compared: a product with a Scalar or a
# ScalarList is 1 ulp apart, which compounds over steps).
_ROUNDS_DIFFERENTLY_IN_PLACE = {
    torch.ops.aten._foreach_mul_.Scalar,
    torch.ops.aten._foreach_mul_.ScalarList,
}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _as_eager_ran(node: fx.Node) -> Callable[..., Any]:
    """The callable that computes ``node`` as the op eager ran does."""
    if is_assert(node):
        return assert_scalar
    inplace = node.meta.get("inplace")
    values = node.meta.get("val")
    if node.target is inplace:  # (turned back in place: reinplace.py)
        return node.target  # type: ignore[no-any-return]
    if inplace not in _ROUNDS_DIFFERENTLY_IN_PLACE or not any(
        getattr(v, "dtype", None) in _LOW_PRECISION for v in values or ()
    ):
        return node.target  # type: ignore[return-value]

    def on_copies(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        out = [same_layout_copy(t) for t in tensors]
        inplace(out, *args, **kwargs)
        return out

    return on_copies


def same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (``clone`` makes a non-dense view contiguous, and a
    CPU kernel may round otherwise on another layout)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


# Ops whose ATen kernels take a 0-dim CPU tensor with tensors on a device, as a scalar
# (TensorIterator's binary and comparison ops; a foreach form falls back to them; an
# index_put_ / masked_fill_ of a CPU 0-dim value, which they read as a number in the
# destination's dtype: moved to the device, a float32 value into a float64 tensor is
# refused, "Index put requires the source and destination dtypes match" — Rprop's
# ``sign[sign.gt(0)] = etaplus`` with a Tensor eta on float64 params).
_TAKE_CPU_SCALARS = frozenset(
    {"add", "sub", "rsub", "mul", "div", "pow", "maximum", "minimum"}
    | {"eq", "ne", "lt", "le", "gt", "ge", "copy", "_to_copy", "index_put", "masked_fill"}
)


def _on_device(node: fx.Node, target: Callable[..., Any]) -> Callable[..., Any]:
    """``target``, or for an op that mixes 0-dim CPU tensors (step counts of a capturable=False
    optimizer, in a graph traced on the capturable path) with tensors on a device and
    whose kernel refuses that (``addcmul``, ``lerp``, ``where``: "expected all tensors on
    the same device"), a call that moves those operands to the device first."""
    if not isinstance(node.target, torch._ops.OpOverload):
        # Python's own ops (getitem of a foreach result, scalar arithmetic) take no device;
        # a getitem's argument holds a whole list's values: scanning them for every item
        # made the first call of a step over N params quadratic in N
        return target
    name = getattr(node.target, "__name__", "").partition(".")[0].removeprefix("_foreach_")
    if name.rstrip("_") in _TAKE_CPU_SCALARS:
        return target
    vals: list[Any] = []

    def collect(n: fx.Node) -> fx.Node:
        val = n.meta.get("val")
        vals.extend(val if isinstance(val, list | tuple) else (val,))
        return n

    fx.map_arg((node.args, node.kwargs), collect)
    tensors = [v for v in vals if hasattr(v, "device") and hasattr(v, "dim")]
    devices = {str(v.device) for v in tensors} - {"cpu"}
    if len(devices) != 1 or not any(str(v.device) == "cpu" and v.dim() == 0 for v in tensors):
        return target
    device = torch.device(devices.pop())

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0:
            return value.to(device, non_blocking=True)
        if isinstance(value, list | tuple):
            return type(value)(move(v) for v in value)
        return value

    def moved(*args: Any, **kwargs: Any) -> Any:
        return target(*move(args), **{k: move(v) for k, v in kwargs.items()})

    return moved


def _attribute(owner: torch.nn.Module, target: str) -> Any:
    value: Any = owner
    for name in target.split("."):
        value = getattr(value, name)
    return value


class TorchPlan:
    """One graph prepared for execution with torch ops."""

    backend = "torch"

    def __init__(
        self,
        gm: fx.GraphModule | None,
        reason: str | None = None,
        *,
        graph: fx.Graph | None = None,
        owner: torch.nn.Module | None = None,
    ) -> None:
        """The plan of ``gm``; or of ``graph`` (its constants ``owner``'s attributes), whose
        GraphModule is made only if asked for (``gm``, ``describe``): the plan runs the
        nodes, and Python compiling the code of a graph of thousands of nodes takes tenths
        of a second."""
        if gm is None:
            assert graph is not None and owner is not None
        else:
            graph, owner = gm.graph, gm
        self._gm, self._graph, self._owner = gm, graph, owner
        self.reason = reason  # why the torch backend did not batch this graph (if it tried)
        slots: dict[fx.Node, int] = {}
        self._inputs: list[int] = []
        self._constants: list[tuple[int, Any]] = []
        self._steps: list[tuple[int, Callable[..., Any], Load, Load]] = []
        self._output: Load = lambda env: ()
        launches = 0
        for node in graph.nodes:
            slot = slots[node] = len(slots)
            if node.op == "placeholder":
                self._inputs.append(slot)
            elif node.op == "get_attr":
                self._constants.append((slot, _attribute(owner, str(node.target))))
            elif node.op == "call_function":
                args = _loader(tuple(node.args), slots)
                kwargs = _loader(dict(node.kwargs), slots)
                target = _as_eager_ran(node)
                launches += isinstance(target, torch._ops.OpOverload)
                self._steps.append((slot, _on_device(node, direct_call(target)), args, kwargs))
            elif node.op == "output":
                self._output = _loader(node.args[0], slots)
            else:
                raise ValueError(f"the torch backend cannot run {node.op} node {node.name}")
        self._size = len(slots)
        self.num_inputs = len(self._inputs)
        self._dead = _dead_after(graph, slots)
        # Each ATen op is at least one kernel launch on a device (Python scalar math is none).
        self.kernel_launches_per_step = launches

    @property
    def gm(self) -> fx.GraphModule:
        if self._gm is None:
            self._gm = fx.GraphModule(self._owner, self._graph)
        return self._gm

    def guarded_addresses(self, indices: Collection[int]) -> None:
        """Nothing to skip: torch ops take the tensors themselves, not their addresses."""

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if len(inputs) != self.num_inputs:
            raise ValueError(f"graph takes {self.num_inputs} inputs, got {len(inputs)}")
        env: list[Any] = [None] * self._size
        for slot, value in zip(self._inputs, inputs, strict=True):
            env[slot] = value
        for slot, value in self._constants:
            env[slot] = value
        with torch.no_grad():
            for (slot, target, args, kwargs), dead in zip(self._steps, self._dead, strict=True):
                env[slot] = target(*args(env), **kwargs(env))
                for d in dead:  # (a temporary's memory goes back as eager's would)
                    env[d] = None
            out = self._output(env)
        return tuple(out) if isinstance(out, list | tuple) else (out,)

    def describe(self) -> str:
        if self.reason is None:
            return self.gm.code.strip()
        header = f"# torch backend, node by node (not batched: {self.reason})"
        return header + "\n" + self.gm.code.strip()


def _dead_after(graph: fx.Graph, slots: dict[fx.Node, int]) -> list[tuple[int, ...]]:
    """Per call_function node, the slots of the values computed in the graph that no later
    node reads: dropped once it ran, so a step's temporaries do not all live until its end
    (a CUDA graph recording keeps its pool to what eager would hold; Muon's Newton-Schulz
    temporaries are gigabytes for a large model). Inputs, constants and outputs are kept."""
    last: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            last[arg] = node
    dead: dict[fx.Node, list[int]] = {}
    for value, user in last.items():
        if value.op == "call_function" and user.op == "call_function":
            dead.setdefault(user, []).append(slots[value])
    return [tuple(dead.get(node, ())) for node in graph.nodes if node.op == "call_function"]


def node_by_node(
    gm: fx.GraphModule,
    reason: str | None = None,
    rewrite: Callable[[fx.Graph], object] | None = None,
) -> TorchPlan:
    """The node-by-node plan of ``gm``, with the writes eager made in place run in place
    (``reinplace.py``, on a copy: the entry keeps the traced graph for explain()), then
    ``rewrite`` applied to that graph (the CPU backend's: ``c_chains.fuse_chains``)."""
    graph = copy.deepcopy(gm.graph)
    reinplace(graph)
    if rewrite is not None:
        rewrite(graph)
    graph.owning_module = gm  # (its constants: ``gm``'s until its own module is made)
    return TorchPlan(None, reason=reason, graph=graph, owner=gm)


# Values per op node from which a graph's ops run node by node, each in place where eager
# wrote in place, rather than batched: a batched op's fresh result costs about a page fault
# per 4 KiB, a node-by-node call some microseconds of Python.
PAGE_VALUES = 4096


def values_per_op(gm: fx.GraphModule) -> int:
    """The graph's input values over its tensor ops (Python scalar math costs less)."""
    values = sum(
        v.numel()
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(v := n.meta.get("val"), torch.Tensor)
    )
    calls = sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor | list)
    )
    return values // max(calls, 1)


class TorchBackend:
    """Backend that executes graphs with torch ops (no fusion, any device).

    A graph whose ops repeat over lanes (parameters) runs batched, one call per op over all
    lanes (``batched.BatchedPlan``); any other graph node by node (``TorchPlan``), and so
    does one whose batched calls would each cover at most two large tensors (Adafactor over
    an MLP's matrices: allocating their results cost more than the calls saved)."""

    name = "torch"
    wants_capturable = False

    def compile(self, gm: fx.GraphModule) -> Plan:
        from optkernels.batched import BatchedPlan  # imports this module
        from optkernels.families import families

        try:
            program = families(gm.graph)
        except NotLanes as exc:
            plan = node_by_node(gm, reason=str(exc))
            log.info(
                "torch backend: node by node (%s), %d ATen op launches per step",
                exc,
                plan.kernel_launches_per_step,
            )
            return plan
        batched = BatchedPlan(gm, program)
        per_op = values_per_op(gm)
        if batched.widest <= 2 and per_op >= PAGE_VALUES:
            reason = (
                f"its batched calls would cover at most {batched.widest} tensors of "
                f"{per_op} values per op: ops run in place, one node at a time"
            )
            log.info("torch backend: node by node (%s)", reason)
            return node_by_node(gm, reason=reason)
        log.info("torch backend: batched over lanes, %d calls per step", len(program.ops))
        return batched
