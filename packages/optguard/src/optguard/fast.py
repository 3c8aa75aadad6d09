"""The fast tier of a check: a C++ guard tree with dict versions, built from live inputs.

The full generated check tests every guard in Python: about 0.4 ms for GPT-2's 148
parameters (some 1,200 guards, 740 on tensors). The fast tier answers the same question
for much less:

- guards on values reached through attributes, list/tuple items and str-keyed dict items
  (the optimizer, its param groups, the params and their grads) become one tree of dynamo's
  C++ guard managers, built from the live values the first time the full check passes;
- everything inside an optimizer's state (reached through a tensor-keyed dict) is covered by
  the version tags of the state dict and of each of its entries (one native loop, native.py,
  once that module is loaded; else one tree node per entry), plus the identity of the
  parameters keying it: unchanged versions mean the same entry dicts holding the same
  tensors the full check accepted;
- the tensor-metadata guards on every item of a list (the params of a group) and on every
  item's ``.grad`` are tested by one C++ loop per list (native.py) once that module is
  loaded, instead of one tree node per tensor;
- the data-pointer guards on pinned tensors (see below: params, state tensors) by one loop
  over the pinned tensors themselves (native ``held``; in Python until it is loaded), with
  no fetching: a backend that baked their addresses in (CUDA graphs, address tables) need
  not compare them again (``guarded_addresses`` of its plan);
- a DTensor's guards (``device_mesh`` and ``placements`` compared with ``==``, its
  ``_local_tensor``'s metadata and data pointer) are tested in the same native visit as the
  DTensor itself: for the items of a list and their grads in the list's loop, for the
  pinned DTensors of the state (and any other pinned one) in one more loop that also
  checks that each still holds the very local tensor it was armed with (so that local
  tensor is pinned too: the gather reuses it; the grads' local tensors the check read are
  handed to the gather like the grads). The native code reads ``_spec.mesh``,
  ``_spec.placements`` and ``_local_tensor`` (what DTensor's getters return; checked on
  the live values when the tier is built, ``_torch_compat.native_dtensor``); where that
  does not hold, those guards stay tree nodes;
- the rest (predicates on hyperparameters, key tuples, other sources, data pointers of
  unpinned tensors) runs as generated Python.

A hit also pins values: a source the tree checks by identity (a parameter keying the state),
an entry of a versioned state dict keyed by a pinned source, and a str-keyed item of such an
entry (a state tensor) hold the very objects they held when the tier was armed. ``pinned``
lists them; the tier's own ``FastGather`` (gather.py, armed from the full gather of the call
that built the tier) reuses them instead of fetching them again: ``inputs(L)`` is the check
and the gather in one call.

The pinned tensors' check also compares their dtype, shape and stride with what they had
when the tier was armed: metadata changed in place on the same state tensor object
(``t_()``, ``as_strided_()``, ``t.data = ...``) keeps its entry's version and may keep its
address. A replaced state tensor changes its entry's version: the full check then runs, and
the tier is built anew (check.py limits how often).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import torch

from optguard import _torch_compat as compat
from optguard import native
from optguard.check import GuardSet, compile_check
from optguard.gather import FastGather
from optguard.guards import (
    ConstantGuard,
    DataPtrGuard,
    DictLengthGuard,
    EqualGuard,
    FloatGuard,
    Guard,
    IdentityGuard,
    LengthGuard,
    NoneGuard,
    TensorMatchGuard,
    TypeGuard,
    float_types,
    guard_sources,
)
from optguard.sources import (
    AttrSource,
    ItemSource,
    KeyedSource,
    Locals,
    LocalSource,
    Source,
)


class FastCheck:
    """``tree.check(L) and residual(L)``, then its gather; see the module docstring."""

    def __init__(
        self,
        tree: compat.GuardTree,
        residual: Any,
        lines: list[str],
        pinned: frozenset[Source] = frozenset(),
        grad_lists: dict[Source, tuple[Any, int]] | None = None,
        states_unchanged: Sequence[Callable[[Locals], bool]] = (),
        local_lists: dict[Source, tuple[Any, int]] | None = None,
    ) -> None:
        self.tree = tree
        self.residual = residual
        self.lines = lines
        self.pinned = pinned
        # Lists whose items' grads one native check reads (and matches) on every hit: the
        # list's source -> (its spec, length). After a hit, ``native.module().take(spec)``
        # gives the grads that check read (gather.py uses them instead of reading again).
        self.grad_lists = grad_lists or {}
        # Lists whose items' grads are DTensors, their local tensors read by that check: the
        # list's source -> (its spec, length); ``native.module().take_locals(spec)`` gives
        # them after a hit.
        self.local_lists = local_lists or {}
        # Whether each optimizer state this tier pinned is still the one it found (see
        # ``stale``).
        self.states_unchanged = list(states_unchanged)
        # Its gather over the pinned values (None: its caller gathers in full).
        self.gather: FastGather | None = None

    def __call__(self, L: Locals) -> bool:
        if self.tree.check(L) and self.residual(L):
            return True
        self.forget()  # a grad check may have passed before another failed
        return False

    def inputs(self, L: Locals, full: Callable[[Locals], list[Any]]) -> list[Any] | None:
        """The inputs when this tier's checks pass on ``L`` (through its gather; else
        ``full(L)``), or None. The list its gather returns is reused: ``release()`` it."""
        if not self(L):
            return None
        if self.gather is None:
            self.forget()  # the full gather reads the grads itself
            return full(L)
        inputs = self.gather(L)
        # The gather takes the grads a check read where one list's grads make up one of its
        # families; the rest (a family over several param groups' lists) it read itself:
        # drop those too, or they would live until the next step.
        self.forget()
        return inputs

    def release(self) -> None:
        """Drop what the last ``inputs`` fetched (see FastGather.release)."""
        if self.gather is not None:
            self.gather.release()

    def forget(self) -> None:
        """Drop the grads the last hit's native checks read, where no gather took them (the
        check must not keep a step's gradients alive)."""
        module = native.module()
        if module is not None:
            for spec, _ in self.grad_lists.values():
                module.take(spec)
            for spec, _ in self.local_lists.values():
                module.take_locals(spec)

    def stale(self, L: Locals) -> bool:
        """Whether an optimizer state this tier pinned has changed since (entries replaced:
        a ``load_state_dict``): its pinned values then hold old state tensors alive, and the
        tier is worth dropping once its entry no longer matches."""
        try:
            return not all(unchanged(L) for unchanged in self.states_unchanged)
        except Exception:
            return True

    def describe(self) -> str:
        links = self.gather.links if self.gather is not None else {}
        by_address = (
            [f"then its gather; {len(links)} grads handed over by address (native)"]
            if links
            else []
        )
        return "\n".join(
            [
                f"C++ guard tree ({len(self.lines)} guards):",
                *(f"    {line}" for line in self.lines),
                "then, in Python:",
                self.residual.code,
                *by_address,
            ]
        )


def build_fast_check(
    guards: Sequence[Guard],
    L: Locals,
    gathered: tuple[Sequence[Source], Sequence[Any]] | None = None,
    by_address: Collection[int] = (),
) -> FastCheck | None:
    """The fast tier for ``guards``, armed from ``L`` (on which the full check passed), or
    None when this torch lacks the pieces or a key of the state cannot be identified.
    ``gathered``: the input sources and the inputs the full gather fetched from ``L``; the
    tier then gathers them itself, fetching only what its checks do not pin, and leaving
    to its checks the inputs at ``by_address`` they read anyway (FastGather)."""
    if not compat.available():
        return None
    sources_of = guard_sources(guards)  # (asked once: 10,000 params' guards)
    keyed_ancestor = _KeyedAncestors()
    known = keyed_ancestor.found
    # per guard (but addresses): the state entry each of its sources lies in
    keyed_of: list[Sequence[KeyedSource | None]] = []
    for g, sources in zip(guards, sources_of, strict=True):
        if isinstance(g, DataPtrGuard):
            keyed_of.append(())
        elif len(sources) == 1:  # (most: no comprehension to run)
            s = sources[0]
            keyed_of.append((known[s] if s in known else keyed_ancestor(s),))
        else:
            keyed_of.append([known[s] if s in known else keyed_ancestor(s) for s in sources])
    on_source = _single_source_guards(guards, sources_of)
    keyed_sources = [keyed for found in keyed_of for keyed in found if keyed is not None]
    states = {keyed.base: None for keyed in keyed_sources}
    keys = {keyed.key: None for keyed in keyed_sources}
    module = native.start()
    if module is not None:  # (DTensor may have been imported since it was loaded)
        module.plain(compat.plain_grad_types())
    versions = getattr(module, "versions", None)  # absent where CPython has no tags (3.14)
    builder = _TreeBuilder(L, set() if versions is not None else set(states))
    residual: list[Guard] = []
    addresses: list[DataPtrGuard] = []
    matched = {g.source for g in guards if isinstance(g, TensorMatchGuard)}
    grad_lists: dict[Source, tuple[Any, int]] = {}
    local_lists: dict[Source, tuple[Any, int]] = {}
    ptr_of = {g.source: g.ptr for g in guards if isinstance(g, DataPtrGuard)}
    listed, identical, addressed = (
        _list_families(
            module, guards, L, builder, set(keys), grad_lists, ptr_of, local_lists, on_source
        )
        if module is not None
        else (set(), set(), set())
    )
    for guard, keyed, sources in zip(guards, keyed_of, sources_of, strict=True):
        if isinstance(guard, DataPtrGuard):
            if guard.source not in addressed:  # else in its list's native check
                addresses.append(guard)  # once the pinned sources are known (below)
            continue
        if isinstance(guard, NoneGuard) and not guard.is_none and guard.source in matched:
            continue  # a tensor match fails on None
        under_state = None not in keyed  # (sources compare by identity: no __eq__)
        if under_state or (guard.source in listed and len(sources) == 1):
            continue  # under the state's dict versions; in its list's native check
        if not builder.add(guard):
            residual.append(guard)
        elif isinstance(guard, IdentityGuard):
            identical.add(guard.source)
    for key in keys:
        if key in identical:
            continue  # its list's native check tests identity
        node = builder.node(key)
        if node is None:
            return None
        value = key.fetch(L)
        compat.GuardTree.id_is(node, value, f"{key.name()} is the same object")
        builder.lines.append(f"{key.name()} is the same object (keys the state)")
        identical.add(key)
    states_unchanged: list[Callable[[Locals], bool]] = []
    for state in states:
        node = builder.node(state)
        value = state.fetch(L)
        if node is None or not isinstance(value, dict):
            return None
        if not all(type(entry) is dict for entry in value.values()):
            return None
        text = f"{state.name()} and its {len(value)} entries are unchanged (dict versions)"
        unchanged: Callable[[Any], bool]
        if versions is not None:
            unchanged = functools.partial(module.versions_match, versions(value))
            compat.GuardTree.predicate(node, unchanged, text)
            text += ", one native check"
        else:
            compat.GuardTree.versions(node, value, state.name())
            unchanged = _same_entries(value)
        states_unchanged.append(_fetching(state, unchanged))
        builder.lines.append(text)
    pinned = _pinned_sources(sources_of, identical, set(states))
    if module is not None:
        more = _held_dtensors(module, on_source, L, builder, pinned, listed, ptr_of)
        if more:
            pinned = pinned | more
            addresses = [g for g in addresses if g.source not in more]
    held = [g for g in addresses if g.source in pinned]
    residual.extend(g for g in addresses if g.source not in pinned)
    if held:
        text = f"{len(held)} pinned tensors keep their data pointers, dtypes, shapes, strides"
        # (most are inputs the full gather has just fetched from ``L``)
        fetched = dict(zip(*gathered, strict=True)) if gathered is not None else {}
        tensors = [fetched[g.source] if g.source in fetched else g.source.fetch(L) for g in held]
        compat.GuardTree.predicate(builder.tree.root, native.held_ptrs(tensors, held), text)
        builder.lines.append(text + (", one native check" if module is not None else ""))
    check = compile_check(GuardSet(tuple(residual)))
    fast = FastCheck(
        builder.tree, check, builder.lines, pinned, grad_lists, states_unchanged, local_lists
    )
    if gathered is not None:
        input_sources, inputs = gathered
        fast.gather = FastGather(input_sources, pinned, grad_lists, local_lists, by_address)
        fast.gather.arm(L, inputs)
    return fast


def _fetching(source: Source, test: Callable[[Any], bool]) -> Callable[[Locals], bool]:
    return lambda L: bool(test(source.fetch(L)))


def _same_entries(state: dict[Any, Any]) -> Callable[[Any], bool]:
    """Whether a dict holds the same entry objects with the same items as ``state`` now
    (without CPython's dict versions: by identity; held by id, not by reference)."""
    snapshot = [(id(k), id(v), [id(x) for x in v.values()]) for k, v in state.items()]

    def unchanged(d: Any) -> bool:
        items = list(d.items())
        return len(items) == len(snapshot) and all(
            id(k) == ik and id(v) == iv and [id(x) for x in v.values()] == ix
            for (k, v), (ik, iv, ix) in zip(items, snapshot, strict=True)
        )

    return unchanged


def _list_families(
    module: Any,
    guards: Sequence[Guard],
    L: Locals,
    builder: _TreeBuilder,
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


def _single_source_guards(
    guards: Sequence[Guard], sources_of: Sequence[tuple[Source, ...]]
) -> dict[Source, list[Guard]]:
    on_source: dict[Source, list[Guard]] = {}
    for g, sources in zip(guards, sources_of, strict=True):
        if len(sources) == 1:
            on_source.setdefault(g.source, []).append(g)
    return on_source


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


def _held_dtensors(
    module: Any,
    on_source: dict[Source, list[Guard]],
    L: Locals,
    builder: _TreeBuilder,
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


def _pinned_sources(
    sources_of: Sequence[tuple[Source, ...]], identical: set[Source], versioned: set[Source]
) -> frozenset[Source]:
    """The guarded sources whose values a hit of the fast tier fixes (see the module)."""

    known: dict[Source, bool] = {}

    def pinned(source: Source) -> bool:
        found = known.get(source)
        if found is None:
            if source in identical:
                found = True
            elif isinstance(source, KeyedSource):  # an entry of a versioned dict, pinned key
                found = source.base in versioned and pinned(source.key)
            elif isinstance(source, ItemSource) and isinstance(source.key, str):
                entry = source.base  # the entry's own version is armed too
                found = isinstance(entry, KeyedSource) and pinned(entry)
            else:
                found = False
            known[source] = found
        return found

    seen: set[Source] = set()
    for sources in sources_of:
        for source in sources:
            while source not in seen:  # (its ancestors are, once one of them is)
                seen.add(source)
                if not isinstance(source, AttrSource | ItemSource | KeyedSource):
                    break
                source = source.base
    return frozenset([s for s in seen if pinned(s)])


class _KeyedAncestors:
    """The innermost entry of an optimizer's state (a KeyedSource) that a source lies in,
    or None; memoized along the path (10,000 params' sources share their ancestors). A
    guard whose sources all lie in one is under the state's dict versions, which say on a
    hit that nothing there changed since the full check passed."""

    def __init__(self) -> None:
        self.found: dict[Source, KeyedSource | None] = {}

    def __call__(self, source: Source) -> KeyedSource | None:
        known = self.found.get(source, _UNKNOWN)
        if known is not _UNKNOWN:
            return cast(KeyedSource | None, known)
        found: KeyedSource | None = None
        if isinstance(source, KeyedSource):
            found = source
        elif isinstance(source, AttrSource | ItemSource):
            found = self(source.base)
        self.found[source] = found
        return found


_UNKNOWN: Any = object()


class _TreeBuilder:
    """Adds guards to a GuardTree, creating the accessor chain of each source once;
    ``versioned`` sources get nodes that can check their entries' versions."""

    def __init__(self, L: Locals, versioned: set[Source]) -> None:
        self.L = L
        self.versioned = versioned
        self.tree = compat.GuardTree()
        self.nodes: dict[Source, Any] = {}
        self.lines: list[str] = []

    def node(self, source: Source) -> Any:
        if source in self.nodes:
            return self.nodes[source]
        node: Any = None
        label = source.name()
        versioned = source in self.versioned
        if isinstance(source, LocalSource):
            value = source.fetch(self.L)
            node = self.tree.local(self.tree.root, source.local, value, label, versioned)
        elif isinstance(source, AttrSource):
            parent = self.node(source.base)
            if parent is not None:
                value = source.fetch(self.L)
                node = self.tree.attr(parent, source.attr, value, label, versioned)
        elif isinstance(source, ItemSource):
            parent = self.node(source.base)
            container = source.base.fetch(self.L)
            plain = type(container) in (list, tuple) or (
                isinstance(container, dict) and isinstance(source.key, str)
            )
            if parent is not None and plain:
                value = source.fetch(self.L)
                node = self.tree.item(parent, container, source.key, value, label, versioned)
        self.nodes[source] = node
        return node

    def add(self, guard: Guard) -> bool:
        """Put ``guard`` into the tree; False if it has to run in Python instead."""
        node = self.node(guard.source)
        if node is None:
            return False
        text = guard.describe()
        tree = compat.GuardTree
        value = guard.source.fetch(self.L)
        if isinstance(guard, TypeGuard):
            tree.type_is(node, guard.cls, text)
        elif isinstance(guard, FloatGuard):
            floats = float_types()
            tree.predicate(node, lambda value: type(value) in floats, text)
        elif isinstance(guard, ConstantGuard):
            constant = guard.value
            if constant is None or isinstance(constant, bool):
                tree.id_is(node, constant, text)
            elif constant != constant:  # NaN: equality cannot test it
                return False
            else:
                tree.type_is(node, type(constant), text)
                tree.equals(node, constant, text)
        elif isinstance(guard, LengthGuard):
            is_dict = isinstance(value, dict)
            if isinstance(guard, DictLengthGuard) and not is_dict:
                return False
            tree.length(node, guard.length, is_dict, text)
        elif isinstance(guard, NoneGuard):
            tree.none(node, guard.is_none, text)
        elif isinstance(guard, TensorMatchGuard):
            tree.tensor(node, value, text)
        elif isinstance(guard, IdentityGuard):
            tree.id_is(node, value, text)
        elif isinstance(guard, EqualGuard):
            # A DTensor's mesh and placements (immutable): the same object passes at once,
            # another of the same type is compared with ==.
            tree.equals(node, guard.value, text)
        else:
            return False
        self.lines.append(text)
        return True
