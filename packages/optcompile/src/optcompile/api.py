"""The user API: ``compile``, ``explain`` and ``reset``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch
from optguard import DEFAULT_RECOMPILE_LIMIT, Locals, group_guards, native
from optsidefx import Effect, TensorWrite
from opttrace import trace

from optcompile import backward
from optcompile.compressed_state import state_bytes
from optcompile.cudagraphs import GraphedPlan
from optcompile.driver import Compiled, newest, reset_all
from optcompile.errors import CompileError, NotCompilableError
from optcompile.explanation import Explanation
from optcompile.optimizer import _OPTIMIZERS as _OPTIMIZERS  # (tests reach the registry here)
from optcompile.optimizer import (
    OPTIONS_ATTR,
    compile_optimizer,
    is_compiled,
    options_of,
    registered,
)
from optcompile.options import BACKEND_CHOICES, DEFAULT_BUCKET_BYTES, Options, backend_reason

__all__ = ["BACKEND_CHOICES", "Explanation", "compile", "explain", "reset"]

Opt = TypeVar("Opt", bound=torch.optim.Optimizer)
F = TypeVar("F", bound=Callable[..., Any])


@overload
def compile(
    obj: Opt,
    *,
    backend: str = ...,
    cudagraphs: str | bool = ...,
    fullgraph: bool = ...,
    recompile_limit: int = ...,
    in_backward: bool = ...,
    bucket_bytes: int = ...,
    state_dtype: Any = ...,
) -> Opt: ...


@overload
def compile(
    obj: F,
    *,
    backend: str = ...,
    cudagraphs: str | bool = ...,
    fullgraph: bool = ...,
    recompile_limit: int = ...,
    state_dtype: Any = ...,
) -> F: ...


def compile(
    obj: Any,
    *,
    backend: str = "auto",
    cudagraphs: str | bool = "auto",
    fullgraph: bool = False,
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT,
    in_backward: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    state_dtype: Any = None,
) -> Any:
    """Compile an optimizer's ``step`` (returns the same optimizer) or a function.

    ``backend``: "auto" (Triton kernels for CUDA tensors, else torch) | "torch" | "triton".
    ``cudagraphs``: "auto" records the step's kernels as a CUDA graph after its first call
    when they run on one CUDA device (explain() says why not otherwise); True raises where
    that is not possible; False never records.
    ``fullgraph=True`` raises where the tracer cannot capture the step instead of falling
    back to eager with a warning.
    ``recompile_limit``: entries kept per object before it falls back to eager.
    ``in_backward=True`` (optimizers only): ``loss.backward()`` updates the parameters as
    their gradients arrive, in buckets of about ``bucket_bytes`` of gradients (one param
    group each; default 128 MiB), each one compiled launch, and frees each gradient after
    its update (see docs/in_backward.md).
    ``state_dtype``: None keeps the optimizer's state as it is; ``torch.bfloat16`` stores
    each state tensor of a parameter's shape in bfloat16 with stochastic rounding,
    ``"int8"`` in blockwise int8 (256 per block, float32 scales); ``state_dict()`` stays
    full precision (docs/state_dtype.md).
    """
    options = Options(
        backend, cudagraphs, fullgraph, recompile_limit, in_backward, bucket_bytes, state_dtype
    )
    if isinstance(obj, torch.optim.Optimizer):
        return compile_optimizer(obj, options)
    if state_dtype is not None:
        raise CompileError(
            f"state_dtype={state_dtype!r} applies to optimizers (their state); "
            f"{getattr(obj, '__qualname__', type(obj).__qualname__)} is not one: compile "
            "it without state_dtype"
        )
    _refuse_non_functions(obj)
    if in_backward:
        raise CompileError(
            f"in_backward=True applies to optimizers; got {type(obj).__qualname__}. Pass "
            "the optimizer (optcompile.compile(opt, in_backward=True))"
        )
    return _compile_function(obj, options)


def _refuse_non_functions(obj: Any) -> None:
    """Raise NotCompilableError for what has no tensor function to trace, saying what to
    pass instead."""
    name = type(obj).__qualname__
    if isinstance(obj, torch.nn.Module):
        raise NotCompilableError(
            f"optcompile.compile got a torch.nn.Module ({name}); optcompile compiles "
            "optimizer steps, not models. Pass the model's optimizer "
            "(optcompile.compile(torch.optim.AdamW(model.parameters()))), and use "
            "torch.compile(model) for the forward pass"
        )
    if isinstance(obj, type):
        what = "an optimizer class" if issubclass(obj, torch.optim.Optimizer) else "a class"
        raise NotCompilableError(
            f"optcompile.compile got {what} ({obj.__qualname__}), not an instance; pass the "
            f"optimizer itself (optcompile.compile({obj.__qualname__}(params, ...))) or a "
            "function over tensors"
        )
    if isinstance(obj, types.MethodType) and isinstance(obj.__self__, torch.optim.Optimizer):
        raise NotCompilableError(
            f"optcompile.compile got the bound method {obj.__qualname__}; pass the optimizer "
            "itself (optcompile.compile(opt)): its step is compiled in place"
        )
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        raise NotCompilableError(
            f"optcompile.compile got an LR scheduler ({name}); pass the optimizer it "
            "schedules (optcompile.compile(scheduler.optimizer)): learning-rate changes "
            "never retrace"
        )
    if not callable(obj):
        raise NotCompilableError(
            f"optcompile.compile takes a torch.optim.Optimizer or a function over tensors, "
            f"got {name}"
        )
    try:
        inspect.signature(obj)
    except (TypeError, ValueError):
        raise NotCompilableError(
            f"optcompile.compile cannot read the signature of {name} {obj!r} (a builtin or "
            "an extension function); wrap it in a Python function "
            "(optcompile.compile(lambda x: fn(x)))"
        ) from None


def _compile_function(fn: Callable[..., Any], options: Options) -> Any:
    existing = getattr(fn, "_optcompile", None)
    if isinstance(existing, Compiled):  # compiled before: same options, the same wrapper
        previous: Any = fn
        if not options.differences(previous._optcompile_options):
            return fn
        fn = previous.__wrapped__
    backend = options.backend_for(fn)
    signature = inspect.signature(fn)

    def call(L: Locals) -> Any:
        bound = inspect.BoundArguments(signature, dict(L))
        return fn(*bound.args, **bound.kwargs)

    compiled = Compiled(
        getattr(fn, "__qualname__", repr(fn)),
        lambda L: trace(lambda **tracked: call(tracked), L),
        call,
        backend,
        options.fullgraph,
        options.recompile_limit,
    )
    under_dynamo: Callable[..., Any] = torch.compiler.disable(compiled)  # type: ignore[no-untyped-call]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for value in bound.arguments.values():
            # The function's trace replays opt.step(...) as a call: the optimizer's own step
            # is compiled, with the same options (unless it was compiled before).
            if isinstance(value, torch.optim.Optimizer) and not is_compiled(value):
                compile_optimizer(value, options)
        if torch.compiler.is_compiling():
            return under_dynamo(bound.arguments)  # (see optimizer._step_under_dynamo)
        return compiled(bound.arguments)

    wrapper._optcompile = compiled  # type: ignore[attr-defined]
    wrapper._optcompile_options = options  # type: ignore[attr-defined]
    return wrapper


def _compiled_of(obj: Any) -> Compiled:
    if isinstance(obj, torch.optim.Optimizer) and is_compiled(obj):
        return registered(obj)
    compiled = getattr(obj, "_optcompile", None)
    if isinstance(compiled, Compiled):
        return compiled
    raise CompileError(
        f"{type(obj).__qualname__} object was not compiled; pass the result of "
        "optcompile.compile(...) to optcompile.explain"
    )


def explain(obj: Any, verbose: bool = False) -> Explanation:
    """Report what optcompile did with a compiled object: traces, retrace reasons, fallback,
    backend, launches per step, CUDA graph state, guards grouped by kind (``str()`` is a
    summary of at most 40 lines; ``verbose=True`` makes it the full text; the fields always
    hold it)."""
    compiled = _compiled_of(obj)
    explanation = _explain_object(obj, compiled, verbose)
    fmt = options_of(obj).state_format if isinstance(obj, torch.optim.Optimizer) else None
    if fmt is None:
        return explanation
    return dataclasses.replace(explanation, state_format=fmt, state_bytes=state_bytes(obj, fmt))


def _explain_object(obj: Any, compiled: Compiled, verbose: bool) -> Explanation:
    learned = backward.buckets(obj) if isinstance(obj, torch.optim.Optimizer) else []
    if learned:
        return _explain_buckets(compiled, learned, verbose, obj)
    if is_compiled(obj) and obj.__dict__[OPTIONS_ATTR].in_backward:
        return dataclasses.replace(
            _explain(compiled, verbose),
            buckets=["(none yet: the first backward learns them)"],
        )
    return _explain(compiled, verbose)


def _explain_buckets(
    compiled: Compiled,
    learned: list[tuple[list[torch.Tensor], Compiled | None]],
    verbose: bool,
    opt: torch.optim.Optimizer | None = None,
) -> Explanation:
    """An in-backward optimizer: the newest bucket's report, counts over every bucket."""
    # (first: it folds the replays the hooks made natively into the graphs' counts)
    directs = backward.direct_status(opt) if opt is not None else []
    ran = [c for _, c in learned if c is not None]
    base = _explain(ran[-1] if ran else compiled, verbose)
    lines = []
    for number, (params, bucket) in enumerate(learned):
        mib = sum(p.numel() * p.element_size() for p in params) / 2**20
        what = f"bucket {number}: {len(params)} params, {mib:.2f} MiB of gradients"
        if bucket is not None:
            entry = newest(bucket)
            launches = entry.plan.kernel_launches_per_step if entry else 0
            what += f", traces {bucket.stats.traces}, {launches} launches"
            if entry is not None and isinstance(entry.plan, GraphedPlan):
                what += f", CUDA graph: {entry.plan.status()}"
            if bucket.stats.fallback_reason:
                what += f", runs eagerly: {bucket.stats.fallback_reason}"
            if entry is not None and isinstance(entry.plan, GraphedPlan) and number < len(directs):
                what += f"; {directs[number]}"
        lines.append(what)
    return dataclasses.replace(
        base,
        name=compiled.name,
        traces=sum(c.stats.traces for c in ran),
        entries=sum(len(c.cache.entries) for c in ran),
        retrace_reasons=[r for c in ran for r in c.stats.retrace_reasons],
        buckets=lines,
    )


def _explain(compiled: Compiled, verbose: bool) -> Explanation:
    entry = newest(compiled)
    plans = [e.value.plan for e in compiled.cache.entries]
    graphed = [p for p in plans if isinstance(p, GraphedPlan)]
    if entry is None:
        status = "no entry yet"
    elif isinstance(entry.plan, GraphedPlan):
        status = entry.plan.status()
    else:
        status = "off (cudagraphs=False)"
    graph = entry.traced.graph if entry else None
    return Explanation(
        traces=compiled.stats.traces,
        retrace_reasons=list(compiled.stats.retrace_reasons),
        guards=entry.traced.guards.describe() if entry else [],
        graph_code=entry.plan.describe() if entry else "",
        check_code=entry.prologue.describe() if entry else "",
        gather_code=entry.gather_code if entry else "",
        replay_code=entry.replay.code if entry else "",
        backend=compiled.backend.name,
        backend_reason=backend_reason(compiled.backend),
        entries=len(compiled.cache.entries),
        fallback_reason=compiled.stats.fallback_reason,
        entry_guards=[e.value.traced.guards.describe() for e in compiled.cache.entries],
        kernel_launches_per_step=entry.plan.kernel_launches_per_step if entry else 0,
        cudagraphs=status,
        cudagraph_recordings=sum(p.recordings for p in graphed),
        cudagraph_replays=sum(p.replays for p in graphed),
        native_checks=native.status(),
        name=compiled.name,
        recompile_limit=compiled.cache.limit,
        eager=compiled.stats.eager_for_good,
        guard_groups=group_guards(entry.traced.guards.guards) if entry else [],
        graph_ops=sum(1 for n in graph.nodes if n.op == "call_function") if graph else 0,
        graph_inputs=len(entry.traced.input_sources) if entry else 0,
        side_effects=_replayed(entry.replay.effects) if entry else 0,
        collectives=_collectives(graph) if graph else [],
        verbose=verbose,
    )


# The functional-collective op that moves no data between ranks: the wait for a result
# (the tracer records it where funcol wraps a result to be awaited on its first use).
_NOT_COLLECTIVES = ("wait_tensor",)


def _collectives(graph: Any) -> list[str]:
    """The collectives a traced step runs (those DTensor's sharding rules called for), in
    graph order: ``all_reduce(sum) of linalg_vector_norm_default``."""
    found = []
    for node in graph.nodes:
        target = getattr(node.target, "namespace", None)
        name = getattr(node.target, "__name__", "").split(".")[0]
        if target != "_c10d_functional" or name.startswith(_NOT_COLLECTIVES):
            continue
        first = node.args[0] if node.args else None
        what = f" of {first.name}" if isinstance(first, torch.fx.Node) else ""
        op = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else ""
        found.append(f"{name}({op}){what}" if op else f"{name}{what}")
    return found


def _replayed(effects: tuple[Effect, ...]) -> int:
    return sum(1 for e in effects if not isinstance(e, TensorWrite))  # writes are in the graph


def reset() -> None:
    """Drop every compiled entry and statistic; the next call of each compiled object traces."""
    reset_all()
