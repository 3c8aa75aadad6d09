"""A compiled optimizer stepped beside an eager one over copies of the same params, and
their comparison: what the backend tests (test_cpu_backend.py, test_host_values.py) share.
"""

from __future__ import annotations

import optcompile
import torch
from optcompile.testing import assert_within_ulps

# Tolerance in ulps of each tensor's dtype, at the scale of its largest value: per-op
# rounding as ATen's, but fused multiply-adds where ATen's CPU kernels round the product
# (and the other way round), an ulp now and then that a later op can grow.
ULPS = {torch.float32: 64, torch.float64: 64, torch.bfloat16: 4, torch.float16: 8}


def step_both(params, opt, reference, eager, steps, gen, dtype=torch.float32, after=None):
    """``steps`` steps of both optimizers, each param and its reference given the same
    random grad (drawn from ``gen``, on the param's device) before each; ``after()`` after
    each step of both."""
    for _ in range(steps):
        for p, q in zip(params, reference, strict=True):
            grad = torch.randn(p.shape, generator=gen).to(p.device, dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        eager.step()
        if after is not None:
            after()


def step_sharing_a_grad(params, opt, reference, eager, gen, steps=3):
    """``steps`` steps of both optimizers over three params: the first two given one grad
    tensor (the trace reads it once), the third its own (drawn in its shape and dtype)."""
    last = params[2]
    for _ in range(steps):
        shared = torch.randn(3, generator=gen).to(last.device)
        own = torch.randn(last.shape, generator=gen, dtype=last.dtype).to(last.device)
        for group in (params, reference):
            group[0].grad, group[1].grad, group[2].grad = shared, shared, own.clone()
        opt.step()
        eager.step()


def compiled_and_eager(make, params, reference, backend):
    """``make``'s optimizer over ``params`` compiled on ``backend``, and over ``reference``."""
    return optcompile.compile(make(params), backend=backend), make(reference)


def reloaded(make, params, reference, backend, opt, eager):
    """Fresh optimizers of both sides, each loading the other's state dict (torch.optim
    casts what it loads to the params' dtypes)."""
    saved, eager_saved = opt.state_dict(), eager.state_dict()
    opt, eager = compiled_and_eager(make, params, reference, backend)
    opt.load_state_dict(eager_saved)
    eager.load_state_dict(saved)
    return opt, eager


def steps_as_eager(make, params, reference, backend, steps, gen):
    """``steps`` steps of both sides, compiled (no fallback) and matching eager."""
    opt, eager = compiled_and_eager(make, params, reference, backend)
    step_both(params, opt, reference, eager, steps, gen)
    assert optcompile.explain(opt).fallback_reason is None
    assert_matches_eager(params, opt, reference, eager, torch.float32)


def assert_matches_eager(params, opt, reference, eager, dtype, ulps=None):
    for p, q in zip(params, reference, strict=True):
        assert_within_ulps(p, q, ulps or ULPS[dtype])
        assert opt.state[p].keys() == eager.state[q].keys()
        for key, value in eager.state[q].items():
            if torch.is_tensor(value):
                assert opt.state[p][key].dtype == value.dtype, key
                assert_within_ulps(opt.state[p][key], value, ulps or ULPS.get(value.dtype, 0))
            else:
                assert opt.state[p][key] == value, key
