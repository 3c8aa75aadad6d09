"""Custom optimizers written as users write them, shared by the integration tests: Lion
(custom optimizers, low-precision state, DTensor scenarios) and the steps the Triton backend
fuses only partly, not at all, or only through a case of its own (Triton backend, CUDA
graphs)."""

from __future__ import annotations

from typing import Any

import torch

optim = torch.optim


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): sign of an interpolated momentum, decoupled weight decay."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        foreach: bool = False,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "foreach": foreach}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            if group["foreach"]:
                self._foreach_update(group, params, grads, exp_avgs)
            else:
                self._loop_update(group, params, grads, exp_avgs)
        return loss

    @staticmethod
    def _loop_update(group: dict[str, Any], params: list, grads: list, exp_avgs: list) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        for p, g, m in zip(params, grads, exp_avgs, strict=True):
            update = (m * beta1 + g * (1 - beta1)).sign_()
            p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)
            m.lerp_(g, 1 - beta2)

    @staticmethod
    def _foreach_update(group: dict[str, Any], params: list, grads: list, exp_avgs: list) -> None:
        if not params:
            return
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        updates = torch._foreach_mul(exp_avgs, beta1)
        torch._foreach_add_(updates, grads, alpha=1 - beta1)
        torch._foreach_sign_(updates)
        torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_add_(params, updates, alpha=-lr)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)


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


class ScaledByAConstant(PerParameterSGD):
    """Makes a tensor from Python data in its step (``torch.tensor(2.0)``): a graph
    constant, which the torch backend hands to the kernel."""

    def update(self, p, lr):
        p.add_(p.grad * torch.tensor(2.0, device=p.device), alpha=-lr)


class MaskedTrust(PerParameterSGD):
    """A per-tensor trust ratio chosen by a bool the norms decide: the prelude hands the
    kernel a 0-dim bool per lane."""

    def update(self, p, lr):
        weight, update = p.norm(), p.grad.norm()
        usable = (weight > 0) & (update > 0)
        p.add_(p.grad * torch.where(usable, weight / update, 1.0), alpha=-lr)


class SophiaLike(optim.Optimizer):
    """A one-sided clamp (``clamp(None, 1)``, ``clamp(max=3)``) and a sign."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"], state["h"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].lerp_(p.grad, 1 - group["beta1"])
                state["h"].mul_(group["beta2"]).addcmul_(p.grad, p.grad, value=1 - group["beta2"])
                ratio = (state["m"].abs() / (0.05 * state["h"] + 1e-15)).clamp(None, 1)
                ratio = ratio * torch.exp(-p.abs().clamp(max=3))
                p.addcmul_(state["m"].sign(), ratio, value=-group["lr"])


def _clipped_by_global_norm(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """``grads`` scaled down to a global norm of at most 1 (one coefficient for all)."""
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch._foreach_mul(grads, (1.0 / (total + 1e-6)).clamp(max=1.0))


class ClippedAdam(optim.Optimizer):
    """Adam (foreach) on grads clipped by their global norm: one coefficient for all lanes,
    computed from the norms."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            grads = _clipped_by_global_norm(grads)
            for p in params:
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
            ms = [self.state[p]["m"] for p in params]
            vs = [self.state[p]["v"] for p in params]
            torch._foreach_lerp_(ms, grads, 1 - group["beta1"])
            torch._foreach_mul_(vs, group["beta2"])
            torch._foreach_addcmul_(vs, grads, grads, value=1 - group["beta2"])
            denominators = torch._foreach_add(torch._foreach_sqrt(vs), group["eps"])
            torch._foreach_addcdiv_(params, ms, denominators, value=-group["lr"])


class CountedClippedMomentum(optim.Optimizer):
    """A global-norm clip (the prelude) before a momentum step scaled by its CPU step
    count's ``.item()``: the host computes the scale (and writes the counts back) each call,
    the prelude's results are lane inputs of the kernel."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            grads = _clipped_by_global_norm(grads)
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"], state["m"] = torch.tensor(0.0), torch.zeros_like(p)
            steps = [self.state[p]["step"] for p in params]
            ms = [self.state[p]["m"] for p in params]
            torch._foreach_add_(steps, 1.0)
            torch._foreach_lerp_(ms, grads, 0.1)
            for p, m, count in zip(params, ms, steps, strict=True):
                p.add_(m, alpha=-group["lr"] / (1 - 0.9 ** count.item()))
