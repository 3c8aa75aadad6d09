"""The fast tier's C++ guard tree, built from guards and the live values they hold for.

Each source reached through attributes, list/tuple items and str-keyed dict items from a
local gets one accessor node of dynamo's guard managers (``_torch_compat.GuardTree``),
created once per source (the items of a list or tuple longer than ``compat.CHUNK`` through
one node per slice of that many: a node finds its children by a linear scan); a guard on it
becomes a check of that node where the tree has one for its kind (type, float, constant,
length, None-ness, tensor metadata, identity, equality). The other guards run as generated
Python (fast.py).
"""

from __future__ import annotations

from typing import Any

from optguard import _torch_compat as compat
from optguard.guards import (
    ConstantGuard,
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
)
from optguard.sources import AttrSource, ItemSource, Locals, LocalSource, Source


class TreeBuilder:
    """Adds guards to a GuardTree, creating the accessor chain of each source once."""

    def __init__(self, L: Locals) -> None:
        self.L = L
        self.tree = compat.GuardTree()
        self.nodes: dict[Source, Any] = {}
        # (a long list's source, a slice's start) -> the slice's node and items
        self.chunks: dict[tuple[Source, int], tuple[Any, Any]] = {}
        self.lines: list[str] = []

    def node(self, source: Source) -> Any:
        if source in self.nodes:
            return self.nodes[source]
        node: Any = None
        label = source.name()
        if isinstance(source, LocalSource):
            value = source.fetch(self.L)
            node = self.tree.local(self.tree.root, source.local, value, label)
        elif isinstance(source, AttrSource):
            parent = self.node(source.base)
            if parent is not None:
                value = source.fetch(self.L)
                node = self.tree.attr(parent, source.attr, value, label)
        elif isinstance(source, ItemSource):
            parent = self.node(source.base)
            container = source.base.fetch(self.L)
            plain = type(container) in (list, tuple) or (
                isinstance(container, dict) and isinstance(source.key, str)
            )
            if parent is not None and plain:
                value = source.fetch(self.L)
                key = source.key
                if type(key) is int and key >= 0 and len(container) > compat.CHUNK:
                    start = key - key % compat.CHUNK
                    chunk = self.chunks.get((source.base, start))
                    if chunk is None:
                        chunk = self.chunks[(source.base, start)] = compat.GuardTree.chunk(
                            parent, container, start, source.base.name()
                        )
                    (parent, container), key = chunk, key - start
                node = self.tree.item(parent, container, key, value, label)
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
