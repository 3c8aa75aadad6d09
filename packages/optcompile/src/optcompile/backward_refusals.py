"""Refusals of the step inside backward: what cannot hold when no moment sees every
gradient (gradient norm clipping, GradScaler over an in-backward optimizer's params).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from optcompile import _torch_compat
from optcompile.errors import CompileError

# id(param) -> (the param, the name of the in-backward optimizer that owns it), for the
# refusals below; weak, and an id reused by another tensor is told apart by identity.
_OWNED: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


def _owner(p: torch.Tensor) -> str | None:
    entry = _OWNED.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


# -- refusals: what cannot hold when no moment sees every gradient --

_INSTALLED: list[bool] = []


def _install_refusals() -> None:
    if not _INSTALLED:
        _torch_compat.guard_grad_norm_clipping(_refuse_clipping)
        _torch_compat.guard_grad_scaling(_refuse_scaling)
        _INSTALLED.append(True)


def _refuse_clipping(parameters: Any) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    for p in params:
        owner = _owner(p)
        if owner is not None:
            raise CompileError(
                f"clip_grad_norm_ over parameters of {owner}, compiled with "
                "in_backward=True: each gradient is used and freed during backward, as it "
                "arrives, so no moment sees all of them and their norm cannot be taken "
                f"(a param of shape {tuple(p.shape)} has grad {_grad_text(p)}). Clipping "
                "each bucket by its own norm is not the same update. Compile without "
                "in_backward=True to clip by the norm over all gradients"
            )


def _refuse_scaling(scaled: Any) -> None:
    if not _OWNED or not isinstance(scaled, torch.Tensor | list | tuple):
        return  # (an iterator GradScaler returns for other iterables is not consumed here)
    roots = [scaled] if isinstance(scaled, torch.Tensor) else list(scaled)
    p = _owned_leaf(roots)
    if p is not None:
        raise CompileError(
            f"GradScaler.scale: this loss backpropagates into parameters of {_owner(p)}, "
            "compiled with in_backward=True (a param of shape "
            f"{tuple(p.shape)}). Its update runs during backward, before GradScaler could "
            "unscale the gradients or skip a step with inf/NaN gradients. Train without "
            "GradScaler (bf16 autocast needs none) or compile without in_backward=True"
        )


def _owned_leaf(roots: list[Any]) -> torch.Tensor | None:
    """A parameter of an in-backward optimizer that ``roots``' autograd graph reaches."""
    seen: set[Any] = set()
    stack = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = _torch_compat.accumulate_grad_variable(node)
        if leaf is not None and _owner(leaf) is not None:
            return leaf
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return None


def _grad_text(p: torch.Tensor) -> str:
    return "None (already applied and freed)" if p.grad is None else "not yet applied"
