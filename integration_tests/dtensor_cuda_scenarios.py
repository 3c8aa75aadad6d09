"""Steps with reductions over FSDP2 on two GPUs (NCCL), run by test_dtensor_cuda.py in each of
two spawned processes (skipped where fewer than two CUDA devices are).

Each optimizer's compiled step (the defaults) runs beside eager over a twin model on the
rank's GPU: the norms of sharded tensors are partial sums that DTensor's rules all-reduce
across the ranks (Muon's matmuls: all-gathers too), in the graph's prelude, each awaited
there before a Triton kernel reads its result by address (collectives are kept out of CUDA
graphs: such a step runs without one, and explain() says so). ``main`` writes, per
optimizer, "ok" or the error to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import optcompile
import torch
import torch.distributed as dist
from dtensor_setup import (
    ClippedSGD,
    Lamb,
    Lars,
    Tiny,
    assert_collectives,
    assert_same,
    copy_grads,
    init_group,
    run_each,
)
from torch import nn

STEPS = 4
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # the Triton kernels' float rounding

_matrices: Callable[[nn.Module], list[Any]] = lambda m: [  # noqa: E731
    p for p in m.parameters() if p.dim() == 2
]
_all: Callable[[nn.Module], list[Any]] = lambda m: list(m.parameters())  # noqa: E731
# name -> (optimizer over a list of params, which params, traces)
OPTIMIZERS: dict[str, tuple[Callable[[list[Any]], torch.optim.Optimizer], Any, int]] = {
    "LAMB": (lambda ps: Lamb(ps), _all, 2),
    "LARS": (lambda ps: Lars(ps), _all, 2),
    "global norm inside the step": (lambda ps: ClippedSGD(ps), _all, 1),
    "Muon": (functools.partial(torch.optim.Muon, lr=1e-2, weight_decay=0.1), _matrices, 1),
}


def _model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny().cuda()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run(mesh: Any, name: str) -> None:
    make, params, traces = OPTIMIZERS[name]
    model, ref = _model(mesh), _model(mesh)
    opt = optcompile.compile(make(params(model)))
    eager = make(params(ref))
    gen = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            model(torch.randn(2, 5, 8, device="cuda", generator=gen)).pow(2).mean().backward()
            copy_grads(model, ref)
            for o in (opt, eager):
                o.step()
                o.zero_grad()
    fallbacks = [str(w.message) for w in caught if w.category is optcompile.FallbackWarning]
    assert not fallbacks, fallbacks
    assert_same(model, opt, ref, eager, **TOLERANCE)
    explanation = optcompile.explain(opt)
    assert explanation.traces == traces, explanation.retrace_reasons
    assert_collectives(opt, "all_reduce(sum)")
    assert explanation.cudagraph_recordings == 0, explanation.cudagraphs
    assert "collectives are kept out of CUDA graphs" in explanation.cudagraphs


def main(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(rank)
    init_group("nccl", rank, world_size, out, 120)
    mesh = init_device_mesh("cuda", (world_size,))
    run_each(rank, out, {name: functools.partial(run, mesh, name) for name in OPTIMIZERS})


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
