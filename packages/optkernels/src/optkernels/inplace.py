"""Which batched ops may write their result into their first argument (reinplacing).

The step graph is functional: each op makes new tensors and trailing ``copy_`` nodes write
the results into the inputs. Eager ran most of those ops in place (``p.mul_``,
``exp_avg.lerp_``), and the batched plan can too, where nothing reads the overwritten values
afterwards: no allocation per op and lane, and a write whose value already sits in its input
disappears. ``reinplace`` decides op by op, in execution order, tracking which storages each
slot's tensors live in:

- the first argument must be tensors the plan owns (a foreach op's fresh results, or what an
  earlier in-place op wrote) or inputs that the step overwrites anyway (every one of them is
  a writeback target);
- no later op, writeback or output may read those storages' current values through anything
  but the op's own result, nor may the op's other arguments;
- each lane's result must have its first argument's dtype, shape and strides;
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


def reinplace(
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
    ops = program.ops
    written = {loc[dst][0] for dst, _ in program.writes}
    order = {slot: k for k, slot in enumerate(slots)}  # result slot -> op index
    lengths = {slot: _length(op) for slot, op in zip(slots, ops, strict=True)}
    reads = [{loc[n][0] for n in op_nodes(op)} for op in ops]
    final = {loc[src][0] for _, src in program.writes}
    final |= {loc[n][0] for n in _output_nodes(program.output)}
    later: list[set[int]] = []  # slots read after op k
    seen = set(final)
    for k in reversed(range(len(ops))):
        later.append(set(seen))
        seen |= reads[k]
    later.reverse()
    # The storages a slot's tensors live in (an input's own slot is its storage), and per
    # lane the input slot a result's tensor is after in-place ops (None: the plan's own).
    storages: dict[int, frozenset[int]] = {}
    for node in (*program.placeholders, *program.constants):
        storages[loc[node][0]] = frozenset((loc[node][0],))
    lanes_of: dict[int, tuple[int | None, ...]] = {}
    owned: set[int] = set()
    inplace: set[int] = set()
    dropped: set[int] = set()
    for k, op in enumerate(ops):
        slot = slots[k]
        target = _target(op, loc, written, lengths, owned, storages, lanes_of) if can(k) else None
        if target is not None:
            held, lanes = target
            stale = [s for s in later[k] if order.get(s, -1) < k and storages[s] & held]
            others = {loc[n][0] for n in op_nodes(op, skip_first=True)}
            writes = _self_writes(slot, lanes, program, loc)
            if not stale and not _reads(storages, others, held) and writes is not None:
                inplace.add(k)
                dropped |= writes
                storages[slot] = held
                lanes_of[slot] = lanes
                owned.add(slot)
                continue
        if not any(isinstance(v, torch.Tensor) for v in _values(op.nodes[0])):
            storages[slot] = frozenset()  # numbers
        elif fresh(k):
            storages[slot] = frozenset((slot,))
            owned.add(slot)
        else:  # a loop's results may be views of what it reads
            storages[slot] = frozenset().union(*(storages[s] for s in reads[k]))
    return inplace, dropped


def _length(op: BatchedOp) -> int:
    return op.lanes if op.kind == "family" else len(_values(op.nodes[0]))


def _values(node: fx.Node) -> list[Any]:
    val = node.meta.get("val")
    return list(val) if isinstance(val, list | tuple) else [val]


def _target(
    op: BatchedOp,
    loc: dict[fx.Node, Loc],
    written: set[int],
    lengths: dict[int, int],
    owned: set[int],
    storages: dict[int, frozenset[int]],
    lanes_of: dict[int, tuple[int | None, ...]],
) -> tuple[frozenset[int], tuple[int | None, ...]] | None:
    """The storages op would overwrite and, per lane, the input slot each is (None: the
    plan's own tensor); None when its first argument is not a whole column the op may
    overwrite, or its results do not fit there."""
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
            if len(set(slots)) != len(slots) or not all(s in written for s in slots):
                return None
            return _fits(op, firsts, frozenset(slots), slots)
        slot = locs[0][0]
        if [loc for loc in locs] != [(slot, i) for i in range(len(locs))]:
            return None
        if lengths.get(slot) != len(locs):
            return None
    else:
        return None
    if slot not in owned:
        return None
    return _fits(op, firsts, storages[slot], lanes_of.get(slot, (None,) * len(firsts)))


def _fits(
    op: BatchedOp, firsts: list[Any], held: frozenset[int], lanes: tuple[int | None, ...]
) -> tuple[frozenset[int], tuple[int | None, ...]] | None:
    """``(held, lanes)`` when each lane's result, as the graph's op computes it, has its
    first argument's dtype, shape and strides (what an in-place op writes), else None."""
    results = _functional_results(op)
    if results is None or len(results) != len(firsts):
        return None
    for out, first in zip(results, firsts, strict=True):
        if not isinstance(first, torch.Tensor) or out != _layout(first):
            return None
    return held, lanes


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride())


def _functional_results(op: BatchedOp) -> list[tuple[Any, ...]] | None:
    """Each lane's result layout (dtype, shape, strides) as the graph's functional op makes
    it, found by running it on meta tensors: ``meta["val"]`` cannot tell, since for a node
    recorded from an in-place op it describes the written tensor (``a.div_(b)`` keeps a's
    dtype where ``div(a, b)`` may promote). None if that fails."""
    cache: dict[Any, Any] = {}

    def example(a: Any, lane: int | None) -> Any:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                return torch.empty_strided(
                    tuple(val.shape), val.stride(), dtype=val.dtype, device="meta"
                )
            return val
        return a

    def build(arg: Arg, lane: int | None) -> Any:
        tag = arg[0]
        if tag == "const":
            return arg[1]
        if tag == "node":
            if op.kind == "foreach" and isinstance(arg[1].meta.get("val"), list | tuple):
                return [_empty(v) for v in arg[1].meta["val"]]
            return example(arg[1], lane)
        if tag == "column":
            if lane is None:
                return [example(n, None) for n in arg[1]]
            return example(arg[1][lane], lane)
        return arg[1](build(a, lane) for a in arg[2])

    def run(lane: int | None) -> Any:
        args = [build(a, lane) for a in op.args]
        kwargs = {k: build(a, lane) for k, a in op.kwargs}
        key = _key((args, kwargs))
        if key not in cache:
            with torch.no_grad():
                out = op.target(*args, **kwargs)
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


def _empty(val: Any) -> Any:
    return torch.empty_strided(tuple(val.shape), val.stride(), dtype=val.dtype, device="meta")


def _key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return _layout(a)
    if isinstance(a, list | tuple):
        return (type(a), tuple(_key(x) for x in a))
    if isinstance(a, dict):
        return tuple((k, _key(v)) for k, v in a.items())
    return (type(a), repr(a))


def _reads(storages: dict[int, frozenset[int]], slots: set[int], held: frozenset[int]) -> bool:
    return any(storages.get(s, frozenset()) & held for s in slots)


def _self_writes(
    slot: int, lanes: tuple[int | None, ...], program: Families, loc: dict[fx.Node, Loc]
) -> set[int] | None:
    """The writes of the result in ``slot`` that become copies of a tensor onto itself; None
    when one would copy an input the result now lives in into another input."""
    dropped = set()
    for w, (dst, src) in enumerate(program.writes):
        s, i = loc[src]
        if s != slot:
            continue
        lane = lanes[i if i is not None else 0]
        if lane is None:
            continue  # the result lives in the plan's own tensor: the write copies it
        if lane != loc[dst][0]:
            return None
        dropped.add(w)
    return dropped


def _output_nodes(arg: Any) -> Iterator[fx.Node]:
    if isinstance(arg, fx.Node):
        yield arg
    elif isinstance(arg, list | tuple):
        for a in arg:
            yield from _output_nodes(a)
