"""Sharded-training scenarios run by test_dtensor.py in each of two spawned gloo processes.

Each scenario compiles an optimizer over a small FSDP2 (``fully_shard``) transformer, steps it
beside eager torch.optim over a twin model (same seed, same batches), and raises on any
difference in parameters or state. ``main`` runs them all on one rank and writes, per
scenario, "ok" or the error to ``<out>/rank<r>.json``: one spawn serves the whole module.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import optcompile
import torch
import torch.distributed as dist
from step_optimizers import Lion
from torch import nn

D = 16


class Block(nn.Module):
    """Pre-norm attention and MLP, tiny."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.mlp(x)


class Tiny(nn.Module):
    """Embedding, two blocks, a head of 3 outputs (rows that do not split evenly)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@functools.cache
def cpu_mesh() -> Any:
    """Both ranks, on the CPU (FSDP2's default mesh is on the accelerator where there is one,
    and gloo cannot reduce-scatter CUDA tensors)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def sharded_model(seed: int = 0) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Tiny()
    for block in model.blocks:
        fully_shard(block, mesh=cpu_mesh())
    fully_shard(model, mesh=cpu_mesh())
    return model


def backward(model: nn.Module, step: int) -> None:
    """A forward and backward on this rank's batch for ``step`` (FSDP2 reduce-scatters)."""
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(2, 5, 8, generator=gen)
    model(x).pow(2).mean().backward()


def copy_grads(src: nn.Module, dst: nn.Module) -> None:
    """Give ``dst`` the gradients ``src``'s backward made: the twins are compared on the
    optimizer alone (gloo's reductions need not give two models the same bits)."""
    for p, q in zip(src.parameters(), dst.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()


def local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def assert_same(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ref: nn.Module,
    eager: torch.optim.Optimizer,
    **tolerance: Any,
) -> None:
    """Parameters and every state entry equal (local shards), state of the same kind."""
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(local(p), local(q), **tolerance)
        assert set(opt.state[p]) == set(eager.state[q]), (set(opt.state[p]), set(eager.state[q]))
        for key, value in eager.state[q].items():
            mine = opt.state[p][key]
            assert type(mine) is type(value), (key, type(mine), type(value))
            if hasattr(value, "placements"):
                assert mine.placements == value.placements, (key, mine.placements)
                assert mine.device_mesh == value.device_mesh
            torch.testing.assert_close(local(mine), local(value), **tolerance)


def run_pair(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    steps: int = 5,
    schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    before_step: Callable[[nn.Module], None] | None = None,
    params: Callable[[nn.Module], list[Any]] = lambda m: list(m.parameters()),
) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    model, ref = sharded_model(), sharded_model()
    opt = optcompile.compile(make(params(model)))
    eager = make(params(ref))
    step_pair(model, opt, ref, eager, steps, schedule, before_step)
    assert_same(model, opt, ref, eager)
    return model, opt, ref, eager


def step_pair(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ref: nn.Module,
    eager: torch.optim.Optimizer,
    steps: int,
    schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
    before_step: Callable[[nn.Module], None] | None = None,
) -> None:
    """``steps`` steps of both: the model's backward, its grads copied to the twin."""
    scheds = [schedule(o) for o in (opt, eager)] if schedule else []
    for step in range(steps):
        backward(model, step)
        copy_grads(model, ref)
        for m, o in ((model, opt), (ref, eager)):
            if before_step is not None:
                before_step(m)
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()


class ClippedSGD(torch.optim.Optimizer):
    """SGD on gradients clipped by their global norm inside the step (a reduction over
    every parameter: with DTensor, partial norms all-reduced across ranks)."""

    def __init__(self, params: Any, lr: float = 0.1, max_norm: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "max_norm": max_norm})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            coef = torch.clamp(group["max_norm"] / (norm + 1e-6), max=1.0)
            torch._foreach_add_(params, torch._foreach_mul(grads, coef), alpha=-group["lr"])


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020), per tensor: Adam's bias-corrected update plus weight decay,
    scaled by the trust ratio ||p|| / ||update|| (1 where either norm is 0). On a sharded
    param both norms are partial sums that DTensor's rules all-reduce."""

    def __init__(self, params: Any, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), device=p.device)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m_hat = m / (1 - beta1 ** state["step"])
                v_hat = v / (1 - beta2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm = torch.linalg.vector_norm(p)
                u_norm = torch.linalg.vector_norm(update)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                p.add_(update * trust, alpha=-group["lr"])


class Lars(torch.optim.Optimizer):
    """LARS (You et al. 2017), foreach: SGD with momentum whose step for each tensor is
    scaled by the trust ratio eta * ||p|| / (||g|| + weight_decay * ||p||)."""

    def __init__(self, params: Any, lr=0.1, momentum=0.9, weight_decay=1e-4, eta=1e-3):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eta": eta}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
            weight_decay = group["weight_decay"]
            p_norms = torch._foreach_norm(params)
            g_norms = torch._foreach_norm(grads)
            denominators = torch._foreach_add(g_norms, torch._foreach_mul(p_norms, weight_decay))
            torch._foreach_add_(denominators, 1e-8)
            trust = torch._foreach_div(torch._foreach_mul(p_norms, group["eta"]), denominators)
            updates = torch._foreach_add(grads, params, alpha=weight_decay)
            torch._foreach_mul_(updates, trust)
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, updates)
            torch._foreach_add_(params, bufs, alpha=-group["lr"])


def no_fallback(caught: list[warnings.WarningMessage]) -> None:
    fallbacks = [str(w.message) for w in caught if w.category is optcompile.FallbackWarning]
    assert not fallbacks, fallbacks


def traces(opt: Any) -> int:
    return optcompile.explain(opt).traces


# -- scenarios ----------------------------------------------------------------------------------


def adamw_with_scheduler() -> None:
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1))  # noqa: E731
    _, opt, _, _ = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), schedule=sched)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def adamw_for_loop() -> None:
    _, opt, _, _ = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def sgd_momentum_with_scheduler() -> None:
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5)  # noqa: E731
    _, opt, _, _ = run_pair(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), schedule=sched)
    # (the momentum buffers are made by the first step: one retrace, as for plain tensors)
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons


def custom_lion() -> None:
    _, opt, _, _ = run_pair(lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1))
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons


def adafactor() -> None:
    # Eager Adafactor fails on sharded matrices in torch itself (an in-place pow_ of a
    # partial norm); its vector path (norms, biases) is what eager FSDP2 can run. Its lerp_
    # by a weight read from a tensor goes through DTensor's C++ sharding cache, which
    # compares such weights of two calls (by node: nothing is decided on a value). Its
    # ``param.norm(2).item()`` reads the partial norm of the local shard, in eager DTensor as
    # here (DTensor's rules call for no all-reduce there): compiled equals eager, one trace.
    vectors = lambda m: [p for p in m.parameters() if p.dim() == 1]  # noqa: E731
    for foreach in (False, True):
        make = functools.partial(torch.optim.Adafactor, lr=1e-2, foreach=foreach)
        _, opt, _, _ = run_pair(make, params=vectors)
        assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons
    # On sharded matrices the trace meets eager's own error: a FallbackWarning that names
    # it, then eager raises it.
    errors = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for compiled in (True, False):
            model = sharded_model()
            opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
            backward(model, 0)
            try:
                (optcompile.compile(opt) if compiled else opt).step()
            except RuntimeError as exc:
                errors.append(str(exc).splitlines()[0])
    assert len(errors) == 2 and errors[0] == errors[1], errors
    assert "in-place operations that require placement changes" in errors[0], errors
    fallbacks = [str(w.message) for w in caught if w.category is optcompile.FallbackWarning]
    assert len(fallbacks) == 1 and errors[0] in fallbacks[0], fallbacks


def clip_grad_norm_before_step() -> None:
    clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # noqa: E731
    _, opt, _, _ = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), before_step=clip)
    assert traces(opt) == 1


def global_norm_inside_step() -> None:
    _, opt, _, _ = run_pair(lambda ps: ClippedSGD(ps))
    explanation = optcompile.explain(opt)
    assert "all_reduce" in explanation.graph_code, explanation.graph_code
    assert any("all_reduce" in c for c in explanation.collectives), explanation.collectives
    assert "collectives" in str(explanation)


def assert_collectives(opt: Any, *kinds: str) -> None:
    """explain() lists the collectives DTensor's rules put into the graph, each awaited there
    (a backend hands its result to a kernel: nothing else would wait for it)."""
    explanation = optcompile.explain(opt)
    listed = " ".join(explanation.collectives)
    for kind in kinds:
        assert kind in listed, (kind, explanation.collectives)
    calls = re.findall(r"torch\.ops\._c10d_functional\.(\w+)\.default\(", explanation.graph_code)
    waits = calls.count("wait_tensor")
    assert waits == len(calls) - waits == len(explanation.collectives), calls


def lamb_trust_ratios() -> None:
    # Per tensor (a for-loop): the norms of a sharded param and of its update are partial
    # sums; DTensor all-reduces them where its rules say (here before each use of a norm, as
    # in eager). The state is made in the first step: one retrace, as for plain tensors.
    _, opt, _, _ = run_pair(Lamb, steps=3)
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons
    assert_collectives(opt, "all_reduce(sum)")


def lars_trust_ratios() -> None:
    _, opt, _, _ = run_pair(Lars, steps=3)
    assert traces(opt) == 2, optcompile.explain(opt).retrace_reasons
    assert_collectives(opt, "all_reduce(sum)")


def _matrices(model: nn.Module) -> list[Any]:
    """The model's 2-D parameters (Muon's): tall, wide and square ones."""
    return [p for p in model.parameters() if p.dim() == 2]


def muon_newton_schulz() -> None:
    # torch.optim.Muon over the sharded matrices (Shard(0)): its Newton-Schulz matmuls run
    # through DTensor's matmul rules, which pick the all-gathers and all-reduces.
    make = functools.partial(torch.optim.Muon, lr=1e-2, weight_decay=0.1)
    _, opt, _, _ = run_pair(make, steps=3, params=_matrices)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons
    assert_collectives(opt, "all_reduce(sum)", "all_gather_into_tensor")


def mixed_groups() -> None:
    def make(ps: list[Any]) -> torch.optim.Optimizer:
        torch.manual_seed(1)
        plain = nn.Linear(4, 4)
        for p in plain.parameters():
            p.grad = torch.ones_like(p)
        return torch.optim.AdamW([{"params": ps}, {"params": list(plain.parameters())}])

    def plain_grads(model: nn.Module) -> None:  # (zero_grad drops them each step)
        for o in optimizers:
            for p in o.param_groups[1]["params"]:
                p.grad = torch.ones_like(p)

    optimizers: list[torch.optim.Optimizer] = []
    remember = lambda ps: optimizers.append(make(ps)) or optimizers[-1]  # noqa: E731
    _, opt, _, eager = run_pair(remember, before_step=plain_grads)
    for p, q in zip(opt.param_groups[1]["params"], eager.param_groups[1]["params"], strict=True):
        torch.testing.assert_close(p, q)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def checkpoint_interchange(tmp: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def make(ps: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-2)

    for saver_compiled in (False, True):
        path = os.path.join(tmp, f"ckpt-{saver_compiled}")
        saver, saver_opt = sharded_model(), None
        saver_opt = make(saver.parameters())
        if saver_compiled:
            saver_opt = optcompile.compile(saver_opt)
        for step in range(3):
            backward(saver, step)
            saver_opt.step()
            saver_opt.zero_grad()
        state = {"model": saver.state_dict(), "optim": get_optimizer_state_dict(saver, saver_opt)}
        dcp.save(state, checkpoint_id=path)
        # Load into a fresh pair: one compiled, one eager; both continue from the checkpoint.
        loaded = []
        for compiled in (True, False):
            model = sharded_model(seed=7)
            opt = make(model.parameters())
            if compiled:
                opt = optcompile.compile(opt)
            target = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(target, checkpoint_id=path)
            model.load_state_dict(target["model"])
            set_optimizer_state_dict(model, opt, target["optim"])
            loaded.append((model, opt))
        (model, opt), (ref, eager) = loaded
        for step in range(3, 5):
            backward(model, step)
            copy_grads(model, ref)
            copy_grads(model, saver)
            for o in (opt, eager, saver_opt):
                o.step()
                o.zero_grad()
        assert_same(model, opt, ref, eager)
        assert_same(model, opt, saver, saver_opt)


def checkpoint_reshards_into_a_2d_mesh(tmp: str) -> None:
    # Saved by a compiled FSDP2 run (Shard(0) over both ranks), loaded by DCP into compiled
    # and eager 2-D models (other placements: resharded); both continue equal.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = os.path.join(tmp, "ckpt-reshard")
    saver = sharded_model()
    saver_opt = optcompile.compile(torch.optim.AdamW(saver.parameters(), lr=1e-2))
    for step in range(2):
        backward(saver, step)
        saver_opt.step()
        saver_opt.zero_grad()
    state = {
        "model": get_model_state_dict(saver),
        "optim": get_optimizer_state_dict(saver, saver_opt),
    }
    dcp.save(state, checkpoint_id=path)
    loaded = []
    for compiled in (True, False):
        model = model_2d(seed=7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if compiled:
            opt = optcompile.compile(opt)
        target = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(model, target["model"])
        set_optimizer_state_dict(model, opt, target["optim"])
        loaded.append((model, opt))
    (model, opt), (ref, eager) = loaded
    for p, q in zip(model.parameters(), saver.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq"):
            mine, saved = opt.state[p][key], saver_opt.state[q][key]
            assert mine.placements == p.placements, (key, mine.placements, p.placements)
            torch.testing.assert_close(mine.full_tensor(), saved.full_tensor(), rtol=0, atol=0)
    step_2d([(model, opt), (ref, eager)], range(2, 4))
    assert_same(model, opt, ref, eager)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons


def ddp_unchanged() -> None:
    from torch.nn.parallel import DistributedDataParallel

    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return DistributedDataParallel(Tiny())

    model, ref = make_model(), make_model()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2))
    eager = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step_pair(model, opt, ref, eager, 5)
    assert_same(model, opt, ref, eager)
    assert traces(opt) == 1


def placements_change_retraces() -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    @optcompile.compile
    def scale(xs: list[torch.Tensor], factor: float) -> None:
        torch._foreach_mul_(xs, factor)

    full = torch.arange(8.0).reshape(4, 2)
    for placement in (Shard(0), Shard(0), Replicate()):
        x = distribute_tensor(full.clone(), mesh, [placement])
        scale([x], 0.5)
        torch.testing.assert_close(x.full_tensor(), full * 0.5)
    explanation = optcompile.explain(scale)
    assert explanation.traces == 2, explanation.retrace_reasons
    reason = explanation.retrace_reasons[-1]
    assert "placements" in reason and "Replicate" in reason, reason


def native_checks_catch_dtensor_changes() -> None:
    """The fast tier checks DTensors in C++ (mesh, placements, local tensor of the params,
    their grads and the state): a hit needs no Python per DTensor, and each change in place
    is still caught, with a reason naming it; a new but equal local tensor object at the
    same address keeps the trace."""
    from optguard import native
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    model, opt, ref, eager = run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=3)
    if native.module() is not None:  # (else the same checks run in the tree and Python)
        code = optcompile.explain(opt).check_code
        assert "pinned DTensors keep mesh and placements" in code, code
        assert "their DTensors keep mesh and placements" in code, code
    ps, qs = list(model.parameters()), list(ref.parameters())

    def replicate_in_place(t: Any) -> None:  # the same object, gathered (valid on any world)
        full = t.redistribute(placements=[Replicate()])
        t._spec, t._local_tensor = full._spec, full._local_tensor

    def state_local(o: Any, q: Any) -> None:
        st = o.state[q]["exp_avg"]
        st._local_tensor = st._local_tensor.clone()

    def same_address(o: Any, q: Any) -> None:  # another object, the same storage
        q._local_tensor = q._local_tensor.view_as(q._local_tensor)

    def equal_spec(o: Any, q: Any) -> None:  # another but equal spec (==, not identity)
        g = q.grad
        g._spec = DTensorSpec(g._spec.mesh, tuple(g._spec.placements), g._spec.tensor_meta)

    def param_local(o: Any, q: Any) -> None:
        q._local_tensor = q._local_tensor.clone()

    def grad_placements(o: Any, q: Any) -> None:
        replicate_in_place(q.grad)

    def state_placements(o: Any, q: Any) -> None:
        replicate_in_place(o.state[q]["exp_avg_sq"])

    changes = [
        (state_local, 0, "['exp_avg']._local_tensor: data pointer changed"),
        (same_address, 1, None),
        (equal_spec, 2, None),
        (param_local, 3, "._local_tensor: data pointer changed"),
        (state_placements, 5, "['exp_avg_sq'].placements: value changed"),
        # (last: the next backward's grads would be sharded again, another retrace)
        (grad_placements, 4, ".grad.placements: value changed"),
    ]
    for k, (change, i, reason) in enumerate(changes):
        before = traces(opt)
        backward(model, 10 + k)
        copy_grads(model, ref)
        for o, params in ((opt, ps), (eager, qs)):
            change(o, params[i])
            o.step()
        explanation = optcompile.explain(opt)
        if reason is None:
            assert explanation.traces == before, explanation.retrace_reasons
        else:
            assert explanation.traces == before + 1, (change.__name__, explanation.retrace_reasons)
            assert reason in explanation.retrace_reasons[-1], explanation.retrace_reasons[-1]
        for o in (opt, eager):
            o.zero_grad()
    assert_same(model, opt, ref, eager)


@functools.cache
def mesh_2d() -> Any:
    """ "dp" x "tp" = 1 x 2 over the two ranks (a 2 x 2 mesh would need four processes)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))


def model_2d(seed: int = 0) -> nn.Module:
    """Tiny with each block's MLP split column- then row-wise over "tp", then fully_shard
    over "dp": those params are DTensors with two placements."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = mesh_2d()
    torch.manual_seed(seed)
    model = Tiny()
    for block in model.blocks:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(block.mlp, mesh["tp"], plan)  # type: ignore[arg-type]
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def step_2d(pairs: list[tuple[nn.Module, torch.optim.Optimizer]], steps: range) -> None:
    """Steps of the first model on a batch the same on every rank (tensor parallel
    replicates the input); every other model steps on its gradients."""
    (model, _), *others = pairs
    for step in steps:
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        for other, _ in others:
            copy_grads(model, other)
        for _, o in pairs:
            o.step()
            o.zero_grad()


def fsdp_x_tensor_parallel() -> None:
    model, ref = model_2d(), model_2d()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2))
    eager = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step_2d([(model, opt), (ref, eager)], range(5))
    assert_same(model, opt, ref, eager)
    assert traces(opt) == 1, optcompile.explain(opt).retrace_reasons
    two_d = [p.placements for p in model.parameters() if len(p.placements) == 2]
    assert len(two_d) == 8 and any("Shard(dim=1)" in str(pl) for pl in two_d), two_d


def triton_backend_fuses_like_plain() -> None:
    # backend="triton" (under TRITON_INTERPRET=1 on the CPU): the sharded elementwise step
    # is the plain step over the local shards, so it fuses into the same launches.
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # (test_dtensor.py skips it then)

    def make(ps: list[Any]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)

    model, ref = sharded_model(), sharded_model()
    opt = optcompile.compile(make(list(model.parameters())), backend="triton")
    eager = make(list(ref.parameters()))
    plain = [nn.Parameter(local(p).detach().clone()) for p in model.parameters()]
    plain_opt = optcompile.compile(make(plain), backend="triton")
    for step in range(2):
        backward(model, step)
        copy_grads(model, ref)
        for p, q in zip(plain, model.parameters(), strict=True):
            p.grad = local(q.grad).clone()
        for o in (opt, eager, plain_opt):
            o.step()
            o.zero_grad()
    assert_same(model, opt, ref, eager)
    sharded, flat = optcompile.explain(opt), optcompile.explain(plain_opt)
    assert sharded.fallback_reason is None and "@triton.jit" in sharded.graph_code
    # One generated kernel over every lane (plus the small one that writes the 0-dim step
    # counts back: the step keeps them off the device here), the very kernels of the plain
    # step over the same local shards.
    code = sharded.graph_code
    kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
    assert len([k for k in kernels if "_small(" not in k]) == 1, code[:600]
    assert code == flat.graph_code
    assert sharded.kernel_launches_per_step == flat.kernel_launches_per_step
    assert not sharded.collectives, sharded.collectives
    for p, q in zip(plain, model.parameters(), strict=True):
        torch.testing.assert_close(p, local(q))
    # A global norm inside the step: the norms and their all-reduce (DTensor's rules) run on
    # the torch backend before the kernel; everything elementwise is one kernel.
    optcompile.reset()
    model, ref = sharded_model(), sharded_model()
    opt = optcompile.compile(ClippedSGD(model.parameters()), backend="triton")
    eager = ClippedSGD(ref.parameters())
    step_pair(model, opt, ref, eager, 2)
    assert_same(model, opt, ref, eager)
    explanation = optcompile.explain(opt)
    code = explanation.graph_code
    assert explanation.collectives == ["all_reduce(sum) of pow_tensor_scalar"], explanation
    prelude = code.split("\n", 3)[2]  # the "# partly fused: ..." line names what runs first
    assert prelude.startswith("# partly fused") and "all_reduce" in prelude, code[:800]
    kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
    assert len(kernels) == 1, kernels
    # Trust ratios, per tensor (LARS foreach, LAMB for-loop): each tensor's norms and
    # DTensor's all-reduces of them run in the prelude, each awaited there before the kernel
    # reads it (a kernel takes the result by address); what follows them is one kernel.
    for make in (Lars, Lamb):
        optcompile.reset()
        model, ref = sharded_model(), sharded_model()
        opt = optcompile.compile(make(model.parameters()), backend="triton")
        eager = make(ref.parameters())
        step_pair(model, opt, ref, eager, 2)
        assert_same(model, opt, ref, eager)
        assert_collectives(opt, "all_reduce(sum)")
        code = optcompile.explain(opt).graph_code
        prelude = code.split("\n", 3)[2]
        assert prelude.startswith("# partly fused") and "wait_tensor" in prelude, code[:800]
        kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
        assert len([k for k in kernels if "_small(" not in k]) == 1, kernels
        _assert_prelude_kept_out_of_graphs(opt)
    # Muon (defaults) over the sharded tall, wide and square matrices: the Newton-Schulz
    # matmuls with DTensor's all-gathers and all-reduces (and the momentum they read) run in
    # the prelude; the weight decay and the update, each matrix's lr scaled by its global
    # shape (a number per lane), in one kernel. The same bits as eager.
    optcompile.reset()
    model, ref = sharded_model(), sharded_model()
    opt = optcompile.compile(torch.optim.Muon(_matrices(model), lr=1e-2), backend="triton")
    eager = torch.optim.Muon(_matrices(ref), lr=1e-2)
    step_pair(model, opt, ref, eager, 2)
    assert_same(model, opt, ref, eager, rtol=0, atol=0)
    assert_collectives(opt, "all_reduce(sum)", "all_gather_into_tensor")
    code = optcompile.explain(opt).graph_code
    kernels = [line for line in code.splitlines() if line.startswith("def foreach_")]
    assert len(kernels) == 1 and code.split("\n", 3)[2].startswith("# partly fused"), kernels
    _assert_prelude_kept_out_of_graphs(opt)


def _assert_prelude_kept_out_of_graphs(opt: Any) -> None:
    """A prelude that runs DTensor's collectives is not recorded in a CUDA graph: the
    reason explain() gives on CUDA names the collective."""
    from optcompile.api import _compiled_of
    from optcompile.driver import newest

    entry = newest(_compiled_of(opt))
    assert entry is not None
    reason = entry.plan.plan.prelude_capture_reason()
    assert reason is not None and "collectives are kept out of CUDA graphs" in reason, reason


SCENARIOS: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (
        adamw_with_scheduler,
        adamw_for_loop,
        sgd_momentum_with_scheduler,
        custom_lion,
        adafactor,
        clip_grad_norm_before_step,
        global_norm_inside_step,
        lamb_trust_ratios,
        lars_trust_ratios,
        muon_newton_schulz,
        mixed_groups,
        checkpoint_interchange,
        checkpoint_reshards_into_a_2d_mesh,
        ddp_unchanged,
        placements_change_retraces,
        native_checks_catch_dtensor_changes,
        fsdp_x_tensor_parallel,
        triton_backend_fuses_like_plain,
    )
}


def spawn_ranks(script: str, world_size: int, out: str) -> list[dict[str, str]]:
    """Run ``script rank world_size out`` in one process per rank; each rank's results, as
    its ``main`` wrote them to ``<out>/rank<r>.json``."""
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(world_size), out],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(world_size)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    found = []
    for rank in range(world_size):
        path = os.path.join(out, f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} exited with {codes[rank]} and no results"
        with open(path) as f:
            found.append(json.load(f))
    return found


def init_group(backend: str, rank: int, world_size: int, out: str, seconds: int) -> None:
    """The ranks' process group, met through a file store in ``out``."""
    dist.init_process_group(
        backend,
        init_method=f"file://{os.path.join(out, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=seconds),
    )


def main(rank: int, world_size: int, out: str) -> None:
    os.environ.setdefault("OPTCOMPILE_NATIVE", "0")
    init_group("gloo", rank, world_size, out, 60)

    def checked(name: str, scenario: Callable[..., None]) -> Callable[[], None]:
        def call() -> None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if name.startswith("checkpoint_"):
                    scenario(out)
                else:
                    scenario()
            no_fallback(caught)

        return call

    run_each(rank, out, {name: checked(name, s) for name, s in SCENARIOS.items()})


def run_each(rank: int, out: str, calls: dict[str, Callable[[], None]]) -> None:
    """Run each call on this rank (compile caches reset between them, ranks in step after
    each), write ``{name: "ok" | traceback}`` to ``out/rank{rank}.json`` (what
    ``spawn_ranks`` reads) and end the process group."""
    results: dict[str, str] = {}
    try:
        for name, call in calls.items():
            optcompile.reset()
            try:
                call()
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
