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
