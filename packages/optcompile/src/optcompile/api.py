"""The user API: ``compile``, ``explain`` and ``reset``."""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import torch
from optguard import DEFAULT_RECOMPILE_LIMIT, Locals, native
from optkernels import Backend, BackendError, get_backend
from opttrace import closure_reason, eager_step, trace, trace_step

from optcompile._torch_compat import has_step_hooks, step_post_hooks, step_pre_hooks
from optcompile.cudagraphs import GraphedBackend, GraphedPlan
from optcompile.driver import Compiled, newest, reset_all
from optcompile.errors import CompileError

Opt = TypeVar("Opt", bound=torch.optim.Optimizer)
F = TypeVar("F", bound=Callable[..., Any])

BACKEND_CHOICES = ("auto", "torch", "triton")
_OPTIMIZERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, Compiled] = (
    weakref.WeakKeyDictionary()
)


def _backend(name: str, obj: Any) -> Backend:
    if name not in BACKEND_CHOICES:
        raise CompileError(f"backend={name!r} is unknown; choose one of {BACKEND_CHOICES}")
    if name == "auto":
        name = "triton" if _wants_triton(obj) else "torch"
    try:
        return get_backend(name)
    except BackendError as exc:
        raise CompileError(str(exc)) from exc


def _wants_triton(obj: Any) -> bool:
    """ "auto": the Triton kernels when there is a CUDA device, Triton can run, and (for an
    optimizer) its params live on CUDA; otherwise the torch backend."""
    if not torch.cuda.is_available():
        return False
    from optkernels.triton_backend import triton_usable

    if triton_usable() is not None:
        return False
    if isinstance(obj, torch.optim.Optimizer):
        return any(p.is_cuda for group in obj.param_groups for p in group["params"])
    return True


@overload
def compile(
    obj: Opt,
    *,
    backend: str = ...,
    cudagraphs: str | bool = ...,
    fullgraph: bool = ...,
    recompile_limit: int = ...,
) -> Opt: ...


@overload
def compile(
    obj: F,
    *,
    backend: str = ...,
    cudagraphs: str | bool = ...,
    fullgraph: bool = ...,
    recompile_limit: int = ...,
) -> F: ...


def compile(
    obj: Any,
    *,
    backend: str = "auto",
    cudagraphs: str | bool = "auto",
    fullgraph: bool = False,
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT,
) -> Any:
    """Compile an optimizer's ``step`` (returns the same optimizer) or a function.

    ``backend``: "auto" (Triton kernels for CUDA tensors, else torch) | "torch" | "triton".
    ``cudagraphs``: "auto" records the step's kernels as a CUDA graph after its first call
    when they run on one CUDA device (explain() says why not otherwise); True raises where
    that is not possible; False never records.
    ``fullgraph=True`` raises where the tracer cannot capture the step instead of falling
    back to eager with a warning.
    ``recompile_limit``: entries kept per object before it falls back to eager.
    """
    chosen: Backend = _backend(backend, obj)
    if cudagraphs is not False:
        chosen = GraphedBackend(chosen, cudagraphs)
    if isinstance(obj, torch.optim.Optimizer):
        return _compile_optimizer(obj, chosen, fullgraph, recompile_limit)
    if callable(obj):
        return _compile_function(obj, chosen, fullgraph, recompile_limit)
    raise CompileError(
        f"optcompile.compile takes a torch.optim.Optimizer or a function, "
        f"got {type(obj).__qualname__}"
    )


def _compile_optimizer(opt: Opt, backend: Backend, fullgraph: bool, recompile_limit: int) -> Opt:
    if opt in _OPTIMIZERS:
        return opt
    reason = closure_reason(type(opt))
    if reason is not None and fullgraph:
        raise CompileError(f"fullgraph=True: {reason}")
    compiled = _OPTIMIZERS[opt] = Compiled(
        f"{type(opt).__name__}.step",
        lambda L: trace_step(L["opt"], capturable=backend.wants_capturable),
        lambda L: eager_step(L["opt"]),
        backend,
        fullgraph,
        recompile_limit,
        pin_inputs=True,
    )
    if reason is not None:  # LBFGS: its own step (hooks, closure) stays as it is
        compiled.fall_back(reason)
        return opt
    # Entries fetch their inputs through Sources and pin only what the optimizer holds anyway
    # (params, state); what they own themselves (plans, graphs) goes with the optimizer: the
    # finalizer releases it even if something still holds `compiled`.
    weakref.finalize(opt, compiled.release)
    opt.step = types.MethodType(_compiled_step, opt)  # type: ignore[method-assign]
    return opt


def _compiled_step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """The compiled ``step``: hooks and the closure run eagerly, the update is compiled."""
    if torch.compiler.is_compiling():  # (57 ns; a disabled function costs 300 ns a call)
        return _step_under_dynamo(self, closure)
    return _step(self, closure)


def _step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
    if closure is None and not has_step_hooks(self):  # the usual call: nothing else to run
        _OPTIMIZERS[self]({"opt": self})
        self._opt_called = True  # type: ignore[attr-defined]  # see below
        return None
    args: tuple[Any, ...] = (self,)
    kwargs: dict[str, Any] = {} if closure is None else {"closure": closure}
    for hook in step_pre_hooks(self):
        result = hook(self, args, kwargs)
        if result is not None:
            args, kwargs = result
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    _OPTIMIZERS[self]({"opt": self})
    self._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers' wrapper sets
    for hook in step_post_hooks(self):
        hook(self, args, kwargs)
    return loss


# Inside a function torch.compile traces (a training step calling opt.step()), dynamo would
# trace this glue and the plan behind it, op by op, up to its recompile limits: the step is
# compiled already, so dynamo is told to run it as it is (a graph break).
_step_under_dynamo: Callable[..., Any] = torch.compiler.disable(_step)  # type: ignore[no-untyped-call]


def _compile_function(fn: F, backend: Backend, fullgraph: bool, recompile_limit: int) -> F:
    signature = inspect.signature(fn)

    def call(L: Locals) -> Any:
        bound = inspect.BoundArguments(signature, dict(L))
        return fn(*bound.args, **bound.kwargs)

    compiled = Compiled(
        getattr(fn, "__qualname__", repr(fn)),
        lambda L: trace(lambda **tracked: call(tracked), L),
        call,
        backend,
        fullgraph,
        recompile_limit,
    )
    under_dynamo: Callable[..., Any] = torch.compiler.disable(compiled)  # type: ignore[no-untyped-call]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for value in bound.arguments.values():
            # The function's trace replays opt.step(...) as a call: the optimizer's own step
            # is compiled, with the same options.
            if isinstance(value, torch.optim.Optimizer):
                _compile_optimizer(value, backend, fullgraph, recompile_limit)
        if torch.compiler.is_compiling():
            return under_dynamo(bound.arguments)  # (see _step_under_dynamo)
        return compiled(bound.arguments)

    wrapper._optcompile = compiled  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class Explanation:
    """What optcompile did with one compiled object."""

    traces: int
    retrace_reasons: list[str]
    guards: list[str]
    graph_code: str
    check_code: str
    gather_code: str
    replay_code: str
    backend: str
    entries: int
    fallback_reason: str | None
    entry_guards: list[list[str]] = field(default_factory=list)  # per entry, newest first
    kernel_launches_per_step: int = 0  # of the newest entry's plan
    cudagraphs: str = "off"  # the newest entry's graph, or why it has none
    cudagraph_recordings: int = 0  # over every entry
    cudagraph_replays: int = 0
    native_checks: str = ""  # optguard's C++ per-tensor checks: loaded, building, failed, off

    def __str__(self) -> str:
        older = [
            line
            for i, guards in enumerate(self.entry_guards[1:], start=2)
            for line in (f"guards of entry {i} (older):", *(f"  - {g}" for g in guards))
        ]
        parts = [
            f"traces: {self.traces}   entries: {self.entries}   backend: {self.backend}"
            f"   kernel launches per step: {self.kernel_launches_per_step}",
            f"fallback: {self.fallback_reason or 'none'}",
            f"CUDA graphs: {self.cudagraphs}",
            f"native per-tensor checks: {self.native_checks}",
            "retrace reasons:",
            *(f"  - {r}" for r in self.retrace_reasons or ["(none)"]),
            f"guards of the newest entry ({len(self.guards)}):",
            *(f"  - {g}" for g in self.guards),
            *older,
            "check code:",
            self.check_code,
            "graph code:",
            self.graph_code,
            "replay code:",
            self.replay_code,
        ]
        return "\n".join(parts)


def _compiled_of(obj: Any) -> Compiled:
    if isinstance(obj, torch.optim.Optimizer) and obj in _OPTIMIZERS:
        return _OPTIMIZERS[obj]
    compiled = getattr(obj, "_optcompile", None)
    if isinstance(compiled, Compiled):
        return compiled
    raise CompileError(
        f"{type(obj).__qualname__} object was not compiled; pass the result of "
        "optcompile.compile(...) to optcompile.explain"
    )


def explain(obj: Any) -> Explanation:
    """Report traces, retrace reasons, guards and generated code of a compiled object."""
    compiled = _compiled_of(obj)
    entry = newest(compiled)
    plans = [e.value.plan for e in compiled.cache.entries]
    graphed = [p for p in plans if isinstance(p, GraphedPlan)]
    if entry is None:
        status = "no entry yet"
    elif isinstance(entry.plan, GraphedPlan):
        status = entry.plan.status()
    else:
        status = "off (cudagraphs=False)"
    return Explanation(
        traces=compiled.stats.traces,
        retrace_reasons=list(compiled.stats.retrace_reasons),
        guards=entry.traced.guards.describe() if entry else [],
        graph_code=entry.plan.describe() if entry else "",
        check_code=compiled.cache.entries[0].check.describe() if entry else "",
        gather_code=entry.gather_code if entry else "",
        replay_code=entry.replay.code if entry else "",
        backend=compiled.backend.name,
        entries=len(compiled.cache.entries),
        fallback_reason=compiled.stats.fallback_reason,
        entry_guards=[e.value.traced.guards.describe() for e in compiled.cache.entries],
        kernel_launches_per_step=entry.plan.kernel_launches_per_step if entry else 0,
        cudagraphs=status,
        cudagraph_recordings=sum(p.recordings for p in graphed),
        cudagraph_replays=sum(p.replays for p in graphed),
        native_checks=native.status(),
    )


def reset() -> None:
    """Drop every compiled entry and statistic; the next call of each compiled object traces."""
    reset_all()
