"""Row loops: statements repeated for every item of a long list, generated once.

A guard check or gather over an optimizer of 10,000 parameters would otherwise be tens of
thousands of lines (each parameter's type, metadata and address, its grad, its state
entries), and compiling that text costs more than the trace. Here each statement that
reads from exactly one item of a long list (``params[i]``, and what is reached from it:
``params[i].grad``, ``state[params[i]]['exp_avg']``) belongs to that item's *row*. Each row's
statements are rendered once as a template, with the row's values that may differ (an
address, an output position, a shape) left as slots; rows whose templates match become one
loop over a table of their slot values:

    for i, ptr, ptr_2 in rows:
        item = opt_param_groups_0_params[i]
        if not (type(item) is Parameter_type and ...):
            return False
        if not item.data_ptr() == ptr:
            return False
        ...

A statement outside the rows that reads a row's value (a disjointness guard over every
step count) reads it from a list the loop fills. The code is as long for 10 rows as for
10,000; it tests the same facts (a check is a conjunction, and fetching has no effects,
so the order of the tests does not change its answer).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from optguard.codegen import SourceCode
from optguard.sources import ItemSource, Source, variable_name

# Fewer rows than this of one template stay straight-line code (readable, and as fast).
MIN_ROWS = 8

Emitter = Callable[[SourceCode], None]
Statement = tuple[tuple[Source, ...], Emitter]  # the sources it reads, how to emit it


@dataclass
class _Row:
    item: ItemSource
    statements: list[int]
    text: str = ""
    slots: list[tuple[bool, Any, str]] = field(default_factory=list)  # (inline, value, hint)
    locals: dict[Source, str] = field(default_factory=dict)  # row source -> its marker name


class _RowCode(SourceCode):
    """One row's statements as a template: the row's sources are named by markers relative
    to its item, constants become slots, every other source is the outer code's variable."""

    def __init__(self, outer: SourceCode, row: _Row) -> None:
        super().__init__(indent="    ")
        self.outer, self.row = outer, row
        self._item_name = variable_name(row.item)
        self._taken_markers: set[str] = set()
        self.names[row.item] = self._marker(row.item, "item")
        index = self._slot(True, row.item.key, "i")
        self.lines.append(f"    {self.names[row.item]} = {outer.var(row.item.base)}[{index}]")

    def var(self, source: Source) -> str:
        known = self.names.get(source)
        if known is not None:
            return known
        items = source.__dict__.get("_items")  # (_items' cache, read without a call)
        if self.row.item not in (_items(source) if items is None else items):
            return self.outer.var(source)
        parents = tuple([self.var(p) for p in source.parents()])
        relative = source.__dict__.get("_variable_name") or variable_name(source)
        relative = relative.replace(self._item_name, "item")
        name = self.names[source] = self._marker(source, relative)
        self.lines.append(f"{self.indent}{name} = {source.expr(parents)}")
        return name

    # (constant and inline append their slot themselves: a row of 11 guards has 40 slots)
    def constant(self, value: Any, hint: str) -> str:
        slots = self.row.slots
        slots.append((False, value, hint))
        return f"\x03{len(slots) - 1}\x04"

    def inline(self, value: Any, hint: str = "value") -> str:
        slots = self.row.slots
        slots.append((True, value, hint))
        return f"\x03{len(slots) - 1}\x04"

    def _slot(self, inline: bool, value: Any, hint: str) -> str:
        self.row.slots.append((inline, value, hint))
        return f"\x03{len(self.row.slots) - 1}\x04"

    def _marker(self, source: Source, relative: str) -> str:
        name, n = relative, 1
        while name in self._taken_markers:  # two sources with one relative name
            n += 1
            name = f"{relative}_{n}"
        self._taken_markers.add(name)
        self.row.locals[source] = name
        return f"\x01{name}\x02"


def _items(source: Source) -> frozenset[ItemSource]:
    """The items with an int key (``params[3]``) that ``source`` is reached through."""
    found: frozenset[ItemSource] | None = source.__dict__.get("_items")
    if found is None:
        acc: set[ItemSource] = set()
        for parent in source.parents():
            acc |= _items(parent)
        if isinstance(source, ItemSource) and type(source.key) is int:
            acc.add(source)
        # (kept on the source, like its name: the check and the gathers ask again)
        found = source.__dict__["_items"] = frozenset(acc)
    return found


def _rows(statements: Sequence[Statement]) -> dict[ItemSource, _Row]:
    """Each statement that reads from exactly one item of a long list, by that item."""
    # The items each statement reaches, by the id of their set: one source's set is shared
    # by all its readers, so the work below is per distinct set, not per statement.
    reached: list[int] = []
    sets: dict[int, frozenset[ItemSource] | set[ItemSource]] = {}  # (keeps each id unique)
    for sources, _ in statements:
        found: frozenset[ItemSource] | set[ItemSource] | None = sources[0].__dict__.get("_items")
        if found is None:
            found = _items(sources[0])
        if len(sources) > 1:  # (a guard over every param's state: thousands of sources)
            found = set(found)
            for s in sources[1:]:
                found.update(_items(s))
        reached.append(id(found))
        sets[id(found)] = found
    keys: defaultdict[Source, set[int | str]] = defaultdict(set)
    for found in sets.values():
        for item in found:
            keys[item.base].add(item.key)
    long = {base for base, k in keys.items() if len(k) >= MIN_ROWS}
    owner: dict[int, ItemSource | None] = {}  # the one item of a long list, by set
    for key, found in sets.items():
        mine, count = None, 0
        for item in found:
            if item.base in long:
                mine, count = item, count + 1
        owner[key] = mine if count == 1 else None
    rows: dict[ItemSource, _Row] = {}
    for index, key in enumerate(reached):
        mine = owner[key]
        if mine is not None:
            row = rows.get(mine)
            if row is None:
                row = rows[mine] = _Row(mine, [])
            row.statements.append(index)
    return rows


def _key(value: Any) -> Any:
    try:
        key = (type(value), value)
        hash(key)
        return key
    except TypeError:
        return ("id", id(value))


def _same(values: Sequence[Any]) -> bool:
    """Whether every value is the first (by type and ==; unhashable ones by identity)."""
    try:
        return len(set(zip(map(type, values), values, strict=True))) == 1  # (one pass in C)
    except TypeError:
        first = _key(values[0])
        return all(_key(v) == first for v in values)


def emit(body: SourceCode, statements: Sequence[Statement]) -> bool:
    """Emit ``statements`` onto ``body``, rows of one template as one loop each (see the
    module docstring); True if any loop was emitted."""
    rows = _rows(statements)
    if len(rows) < MIN_ROWS:
        for _, emitter in statements:
            emitter(body)
        return False
    for row in rows.values():
        code = _RowCode(body, row)
        for index in row.statements:
            statements[index][1](code)
        row.text = "\n".join(code.lines)
    groups: dict[tuple[Source, str], list[_Row]] = {}
    for row in rows.values():
        groups.setdefault((row.item.base, row.text), []).append(row)
    looped = [g for g in groups.values() if len(g) >= MIN_ROWS]
    owner = {i: n for n, g in enumerate(looped) for row in g for i in row.statements}
    # Row values the straight-line statements read: collected into lists by the loops.
    wanted: dict[int, dict[str, list[Source]]] = {}
    where: dict[Source, tuple[int, str]] = {}
    for n, group in enumerate(looped):
        for row in group:
            for source, name in row.locals.items():
                where[source] = (n, name)
    for index, (sources, _) in enumerate(statements):
        if index in owner:
            continue
        for s in sources:
            if s in where:
                n, name = where[s]
                wanted.setdefault(n, {}).setdefault(name, [])
    lists: dict[tuple[int, str], str] = {}
    for n, names in wanted.items():
        for name in names:
            lists[(n, name)] = body._fresh(f"{name}_all")
            for k, row in enumerate(looped[n]):
                source = next(s for s, m in row.locals.items() if m == name)
                names[name].append(source)
                body.names[source] = f"{lists[(n, name)]}[{k}]"
            body.lists[tuple(names[name])] = lists[(n, name)]
    emitted: set[int] = set()

    def loop(n: int) -> None:
        if n in emitted:
            return
        emitted.add(n)
        _emit_loop(body, looped[n], {name: lists[(n, name)] for name in wanted.get(n, {})})

    for index, (sources, emitter) in enumerate(statements):
        in_loop = owner.get(index)
        if in_loop is not None:
            if in_loop not in emitted:  # (once per loop: most statements are in one)
                loop(in_loop)
            continue
        for s in sources:
            if s in where:
                loop(where[s][0])
        emitter(body)
    return bool(looped)


def _values(row: _Row) -> tuple[Any, ...]:
    return tuple(map(_VALUE, row.slots))


_VALUE = operator.itemgetter(1)


def _emit_loop(body: SourceCode, group: list[_Row], collect: dict[str, str]) -> None:
    first = group[0]
    text = first.text
    varying: list[tuple[int, str]] = []  # (slot, loop variable)
    # Each slot's values over the rows (zip and map: no Python call per row).
    columns = list(zip(*map(_values, group), strict=False))
    for k, (inline, value, hint) in enumerate(first.slots):
        if _same(columns[k]):
            shown = repr(value) if inline else body.constant(value, hint)
        else:
            shown = body._fresh(hint)
            varying.append((k, shown))
        text = text.replace(f"\x03{k}\x04", shown)
    names = {m: body._fresh(m) for m in first.locals.values()}
    for marker, name in names.items():
        text = text.replace(f"\x01{marker}\x02", name)
    table: tuple[Any, ...]
    if len(varying) == 1:
        table = columns[varying[0][0]]
    else:
        table = tuple(zip(*[columns[k] for k, _ in varying], strict=True))
    for name in collect.values():
        body.emit(f"{name} = []")
    loop_vars = ", ".join(name for _, name in varying)
    body.emit(f"for {loop_vars} in {body.constant(table, 'rows')}:  # {len(group)} rows")
    for line in text.split("\n"):
        body.lines.append(body.indent + line)
    for marker, name in collect.items():
        body.emit(f"    {name}.append({names[marker]})")
