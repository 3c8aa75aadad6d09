"""Generate the code that replays a step's side effects after its compiled graph ran."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from optguard import Locals, SourceCode, build_function

from optsidefx.errors import SideEffectError
from optsidefx.ledger import (
    Apply,
    AttrStore,
    Build,
    Call,
    CallResult,
    Const,
    Effect,
    Input,
    ItemStore,
    Output,
    Ref,
    Return,
    TensorWrite,
)

log = logging.getLogger("optcompile.sidefx")

ReplayFn = Callable[[Locals, Sequence[torch.Tensor]], Any]


@dataclass(frozen=True)
class Replay:
    """``replay(L, outs)``: applies the effects with this call's values and returns the result."""

    effects: tuple[Effect, ...]
    fn: ReplayFn
    code: str

    def __call__(self, L: Locals, outs: Sequence[torch.Tensor]) -> Any:
        return self.fn(L, outs)


def generate_replay(effects: Sequence[Effect]) -> Replay:
    """Emit straight-line Python for ``effects`` (tensor writes live in the graph, not here)."""
    code = SourceCode()
    result = "None"

    def ref(r: Ref) -> str:
        if isinstance(r, Output):
            return f"outs[{r.index}]"
        if isinstance(r, Input):
            return code.var(r.source)
        if isinstance(r, Const):
            return code.literal(r.value)
        if isinstance(r, CallResult):
            return f"result_{r.index}"
        if isinstance(r, Apply):
            return f"{code.constant(r.fn, r.name)}({', '.join(ref(a) for a in r.args)})"
        if isinstance(r, Build):
            items = [ref(i) for i in r.items]
            if r.kind is dict:
                pairs = ", ".join(f"{k!r}: {v}" for k, v in zip(r.keys, items, strict=True))
                return "{" + pairs + "}"
            if r.kind is tuple:
                return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
            if r.kind is list:
                return f"[{', '.join(items)}]"
        raise SideEffectError(f"cannot replay a reference to {r!r}")

    for e in effects:
        if isinstance(e, ItemStore):
            target, key, value = ref(e.target), ref(e.key), ref(e.value)
            code.emit(f"{target}[{key}] = {value}")
        elif isinstance(e, AttrStore):
            target, value = ref(e.target), ref(e.value)
            code.emit(f"{target}.{e.attr} = {value}")
        elif isinstance(e, Call):
            args = ", ".join(ref(a) for a in e.args)
            code.emit(f"result_{e.index} = {ref(e.target)}.{e.method}({args})")
        elif isinstance(e, Return):
            result = ref(e.value)
        elif not isinstance(e, TensorWrite):
            raise SideEffectError(f"unknown effect {e!r}")
    code.emit(f"return {result}")
    fn, text = build_function("replay", "L, outs", code.lines, code.constants)
    log.debug("replay of %d effects:\n%s", len(effects), text)
    return Replay(tuple(effects), fn, text)
