"""backend="triton": foreach steps fused into generated Triton kernels, compared with eager.

On CPU the kernels run under TRITON_INTERPRET=1 (the test sessions set it); on a CUDA
machine they run on the device. Sizes are odd on purpose (1, 7, 1000, 4097 elements and a
0-dim parameter): blocks straddle tensor ends. The capturable path is traced for the kernels,
so results match eager within float rounding, not bitwise.
"""

from __future__ import annotations

import io
import os

import numpy as np
import optcompile
import opttrace
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from optkernels._triton_compat import launch_signature
from optkernels.host import scalar_function
from optkernels.triton_backend import LAUNCH_SIGNATURES, TritonPlan
from step_optimizers import (
    ClippedAdam,
    CountedClippedMomentum,
    DecayMatricesOnly,
    ForeachLamb,
    MaskedTrust,
    ScaledByAConstant,
    SophiaLike,
    StepScaledTrustSGD,
    TrustRatioSGD,
)

optim = torch.optim
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
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


# A reduction inside the step: the kernels are elementwise only, so the norms (and what they
# depend on) run on the torch backend first; the rest is one kernel.
PARTLY_FUSED = {
    "trust ratio (for-loop)": (TrustRatioSGD, "aten.linalg_vector_norm.default", 0),
    "LAMB (foreach)": (ForeachLamb, "aten._foreach_norm.Scalar", 1),
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


@pytest.mark.parametrize("name", sorted(FUSED))
def test_foreach_step_runs_as_at_most_two_launches_and_matches_eager(name):
    params, opt, reference, eager = _run(FUSED[name])
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    assert 1 <= report.kernel_launches_per_step <= 2, report.graph_code[:500]
    assert "@triton.jit" in report.graph_code


@pytest.mark.parametrize("name", sorted(PARTLY_FUSED))
def test_an_op_the_kernels_cannot_take_runs_on_the_torch_backend_inside_the_plan(name):
    cls, op, writes = PARTLY_FUSED[name]
    params, opt, reference, eager = _run(cls)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    code = report.graph_code
    assert f"# partly fused: {op} not an op the kernel generator knows" in code
    assert "@triton.jit" in code
    plan = _plan(opt)
    assert plan.split is not None and len(plan.split.writes) == 6 * writes
    # The reductions run on the torch backend; everything elementwise is one kernel.
    assert len(plan.groups) == 1
    unfused = plan.prelude.kernel_launches_per_step
    assert plan.kernel_launches_per_step == unfused + 1 + writes
    if DEVICE == "cuda":  # recorded with its prelude: one graph launch, and beside it the
        # copy of the grads the prelude reads and the deferred writes
        assert report.cudagraph_recordings == 1, report.cudagraphs
        assert report.kernel_launches_per_step == 1 + 1 + writes
    else:
        assert report.kernel_launches_per_step == plan.kernel_launches_per_step


def test_a_graph_that_is_not_one_program_per_tensor_runs_wholly_on_the_torch_backend():
    params, opt, reference, eager = _run(DecayMatricesOnly)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    code = optcompile.explain(opt).graph_code
    assert code.startswith("# not fused (the per-tensor op sequences differ between parameters)")
    assert "the torch backend runs this graph" in code
    assert _plan(opt).split is None


@pytest.mark.parametrize("make", [StepScaledTrustSGD, lambda ps: optim.Adafactor(ps, lr=0.1)])
def test_a_value_read_from_a_tensor_that_an_unfused_op_needs_runs_with_it(make):
    # The norm runs before the kernel (or the whole graph on the torch backend): the scalar
    # math it reads, and the tensor read under that, go with it.
    params, opt, reference, eager = _run(make)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    assert optcompile.explain(opt).fallback_reason is None


@pytest.mark.parametrize(
    "options",
    [{}, {"nesterov": False, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}],
    ids=["defaults", "rms-matched"],
)
def test_muon_runs_its_matmuls_first_and_its_tail_over_every_shape_in_one_launch(options):
    # Muon over a tall, a wide and a square matrix: the Newton-Schulz matmuls (and the
    # momentum and nesterov lerps they read) run on the torch backend first; the weight decay
    # and the update, whose lr Muon scales by each matrix's shape (a Python number per
    # shape: each lane reads its own from the host), run in one kernel for all three. The
    # tall matrix's update comes back transposed from the matmuls: the plan lays it out like
    # its parameter. The same bits as eager: the same ATen ops first, then eager's own
    # per-element arithmetic (one rounding of p * (1 - lr * wd), one fused add).
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 6), (3, 8), (5, 5)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def make(ps):
        return optim.Muon(ps, lr=1e-2, **options)

    opt, eager = optcompile.compile(make(params), backend="triton"), make(reference)
    for _ in range(3):
        for p, q in zip(params, reference, strict=True):
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            q.grad = p.grad.clone()
        opt.step()
        eager.step()
    _assert_close(params, opt, reference, eager, rtol=0, atol=0)
    plan = _plan(opt)
    assert plan.split is not None and plan.layouts  # partly fused, with results laid out
    (part,) = plan.parts
    assert part.program.lanes == 3 and len(part.groups) == 1
    report = optcompile.explain(opt)
    assert report.graph_code.count("@triton.jit") == 1
    writes = 1  # the momentum buffers, which the matmuls read, written after the kernel
    relaid = 1  # the tall matrix's update, laid out like its parameter before the kernel
    prelude = plan.prelude.kernel_launches_per_step
    assert plan.kernel_launches_per_step == prelude + relaid + 1 + writes
    if DEVICE == "cuda":  # the third call was recorded (the second traced again: momentum)
        # One graph launch (the prelude, the layout and the kernel in it), and beside it the
        # copy of the grads the prelude reads and the deferred writes.
        assert report.cudagraph_recordings == 1, report.cudagraphs
        assert report.kernel_launches_per_step == 1 + 1 + writes
    else:
        assert report.kernel_launches_per_step == plan.kernel_launches_per_step
    assert "lays out 1 of their results like their params (1 launch(es))" in report.graph_code
    picks = [op for op in part.program.ops if op.op == "pick"]
    assert len(picks) == 1  # each lane's -lr * its shape's scale


def test_a_for_loop_step_over_groups_with_their_own_hyperparameters_is_one_kernel():
    # Each group's lr and momentum are scalars of their own: a lane reads its group's, as a
    # number the host gathers per lane, so the lanes of both groups share one kernel.
    def make(ps):
        groups = [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.05, "momentum": 0.5}]
        return optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True, foreach=False)

    params, opt, reference, eager = _run(make)
    _assert_close(params, opt, reference, eager, rtol=1e-6, atol=1e-7)
    report = optcompile.explain(opt)
    assert report.kernel_launches_per_step == 1 and report.graph_code.count("@triton.jit") == 1
    assert _plan(opt).host  # (the lanes' numbers: one row of host values per lane)


def test_a_grad_laid_out_unlike_its_param_runs_on_the_torch_backend_and_matches():
    # The kernels read a lane's tensors at the same offsets: a transposed grad next to a
    # row-major param would pair the wrong elements.
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 5, generator=gen).to(DEVICE)) for _ in range(2)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def make(ps):
        return optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)

    opt, eager = optcompile.compile(make(params), backend="triton"), make(reference)
    for _ in range(2):
        for p, q in zip(params, reference, strict=True):
            p.grad = torch.randn(5, 3, generator=gen).to(DEVICE).t()  # strides (1, 3)
            q.grad = p.grad.clone()
        opt.step()
        eager.step()
    _assert_close(params, opt, reference, eager)
    code = optcompile.explain(opt).graph_code
    assert "do not share one dense memory layout" in code
    assert "the torch backend runs this graph" in code


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


def test_new_grad_tensors_each_step_update_the_address_table_only():
    params, opt, *_ = _run(FUSED["Adam"], steps=2)
    plan = _unwrap(_OPTIMIZERS[opt].cache.entries[0].value.plan)
    tables = dict(plan._tables)
    (group,) = plan.groups
    static = group.ptrs
    uploads = group.table_uploads
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert plan._tables == tables  # block tables are built once, from shapes
    assert group.ptrs is static  # params and state did not move: their table stays
    assert group.table_uploads == uploads + 1  # the grads' table only
    opt.step()
    assert group.table_uploads == uploads + 1  # same grads: nothing uploaded
    assert _OPTIMIZERS[opt].stats.traces == 1


def test_the_buffers_version_stands_while_every_buffer_stays_and_moves_when_one_is_replaced():
    """A CUDA graph's static inputs (``buffers()``) are compared only when this count moves
    (optcompile.cudagraphs): new grads rewrite their table in place, which keeps it."""
    params, opt, *_ = _run(FUSED["Adam"], steps=2)
    plan = _unwrap(_OPTIMIZERS[opt].cache.entries[0].value.plan)
    version, buffers = plan.buffers_version, plan.buffers()
    for p in params:
        p.grad = torch.ones_like(p)  # new addresses: the grads' table is rewritten
    opt.step()
    opt.step()
    assert plan.buffers_version == version
    assert [b.data_ptr() for b in plan.buffers()] == [b.data_ptr() for b in buffers]
    (group,) = plan.groups
    group.dptrs = None  # as when a table must grow: the next call makes a new buffer
    opt.step()
    assert plan.buffers_version != version
    assert any(a is not b for a, b in zip(plan.buffers(), buffers, strict=True))


def test_a_param_moved_to_new_storage_is_seen_by_the_kernel():
    """``p.data = ...`` keeps the object but moves its address: the entry's data-pointer
    guards (tested on every hit, by either tier) reject the call, so the kernel never reads
    through the old address table; the new trace bakes the new addresses in."""
    params, opt, reference, eager = _run(FUSED["AdamW weight decay"], steps=2)
    entry = _OPTIMIZERS[opt].cache.entries[0].value
    first, inputs = _unwrap(entry.plan), entry.gather({"opt": opt})
    # The plan compares only the static addresses no guard tests: 0-dim CPU step counts.
    checked = first.groups[0].static.compared
    assert all(inputs[i].dim() == 0 and not inputs[i].is_cuda for i in checked)
    assert len(checked) < sum(i >= 0 for i in first.groups[0].static_slots)
    for p, q in zip(params, reference, strict=True):
        p.data = p.data.clone()
        opt.state[p]["exp_avg"].data = opt.state[p]["exp_avg"].data.clone()
        grad = torch.full_like(p, 0.25)
        p.grad, q.grad = grad, grad.clone()
    opt.step()
    eager.step()
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.traces == 2 and "data pointer" in report.retrace_reasons[0]
    assert _unwrap(_OPTIMIZERS[opt].cache.entries[0].value.plan) is not first


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


@pytest.mark.parametrize("name", sorted(LOOP_FUSED))
def test_for_loop_steps_fuse_into_one_kernel_too(name):
    """A for-loop step is the same op sequence once per parameter: its independent
    per-parameter components become the kernel's lanes, as the foreach lists do."""
    params, opt, reference, eager = _run(LOOP_FUSED[name])
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert 1 <= report.kernel_launches_per_step <= 2, report.graph_code[:300]
    assert "@triton.jit" in report.graph_code


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


def test_param_groups_of_different_sizes_fuse_group_by_group():
    """Decay and no-decay groups run one set of foreach ops each, over lists of different
    lengths: each group becomes its own lane program (its own kernel)."""

    def make(ps):
        return optim.AdamW(
            [{"params": ps[:4], "weight_decay": 0.1}, {"params": ps[4:], "weight_decay": 0.0}],
            lr=1e-2,
            foreach=True,
            **CAP,
        )

    params, opt, reference, eager = _run(make)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    plan = _unwrap(_OPTIMIZERS[opt].cache.entries[0].value.plan)
    assert [part.program.lanes for part in plan.parts] in ([4, 2], [2, 4])
    assert optcompile.explain(opt).kernel_launches_per_step <= 4


@pytest.mark.parametrize("foreach", [True, False])
def test_empty_groups_and_params_without_grads_fuse_the_rest(foreach):
    """A group with no params, and a group whose params have no grads, add no lanes."""

    def make(ps):
        return optim.AdamW(
            [{"params": ps[:4]}, {"params": []}, {"params": ps[4:], "lr": 0.1}],
            lr=1e-2,
            foreach=foreach,
            **CAP,
        )

    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in SHAPES]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, eager = optcompile.compile(make(params), backend="triton"), make(reference)
    for _ in range(3):
        for p, q in zip(params[:4], reference[:4], strict=True):
            grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        eager.step()
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    assert all(not opt.state[p] for p in params[4:])
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and 1 <= report.kernel_launches_per_step <= 2


def test_a_step_without_any_grad_launches_nothing():
    opt = optcompile.compile(optim.AdamW([torch.nn.Parameter(torch.ones(3))]), backend="triton")
    opt.step()
    report = optcompile.explain(opt)
    assert report.kernel_launches_per_step == 0
    assert report.graph_code.startswith("# no tensor work")


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
    assert part._uniform_host_values(one_fn, views, scalars) == uniform  # what a call takes
    uneven = {k: v.copy() for k, v in views.items()}
    for v in uneven.values():
        v[1] += 1
    assert part._uniform_host_values(one_fn, uneven, scalars) is None  # lanes differ: per lane
    opt.param_groups[0]["betas"] = (1.0, 0.999)
    scalars = scalar_function(part.program, part.index)(entry.gather({"opt": opt}))
    with pytest.raises(ZeroDivisionError):
        one_fn(one, scalars, 1)
    assert part._uniform_host_values(one_fn, views, scalars) is None
    with np.errstate(all="ignore"):
        per_lane = every(views, scalars, lanes)
    assert any(np.isinf(per_lane[var]).all() for var in part.host_order)


@pytest.mark.parametrize("kind", ["native", "torch"])
def test_address_checks_see_a_moved_input_through_either_kind(kind, monkeypatch):
    """An address table's check (optkernels.addresses) with optguard's C++ loops handed in
    and with torch's compare: the same answers."""
    from optguard import native
    from optkernels import addresses

    module = native.start(wait=True) if kind == "native" else None
    if kind == "native" and module is None:
        pytest.skip(f"native checks: {native.status()}")
    monkeypatch.setattr(addresses, "_native", module)
    inputs = [torch.randn(3), 2.0, torch.randn(4), torch.randn(5)]
    check = addresses.AddressCheck([0, -1, 2, 3], checked={0, 2})
    assert check.compared == [0, 2]
    assert not check.equal(inputs)  # nothing recorded
    ptrs = check.record(inputs)
    assert ptrs == [inputs[0].data_ptr(), 0, inputs[2].data_ptr(), inputs[3].data_ptr()]
    assert check.equal(inputs) and check.equal(tuple(inputs))
    assert check.equal([*inputs[:3], torch.randn(5)])  # position 3 is not compared
    inputs[2].set_(torch.randn(4))  # the same object at a new address
    assert not check.equal(inputs)
    check.record(inputs)
    assert check.equal(inputs)
    other = "torch" if kind == "native" else "native"
    monkeypatch.setattr(addresses, "_native", module if other == "native" else None)
    if module is not None:  # recorded by the other kind: not trusted until recorded again
        assert not check.equal(inputs)
        check.record(inputs)
        assert check.equal(inputs)


def test_a_0dim_tensor_made_in_the_step_is_a_constant_of_the_kernel():
    """torch.tensor(...) inside a step is a constant of the graph (a get_attr node): it
    crashed the lane builder (KeyError), then the torch backend handed it over (a prelude,
    no CUDA graph); a 0-dim float one is now a constant of the kernel: one launch."""
    params, opt, reference, eager = _run(lambda ps: ScaledByAConstant(ps, lr=0.1))
    _assert_close(params, opt, reference, eager, rtol=1e-6, atol=1e-7)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and "@triton.jit" in report.graph_code
    assert "partly fused" not in report.graph_code and report.kernel_launches_per_step == 1


@pytest.mark.parametrize(
    ("make", "launches"), [(SophiaLike, 1), (MaskedTrust, None)], ids=["clamp", "bool"]
)
def test_one_sided_clamps_and_bool_lane_inputs_fuse(make, launches):
    """``clamp`` without a bound used to stop fusion ("constant None as an operand"), and a
    bool a prelude computes ("dtype torch.bool of a lane input") sent the whole graph to
    the torch backend."""
    params, opt, reference, eager = _run(make)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and "@triton.jit" in report.graph_code
    if launches is not None:
        assert report.kernel_launches_per_step == launches
    else:
        assert "partly fused" in report.graph_code


def test_a_coefficient_all_lanes_share_is_computed_by_the_prelude_and_the_rest_fused():
    """The clip coefficient (scalar tensor work on the global norm) used to stop fusion of
    the whole step ("cannot be an argument of a per-item op"): the prelude computes it now,
    and the update is one kernel."""
    params, opt, reference, eager = _run(ClippedAdam)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and "@triton.jit" in report.graph_code
    assert "partly fused" in report.graph_code
    # the norms, the stack, the global norm and four scalar ops, then one kernel
    assert report.kernel_launches_per_step <= 8


@pytest.mark.parametrize("name", ["NAdam", "Adamax"])
def test_one_zero_dim_float16_param_on_the_eager_path_is_one_lane(name):
    """float16 with capturable=False traces eager's own path (Python arithmetic on .item()
    values). With one 0-dim param its single lane took a step count's .item() for a scalar
    input: KeyError '_local_scalar_dense_default' (the differential test found it); then the
    torch backend ran it; now that arithmetic is the lane's, computed on the host."""
    gen = torch.Generator().manual_seed(0)
    value = torch.randn((), generator=gen).to(DEVICE, torch.float16)
    p, q = torch.nn.Parameter(value.clone()), torch.nn.Parameter(value.clone())
    make = getattr(optim, name)
    opt = optcompile.compile(make([p], lr=1e-2, foreach=False), backend="triton", fullgraph=True)
    eager = make([q], lr=1e-2, foreach=False)
    for _ in range(3):
        grad = torch.randn((), generator=gen).to(DEVICE, torch.float16)
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        eager.step()
    code = optcompile.explain(opt).graph_code
    if DEVICE == "cpu":
        assert code.startswith("# 1 kernel launch(es) per step")
    else:  # only 0-dim tensors, the param on the GPU and its step count on the CPU: nothing
        # to fuse, and the plan says why it runs on the torch backend
        assert code.startswith("# not fused (its tensors live on several devices")
    _assert_close([p], opt, [q], eager, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize(
    "dtypes",
    [("bfloat16", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16")],
    ids="-".join,
)
@pytest.mark.parametrize("shapes", [((), ()), ((3,), ())], ids=["0-dim", "mixed"])
def test_rprop_sign_test_per_lane_dtype_matches_eager(dtypes, shapes):
    """Rprop's foreach path sets each sign tensor to etaminus and then tests sign ==
    etaminus. ATen casts the scalar to the comparison's dtype (0.4 is 0.400390625 in
    bfloat16), and each lane's scalar_tensor(eta) has its lane's dtype: a bfloat16 lane
    compared in float32, and a float32 lane given the bfloat16 lane's eta, took the wrong
    side (the differential test found it: 0-dim float32 + bfloat16). With only 0-dim
    params on a GPU (their step counts on the CPU) there is nothing to fuse: the plan says
    why the torch backend runs it, and the values must still be eager's."""
    gen = torch.Generator().manual_seed(0)
    values = [
        torch.randn(s, generator=gen).to(DEVICE, getattr(torch, d))
        for s, d in zip(shapes, dtypes, strict=True)
    ]
    params = [torch.nn.Parameter(v.clone()) for v in values]
    reference = [torch.nn.Parameter(v.clone()) for v in values]
    make = lambda ps: optim.Rprop(ps, lr=1e-2, etas=(0.4, 1.5), foreach=True)  # noqa: E731
    opt, eager = optcompile.compile(make(params), backend="triton"), make(reference)
    for _ in range(4):
        for p, q in zip(params, reference, strict=True):
            grad = torch.randn(p.shape, generator=gen).to(DEVICE, p.dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        eager.step()
    code = optcompile.explain(opt).graph_code
    if DEVICE == "cpu" or shapes != ((), ()):
        assert "@triton.jit" in code
    else:
        assert code.startswith("# not fused (its tensors live on several devices")
    exact = {"rtol": 0, "atol": 0} if DEVICE == "cpu" else {"rtol": 1.6e-2, "atol": 1e-5}
    _assert_close(params, opt, reference, eager, **exact)


@pytest.mark.parametrize("capturable", [True, False], ids=["steps on device", "steps on host"])
def test_kernel_arguments_have_the_types_whose_launchers_are_built_ahead(capturable):
    """A cold first call on CUDA has Triton build the launchers of ``LAUNCH_SIGNATURES`` in
    the background (_triton_compat.prefetch_runtime): the kernels' launches must have those
    argument types, or Triton builds theirs in the foreground (the small kernel, which
    copies out 0-dim results, runs where the host does not compute them)."""
    params = [torch.nn.Parameter(torch.ones(s, device=DEVICE)) for s in SHAPES]
    adamw = optim.AdamW(params, lr=1e-2, foreach=True, capturable=capturable)
    opt = optcompile.compile(adamw, backend="triton")
    for _ in range(2):  # (the first call creates the state; the second traces the steady step)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    entry = _OPTIMIZERS[opt].cache.entries[0].value
    plan = TritonPlan(entry.traced.graph_module)
    plan(entry.gather({"opt": opt}))
    assert plan.host is not capturable
    calls = [call for part in plan.parts for call in part.kernel_calls()]
    found = {launch_signature(kernel.fn, args) for kernel, _, args, _ in calls}
    assert found == set(LAUNCH_SIGNATURES[: 1 if plan.host else 2])


class _GraphProtocol:
    """Runs a plan as its CUDA graph does, without one (no CUDA here): the first call whole,
    then ``prepare`` + ``launch`` (what a graph records and replays) + ``finish``."""

    def __init__(self, plan):
        self.plan, self.calls, self.stale = plan, 0, []

    def __call__(self, inputs):
        self.calls += 1
        if self.calls == 1:
            return self.plan(inputs)
        self.plan.prepare(inputs)
        self.stale.append(self.plan.stale(inputs))
        self.plan.launch()
        self.plan.finish(inputs)
        return ()


PRELUDES = {
    "Muon": lambda ps: optim.Muon(ps, lr=1e-2),
    "LAMB (foreach)": ForeachLamb,
    "trust ratio (for-loop)": TrustRatioSGD,
    "global-norm clip": ClippedAdam,
    "global-norm clip, host step counts": CountedClippedMomentum,
}


# The host computes with the prelude's 0-dim results (under the interpreter, where they are
# CPU tensors): ``prepare`` runs before the replay, so no graph.
REFUSED = {"global-norm clip, host step counts": "the host computes with its 0-dim results"}
# On CUDA the prelude's 0-dim result (the clip coefficient) is a device tensor beside the CPU
# step counts the host reads: the kernels take their 0-dim values from one place, so the
# whole step runs on the torch backend (no split, no graph), and says why.
UNSPLIT_ON_CUDA = {"global-norm clip, host step counts": "its tensors live on several devices"}


@pytest.mark.parametrize("name", sorted(PRELUDES))
def test_a_prelude_runs_as_its_cuda_graph_would_and_matches_eager(name):
    # A plan whose torch-backend ops (Muon's matmuls, LAMB's norms, a global-norm clip) come
    # first is recorded with them: its prepare / launch / finish split, driven as the graph
    # is (launch once per call, on the plan's copies of the new grads; the kernels' tables
    # point at the prelude's results; its deferred writes after the kernels), matches eager
    # over steps with new grad tensors each step and a hyperparameter the prelude reads
    # changed midway (the graph would be re-recorded, saying why).
    from optcompile.api import _compiled_of
    from optcompile.driver import newest
    from optkernels.prelude_capture import capture_reason

    shapes = [(8, 6), (3, 8), (5, 5)] if name == "Muon" else SHAPES
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE)) for s in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(PRELUDES[name](params), backend="triton")
    eager = PRELUDES[name](reference)
    params = opt.param_groups[0]["params"]
    reference = eager.param_groups[0]["params"]
    protocol = None
    for step in range(5):
        for p, q in zip(params, reference, strict=True):
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            q.grad = p.grad.clone()
        if step == 4 and name == "Muon":
            for o in (opt, eager):
                o.param_groups[0]["momentum"] = 0.8
        opt.step()
        eager.step()
        if step == 1:  # (a step creating state in its first call traces again)
            entry = newest(_compiled_of(opt))
            plan = entry.plan.plan
            if DEVICE == "cuda" and name in UNSPLIT_ON_CUDA:
                assert plan.split is None and UNSPLIT_ON_CUDA[name] in plan.reason
                assert "torch backend runs this graph" in optcompile.explain(opt).cudagraphs
                continue
            assert plan.split is not None
            assert capture_reason(plan.split.prelude, plan.device) is None
            if name in REFUSED:
                assert REFUSED[name] in plan.prelude_capture_reason()
                return
            assert plan.prelude_capture_reason() is None
            entry.plan = protocol = _GraphProtocol(plan)
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    if protocol is None:  # (UNSPLIT_ON_CUDA)
        return
    assert protocol.calls == 3 and _compiled_of(opt).stats.traces <= 2
    first, last = protocol.stale  # (the protocol's first call ran the plan whole)
    assert first is None
    if name == "Muon":
        assert "the Python numbers its torch-backend ops take changed" in last
        assert "0.95 -> 0.8" in last
    else:
        assert last is None
    capture = protocol.plan.capture
    assert capture.inputs == [] and capture.statics  # the grads' copies; no grad kept
    assert protocol.plan.launches_beside_graph == 1 + (1 if protocol.plan.split.writes else 0)
