"""The fast tier's native checks over many tensors: one C++ visit per list of tensors.

The guards on the items of a list (the params of a group: type, dtype, device, shape,
stride, and where all of them have one, identity and data pointer) and on the items'
``.grad`` become one native check per list (both in one visit of each item) instead of one
tree node per tensor; items and grads that are DTensors get their mesh, placements and local
tensor checked in the same visit. The pinned DTensors that no list covers (an optimizer's
state tensors) get one more native check. fast.py decides which guards go here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import torch

from optguard import _torch_compat as compat
from optguard.guards import DataPtrGuard, EqualGuard, Guard, NoneGuard, TensorMatchGuard
from optguard.sources import AttrSource, ItemSource, Locals, Source
from optguard.tree import TreeBuilder


def list_families(
    module: Any,
    guards: Sequence[Guard],
    L: Locals,
    builder: TreeBuilder,
    keys: set[Source],
    grad_lists: dict[Source, tuple[Any, int]],
    ptr_of: dict[Source, int],
    local_lists: dict[Source, tuple[Any, int]],
    on_source: dict[Source, list[Guard]],
) -> tuple[set[Source], set[Source], set[Source]]:
    """Put the metadata guards on the items of a list (``params[i]``) and on their grads
    (``params[i].grad``) into one native check per list (both kinds in one visit of each
    item), where they cover every item (with the identity of items that key the state, when
    all of them do). Return the
    sources they guard (the caller adds no other guard for them) and those whose identity
    they check, and those whose data pointers (``ptr_of``: their DataPtrGuards) they check
    too; record the grad checks in ``grad_lists`` (see FastCheck).

    Items (or grads) that are DTensors get their mesh, placements and local tensor checked
    in the same visit, where every guard on those is one the visit can test
    (``_dtensor_parts``): the local tensors of items checked by identity are pinned, those
    of grads stashed for the gather (``local_lists``, as ``grad_lists``)."""
    families: dict[tuple[Source, bool], dict[int, list[Guard]]] = {}
    for g in guards:
        if not isinstance(g, TensorMatchGuard) and not (isinstance(g, NoneGuard) and g.is_none):
            continue
        source, grad = g.source, False
        if isinstance(source, AttrSource) and source.attr == "grad":
            source, grad = source.base, True
        if isinstance(source, ItemSource) and isinstance(source.key, int):
            families.setdefault((source.base, grad), {}).setdefault(source.key, []).append(g)
    listed: set[Source] = set()
    identified: set[Source] = set()
    addressed: set[Source] = set()
    checks: dict[tuple[Source, bool], tuple[Any, str, int]] = {}  # spec, text, length
    for (container_source, grad), items in families.items():
        container = container_source.fetch(L)
        if (
            type(container) is not list
            or sorted(items) != list(range(len(container)))
            or any(len(on_item) != 1 for on_item in items.values())
        ):
            continue
        node = builder.node(container_source)
        values = [v.grad if grad else v for v in container]
        if node is None or not all(v is None or _strided(v) for v in values):
            continue
        sources = [items[i][0].source for i in range(len(container))]
        ids = not grad and all(s in keys for s in sources)
        # The same visit checks the addresses too when each item has one guarded.
        ptrs = not grad and all(
            v is not None and ptr_of.get(s) == v.data_ptr()
            for s, v in zip(sources, values, strict=True)
        )
        what = (
            "their grads keep"
            if grad
            else ("its items are the same objects with" if ids else "its items keep")
        )
        text = f"{what} type, dtype, device, shape, stride" + (", data pointer" if ptrs else "")
        dts = _dtensor_parts(values, sources, on_source, ptr_of)
        if dts is not None:
            entries, covered = dts
            text += (
                "; their DTensors keep mesh and placements (==), local tensor "
                + ("(the same object) " if ids else "")
                + "type, dtype, device, shape, stride"
                + (", data pointer" if any(e[2] for e in entries if e is not None) else "")
            )
            spec = module.spec(values, ids, ptrs, entries)
            for guarded, local, ptr in covered:
                listed.update(guarded)
                if ids:
                    identified.add(local)
                if ptr:
                    addressed.add(local)
            if grad:
                local_lists[container_source] = (spec, len(values))
        else:
            spec = module.spec(values, ids, ptrs)
        checks[container_source, grad] = (spec, text, len(values))
        listed.update(sources)
        if ids:
            identified.update(sources)
        if ptrs:
            addressed.update(sources)
    for (container_source, grad), (spec, text, n) in checks.items():
        node = builder.node(container_source)
        if grad:
            grad_lists[container_source] = (spec, n)
            items_check = checks.get((container_source, False))
            if items_check is not None:  # both kinds in one visit of each item
                test = functools.partial(module.match_both, spec, items_check[0])
                text = f"{items_check[1]}; {text}"
            else:
                test = functools.partial(module.match, spec, True)
        elif (container_source, True) in checks:
            continue  # with its grads' check
        else:
            test = functools.partial(module.match, spec, False)
        text = f"{container_source.name()}: {text}"
        compat.GuardTree.predicate(node, test, text)
        builder.lines.append(f"{text} ({n} tensors, one native check)")
    return listed, identified, addressed


_DTENSOR_GUARDS = {"device_mesh": EqualGuard, "placements": EqualGuard}


def _dtensor_parts(
    values: Sequence[Any],
    sources: Sequence[Source],
    on_source: dict[Source, list[Guard]],
    ptr_of: dict[Source, int],
) -> tuple[list[Any], list[tuple[list[Source], Source, bool]]] | None:
    """For values (None or DTensors) at ``sources``: per value, None or the native spec's
    DTensor entry (expected mesh or None, expected placements or None, whether its local
    tensor's data pointer is checked), and per DTensor the sources whose guards that check
    covers, its local tensor's source and whether its address is covered; None unless some
    value is a DTensor and every guard on each one's ``device_mesh``, ``placements`` and
    ``_local_tensor`` is one the native check tests (an equality; a tensor match; a data
    pointer the local tensor has now)."""
    entries: list[Any] = []
    covered: list[tuple[list[Source], Source, bool]] = []
    for value, source in zip(values, sources, strict=True):
        if value is None:
            entries.append(None)
            continue
        if not compat.native_dtensor(value):
            return None
        expected: list[Any] = []
        for attr, kind in _DTENSOR_GUARDS.items():
            on = on_source.get(AttrSource(source, attr), [])
            if len(on) > 1 or not all(type(g) is kind for g in on):
                return None
            expected.append(cast(EqualGuard, on[0]).value if on else None)
        local = AttrSource(source, compat.LOCAL_TENSOR)
        on = on_source.get(local, [])
        if not any(isinstance(g, TensorMatchGuard) for g in on) or not all(
            isinstance(g, TensorMatchGuard | DataPtrGuard) for g in on
        ):
            return None
        ptr = local in ptr_of
        if ptr and ptr_of[local] != getattr(value, compat.LOCAL_TENSOR).data_ptr():
            return None
        entries.append((*expected, ptr))
        guarded: list[Source] = [AttrSource(source, attr) for attr in _DTENSOR_GUARDS]
        guarded.append(local)
        covered.append((guarded, local, ptr))
    if not covered:
        return None
    return entries, covered


def held_dtensors(
    module: Any,
    on_source: dict[Source, list[Guard]],
    L: Locals,
    builder: TreeBuilder,
    pinned: frozenset[Source],
    listed: set[Source],
    ptr_of: dict[Source, int],
) -> set[Source]:
    """One native check over the pinned DTensors whose local tensor no list check covers (an
    optimizer's state tensors): each keeps its mesh and placements (==) and the very local
    tensor it had (its type, dtype, device, shape, stride, requires_grad and, where a guard
    asks, data pointer). Return the local tensors' sources: pinned from then on (the
    caller drops their data-pointer guards: this check tests them)."""
    locals_ = [  # (from the guarded sources: no new Source per pinned one)
        s
        for s in on_source
        if type(s) is AttrSource
        and s.attr == compat.LOCAL_TENSOR
        and s.base in pinned
        and s not in listed
    ]
    sources = sorted([s.base for s in locals_], key=lambda s: s.name())
    values = [s.fetch(L) for s in sources]
    kept = [(s, v) for s, v in zip(sources, values, strict=True) if compat.native_dtensor(v)]
    if not kept:
        return set()
    parts = _dtensor_parts([v for _, v in kept], [s for s, _ in kept], on_source, ptr_of)
    if parts is None:
        return set()
    entries, covered = parts
    objects = [v for _, v in kept]
    spec = module.spec(objects, True, False, entries)
    text = (
        f"{len(objects)} pinned DTensors keep mesh and placements (==) and the same local "
        "tensor with its type, dtype, device, shape, stride"
        + (", data pointer" if any(ptr for _, _, ptr in covered) else "")
    )
    match = module.match
    compat.GuardTree.predicate(builder.tree.root, lambda _: match(spec, False, objects), text)
    builder.lines.append(text + ", one native check")
    return {local for _, local, _ in covered}


def _strided(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided
