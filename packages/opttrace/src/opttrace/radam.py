"""RAdam's for-loop without ``capturable`` (``torch.optim.radam._single_tensor_radam``),
traced with eager's results.

Eager's for-loop reads the step count as a Python float and decides on the rectification in
Python: while ``rho_t > 5`` it updates by ``bias_corrected_exp_avg * lr * adaptive_lr * rect``,
else by ``bias_corrected_exp_avg * lr``. A trace cannot take that decision once for every
later call: both functions here compute both updates and select, ``where(rho_t > 5,
rectified, unrectified)``, eager's products in eager's order in either branch (the select is
exact), with no guard on the step count and no retrace when the rectification starts.

- :func:`for_loop` is eager's own path otherwise (for the torch backend on the CPU: the step
  count read with ``.item()``, so the bias corrections, ``rho_t`` and ``rect`` are the Python
  arithmetic eager does, Python's ``** 0.5`` included, which is not always ``sqrt``'s
  rounding): eager's bits.
- :func:`capturable_for_loop` is the capturable path otherwise (the kernel backends: every
  value a tensor or a number the host computes, the select a lane op), whose own update
  multiplies in another order, ``exp_avg * lr * where(rho_t > 5, rect * adaptive_lr, 1)``.

Eager's foreach path decides per parameter in Python too; it is traced on its capturable path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from opttrace.asgd import in_given_dtype


def for_loop(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    beta1: Any,
    beta2: Any,
    lr: Any,
    weight_decay: Any,
    eps: Any,
    decoupled_weight_decay: bool,
    differentiable: bool,
    maximize: bool,
    capturable: bool,
    has_complex: bool,
) -> None:
    """``_single_tensor_radam`` with ``capturable=False`` (its decision replaced as the module
    docstring says)."""
    del has_complex
    assert not capturable, "RAdam's capturable path is traced as torch.optim writes it"
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
        step_t += 1
        step = step_t.item()
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        bias_corrected_exp_avg = exp_avg / bias_correction1
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        # (a Python float's negative ratio while rho_t < 4, where the unrectified update is
        # taken, has a complex root: 0 there; a tensor's is NaN, which the select drops)
        rect = (ratio if isinstance(ratio, Tensor) else max(ratio, 0.0)) ** 0.5
        sqrt = exp_avg_sq.sqrt()
        exp_avg_sq_sqrt = sqrt.add(eps) if differentiable else sqrt.add_(eps)
        adaptive_lr = (bias_correction2**0.5) / exp_avg_sq_sqrt
        unrectified = bias_corrected_exp_avg * lr
        rectified = unrectified * adaptive_lr * rect
        # eager: ``rectified if rho_t > 5.0 else unrectified`` (x - 5 > 0 exactly when x > 5;
        # rho_t a tensor with a Tensor beta2: compared in its dtype, as eager's ``bool()``)
        if isinstance(rho_t, Tensor):
            rectifies = rho_t > 5.0
        else:
            rectifies = torch.scalar_tensor(rho_t - 5.0, dtype=torch.float64) > 0
        param.add_(torch.where(rectifies, rectified, unrectified), alpha=-1.0)


def capturable_for_loop(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    beta1: Any,
    beta2: Any,
    lr: Any,
    weight_decay: Any,
    eps: Any,
    decoupled_weight_decay: bool,
    differentiable: bool,
    maximize: bool,
    capturable: bool,
    has_complex: bool,
) -> None:
    """``_single_tensor_radam``'s capturable path (torch 2.11-2.13), its update eager's
    ``capturable=False`` one (see the module docstring)."""
    del capturable, has_complex
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
        step_t += 1
        step = in_given_dtype(step_t, beta2)  # (Tensor betas: eager's ``beta ** step``)
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        bias_corrected_exp_avg = exp_avg / bias_correction1
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
        rect = (
            (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        ) ** 0.5
        sqrt = exp_avg_sq.sqrt()
        exp_avg_sq_sqrt = sqrt.add(eps) if differentiable else sqrt.add_(eps)
        # eager's ``float / tensor`` is torch's ``tensor.reciprocal() * float``
        adaptive_lr = exp_avg_sq_sqrt.reciprocal() * (bias_correction2**0.5)
        unrectified = bias_corrected_exp_avg * lr
        # eager: ``unrectified * adaptive_lr * rect if rho_t > 5.0 else unrectified``
        update = torch.where(rho_t > 5.0, unrectified * adaptive_lr * rect, unrectified)
        param.add_(update, alpha=-1.0)
