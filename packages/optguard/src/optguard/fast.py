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

The pinned tensors' check also compares their metadata (what TensorMatchGuard compares)
with what it was when the tier was armed: metadata changed in place on the same state
tensor object (``t_()``, ``as_strided_()``, ``requires_grad_()``, ``t.data = ...``) keeps
its entry's version and may keep its address. Pinned tensors with no data-pointer guard (a
0-dim CPU step count, which a backend may move) are in that check too, for their metadata
alone. A replaced state tensor changes its entry's version: the full check then runs, and
the tier is built anew (check.py limits how often).

The tier is built here (``build_fast_check``) from two pieces: tree.py puts guards into the
C++ guard tree, list_checks.py turns the guards on a list's items and their grads (and on
pinned DTensors) into the native checks above.
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
    DataPtrGuard,
    Guard,
    IdentityGuard,
    NoneGuard,
    TensorMatchGuard,
    guard_sources,
)
from optguard.list_checks import held_dtensors, list_families
from optguard.sources import (
    AttrSource,
    ItemSource,
    KeyedSource,
    Locals,
    Source,
)
from optguard.tree import TreeBuilder


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
        # The hit path's callables, bound once (a hit calls no Python wrapper around them):
        # the tree's own check, the residual's generated function, and what ``forget`` does.
        self._checks: tuple[Callable[[Locals], Any], ...] = (
            tree.root.check,
            getattr(residual, "fn", residual),
        )
        module = native.module()
        self._forgets: list[Callable[[], Any]] = (
            [functools.partial(module.take, spec) for spec, _ in self.grad_lists.values()]
            + [functools.partial(module.take_locals, s) for s, _ in self.local_lists.values()]
            if module is not None
            else []
        )

    def __call__(self, L: Locals) -> bool:
        tree_check, residual = self._checks
        if tree_check(L) and residual(L):
            return True
        self.forget()  # a grad check may have passed before another failed
        return False

    def inputs(self, L: Locals, full: Callable[[Locals], list[Any]]) -> list[Any] | None:
        """The inputs when this tier's checks pass on ``L`` (through its gather; else
        ``full(L)``), or None. The list its gather returns is reused: ``release()`` it."""
        tree_check, residual = self._checks
        if not (tree_check(L) and residual(L)):
            self.forget()  # a grad check may have passed before another failed
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
        for take in self._forgets:
            take()

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
    builder = TreeBuilder(L)
    residual: list[Guard] = []
    addresses: list[DataPtrGuard] = []
    matched = {g.source for g in guards if isinstance(g, TensorMatchGuard)}
    grad_lists: dict[Source, tuple[Any, int]] = {}
    local_lists: dict[Source, tuple[Any, int]] = {}
    ptr_of = {g.source: g.ptr for g in guards if isinstance(g, DataPtrGuard)}
    listed, identical, addressed = (
        list_families(
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
        listed_kind = isinstance(guard, TensorMatchGuard | IdentityGuard | NoneGuard)
        if under_state or (guard.source in listed and len(sources) == 1 and listed_kind):
            # under the state's dict versions; in its list's native check (which tests
            # metadata, identity and None, not a predicate on an item: those stay below)
            continue
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
    more: set[Source] = set()
    if module is not None:
        more = held_dtensors(module, on_source, L, builder, pinned, listed, ptr_of)
        if more:
            pinned = pinned | more
            addresses = [g for g in addresses if g.source not in more]
    held = [g for g in addresses if g.source in pinned]
    residual.extend(g for g in addresses if g.source not in pinned)
    # Pinned tensors with no address guard (step counts: 0-dim CPU tensors a backend may
    # move) keep their metadata too: the state's dict versions do not see ``.data =``.
    unaddressed = _unaddressed_pinned(guards, pinned, listed | more, {g.source for g in held})
    dtensors = {s.base for s in more if isinstance(s, AttrSource)}  # (checked there)
    metadata_only: list[Source] = []
    for guard in unaddressed:
        if guard.source in dtensors:
            continue
        if guard.meta.cls in _HELD_TYPES and guard.meta.layout is torch.strided:
            metadata_only.append(guard.source)
        else:
            residual.append(guard)
    if held or metadata_only:
        n = len(held) + len(metadata_only)
        text = f"{n} pinned tensors keep their metadata" + (
            f", {len(held)} of them their data pointers" if held else ""
        )
        # (most are inputs the full gather has just fetched from ``L``)
        fetched = dict(zip(*gathered, strict=True)) if gathered is not None else {}
        held_sources = [g.source for g in held] + metadata_only
        tensors = [fetched[s] if s in fetched else s.fetch(L) for s in held_sources]
        ptrs: list[int | None] = [g.ptr for g in held]
        ptrs += [None] * len(metadata_only)
        compat.GuardTree.predicate(builder.tree.root, native.held_ptrs(tensors, ptrs), text)
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


def _unaddressed_pinned(
    guards: Sequence[Guard],
    pinned: frozenset[Source],
    checked: set[Source],
    addressed: set[Source],
) -> list[TensorMatchGuard]:
    """The metadata guards on pinned tensors that neither a list's native check (``checked``)
    nor the held check of their data pointers (``addressed``) tests."""
    skip = checked | addressed
    found: dict[Source, TensorMatchGuard] = {}
    for g in guards:
        if isinstance(g, TensorMatchGuard) and g.source in pinned and g.source not in skip:
            found.setdefault(g.source, g)
    return list(found.values())


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


def _single_source_guards(
    guards: Sequence[Guard], sources_of: Sequence[tuple[Source, ...]]
) -> dict[Source, list[Guard]]:
    on_source: dict[Source, list[Guard]] = {}
    for g, sources in zip(guards, sources_of, strict=True):
        if len(sources) == 1:
            on_source.setdefault(g.source, []).append(g)
    return on_source


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
# Types whose metadata the held check reads in C++ (a subclass may compute it in Python).
_HELD_TYPES = (torch.Tensor, torch.nn.Parameter)
