"""Custom optimizers the Triton backend fuses only partly or not at all (shared by the
Triton-backend and CUDA-graph integration tests)."""

from __future__ import annotations

import torch

optim = torch.optim


class PerParameterSGD(optim.Optimizer):
    """A for-loop step over the parameters that have a gradient: ``update(p, lr)`` each."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, group["lr"])

    def update(self, p, lr):
        raise NotImplementedError


class TrustRatioSGD(PerParameterSGD):
    """LARS-style: each update scaled by ||p|| / ||g||, a per-tensor reduction."""

    def update(self, p, lr):
        ratio = p.norm() / (p.grad.norm() + 1e-8)
        p.add_(p.grad * ratio, alpha=-lr)


class DecayMatricesOnly(PerParameterSGD):
    """Weight decay on matrices only: the per-parameter op sequences differ."""

    def update(self, p, lr):
        if p.dim() > 1:
            p.mul_(1 - lr * 0.1)
        p.add_(p.grad, alpha=-lr)


class ForeachLamb(optim.Optimizer):
    """LAMB-style foreach step: the norm of an update that itself updates a state tensor.
    The moment's new value comes from the torch backend and is written after the kernel."""

    def __init__(self, params, lr=1e-2, weight_decay=0.01):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            ms = []
            for p in ps:
                if "m" not in self.state[p]:
                    self.state[p]["m"] = torch.zeros_like(p)
                ms.append(self.state[p]["m"])
            torch._foreach_lerp_(ms, [p.grad for p in ps], 0.1)
            update = torch._foreach_add(ms, ps, alpha=group["weight_decay"])
            ratio = torch._foreach_div(
                torch._foreach_norm(ps), torch._foreach_add(torch._foreach_norm(update), 1e-8)
            )
            torch._foreach_mul_(update, ratio)
            torch._foreach_add_(ps, update, alpha=-group["lr"])


class StepScaledTrustSGD(PerParameterSGD):
    """A trust ratio taken of a tensor scaled by a value read from another tensor (a step
    count's ``.item()``): the norm, which runs before the kernel, needs that read too."""

    def update(self, p, lr):
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        ratio = (p * (1.0 / state["step"].item())).norm()
        p.add_(p.grad * ratio, alpha=-lr)
