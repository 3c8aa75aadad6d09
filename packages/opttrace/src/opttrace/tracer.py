"""The frame tracer: run a step function on tracked inputs and capture it as an ATen graph."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import optguard
import optsidefx
import torch
from optguard import GuardSet, LocalSource, Source, variable_name
from optsidefx import Effect, TensorWrite, append_writebacks
from torch import fx

from opttrace._torch_compat import compiling, rename_placeholder, trace_functional
from opttrace.context import TraceContext
from opttrace.errors import TraceError


@dataclass(frozen=True)
class TracedStep:
    """A traced step: its graph, the Source of each graph input, guards and side effects.

    Calling ``graph_module`` with the tensors at ``input_sources`` performs the step's tensor
    work (writing updated inputs in place through trailing ``copy_`` nodes) and returns the
    tensors that ``effects`` refer to as ``Output(i)``.
    """

    graph_module: fx.GraphModule
    input_sources: tuple[Source, ...]
    guards: GuardSet
    effects: tuple[Effect, ...]
    num_outputs: int
    seconds: float

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph


def trace(fn: Callable[..., Any], inputs: Mapping[str, Any]) -> TracedStep:
    """Trace ``fn(**inputs)``; every value it reads from ``inputs`` is named ``L['<arg>']...``."""
    start = time.perf_counter()
    ctx = TraceContext()
    for name, value in inputs.items():
        ctx.collect(value, LocalSource(name))
    effects: list[Effect] = []

    def body(*fakes: torch.Tensor) -> list[torch.Tensor]:
        ctx.bind(fakes)
        args = {name: ctx.read(value, LocalSource(name)) for name, value in inputs.items()}
        with compiling():
            result = fn(**args)
        ctx.ledger.returned(result)
        effects.extend(ctx.ledger.finalize(ctx.resolve))
        return list(ctx.outputs)

    try:
        gm = trace_functional(body, [t.detach() for t in ctx.input_tensors])
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(_reason(exc), _where(exc)) from exc

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_source = dict(zip(ctx.input_sources, placeholders, strict=True))
    for source, value in _take_input_writes(gm.graph, placeholders, ctx.input_sources):
        ctx.ledger.write_tensor(source, value)
    writes = [e for e in ctx.ledger.effects if isinstance(e, TensorWrite)]
    append_writebacks(gm.graph, writes, by_source)
    sources = _drop_unused_inputs(gm.graph, placeholders, ctx.input_sources)
    gm.graph.lint()
    gm.recompile()
    return TracedStep(
        graph_module=gm,
        input_sources=sources,
        guards=ctx.guards.build(),
        effects=(*effects, *writes),
        num_outputs=len(ctx.outputs),
        seconds=time.perf_counter() - start,
    )


def _take_input_writes(
    graph: fx.Graph, placeholders: list[fx.Node], sources: list[Source]
) -> list[tuple[Source, fx.Node]]:
    """Remove functionalization's trailing ``copy_(input, value)`` nodes; return the writes."""
    source_of = dict(zip(placeholders, sources, strict=True))
    writes = []
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.copy_.default and node.args[0] in source_of:
            writes.append((source_of[node.args[0]], node.args[1]))
            graph.erase_node(node)
    return writes


def _drop_unused_inputs(
    graph: fx.Graph, placeholders: list[fx.Node], sources: list[Source]
) -> tuple[Source, ...]:
    """Erase placeholders nothing reads and name the rest after their sources."""
    kept = []
    for node, source in zip(placeholders, sources, strict=True):
        if not node.users:
            graph.erase_node(node)
            continue
        rename_placeholder(graph, node, variable_name(source))
        kept.append(source)
    return tuple(kept)


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    name = type(exc).__name__
    if "DataDependent" in name or "data-dependent" in text or "_local_scalar_dense" in text:
        return (
            f"the step depends on a tensor's value ({name}: {text}); Python control flow on "
            "tensor values and .item() cannot be traced"
        )
    return f"{name}: {text}"


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path))
    for path in (os.__file__, optguard.__file__, optsidefx.__file__, __file__)
    if path
)


def _where(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame in user or torch.optim code that raised."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    optim_dir = os.path.join(torch_dir, "optim")
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<"):
            continue
        if path.startswith(torch_dir) and not path.startswith(optim_dir):
            continue
        if path.startswith(_LIBRARY_DIRS):
            continue
        return f"{frame.filename}:{frame.lineno}"
    return None
