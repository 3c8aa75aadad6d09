"""Building a differential case's sides (test_differential.py): its params, optimizer,
scheduler and grads, the same values on every call, and one compiled or eager optimizer over
them (a Side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optcompile
import torch
from differential_cases import CUSTOM, DEVICE, LR, LRS, Case, Group, materialize

optim = torch.optim
S = torch.optim.lr_scheduler


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype).to(DEVICE)
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _laid_out(shape: tuple[int, ...], layout: str, gen: torch.Generator, dtype: torch.dtype):
    """A tensor of ``shape`` in ``layout`` ("transposed", "strided", else contiguous)."""
    if layout == "transposed" and len(shape) >= 2:
        return _randn(shape[::-1], gen, dtype).permute(*reversed(range(len(shape))))
    if layout == "strided" and len(shape) >= 1:
        return _randn((*shape[:-1], 2 * shape[-1]), gen, dtype)[..., ::2]
    return _randn(shape, gen, dtype)


def build_params(case: Case) -> list[torch.nn.Parameter]:
    """The case's parameters (added groups' too), the same values and layouts every call."""
    gen = torch.Generator().manual_seed(case.seed)
    specs = case.param_specs()
    flat: dict[str, torch.Tensor] = {}
    for dtype in sorted({p.dtype for p in specs if p.layout == "flat"}):
        total = sum(_numel(p.shape) for p in specs if p.layout == "flat" and p.dtype == dtype)
        flat[dtype] = _randn((total + 1,), gen, getattr(torch, dtype))
    offsets = dict.fromkeys(flat, 1)  # (views start one element in: not at the base)
    params = []
    for spec in specs:
        if spec.layout == "flat":
            start = offsets[spec.dtype]
            offsets[spec.dtype] = start + _numel(spec.shape)
            tensor = flat[spec.dtype][start : offsets[spec.dtype]].view(spec.shape)
        else:
            tensor = _laid_out(spec.shape, spec.layout, gen, getattr(torch, spec.dtype))
        params.append(torch.nn.Parameter(tensor))
    return params


def group_dict(group: Group, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    return {"params": params, **{k: materialize(v) for k, v in group.options.items()}}


def build_optimizer(
    case: Case, params: list[torch.nn.Parameter], added: int = 0
) -> torch.optim.Optimizer:
    """The case's optimizer over its groups and the first ``added`` groups added later."""
    groups, i = [], 0
    for group in case.group_specs()[: len(case.groups) + added]:
        groups.append(group_dict(group, params[i : i + len(group.params)]))
        i += len(group.params)
    defaults = {k: materialize(v) for k, v in case.defaults.items()}
    cls = CUSTOM.get(case.optimizer) or getattr(optim, case.optimizer)
    return cls(groups, **defaults)


def _lambda(epoch: int) -> float:
    return 0.9**epoch


def build_scheduler(case: Case, opt: torch.optim.Optimizer) -> Any:
    if case.scheduler == "StepLR":
        return S.StepLR(opt, step_size=2, gamma=0.5)
    if case.scheduler == "CosineAnnealingLR":
        return S.CosineAnnealingLR(opt, T_max=case.steps)
    if case.scheduler == "LambdaLR":
        return S.LambdaLR(opt, _lambda)
    if case.scheduler == "OneCycleLR":
        defaults = opt.defaults
        cycle = "momentum" in defaults or "betas" in defaults
        max_lr = 10 * LRS.get(case.optimizer, LR)[0]
        return S.OneCycleLR(opt, max_lr=max_lr, total_steps=case.steps + 1, cycle_momentum=cycle)
    return None


def set_grads(case: Case, params: list[torch.nn.Parameter], step: int) -> None:
    """Gradients for ``step``: the same values (and layouts) on every call."""
    gen = torch.Generator().manual_seed(1000 * case.seed + step)
    none = case.none_grads[step] if step < len(case.none_grads) else ()
    shared: dict[Any, torch.Tensor] = {}
    for i, (p, spec) in enumerate(zip(params, case.param_specs(), strict=True)):
        value = _randn(tuple(p.shape), gen, p.dtype)
        key = (tuple(p.shape), p.dtype)
        if i in none:
            p.grad = None
        elif case.grads_in_place and p.grad is not None:
            p.grad.copy_(value)
        elif case.share_grads and key in shared:
            p.grad = shared[key]
        elif spec.grad_layout == "like_param":
            p.grad = torch.empty_like(p).copy_(value)
        elif spec.grad_layout == "strided":
            p.grad = _laid_out(tuple(p.shape), "strided", gen, p.dtype).copy_(value)
        else:
            p.grad = value
        if p.grad is not None:
            shared.setdefault(key, p.grad)


@dataclass
class Side:
    """One optimizer (compiled or eager) over its own parameters, with its scheduler."""

    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: Any
    is_compiled: bool = False
    # The compiled optimizers this side has stepped (one list for the side's successors).
    stepped: list[torch.optim.Optimizer] = field(default_factory=list)
    added: int = 0  # groups added so far
    hook_calls: list[int] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)


def _halve_grads(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.mul_(0.5)


def make_side(
    case: Case, compiled: bool, params: list[torch.nn.Parameter] | None = None, added: int = 0
) -> Side:
    params = build_params(case) if params is None else params
    opt = build_optimizer(case, params, added)
    side = Side(params, opt, None, added=added)
    if case.scheduler_first:
        side.sched = build_scheduler(case, opt)
    if compiled:
        limit = {} if case.recompile_limit is None else {"recompile_limit": case.recompile_limit}
        graphs = "auto" if case.cudagraphs else False  # ("auto": where the step allows one)
        opt = optcompile.compile(opt, backend=case.backend, cudagraphs=graphs, **limit)
        side.is_compiled = True
    if not case.scheduler_first:
        side.sched = build_scheduler(case, opt)
    if case.hooks:
        opt.register_step_pre_hook(_halve_grads)
        opt.register_step_post_hook(lambda *_: side.hook_calls.append(len(side.hook_calls)))
    return side
