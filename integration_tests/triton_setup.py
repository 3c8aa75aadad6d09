"""What the Triton backend's integration tests share (test_triton_backend.py and the
test_triton_*.py files beside it): the device, odd parameter shapes, the optimizers whose steps
fuse, and a compiled optimizer stepped beside eager, compared, and its plan.
"""

from __future__ import annotations

import os

import optcompile
import pytest
import torch
from optkernels.triton_backend import TritonPlan

optim = torch.optim
# The kernels run on a CUDA device, or on the CPU under Triton's interpreter.
TRITON_RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not TRITON_RUNS, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1,), (7,), (1000,), (4097,), (), (3, 5)]
# On CUDA, capturable=True keeps step counts on the device, where the kernels read them
# (capturable=False keeps them on the CPU: that graph runs on the torch backend).
CAP = {"capturable": True} if DEVICE == "cuda" else {}

FUSED = {
    "Adam": lambda ps: optim.Adam(ps, lr=1e-2, foreach=True, **CAP),
    "AdamW weight decay": lambda ps: optim.AdamW(
        ps, lr=1e-2, foreach=True, weight_decay=0.1, **CAP
    ),
    "AdamW amsgrad maximize": lambda ps: optim.AdamW(
        ps, lr=1e-2, foreach=True, amsgrad=True, maximize=True, **CAP
    ),
    "NAdam": lambda ps: optim.NAdam(ps, lr=1e-2, foreach=True, **CAP),
    "Adamax": lambda ps: optim.Adamax(ps, lr=1e-2, foreach=True, **CAP),
    "Adadelta": lambda ps: optim.Adadelta(ps, foreach=True, **CAP),
    "RMSprop centered momentum": lambda ps: optim.RMSprop(
        ps, lr=1e-2, foreach=True, centered=True, momentum=0.5, **CAP
    ),
    "SGD nesterov": lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
    "ASGD": lambda ps: optim.ASGD(ps, lr=1e-2, foreach=True, **CAP),
}
FUSED["RAdam"] = lambda ps: optim.RAdam(ps, lr=1e-2, foreach=True, **CAP)
FUSED["Rprop"] = lambda ps: optim.Rprop(ps, lr=1e-2, foreach=True, **CAP)
FUSED["Adagrad"] = lambda ps: optim.Adagrad(ps, lr=1e-2, foreach=True)


LOOP_FUSED = {
    "Adam": lambda ps: optim.Adam(ps, lr=1e-2, foreach=False, **CAP),
    "AdamW weight decay": lambda ps: optim.AdamW(
        ps, lr=1e-2, foreach=False, weight_decay=0.1, **CAP
    ),
    "AdamW amsgrad maximize": lambda ps: optim.AdamW(
        ps, lr=1e-2, foreach=False, amsgrad=True, maximize=True, **CAP
    ),
    "NAdam": lambda ps: optim.NAdam(ps, lr=1e-2, foreach=False, **CAP),
    "RAdam": lambda ps: optim.RAdam(ps, lr=1e-2, foreach=False, **CAP),
    "Adamax": lambda ps: optim.Adamax(ps, lr=1e-2, foreach=False, **CAP),
    "SGD nesterov": lambda ps: optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, foreach=False),
    # Its step reads ``-clr`` back as a Python number (.item()): the read stays a lane value.
    "Adagrad lr decay": lambda ps: optim.Adagrad(
        ps, lr=1e-2, lr_decay=0.01, weight_decay=0.1, foreach=False
    ),
}


def _run(make, dtype=torch.float32, steps=3):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE, dtype)) for s in SHAPES]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(make(params), backend="triton")
    eager = make(reference)
    for _ in range(steps):
        for p, q in zip(params, reference, strict=True):
            grad = torch.randn(p.shape, generator=gen).to(DEVICE, dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        eager.step()
    return params, opt, reference, eager


def _assert_close(params, opt, reference, eager, **tolerance):
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p, q, **tolerance)
        for key, value in eager.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, **tolerance)


def _plan(opt):
    from optcompile.api import _compiled_of
    from optcompile.driver import newest

    entry = newest(_compiled_of(opt))
    assert entry is not None
    plan = _unwrap(entry.plan)
    assert isinstance(plan, TritonPlan)
    return plan


def _unwrap(plan):
    """The backend's plan inside optcompile's CUDA-graph wrapper."""
    return getattr(plan, "plan", plan)
