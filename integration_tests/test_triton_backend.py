"""backend="triton": foreach steps fused into generated Triton kernels, compared with eager.

On CPU the kernels run under TRITON_INTERPRET=1 (the test sessions set it); on a CUDA
machine they run on the device. Sizes are odd on purpose (1, 7, 1000, 4097 elements and a
0-dim parameter): blocks straddle tensor ends. The capturable path is traced for the kernels,
so results match eager within float rounding, not bitwise.

Here: what fuses, and what runs on the torch backend (inside the plan or instead of it).
Beside it: the address tables (test_triton_addresses.py), step counts on the host
(test_triton_host_steps.py), a prelude run as its CUDA graph would
(test_triton_prelude_capture.py); what they share is in triton_setup.py.
"""

from __future__ import annotations

import optcompile
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from optkernels._triton_compat import launch_signature
from optkernels.triton_backend import LAUNCH_SIGNATURES, TritonPlan
from step_optimizers import (
    ClippedAdam,
    DecayMatricesOnly,
    ForeachLamb,
    MaskedTrust,
    ScaledByAConstant,
    SophiaLike,
    StepScaledTrustSGD,
    TrustRatioSGD,
)
from triton_setup import (
    CAP,
    DEVICE,
    FUSED,
    LOOP_FUSED,
    SHAPES,
    _assert_close,
    _plan,
    _run,
    _unwrap,
    needs_triton,
)

optim = torch.optim
pytestmark = needs_triton


# A reduction inside the step: the kernels are elementwise only, so the norms (and what they
# depend on) run on the torch backend first; the rest is one kernel.
PARTLY_FUSED = {
    "trust ratio (for-loop)": (TrustRatioSGD, "aten.linalg_vector_norm.default", 0),
    "LAMB (foreach)": (ForeachLamb, "aten._foreach_norm.Scalar", 1),
}


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


@pytest.mark.parametrize("name", sorted(LOOP_FUSED))
def test_for_loop_steps_fuse_into_one_kernel_too(name):
    """A for-loop step is the same op sequence once per parameter: its independent
    per-parameter components become the kernel's lanes, as the foreach lists do."""
    params, opt, reference, eager = _run(LOOP_FUSED[name])
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert 1 <= report.kernel_launches_per_step <= 2, report.graph_code[:300]
    assert "@triton.jit" in report.graph_code


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
