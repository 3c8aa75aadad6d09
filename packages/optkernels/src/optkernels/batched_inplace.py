"""Which ops of the batched plan may write their result into their first argument.

The step graph is functional: each op makes new tensors and trailing ``copy_`` nodes write
the results into the inputs. Eager ran most of those ops in place (``p.mul_``,
``exp_avg.lerp_``), and the batched plan can too, where nothing reads the overwritten values
afterwards: no allocation per op and lane, and a write whose value already sits in its input
disappears. (``reinplace.py`` does this for the node-by-node plan by rewriting the graph, for
the ops eager ran in place; here it is decided on the BatchedOps in the order the batched plan
runs them, for every op whose in-place foreach form computes the functional op's bits,
intermediate results included.) ``in_place_ops`` decides op by op, tracking which storages
each slot's tensors live in:

- the first argument must be tensors the plan owns (a foreach op's fresh results, or what an
  earlier in-place op wrote) or inputs that the step overwrites anyway (every one of them is
  a writeback target);
- no later op, writeback or output may read those storages' current values through anything
  but the op's own result, nor may the op's other arguments;
- each lane's result must have its first argument's dtype, shape and strides (a foreach node
  recorded from an in-place op runs that op: eager's result, whatever the functional form's);
- a writeback of the result must go to the input it now lives in (then it is dropped);
- the in-place op must round as the functional one: on the CPU ``_foreach_mul_`` by a
  Scalar or ScalarList does not for float16/bfloat16 (``reference._as_eager_ran``), unless
  it is the op eager ran (a foreach node's ``meta["inplace"]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx

from optkernels.families import Arg, BatchedOp, Families

Loc = tuple[int, int | None]


def arg_nodes(arg: Arg) -> Iterator[fx.Node]:
    """The nodes an argument reads."""
    tag = arg[0]
    if tag == "node":
        yield arg[1]
    elif tag == "column":
        yield from arg[1]
    elif tag == "seq":
        for a in arg[2]:
            yield from arg_nodes(a)


def op_nodes(op: BatchedOp, skip_first: bool = False) -> Iterator[fx.Node]:
    args = op.args[1:] if skip_first else op.args
    for a in (*args, *(v for _, v in op.kwargs)):
        yield from arg_nodes(a)


def in_place_ops(
    program: Families,
    loc: dict[fx.Node, Loc],
    slots: list[int],
    fresh: Callable[[int], bool],
    can: Callable[[int], bool],
) -> tuple[set[int], set[int]]:
    """The ops (indices into ``program.ops``) to run in place on their first argument, and
    the writes (indices into ``program.writes``) that then copy a tensor onto itself.

    ``slots[k]``: op k's result slot; ``fresh(k)``: whether op k, run functionally, returns
    new tensors (a foreach call; a loop may return views of what it reads); ``can(k)``:
    whether op k has an in-place form that rounds like the op the graph records."""
    state = _Storages(program, loc, slots)
    ops = program.ops
    reads = [{loc[n][0] for n in op_nodes(op)} for op in ops]
    later: list[set[int]] = []  # the slots read after op k (by ops, writes, outputs)
    seen = {loc[src][0] for _, src in program.writes}
    seen |= {loc[n][0] for n in _output_nodes(program.output)}
    for k in reversed(range(len(ops))):
        later.append(set(seen))
        seen |= reads[k]
    later.reverse()
    inplace: set[int] = set()
    dropped: set[int] = set()
    for k, op in enumerate(ops):
        slot = slots[k]
        target = state.overwritten(op) if can(k) else None
        if target is not None:
            held, lanes, firsts = target
            old = [s for s in later[k] if state.order.get(s, -1) < k and state.holds(s, held)]
            others = {loc[n][0] for n in op_nodes(op, skip_first=True)}
            writes = state.self_writes(slot, lanes)
            if (
                not old
                and not any(state.holds(s, held) for s in others)
                and writes is not None
                and (_eager_in_place(op) or _fits(op, firsts, state.memo))
            ):
                inplace.add(k)
                dropped |= writes
                state.result(slot, held, lanes)
                continue
        if not any(isinstance(v, torch.Tensor) for v in _values(op.nodes[0])):
            state.storages[slot] = frozenset()  # numbers
        elif fresh(k):
            state.result(slot, frozenset((slot,)), None)
        else:  # a loop's results may be views of what it reads
            state.storages[slot] = frozenset().union(*(state.storages[s] for s in reads[k]))
    return inplace, dropped


class _Storages:
    """Where the tensors of each slot live, as ops run in place: ``storages`` (an input's
    own slot is its storage), ``lanes_of`` (per lane, the input slot a result's tensor is;
    None: the plan's own) and ``owned`` (slots of tensors the plan may overwrite)."""

    def __init__(self, program: Families, loc: dict[fx.Node, Loc], slots: list[int]) -> None:
        self.loc = loc
        self.order = {slot: k for k, slot in enumerate(slots)}  # result slot -> op index
        self.lengths = {slot: _length(op) for slot, op in zip(slots, program.ops, strict=True)}
        self.written = {loc[dst][0] for dst, _ in program.writes}
        self.storages: dict[int, frozenset[int]] = {}
        for node in (*program.placeholders, *program.constants):
            self.storages[loc[node][0]] = frozenset((loc[node][0],))
        self.lanes_of: dict[int, tuple[int | None, ...]] = {}
        self.owned: set[int] = set()
        self.by_source: dict[int, list[tuple[int, int, int | None]]] = {}
        for w, (dst, src) in enumerate(program.writes):
            s, i = loc[src]
            self.by_source.setdefault(s, []).append((w, loc[dst][0], i))
        self.memo: dict[fx.Node, tuple[Any, Any]] = {}

    def holds(self, slot: int, held: frozenset[int]) -> bool:
        return bool(self.storages.get(slot, frozenset()) & held)

    def result(self, slot: int, held: frozenset[int], lanes: tuple[int | None, ...] | None) -> None:
        self.storages[slot] = held
        if lanes is not None:
            self.lanes_of[slot] = lanes
        self.owned.add(slot)

    def overwritten(
        self, op: BatchedOp
    ) -> tuple[frozenset[int], tuple[int | None, ...], list[Any]] | None:
        """What op would overwrite in place: the storages, per lane the input slot each is,
        and each lane's first argument; None when its first argument is not a whole column
        of tensors the plan may overwrite."""
        loc = self.loc
        first = op.args[0] if op.args and op.kind != "shared" else None
        if first is None:
            return None
        if first[0] == "node" and op.kind == "foreach":  # a whole earlier foreach result
            slot = loc[first[1]][0]
            firsts = _values(first[1])
        elif first[0] == "column":
            nodes = first[1]
            locs = [loc[n] for n in nodes]
            firsts = [n.meta.get("val") for n in nodes]
            if all(i is None for _, i in locs):  # inputs: each overwritten by the step anyway
                slots = tuple(s for s, _ in locs)
                if len(set(slots)) != len(slots) or not all(s in self.written for s in slots):
                    return None
                return frozenset(slots), slots, firsts
            slot = locs[0][0]
            if locs != [(slot, i) for i in range(len(locs))]:
                return None
            if self.lengths.get(slot) != len(locs):
                return None
        else:
            return None
        if slot not in self.owned:
            return None
        lanes = self.lanes_of.get(slot, (None,) * len(firsts))
        return self.storages[slot], lanes, firsts

    def self_writes(self, slot: int, lanes: tuple[int | None, ...]) -> set[int] | None:
        """The writes of the result in ``slot`` whose tensors are, per lane, the inputs
        ``lanes`` (None: the plan's own tensor) that copy a tensor onto itself; None when
        one would copy an input into another input."""
        dropped = set()
        for w, dst, i in self.by_source.get(slot, []):
            lane = lanes[i if i is not None else 0]
            if lane is None:
                continue  # the result lives in the plan's own tensor: the write copies it
            if lane != dst:
                return None
            dropped.add(w)
        return dropped


def _eager_in_place(op: BatchedOp) -> bool:
    """A foreach node recorded from an in-place op: that op writes the tensors' own layout
    (its functional form may promote; the graph's values keep eager's dtype)."""
    return op.kind == "foreach" and op.nodes[0].meta.get("inplace") is not None


def _length(op: BatchedOp) -> int:
    return op.lanes if op.kind == "family" else len(_values(op.nodes[0]))


def _values(node: fx.Node) -> list[Any]:
    val = node.meta.get("val")
    return list(val) if isinstance(val, list | tuple) else [val]


def _fits(op: BatchedOp, firsts: list[Any], memo: dict[fx.Node, tuple[Any, Any]]) -> bool:
    """Whether each lane's result, as the graph's op computes it, has its first argument's
    dtype, shape and strides (what an in-place op writes)."""
    results = _functional_results(op, memo)
    if results is None or len(results) != len(firsts):
        return False
    return all(
        isinstance(first, torch.Tensor) and out == _layout(first)
        for out, first in zip(results, firsts, strict=True)
    )


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride())


def _functional_results(
    op: BatchedOp, memo: dict[fx.Node, tuple[Any, Any]]
) -> list[tuple[Any, ...]] | None:
    """Each lane's result layout (dtype, shape, strides) as the graph's functional op makes
    it, found by running it on meta tensors: ``meta["val"]`` cannot tell, since for a node
    recorded from an in-place op it describes the written tensor (``a.div_(b)`` keeps a's
    dtype where ``div(a, b)`` may promote). None if that fails."""
    cache: dict[Any, Any] = {}

    def build(arg: Arg, lane: int | None) -> Any:
        """The argument's example value for ``lane`` (None: the whole list), and its key."""
        tag = arg[0]
        if tag == "const":
            return arg[1], (type(arg[1]), repr(arg[1]))
        if tag == "node":
            return _example(arg[1], memo)
        if tag == "column":
            if lane is not None:
                return _example(arg[1][lane], memo)
            values, keys = zip(*(_example(n, memo) for n in arg[1]), strict=True)
            return list(values), keys
        values, keys = zip(*(build(a, lane) for a in arg[2]), strict=True) if arg[2] else ((), ())
        return arg[1](values), keys

    def run(lane: int | None) -> Any:
        args, keys = zip(*(build(a, lane) for a in op.args), strict=True) if op.args else ((), ())
        kwargs = {k: build(a, lane) for k, a in op.kwargs}
        key = (keys, tuple(v[1] for v in kwargs.values()))
        if key not in cache:
            values = {k: v[0] for k, v in kwargs.items()}
            with torch.no_grad():
                out = op.target(*_on_meta(args), **_on_meta(values))
            cache[key] = (
                [_layout(t) for t in out] if isinstance(out, list | tuple) else [_layout(out)]
            )
        result: list[tuple[Any, ...]] = cache[key]
        return result

    try:
        if op.kind == "foreach":
            return list(run(None))
        return [r for lane in range(op.lanes) for r in run(lane)]
    except Exception:  # an op without a meta kernel: stays functional
        return None


def _example(node: fx.Node, memo: dict[fx.Node, tuple[Any, Any]]) -> tuple[Any, Any]:
    """A node's example value (its trace's fake tensor, a Python number) and a key that
    tells apart what can change an op's result layout."""
    found = memo.get(node)
    if found is not None:
        return found
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        key: Any = _layout(val)
    elif isinstance(val, list | tuple):
        key = tuple(_layout(v) if isinstance(v, torch.Tensor) else type(v) for v in val)
    else:
        key = type(val)
    memo[node] = found = (val, key)
    return found


def _on_meta(a: Any) -> Any:
    """``a`` with each tensor (a trace's fake value) replaced by an empty meta tensor."""
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(tuple(a.shape), a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, list | tuple):
        return type(a)(_on_meta(x) for x in a)
    if isinstance(a, dict):
        return {k: _on_meta(v) for k, v in a.items()}
    return a


def _output_nodes(arg: Any) -> Iterator[fx.Node]:
    if isinstance(arg, fx.Node):
        yield arg
    elif isinstance(arg, list | tuple):
        for a in arg:
            yield from _output_nodes(a)
