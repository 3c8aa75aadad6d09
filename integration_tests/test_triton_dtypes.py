"""backend="triton" in float64, float16 and bfloat16: against eager, and against the torch
backend running the same traced graph on copies of the same inputs.

The kernels compute each op as ATen's CUDA kernels do (optkernels.foreach_kernel): on a GPU
they match the torch backend bitwise in float16 and bfloat16. ATen's CPU kernels, which the
torch backend runs here under TRITON_INTERPRET=1, differ from its CUDA ones by an ulp in
places (they round ``add``'s alpha and scalar to the tensor's dtype, read a 0-dim tensor
they divide or multiply by unrounded, and associate addcmul and addcdiv otherwise), and an
ulp of a float16 intermediate can move a result by a few ulps of its tensor's largest value;
infinities and NaNs must match exactly everywhere.
"""

from __future__ import annotations

import numpy as np
import optcompile
import opttrace
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from optcompile.testing import assert_within_ulps
from optkernels import TorchPlan, reference
from optkernels.triton_backend import TritonPlan
from triton_setup import DEVICE, FUSED, LOOP_FUSED

CASES = {**FUSED, **{f"{name} (for-loop)": make for name, make in LOOP_FUSED.items()}}
# (A 0-dim parameter of a foreach step: the torch backend computes its lane of an
# out-of-place foreach op in float32 where eager's in-place op and the graph keep float16.)
SHAPES = [(7,), (300,), (3, 5)]
ON_GPU = DEVICE == "cuda"


def _params(dtype, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(DEVICE, dtype)) for s in shapes]


def _grads(params, scale, gen):
    return [(torch.randn(p.shape, generator=gen) * scale).to(DEVICE, p.dtype) for p in params]


def _capturable(opt, value):
    """Set every group's ``capturable`` option (where the optimizer has one)."""
    for group in opt.param_groups:
        if "capturable" in group:
            group["capturable"] = value
    return opt


def _assert_same(mine, theirs, ulps):
    """Each pair within ``ulps`` (optcompile.testing.assert_within_ulps)."""
    for a, b in zip(mine, theirs, strict=True):
        assert_within_ulps(a, b, ulps)


def _state_tensors(opt, params):
    return [t for p in params for t in (p, *opt.state[p].values()) if torch.is_tensor(t)]


@pytest.fixture
def functional_reference(monkeypatch):
    """The torch backend runs some foreach nodes as the in-place op eager ran (whose CPU
    kernel rounds its scalar to float16 first); the kernels implement the graph's
    functional ops, as CUDA computes both: compare against those."""
    monkeypatch.setattr(reference, "_ROUNDS_DIFFERENTLY_IN_PLACE", set())


def _same_graph_steps(make, dtype, scale, steps=3, shapes=SHAPES, skip_host=False):
    """The compiled step's graph run by the kernels (in place, on the optimizer's tensors)
    and by the torch backend on copies of the same inputs, step by step; yields the two
    results of every floating tensor the graph takes."""
    params = _params(dtype, shapes=shapes)
    opt = optcompile.compile(_capturable(make(params), True), backend="triton")
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # the first call creates the state; the second traces the steady step
        for p, g in zip(params, _grads(params, scale, gen), strict=True):
            p.grad = g
        opt.step()
    entry = _OPTIMIZERS[opt].cache.entries[0].value
    gm = entry.traced.graph_module
    plan, reference = TritonPlan(gm), TorchPlan(gm)
    assert plan.parts, plan.reason
    for _ in range(steps):
        for p, g in zip(params, _grads(params, scale, gen), strict=True):
            p.grad = g
        inputs = entry.gather({"opt": opt})
        copies = [x.clone() if torch.is_tensor(x) else x for x in inputs]
        plan(inputs)
        reference(copies)
        if skip_host and plan.host:
            pytest.skip(
                "step counts on the CPU: the host computes their bias corrections in float64 "
                "as eager does, not in float32 as the graph's ops (see the host test below)"
            )
        written = [i for i, x in enumerate(inputs) if torch.is_tensor(x) and x.is_floating_point()]
        yield [inputs[i] for i in written], [copies[i] for i in written]


# float16 with gradients whose squares underflow (1e-6: (1 - beta2) * g * g is 1e-15) and
# overflow (1e4); bfloat16 has float32's range.
LOW_PRECISION = [
    *((torch.float16, scale) for scale in (1e-6, 1.0, 1e4)),
    (torch.bfloat16, 1.0),
]


@pytest.mark.usefixtures("functional_reference")
@pytest.mark.parametrize(("dtype", "scale"), LOW_PRECISION, ids=lambda x: str(x))
@pytest.mark.parametrize("name", sorted(CASES))
def test_low_precision_kernels_match_the_torch_backend_on_the_same_graph(name, dtype, scale):
    """Every fused optimizer (its capturable path: what the kernels run) in float16 and
    bfloat16: bitwise on a GPU, the same infinities and NaNs here."""
    for mine, theirs in _same_graph_steps(CASES[name], dtype, scale):
        _assert_same(mine, theirs, ulps=0 if ON_GPU else 4)


def _aten_float32_sqrt_is_exact() -> bool:
    """Whether ATen's float32 sqrt rounds correctly here (as IEEE's sqrt and the kernels'
    ``sqrt_rn`` do). Not on every CPU: torch 2.13's CPU wheel on an AMD EPYC returns
    0.06319753 for sqrt(0.0039939284f), one ulp under the correctly rounded 0.06319754 (the
    bias correction of Adam's step 4 with beta2 0.999), which moves float64 params by a
    float32 ulp of their bias correction, as CUDA's powf does on a GPU."""
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0))
    x = torch.cat([x, torch.tensor([0.0039939284])])
    exact = x.double().sqrt().float()
    return torch.equal(torch.sqrt(x), exact) and torch.equal(torch.sqrt(x[-1]), exact[-1])


_ATEN_FLOAT32_SQRT_EXACT = _aten_float32_sqrt_is_exact()


@pytest.mark.usefixtures("functional_reference")
@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_kernels_match_the_torch_backend_on_the_same_graph(name):
    """float64 lanes compute in float64, lr and betas included (a float32 kernel was off by
    ~1e-7 relative); the bias corrections of float32 step counts stay float32, as in the
    graph. (On a GPU those agree to an ulp of float32: CUDA's powf, which ATen calls, is not
    correctly rounded everywhere; the kernels' pow is; likewise on a CPU whose ATen float32
    sqrt is not: ``_aten_float32_sqrt_is_exact``. The host test below holds float64
    to 1e-13 there.)"""
    # float64 ulps: 4 float32 ulps where ATen's float32 math is not correctly rounded
    wide = 4 * 2**29 if ON_GPU or not _ATEN_FLOAT32_SQRT_EXACT else 4
    for mine, theirs in _same_graph_steps(CASES[name], torch.float64, 1.0, skip_host=True):
        for a, b in zip(mine, theirs, strict=True):
            _assert_same([a], [b], ulps=wide if a.dtype is torch.float64 else 1)


# Eager computes these 0-dim states in float32 tensor arithmetic (NAdam's mu_product,
# ASGD's eta) where the host computes them in float64: an ulp of float32 apart.
_FLOAT32_STATE = {"NAdam", "ASGD"}


@pytest.mark.parametrize("name", sorted(n for n in CASES if not n.startswith("SGD")))
def test_float64_steps_with_host_step_counts_match_eager_to_float64_precision(name):
    """With capturable=False (step counts on the CPU, where the host computes the bias
    corrections: forced here where the kernels run on the CPU too), float64 parameters and
    state match eager's to float64 rounding: the host's values reach the kernels as float64
    (they were staged as float32, ~9 digits lost per step)."""
    make = CASES[name]
    params = _params(torch.float64, seed=2)
    copies = [[torch.nn.Parameter(p.detach().clone()) for p in params] for _ in range(2)]
    opt = optcompile.compile(_capturable(make(params), False), backend="triton")
    other, eager = (_capturable(make(c), False) for c in copies)
    gen = torch.Generator().manual_seed(3)
    for p, g in zip(params, _grads(params, 1.0, gen), strict=True):
        p.grad = g
    opt.step()
    entry = _OPTIMIZERS[opt].cache.entries[0].value
    plan = TritonPlan(entry.traced.graph_module, host_small=True)
    for step in range(4):
        for q, r, g in zip(*copies, _grads(params, 1.0, gen), strict=True):
            q.grad, r.grad = g, g.clone()
        if step == 0:
            opttrace.init_state(other)  # (eager's state for the params with grads)
        plan(entry.gather({"opt": other}))
        eager.step()
    assert plan.host and plan.parts
    rtol = 2e-6 if name.split(" ")[0] in _FLOAT32_STATE else 1e-13
    mine, theirs = _state_tensors(other, copies[0]), _state_tensors(eager, copies[1])
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=1e-15)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch backend"])
@pytest.mark.parametrize("name", sorted(n for n in CASES if not n.startswith("SGD")))
def test_float64_steps_with_capturable_false_match_eager_end_to_end(name, fused):
    """Compiled with the default plan (on the CPU too, where the step counts live with the
    params): the values eager's capturable=False path reads as Python floats are computed
    on the host in double, as eager does and as on a GPU. (Under the interpreter the
    kernels computed them from the float32 step counts: 5e-8 relative off after three
    steps, 3.4e-6 after one at lr=0.1.) Where the kernels do not take the step (a
    transposed grad), the torch backend reads those values in double too (it computed
    them from the float32 step counts; on a GPU it still did for RAdam's for-loop, whose
    graph makes a tensor on the device: see optkernels' test_triton_plan.py)."""
    make = CASES[name]
    params = _params(torch.float64, seed=5, shapes=[*SHAPES, ()])
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(_capturable(make(params), False), backend="triton")
    eager = _capturable(make(copies), False)
    for group in (*opt.param_groups, *eager.param_groups):
        group["lr"] = 0.1
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        for p, q, g in zip(params, copies, _grads(params, 1.0, gen), strict=True):
            if not fused and g.dim() == 2:
                g = g.t().contiguous().t()  # (the kernels take one dense layout)
            p.grad, q.grad = g, g.clone()
        opt.step()
        eager.step()
    assert optcompile.explain(opt).graph_code.startswith("# not fused") is not fused
    rtol = 2e-6 if name.split(" ")[0] in _FLOAT32_STATE else 1e-13
    atol = 1e-15
    if name == "RAdam" and not fused:  # (README: its foreach path's float32 step size)
        rtol, atol = 1e-7, 1e-8
    mine, theirs = _state_tensors(opt, params), _state_tensors(eager, copies)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("scale", [1e-8, 1e-6, 1e4], ids=["1e-8", "1e-6", "1e4"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_float16_steps_give_eagers_infinities_and_nans(name, scale):
    """float16 with gradients whose squares underflow or overflow, compiled against eager
    (with the optimizers' default capturable=False here: Adam, AdamW, Adamax and NAdam then
    trace eager's own path, since their capturable one rounds otherwise in float16), all
    fused into one launch."""
    make = CASES[name]
    params = _params(torch.float16, seed=4)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(make(params), backend="triton")
    eager = make(reference)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q, g in zip(params, reference, _grads(params, scale, gen), strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        eager.step()
    _assert_same(_state_tensors(opt, params), _state_tensors(eager, reference), ulps=4)
    report = optcompile.explain(opt)
    assert "@triton.jit" in report.graph_code and "not fused" not in report.graph_code
    assert report.kernel_launches_per_step in (1, 2)  # (2: the 0-dim results' copy)


@pytest.mark.usefixtures("functional_reference")
@pytest.mark.parametrize("name", ["Adam", "AdamW weight decay"])
def test_a_0dim_float16_parameter_of_a_for_loop_step_gets_a_kernel_of_its_own(name):
    """A 0-dim float16 parameter's for-loop ops with 0-dim float32 bias corrections promote
    to float32 (the graph records it, as eager computes it), where a larger parameter's stay
    float16: its lane gets its own kernel (under the float16 kernel its update was off by
    hundreds of ulps where eps mattered)."""
    steps = _same_graph_steps(LOOP_FUSED[name], torch.float16, 1e-4, shapes=[(7,), ()])
    for mine, theirs in steps:
        _assert_same(mine, theirs, ulps=0 if ON_GPU else 4)


# Eager's own capturable=False path in float16 (optcompile.optimizer traces it for these):
# Python arithmetic on the step counts' .item() values, which the host computes.
EAGER_PATH = {
    "Adam": lambda ps, f: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=f),
    "AdamW": lambda ps, f: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, foreach=f),
    "Adamax": lambda ps, f: torch.optim.Adamax(ps, lr=0.01, foreach=f),
    "NAdam": lambda ps, f: torch.optim.NAdam(ps, lr=0.01, foreach=f),
}


def _triton_plan(opt):
    plan = _OPTIMIZERS[opt].cache.entries[0].value.plan
    return getattr(plan, "plan", plan)  # (a GraphedPlan's)


def _eager_path_pair(name, foreach, steps, set_steps=None):
    """A compiled (backend "triton") and an eager optimizer over float16 copies, stepped
    ``steps`` times with the same grads; ``set_steps``: the step counts both start from."""
    params = _params(torch.float16, seed=7)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(EAGER_PATH[name](params, foreach), backend="triton")
    eager = EAGER_PATH[name](reference, foreach)
    gen = torch.Generator().manual_seed(8)
    for step in range(steps):
        for p, q, g in zip(params, reference, _grads(params, 0.1, gen), strict=True):
            p.grad, q.grad = g, g.clone()
        if step == 0 and set_steps is not None:
            for o, ps in ((opt, params), (eager, reference)):
                opttrace.init_state(o)
                for p, count in zip(ps, set_steps, strict=True):
                    o.state[p]["step"].fill_(count)
        opt.step()
        eager.step()
    return opt, params, eager, reference


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
@pytest.mark.parametrize("name", sorted(EAGER_PATH))
def test_float16_eager_path_fuses_into_one_launch_and_matches_eager(name, foreach):
    """Eager's bias corrections and step sizes (Python floats from ``.item()``) are
    computed on the host as eager computes them, the rest in one kernel: params and state
    as eager's (bitwise on a GPU; here within the CPU kernels' ulps), the float32 step
    counts and NAdam's mu_product bitwise."""
    opt, params, eager, reference = _eager_path_pair(name, foreach, steps=4)
    report = optcompile.explain(opt)
    assert report.kernel_launches_per_step == 1 and "not fused" not in report.graph_code
    assert _triton_plan(opt).host
    mine, theirs = _state_tensors(opt, params), _state_tensors(eager, reference)
    # (On an H100, NAdam's for-loop differs by one float16 ulp: its ``exp_avg_sq.div(
    # bias_correction2)`` divides by a Python float, which ATen's CUDA kernel computes as a
    # multiplication by the float32 reciprocal; the kernel divides. To do: lower a
    # single-tensor division by a host number as ATen's CUDA kernel does.)
    gpu_ulps = 1 if (name, foreach) == ("NAdam", False) else 0
    _assert_same(mine, theirs, ulps=gpu_ulps if ON_GPU else 4)
    for a, b in zip(mine, theirs, strict=True):
        if a.dtype is torch.float32:  # step counts, mu_product
            assert torch.equal(a, b)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_the_host_computes_eagers_python_floats_bitwise(foreach):
    """Each lane's step size and bias correction (``lr / (1 - beta1 ** step)``, ``(1 -
    beta2 ** step) ** 0.5``) are eager's Python floats to the bit, also when the lanes'
    step counts differ (each lane computed by Python's own ``**``: numpy's vectorized power
    differs from it in the last bit for ~1% of such values on AVX-512 machines; the counts
    are chosen among those where it does here, if any)."""
    final = [s for s in range(1000, 20000) if np.power(0.999, s) != 0.999**s][:3]
    final += [7, 11, 14][len(final) :]
    counts = [s - 2 for s in final]  # (two steps follow)
    opt, params, eager, reference = _eager_path_pair("Adam", foreach, 2, set_steps=counts)
    (group,) = _triton_plan(opt).groups
    host_values = set(group.host_vals.tolist())
    lr, (beta1, beta2) = 0.01, (0.9, 0.999)
    for p, q in zip(params, reference, strict=True):
        step = eager.state[q]["step"].item()
        assert opt.state[p]["step"].item() == step
        bias_correction1 = 1 - beta1**step
        step_size = (lr / bias_correction1) * -1 if foreach else -(lr / bias_correction1)
        assert step_size in host_values
        assert (1 - beta2**step) ** 0.5 in host_values
