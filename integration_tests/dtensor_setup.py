"""The parts the sharded-training scenarios share: a small FSDP2 (``fully_shard``) transformer
on a CPU mesh (and a 2-D "dp" x "tp" one), eager-vs-compiled stepping and comparison, user-style
optimizers with reductions (LAMB, LARS, a clipped SGD), and the harness that spawns one process
per rank and collects each rank's results (dtensor_scenarios.py, dtensor_cuda_scenarios.py).
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
