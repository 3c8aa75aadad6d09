"""Private torch APIs optcompile uses, in one place (a torch upgrade edits this)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch.optim import optimizer as _optimizer_module

Hook = Callable[..., Any]


def step_pre_hooks(opt: torch.optim.Optimizer) -> Iterable[Hook]:
    """Global then per-optimizer step pre-hooks, in the order torch.optim runs them."""
    return chain(
        _optimizer_module._global_optimizer_pre_hooks.values(),
        opt._optimizer_step_pre_hooks.values(),
    )


def step_post_hooks(opt: torch.optim.Optimizer) -> Iterable[Hook]:
    """Per-optimizer then global step post-hooks, in the order torch.optim runs them."""
    return chain(
        opt._optimizer_step_post_hooks.values(),
        _optimizer_module._global_optimizer_post_hooks.values(),
    )


def has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether any step pre- or post-hook (global or ``opt``'s) is registered."""
    return bool(
        _optimizer_module._global_optimizer_pre_hooks
        or opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or _optimizer_module._global_optimizer_post_hooks
    )


def unhooked_step(cls: type) -> Callable[..., Any]:
    """``cls.step`` without the wrapper torch.optim puts around each class's step (hooks and
    the profiler; it marks it ``hooked`` and keeps the step it wraps as ``__wrapped__``)."""
    step: Callable[..., Any] = cls.step  # type: ignore[attr-defined]
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        inner: Callable[..., Any] = step.__wrapped__
        return inner
    return step


def profiler_enabled() -> bool:
    """Whether torch's profiler records (then ``zero_grad`` runs torch's own, which labels
    itself in the trace)."""
    return bool(torch._C._autograd._profiler_enabled())


# --- in_backward: autograd's engine, compiled autograd, and the two functions it guards ---


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (eager autograd only: compiled
    autograd drops callbacks queued from a hook that runs outside its graph)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def autograd_hook(fn: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``fn`` as a tensor hook that dynamo never traces into, costing a plain call where
    dynamo is not running.

    Dynamo, tracing a graph that calls the hook (compiled autograd's backward graph), sees
    it marked as skipped (``torch._dynamo.decorators.skip``: its frame is never compiled
    and a call to it is a graph break), like a ``torch.compiler.disable``d function. At run
    time, where dynamo's frame callback is set (the hook called from a compiled function's
    frame: compiled autograd's graph, a backward inside ``torch.compile``), the call goes
    through ``torch.compiler.disable``'s wrapper, so that dynamo compiles none of the
    frames ``fn`` calls; elsewhere (eager autograd outside torch.compile: every hook of a
    usual training loop) ``fn`` is called directly, without the wrapper's two switches of
    the frame callback per call."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback
    from torch._dynamo.decorators import skip

    disabled = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]

    def hook(p: torch.Tensor) -> None:
        if get_eval_frame_callback() is None:
            fn(p)
        else:
            disabled(p)

    skipped: Callable[[torch.Tensor], None] = skip(hook)
    return skipped


# The id of the running backward (autograd's graph task; -1 outside one): the hooks of one
# ``backward()`` call see the same id, the next call another. torch's function itself, not a
# wrapper (a bucket's last hook calls it inside every backward).
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id


def graph_exec(graph: Any) -> int | None:
    """The ``cudaGraphExec_t`` of a recorded ``torch.cuda.CUDAGraph`` (an int), or None
    where this torch does not expose it (``raw_cuda_graph_exec``, torch >= 2.9)."""
    found = getattr(graph, "raw_cuda_graph_exec", None)
    if found is None:
        return None
    try:
        value = found()
    except RuntimeError:
        return None
    return int(value) if value else None


def in_compiled_autograd() -> bool:
    """Whether the running backward is torch's compiled autograd's graph."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.in_compiled_autograd_region)


def compiled_autograd(compiler: Callable[..., Any]) -> Any:
    """A context in which ``backward()`` runs through torch's compiled autograd, its graph
    compiled by ``compiler`` (e.g. ``torch.compile(backend="eager")``)."""
    from torch._dynamo import compiled_autograd as ca

    return ca._enable(compiler)


def compiled_autograd_config() -> Any:
    """A context in which functions compiled by ``torch.compile`` run the backward they call
    through compiled autograd (``torch._dynamo.config.compiled_autograd = True``)."""
    import torch._dynamo

    return torch._dynamo.config.patch(compiled_autograd=True)


def accumulate_grad_variable(node: Any) -> torch.Tensor | None:
    """The leaf tensor an autograd graph node accumulates into (None for other nodes)."""
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def guard_grad_norm_clipping(check: Callable[[Any], Any]) -> None:
    """Call ``check(parameters)`` before every ``clip_grad_norm_`` (and the deprecated
    ``clip_grad_norm``) clips, whatever name it was imported under: both clip through this
    module-level function of ``torch.nn.utils.clip_grad``. Installed once."""
    from torch.nn.utils import clip_grad

    clip = clip_grad._clip_grads_with_norm_
    if getattr(clip, "_optcompile_guarded", False):
        return

    def clip_checked(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)
        check(parameters)
        return clip(parameters, *args, **kwargs)

    clip_checked._optcompile_guarded = True  # type: ignore[attr-defined]
    clip_grad._clip_grads_with_norm_ = clip_checked


def guard_grad_scaling(check: Callable[[Any], Any]) -> None:
    """Call ``check(scaled_outputs)`` after every enabled ``torch.amp.GradScaler.scale``
    (``torch.cuda.amp.GradScaler`` inherits it). Installed once."""
    from torch.amp.grad_scaler import GradScaler

    scale = GradScaler.scale
    if getattr(scale, "_optcompile_guarded", False):
        return

    def scale_checked(self: GradScaler, outputs: Any) -> Any:
        scaled = scale(self, outputs)
        if self.is_enabled():
            check(scaled)
        return scaled

    scale_checked._optcompile_guarded = True  # type: ignore[attr-defined]
    GradScaler.scale = scale_checked  # type: ignore[method-assign]
