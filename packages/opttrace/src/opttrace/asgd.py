"""ASGD's for-loop without ``capturable`` (``torch.optim.asgd._single_tensor_asgd``), traced
with eager's results.

Eager's for-loop reads eta and the step count as Python floats (``.item()``) and decides how to
average on mu's value: ``ax.copy_(param)`` while ``mu == 1`` (the first ``t0`` steps), else
``ax.add_(param.sub(ax).mul_(mu))``. A trace cannot take that decision once for every later
call; both functions here compute both and select per element, ``where(mu == 1, param,
formula)``: mu is one value per parameter, so the select is exact and the result is eager's in
either branch, bit for bit, with no guard on mu's value and no retrace when mu leaves 1 (a guard
would read every parameter's mu on every call and trace the step again at step ``t0 + 2``; the
select is one compare per element in a kernel that reads ``param`` and ``ax`` anyway).

- :func:`for_loop` is eager's own path otherwise (for the torch backend on the CPU: its Python
  floats are the ``.item()`` values the tracer records as symbolic scalars, so each op gets
  what eager gives it, a Python number, not a 0-dim tensor, whose dtype would take part in
  type promotion): eager's bits.
- :func:`capturable_for_loop` is the capturable path otherwise (for the kernel backends, and
  where the state is on a GPU: every value stays a tensor, the select a lane op, so the step
  still fuses into one launch; the step counts, eta and mu are read in float64 as eager's
  Python floats, opttrace.optimizer).

Eager's foreach path averages by the formula whatever mu is, and computes mu from a step
count read as a Python float (``torch.as_tensor(1 / max(1, step.item() - t0))``): it is traced
as it stands, that ``as_tensor`` of a number read from a tensor recorded as a 0-dim tensor of
it (:func:`numbers_as_tensors`) where the eager path is traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from opttrace.patches import patched
from opttrace.symbolic import node_of


def for_loop(
    params: list[Tensor],
    grads: list[Tensor],
    axs: list[Tensor],
    mus: list[Tensor],
    etas: list[Tensor],
    state_steps: list[Tensor],
    *,
    lambd: Any,
    lr: Any,
    t0: Any,
    alpha: Any,
    weight_decay: Any,
    maximize: bool,
    differentiable: bool,
    capturable: bool,
    has_complex: bool,
) -> None:
    """``_single_tensor_asgd`` with ``capturable=False`` (eager's Python decisions on
    tensor values replaced as the module docstring says); ``capturable=True`` is not
    taken here (the caller traces torch's own)."""
    del differentiable, has_complex  # (the differentiable option is never traced)
    assert not capturable, "ASGD's capturable path is traced as torch.optim writes it"
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        mu, ax, eta, step_t = mus[i], axs[i], etas[i], state_steps[i]
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            param = torch.view_as_real(param)
            ax = torch.view_as_real(ax)
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        eta_value = eta.item()
        param.mul_(1 - lambd * eta_value)
        param.add_(grad, alpha=-eta_value)
        # eager: ``ax.copy_(param) if mu.item() == 1 else ax.add_(param.sub(ax).mul_(mu))``
        ax.copy_(torch.where(mu == 1, param, ax.add(param.sub(ax).mul_(mu))))
        step = step_t.item()
        eta.copy_(_as_tensor(lr / ((1 + lambd * lr * step) ** alpha)))
        if isinstance(t0, Tensor):  # eager: max(1, step - t0), a bool read from a tensor
            mu.copy_(1 / torch.clamp_min(step - t0, 1))
        else:
            mu.copy_(_as_tensor(1 / max(1, step - t0)))


def _as_tensor(value: Any) -> Tensor:
    """``torch.as_tensor(value)`` (a tensor as it is, a Python number in the default
    dtype, on the CPU) for a symbolic number too, which as_tensor would read."""
    if isinstance(value, Tensor):
        return value
    return torch.scalar_tensor(value, dtype=torch.get_default_dtype())


_AS_TENSOR = torch.as_tensor


def _as_tensor_of_symbolic(data: Any, dtype: Any = None, device: Any = None) -> Tensor:
    """``torch.as_tensor`` that records a 0-dim tensor of a symbolic number (in the dtype
    as_tensor gives that Python type) instead of reading its value."""
    node = node_of(data)
    if node is None:
        return _AS_TENSOR(data, dtype=dtype, device=device)
    if dtype is None:
        kinds: dict[type, torch.dtype] = {float: torch.get_default_dtype(), bool: torch.bool}
        dtype = kinds.get(node.pytype, torch.int64)
    return torch.scalar_tensor(data, dtype=dtype, device=device)


@contextlib.contextmanager
def numbers_as_tensors() -> Iterator[None]:
    """While tracing eager's path: ``torch.as_tensor`` of a number read from a tensor (ASGD's
    foreach mu) records it as a 0-dim tensor, as eager makes one of the Python float."""
    with patched(torch, "as_tensor", _as_tensor_of_symbolic):
        yield


def capturable_for_loop(
    params: list[Tensor],
    grads: list[Tensor],
    axs: list[Tensor],
    mus: list[Tensor],
    etas: list[Tensor],
    state_steps: list[Tensor],
    *,
    lambd: Any,
    lr: Any,
    t0: Any,
    alpha: Any,
    weight_decay: Any,
    maximize: bool,
    differentiable: bool,
    capturable: bool,
    has_complex: bool,
) -> None:
    """``_single_tensor_asgd``'s capturable path (torch 2.11-2.13), its averaging eager's
    ``capturable=False`` one (see the module docstring)."""
    del differentiable, capturable, has_complex  # (never traced differentiable)
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        mu, ax, eta, step_t = mus[i], axs[i], etas[i], state_steps[i]
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            param = torch.view_as_real(param)
            ax = torch.view_as_real(ax)
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        param.mul_(1 - lambd * in_given_dtype(eta, lambd))
        param.addcmul_(grad, eta, value=-1)
        # eager: ``ax.copy_(param) if mu.item() == 1 else ax.add_(param.sub(ax).mul_(mu))``
        ax.copy_(torch.where(mu == 1, param, ax.add(param.sub(ax).mul_(mu))))
        step = in_given_dtype(step_t, lr, lambd, alpha)
        eta.copy_(lr / ((1 + lambd * lr * step) ** alpha))
        step = in_given_dtype(step_t, t0)
        mu.copy_(1 / torch.maximum(step - t0, torch.ones_like(step)))


def in_given_dtype(value: Tensor, *hyperparameters: Any) -> Tensor:
    """``value`` (a step count or eta, which a capturable for-loop may see in float64 where
    eager reads a Python float) in the dtype of the first Tensor among ``hyperparameters``:
    eager's arithmetic of its Python float with a Tensor hyperparameter is an op in that
    tensor's dtype. ``value`` itself where they are all numbers."""
    for hyperparameter in hyperparameters:
        if isinstance(hyperparameter, Tensor):
            return value.to(hyperparameter.dtype)
    return value
