"""Gather an entry's inputs after a hit of its fast tier, fetching only what can change.

The full gather (``compile_fetch``) walks every input's access path: over a thousand fetches
for an optimizer of 200 parameters, most of them returning the very objects of the last call
(the parameters, their state tensors). After a hit of the fast tier (fast.py) those are
*pinned*: the tier's identity guards and dict versions prove the paths still lead to the
objects it was armed with. ``FastGather`` keeps them in a template, armed from a full gather
run while the fast tier held, and fetches the rest anew on each call:

- an attribute of a pinned object (``param.grad``) is read for every such input at once,
  ``map(attrgetter(attr), <the pinned objects>)`` (``.grad``: one C++ loop, native.py, once
  that module is loaded; or no loop at all when they are the items of a list whose grads the
  tier's native check has just read and matched: ``take`` hands that list over), written
  into its slots by one slice assignment when they are evenly spaced;
- any other input (a hyperparameter in a param group) by straight-line code from ``L``.

Inputs the caller reads only for their data pointers (``by_address``: a plan that only
writes the grads' addresses into its tables) are not fetched at all where the tier's native
check reads them anyway (a list's grads): their slots stay None, that check keeps the grads'
pointers (native ``by_address``), and ``links`` says where the caller's native address
check finds each (slot -> (spec, item); optkernels' ``AddressCheck.link``). No grad is
wrapped into a list, stored or released, and the plan does not read them again.

The template holds the pinned objects until the next full gather re-arms it; whoever owns
the FastGather must own them anyway (a compiled optimizer's entries: its params and state).
Each call fills the one output list in place (no copy of a thousand slots); ``release()``
after the caller is done with it drops what was fetched (the grads), so nothing of a call
outlives it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from optguard import native
from optguard._torch_compat import LOCAL_TENSOR as _LOCAL_TENSOR
from optguard.codegen import SourceCode, build_function
from optguard.sources import AttrSource, ItemSource, Locals, Source


class FastGather:
    """``gather(L)`` for calls on which the fast tier holding ``pinned`` passed; see the
    module docstring. ``arm(L, inputs)`` after each full gather; until then ``armed`` is
    False and the caller runs the full gather."""

    def __init__(
        self,
        sources: Sequence[Source],
        pinned: Collection[Source],
        grad_lists: Mapping[Source, tuple[Any, int]] | None = None,
        local_lists: Mapping[Source, tuple[Any, int]] | None = None,
        by_address: Collection[int] = (),
    ) -> None:
        """``grad_lists``, ``local_lists``: the fast tier's (``FastCheck``); ``by_address``:
        the input slots its caller reads only for their data pointers."""
        self.sources = list(sources)
        # slot -> (native spec, item) for the inputs left None and read by address
        self.links: dict[int, tuple[Any, int]] = {}
        position = {s: i for i, s in enumerate(self.sources)}
        families: dict[str, list[tuple[int, Source]]] = {}
        rest: list[tuple[int, Source]] = []
        module = native.module()
        taken = _taken_locals(self.sources, local_lists or {}) if module is not None else []
        in_taken = {i for _, slots in taken for i in slots}
        for i, s in enumerate(self.sources):
            if s in pinned or i in in_taken:
                continue
            if isinstance(s, AttrSource) and s.base in pinned:
                families.setdefault(s.attr, []).append((i, s.base))
            else:
                rest.append((i, s))
        self.pinned_slots = [i for i, s in enumerate(self.sources) if s in pinned]
        # Per family: its slots and where each base comes from (an input slot, or a source
        # fetched when arming).
        self._families = [
            (attr, [i for i, _ in items], [(position.get(b), b) for _, b in items])
            for attr, items in families.items()
        ]
        body = SourceCode()
        clear = SourceCode()
        for spec, slots in taken:  # the grads' local tensors the tier's check read
            values = (
                f"{body.constant(module.take_locals, 'take_locals')}({body.constant(spec, 'spec')})"
            )
            fetch = body.constant(_fetcher([self.sources[i] for i in slots]), "fetch")
            _emit_slots(body, clear, slots, f"({values} or {fetch}(L))", "slots_local")
        for k, (attr, slots, bases) in enumerate(self._families):
            if attr == "grad" and module is not None:
                values = f"{body.constant(module.grads, 'grads')}(bases[{k}])"
                spec = _grad_list(grad_lists or {}, [b for _, b in bases])
                if (
                    spec is not None
                    and all(i in by_address for i in slots)
                    and module.by_address(spec)
                ):  # the tier's check keeps their pointers on this call; nothing fetched
                    self.links.update((i, (spec, j)) for j, i in enumerate(slots))
                    body.emit(f"# out[{_slice_text(slots)}]: the grads, by address (native)")
                    continue
                if spec is not None:  # the tier's check read them on this call
                    take = body.constant(module.take, "take")
                    values = f"({take}({body.constant(spec, 'spec')}) or {values})"
            else:
                getter = body.constant(operator.attrgetter(attr), f"get_{attr}")
                values = f"list(map({getter}, bases[{k}]))"
            _emit_slots(body, clear, slots, values, f"slots_{attr}")
        for i, s in rest:
            body.emit(f"out[{i}] = {body.var(s)}")
            clear.emit(f"out[{i}] = None")
        body.emit("return out")
        clear.emit("return None")
        self._fill: Callable[[Locals, list[Any], list[list[Any]]], list[Any]]
        self._fill, self.code = build_function(
            "fast_gather", "L, out, bases", body.lines, body.constants
        )
        self._clear: Callable[[list[Any]], None]
        self._clear, _ = build_function("fast_gather_release", "out", clear.lines, clear.constants)
        self._template: list[Any] | None = None  # the output list: pinned values, the rest None
        self._bases: list[list[Any]] = []

    @property
    def armed(self) -> bool:
        return self._template is not None

    def arm(self, L: Locals, inputs: Sequence[Any]) -> None:
        """Take the pinned values from ``inputs``, gathered in full while the fast tier held."""
        template: list[Any] = [None] * len(inputs)  # nothing fetched anew is held
        for i in self.pinned_slots:
            template[i] = inputs[i]
        self._template = template
        self._bases = [
            [inputs[i] if i is not None else base.fetch(L) for i, base in bases]
            for _, _, bases in self._families
        ]

    def __call__(self, L: Locals) -> list[Any]:
        """The inputs, in one list reused from call to call: ``release()`` it when done."""
        assert self._template is not None, "FastGather used before arm()"
        return self._fill(L, self._template, self._bases)

    def release(self) -> None:
        """Drop what the last call fetched (its grads must not outlive the step)."""
        if self._template is not None:
            self._clear(self._template)

    @property
    def fetched(self) -> int:
        """Inputs fetched anew on each call (those read by address included)."""
        return len(self.sources) - len(self.pinned_slots)


def _grad_list(grad_lists: Mapping[Source, tuple[Any, int]], bases: list[Source]) -> Any:
    """The native spec whose check reads the grads of exactly ``bases`` (the items of one
    list, in order), or None."""
    for container, (spec, n) in grad_lists.items():
        if n == len(bases) and all(
            isinstance(b, ItemSource) and b.base == container and b.key == i
            for i, b in enumerate(bases)
        ):
            return spec
    return None


def _taken_locals(
    sources: Sequence[Source], local_lists: Mapping[Source, tuple[Any, int]]
) -> list[tuple[Any, list[int]]]:
    """Per list of ``local_lists`` whose every item's ``.grad._local_tensor`` is an input:
    its native spec and the input slots of those local tensors, in item order."""
    found: dict[Source, dict[int, int]] = {}
    for i, s in enumerate(sources):
        if not (isinstance(s, AttrSource) and s.attr == _LOCAL_TENSOR):
            continue
        grad = s.base
        if not (isinstance(grad, AttrSource) and grad.attr == "grad"):
            continue
        item = grad.base
        if isinstance(item, ItemSource) and isinstance(item.key, int) and item.base in local_lists:
            found.setdefault(item.base, {})[item.key] = i
    out: list[tuple[Any, list[int]]] = []
    for container, slots in found.items():
        spec, n = local_lists[container]
        if sorted(slots) == list(range(n)):
            out.append((spec, [slots[k] for k in range(n)]))
    return out


def _slice_text(slots: list[int]) -> str:
    step = slots[1] - slots[0] if len(slots) > 1 else 1
    if step > 0 and slots == list(range(slots[0], slots[-1] + 1, step)):
        return f"{slots[0]}:{slots[-1] + 1}:{step}"
    return ", ".join(map(str, slots))


def _emit_slots(
    body: SourceCode, clear: SourceCode, slots: list[int], values: str, name: str
) -> None:
    """Put the list ``values`` evaluates to into ``out`` at ``slots`` (one slice assignment
    when they are evenly spaced, else a loop), and the lines that clear them again."""
    step = slots[1] - slots[0] if len(slots) > 1 else 1
    if step > 0 and slots == list(range(slots[0], slots[-1] + 1, step)):
        body.emit(f"out[{slots[0]}:{slots[-1] + 1}:{step}] = {values}")
        nones = clear.constant([None] * len(slots), "nones")
        clear.emit(f"out[{slots[0]}:{slots[-1] + 1}:{step}] = {nones}")
    else:
        body.emit(f"for i, v in zip({body.constant(slots, name)}, {values}):")
        body.emit("    out[i] = v")
        clear.emit(f"for i in {clear.constant(slots, name)}:")
        clear.emit("    out[i] = None")


def _fetcher(sources: Sequence[Source]) -> Callable[[Locals], list[Any]]:
    return lambda L: [s.fetch(L) for s in sources]
