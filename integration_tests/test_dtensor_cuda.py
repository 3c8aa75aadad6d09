"""FSDP2 on a CUDA device (skipped elsewhere; runs on the GPU machine): NCCL, world size 1 in
this process, ``fully_shard`` on a small transformer on the device.

The compiled step with the defaults (backend "auto": Triton kernels, CUDA graphs) runs over
fresh DTensor gradients from a real backward each step; it matches eager (every param and
state shard, within the Triton backend's float rounding as in test_triton_backend.py), traces
as often as the plain compiled step, and launches what the plain compiled step launches over
the same local shards (which it also matches). On two GPUs, steps with reductions (LAMB,
LARS, a global norm, Muon) over NCCL, world size 2, in spawned processes
(dtensor_cuda_scenarios.py): DTensor's collectives in the graph, each awaited there before a
kernel reads its result; parity with eager.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dtensor_cuda_scenarios
import dtensor_setup
import optcompile
import pytest
import torch
import torch.distributed as dist
from dtensor_setup import Lamb, Lars, Tiny, assert_same, copy_grads, local
from step_optimizers import Lion
from torch import nn

DEVICE, BACKEND = "cuda", "nccl"
STEPS = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA device and NCCL",
)

optim = torch.optim
# name -> (optimizer over a list of params, traces: 2 where the step makes its state)
OPTIMIZERS: dict[str, tuple[Callable[[list[Any]], torch.optim.Optimizer], int]] = {
    "AdamW": (lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.1), 1),
    "AdamW capturable": (lambda ps: optim.AdamW(ps, lr=1e-2, capturable=True), 1),
    "SGD momentum": (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), 2),
    "Lion": (lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1), 2),
    # Trust ratios: the norms run before the kernel (on one rank DTensor all-reduces nothing)
    "LAMB": (lambda ps: Lamb(ps), 2),
    "LARS": (lambda ps: Lars(ps), 2),
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group(BACKEND, store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh(DEVICE, (1,))
    finally:
        dist.destroy_process_group()


def _model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny().to(DEVICE)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_step_on_the_device_matches_eager_and_launches_like_the_plain_step(
    mesh: Any, name: str
) -> None:
    make, traces = OPTIMIZERS[name]
    model, ref = _model(mesh), _model(mesh)
    opt = optcompile.compile(make(list(model.parameters())))
    eager = make(list(ref.parameters()))
    plain = [nn.Parameter(local(p).detach().clone()) for p in model.parameters()]
    plain_opt = optcompile.compile(make(plain))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for _ in range(STEPS):
        x = torch.randn(2, 5, 8, device=DEVICE, generator=gen)
        model(x).pow(2).mean().backward()
        copy_grads(model, ref)
        for p, q in zip(plain, model.parameters(), strict=True):
            p.grad = local(q.grad).clone()
        for o in (opt, eager, plain_opt):
            o.step()
            o.zero_grad()
    assert_same(model, opt, ref, eager, **TOLERANCE)
    for p, q in zip(plain, model.parameters(), strict=True):
        torch.testing.assert_close(p, local(q), **TOLERANCE)
    sharded, flat = optcompile.explain(opt), optcompile.explain(plain_opt)
    assert sharded.fallback_reason is None, sharded.fallback_reason
    assert sharded.traces == flat.traces == traces, sharded.retrace_reasons
    assert "@triton.jit" in sharded.graph_code
    assert sharded.kernel_launches_per_step == flat.kernel_launches_per_step
    assert not sharded.collectives
    # One rank: no collective, so a step with a prelude (LAMB, LARS) is recorded with it.
    assert sharded.cudagraph_recordings == flat.cudagraph_recordings == 1, sharded.cudagraphs


@pytest.fixture(scope="module")
def two_gpu_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    out = str(tmp_path_factory.mktemp("dtensor_cuda"))
    return dtensor_setup.spawn_ranks(dtensor_cuda_scenarios.__file__, 2, out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("name", sorted(dtensor_cuda_scenarios.OPTIMIZERS))
def test_steps_with_reductions_over_two_gpus_match_eager(
    two_gpu_results: list[dict[str, str]], name: str
) -> None:
    for rank, by_name in enumerate(two_gpu_results):
        outcome = by_name.get(name, "did not run")
        assert outcome == "ok", f"rank {rank}:\n{outcome}"
