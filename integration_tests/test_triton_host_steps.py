"""backend="triton" with step counts on the host (capturable=False): what depends only on them
is computed there, once for lanes that agree or per lane, and the step matches eager's
(setup: triton_setup.py).
"""

from __future__ import annotations

import io

import numpy as np
import optcompile
import opttrace
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from optkernels.host import scalar_function
from optkernels.host_rows import uniform_values
from optkernels.triton_backend import TritonPlan
from triton_setup import DEVICE, FUSED, SHAPES, _assert_close, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("name", sorted(n for n in FUSED if not n.startswith("SGD")))
def test_step_counts_computed_on_the_host_give_the_same_results(name):
    """capturable=False optimizers on CUDA keep step counts on the CPU: the plan computes
    what depends only on them there (for all lanes at once) and the kernel reads the
    results; forced here on the CPU, the numbers agree with the device-side path's to float32
    rounding (lanes with equal step counts are computed in float64, as eager does)."""
    make = FUSED[name]
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES]
    others = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, other = optcompile.compile(make(params), backend="triton"), make(others)
    plan = None
    for _ in range(3):
        for p, q in zip(params, others, strict=True):
            grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        if plan is None:
            entry = _OPTIMIZERS[opt].cache.entries[0].value
            plan = TritonPlan(entry.traced.graph_module, host_small=True)
            opttrace.init_state(other)
        plan(entry.gather({"opt": other}))
        steps = [other.state[q]["step"] for q in others]
        # The step counts alias one buffer (read and written as one tensor per call)...
        assert len({t.untyped_storage().data_ptr() for t in steps}) == 1
        # ...and one re-pointed in between (same value, new storage) is aliased again.
        steps[1].set_(steps[1].clone())
    assert plan.host and plan.kernel_launches_per_step == 1
    # Only what the kernel reads goes to the device: one row (stride 0) while the lanes agree.
    (part,) = plan.parts
    assert set(part.host_read) <= set(part.host_order)
    for group in part.groups:
        assert group.host_vals is not None and group.host_vals.device == part.device
        assert group.host_vals.numel() == 4 + len(group.lanes) * len(part.host_read)
        assert float(group.host_vals[0]) in (0.0, float(len(part.host_read)))
    _assert_close(params, opt, others, other, rtol=1e-5, atol=1e-6)
    # The aliased step counts save and load as separate values.
    buffer = io.BytesIO()
    torch.save(other.state_dict(), buffer)
    buffer.seek(0)
    fresh = make([torch.nn.Parameter(q.detach().clone()) for q in others])
    fresh.load_state_dict(torch.load(buffer))
    saved = [fresh.state[q]["step"] for q in fresh.param_groups[0]["params"]]
    assert [float(t) for t in saved] == [float(other.state[q]["step"]) for q in others]


def test_host_step_counts_that_differ_between_lanes_match_eager():
    """Lanes whose step counts differ (a param whose state was reset) take the per-lane
    numpy path instead of the uniform one; either way the step matches eager's."""
    make = FUSED["Adam"]
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES]
    copies = [[torch.nn.Parameter(p.detach().clone()) for p in params] for _ in range(2)]
    opt = optcompile.compile(make(params), backend="triton")
    other, eager = make(copies[0]), make(copies[1])
    plan = None
    for step in range(4):
        for p, q, r in zip(params, *copies, strict=True):
            grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            p.grad, q.grad, r.grad = grad, grad.clone(), grad.clone()
        opt.step()
        if plan is None:
            entry = _OPTIMIZERS[opt].cache.entries[0].value
            plan = TritonPlan(entry.traced.graph_module, host_small=True)
            opttrace.init_state(other)
        if step == 2:  # lane 1 counts from 10 from now on, in both
            for o in (other, eager):
                o.state[o.param_groups[0]["params"][1]]["step"].fill_(10.0)
        plan(entry.gather({"opt": other}))
        eager.step()
    steps = [float(other.state[q]["step"]) for q in copies[0]]
    assert steps[1] == 12.0 and steps[0] == 4.0
    (part,) = plan.parts
    for group in part.groups:  # one row per lane now: the row stride is the row's length
        assert float(group.host_vals[0]) == len(part.host_read) > 0
    _assert_close(copies[0], other, copies[1], eager, rtol=1e-5, atol=1e-6)


def test_uniform_host_arithmetic_agrees_with_per_lane_and_refuses_what_python_cannot():
    """The uniform (Python float) and per-lane (numpy float32) forms of the host arithmetic
    give the same values; where Python raises (1 - beta1 ** step == 0 with beta1 = 1), the
    uniform form raises and the per-lane one gives torch's inf."""
    make = FUSED["Adam"]
    params = [torch.nn.Parameter(torch.randn(s).to(DEVICE)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = optcompile.compile(make(params), backend="triton")
    opt.step()
    entry = _OPTIMIZERS[opt].cache.entries[0].value
    plan = TritonPlan(entry.traced.graph_module, host_small=True)
    inputs = entry.gather({"opt": opt})
    plan(inputs)
    part = plan.parts[0]
    group = part.groups[0]
    scalars = scalar_function(part.program, part.index)(inputs)
    lanes = len(group.lanes)
    views = {k: b.cpu().numpy() for k, b in group.small_buffers.items()}  # CPU or CUDA steps
    every, one_fn = part._host_fns[tuple(group.lanes)]
    assert one_fn is not None
    per_lane = every(views, scalars, lanes)
    one = {k: float(v[0]) for k, v in views.items()}
    uniform = one_fn(one, scalars, 1)
    for var in part.host_order:  # float32's 1 - 0.999 ** step loses ~1e-5 to cancellation
        np.testing.assert_allclose(per_lane[var], np.full(lanes, uniform[var]), rtol=5e-5)
    assert uniform_values(one_fn, views, scalars) == uniform  # what a call takes
    uneven = {k: v.copy() for k, v in views.items()}
    for v in uneven.values():
        v[1] += 1
    assert uniform_values(one_fn, uneven, scalars) is None  # lanes differ: per lane
    opt.param_groups[0]["betas"] = (1.0, 0.999)
    scalars = scalar_function(part.program, part.index)(entry.gather({"opt": opt}))
    with pytest.raises(ZeroDivisionError):
        one_fn(one, scalars, 1)
    assert uniform_values(one_fn, views, scalars) is None
    with np.errstate(all="ignore"):
        per_lane = every(views, scalars, lanes)
    assert any(np.isinf(per_lane[var]).all() for var in part.host_order)
