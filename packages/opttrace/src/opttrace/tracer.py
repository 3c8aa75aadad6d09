"""The frame tracer: run a step function on tracked inputs and capture it as an ATen graph."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optguard
import optsidefx
import torch
from optguard import (
    AttrSource,
    DataPtrGuard,
    GlobalSource,
    GuardSet,
    IdentityGuard,
    ItemSource,
    LocalSource,
    Source,
    autocast_guard,
)
from optsidefx import (
    AttrStore,
    Const,
    Effect,
    Input,
    ItemStore,
    TensorWrite,
    append_writebacks,
)
from torch import fx

from opttrace import audit, patches, symbolic
from opttrace._torch_compat import clear_dtensor_caches, compiling, lazy_graph_module
from opttrace.context import TraceContext
from opttrace.errors import TraceError
from opttrace.recorder import Recorder

log = logging.getLogger("optcompile.graph")


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
    capturable: bool = False

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph


def trace(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    *,
    capturable: bool = False,
    python_floats: Sequence[torch.Tensor] = (),
    float64_inputs: Sequence[torch.Tensor] = (),
) -> TracedStep:
    """Trace ``fn(**inputs)``; every value it reads from ``inputs`` is named ``L['<arg>']...``.

    By default the step runs exactly the Python eager would, so the graph computes what eager
    computes, operation for operation. ``capturable=True`` shows optimizers with
    ``capturable=True`` and ``torch.compiler.is_compiling()`` reporting True: the paths
    torch.optim keeps on the device, for steps whose eager path decides on tensor values.
    ``python_floats`` (with it, for such a step when the optimizer is not capturable) are
    0-dim float tensors (step counts in the state) that eager's path reads as Python
    floats: their placeholders say so (``meta["python_float"]``), so that a backend may
    compute what depends only on them and on scalars as eager does, in double (optkernels'
    host arithmetic). The step itself sees those of them in ``float64_inputs`` in float64
    (a step that decides on them in Python, traced on its capturable path: RAdam, ASGD).
    """
    # A trace allocates tens of thousands of small objects that all live until it ends; the
    # cyclic collector would rescan them again and again (a third of the time at 1,000 params).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with patches.tracing():  # one trace at a time; its patches seen by this thread only
            return _trace(fn, inputs, capturable, python_floats, float64_inputs)
    finally:
        if collecting:
            gc.enable()


def _trace(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    capturable: bool,
    python_floats: Sequence[torch.Tensor],
    float64_inputs: Sequence[torch.Tensor],
) -> TracedStep:
    recorder = Recorder()
    try:
        traced = _record(fn, inputs, capturable, python_floats, float64_inputs, recorder)
    finally:
        recorder.detach_hooks()
        clear_dtensor_caches()
    if log.isEnabledFor(logging.INFO):
        ops = sum(1 for n in traced.graph.nodes if n.op == "call_function")
        log.info(
            "traced %s in %.3f s: %d ops over %d inputs, %d guards, %d side effects%s",
            getattr(fn, "__qualname__", "a function"),
            traced.seconds,
            ops,
            len(traced.input_sources),
            len(traced.guards),
            len(traced.effects),
            " (capturable path)" if capturable else "",
        )
        log.debug("%s", traced.graph_module.code.strip())
    return traced


def _record(
    fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    capturable: bool,
    python_floats: Sequence[torch.Tensor],
    float64_inputs: Sequence[torch.Tensor],
    recorder: Recorder,
) -> TracedStep:
    start = time.perf_counter()
    ctx = TraceContext(recorder, capturable, python_floats, float64_inputs)
    ctx.guard(autocast_guard())  # its casts are recorded as graph ops
    for name, value in inputs.items():
        ctx.collect(value, LocalSource(name))
    functions = audit.user_functions([fn, *inputs.values()])
    draws = patches.RandomDraws()
    snap = audit.snapshot(functions, draws)
    for module, name, value, kind in audit.constant_globals(functions):
        held = GlobalSource(module, name)
        if kind == "identity":
            ctx.guard(IdentityGuard.of(held, value))
        elif kind == "attributes":  # an object's, each
            for attr, copied in value.items():
                ctx.guard_copy(AttrSource(held, attr), copied)
        else:
            ctx.guard_copy(held, value)
    try:
        try:
            with (
                recorder,
                symbolic.extrema_in_graph(),
                symbolic.hashable_in_subclass_dispatch(),
                compiling() if capturable else contextlib.nullcontext(),
                patches.refuse_random_draws(
                    draws, audit.random_draw_refused, [f.__globals__ for f in functions]
                ),
            ):
                args = {name: ctx.read(value, LocalSource(name)) for name, value in inputs.items()}
                result = fn(**args)
        except BaseException:
            audit.restore_quietly(snap)
            raise
        audit.check_and_restore(snap)
        ctx.ledger.returned(result)
        effects = ctx.ledger.finalize(ctx.resolve)
        for source, node in ctx.input_writes():
            ctx.ledger.write_tensor(source, node)
        graph = recorder.graph
        graph.output(ctx.output_nodes())
    except TraceError as exc:
        if exc.where is None:
            raise TraceError(exc.reason, _where(exc)) from exc
        raise
    except Exception as exc:
        raise TraceError(_reason(exc), _where(exc)) from exc

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    sources = [n.meta["source"] for n in placeholders]
    by_source = dict(zip(sources, placeholders, strict=True))
    writes = [e for e in ctx.ledger.effects if isinstance(e, TensorWrite)]
    append_writebacks(graph, writes, by_source, recorder.call)
    _eliminate_dead_code(graph)
    kept = _drop_unused_inputs(graph, placeholders, sources)
    gm = lazy_graph_module(_constants_module(recorder.constants), graph)
    return TracedStep(
        graph_module=gm,
        input_sources=kept,
        guards=_unpin_replaced(ctx.guards.build(), effects),
        effects=(*effects, *writes),
        num_outputs=len(ctx.outputs),
        seconds=time.perf_counter() - start,
        capturable=capturable,
    )


def _unpin_replaced(guards: GuardSet, effects: Sequence[Effect]) -> GuardSet:
    """Drop the data-pointer guards of inputs the step itself replaces (``state['buf'] =
    buf * 0.9 + g``: each call stores a new tensor there, so a guard on its address would
    fail on the next call, retracing every step up to the recompile limit). Backends
    compare those addresses themselves."""
    replaced: set[Source] = set()
    for effect in effects:
        if isinstance(effect, ItemStore) and isinstance(effect.target, Input):
            key = effect.key.value if isinstance(effect.key, Const) else effect.key
            replaced.add(ItemSource(effect.target.source, key))
        elif isinstance(effect, AttrStore) and isinstance(effect.target, Input):
            replaced.add(AttrSource(effect.target.source, effect.attr))
    if not replaced:
        return guards
    return GuardSet(
        tuple(
            g for g in guards.guards if not (isinstance(g, DataPtrGuard) and g.source in replaced)
        )
    )


def _eliminate_dead_code(graph: fx.Graph) -> None:
    """Erase ops whose values nothing uses. The recorded graph is functional: only the
    writebacks (``copy_``) and the output have effects."""
    for node in reversed(graph.nodes):
        if node.op == "call_function" and not node.users and node.target not in _EFFECTFUL:
            graph.erase_node(node)


_EFFECTFUL = (torch.ops.aten.copy_.default, torch.ops.aten._assert_scalar.default)


def _constants_module(constants: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, value in constants.items():
        root.register_buffer(name, value)
    return root


def _drop_unused_inputs(
    graph: fx.Graph, placeholders: list[fx.Node], sources: list[Source]
) -> tuple[Source, ...]:
    """Erase placeholders nothing reads and name the rest after their sources."""
    kept = []
    for node, source in zip(placeholders, sources, strict=True):
        if not node.users:
            graph.erase_node(node)
            continue
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
