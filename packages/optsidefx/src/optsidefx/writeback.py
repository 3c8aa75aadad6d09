"""Write in-place updates of input tensors back inside the graph, as trailing ``copy_`` nodes.

Keeping the writes in the graph (rather than in replay code) lets a backend store results
straight into the input's memory: a fused kernel writes the parameter once, no extra pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from optguard import Source
from torch import fx

from optsidefx.errors import SideEffectError
from optsidefx.ledger import Effect, TensorWrite


def append_writebacks(
    graph: fx.Graph,
    effects: Sequence[Effect],
    placeholders: Mapping[Source, fx.Node],
    call: Callable[[Any, tuple[Any, ...]], fx.Node] | None = None,
) -> list[fx.Node]:
    """Insert ``aten.copy_(input, new_value)`` before the output for each TensorWrite.
    ``call(target, args)`` appends a call node at the insert point (default:
    ``graph.call_function``; a tracer passes its own, cheaper per node)."""
    call = graph.call_function if call is None else call
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    added = []
    with graph.inserting_before(output):
        for e in effects:
            if not isinstance(e, TensorWrite):
                continue
            target = placeholders.get(e.target)
            if target is None:
                raise SideEffectError(
                    f"{e.target.name()} was written in place but is no graph input"
                )
            node = call(torch.ops.aten.copy_.default, (target, e.value))
            node.meta["val"] = target.meta.get("val")
            added.append(node)
    return added
