"""backend="cpu" (what "auto" picks for CPU params when a C compiler is found): each lane
program runs as one generated C loop nest per dtype group; compared with eager torch.optim.

Every optimizer the lanes cover, foreach and for-loop in float32, the default (for-loop)
path in float64, bfloat16 and float16, over three steps: params and every state tensor.
Sizes are odd on purpose (1, 7, a 2-D one, one over the backend's block of 32,768 elements,
so that a lane spans several work items, and in float32 and float64 a 0-dim parameter).
Default options (capturable=False): the trace takes the capturable path and the host
computes what depends on step counts in float64, as eager's Python floats do.
"""

from __future__ import annotations

import copy

import optcompile
import pytest
import torch
from eager_pairs import assert_matches_eager, step_both, step_sharing_a_grad
from optcompile.api import _OPTIMIZERS
from optkernels.c_kernel import find_compiler
from optkernels.cpu_backend import BLOCK, CpuPlan

optim = torch.optim
pytestmark = pytest.mark.skipif(
    isinstance(find_compiler(), str), reason="no C compiler builds the generated loops here"
)
SHAPES = [(1,), (7,), (3, 5), (BLOCK + 33,)]
# A 0-dim float16/bfloat16 parameter's ops promote where the others' do not: its casts
# (``_to_copy``) are not lane ops, so they run on the torch backend first (partly fused).
WIDE_SHAPES = [(), *SHAPES]
MAKE = {
    "Adam": lambda ps, f: optim.Adam(ps, lr=1e-2, foreach=f),
    "AdamW weight decay": lambda ps, f: optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=f),
    "AdamW amsgrad maximize": lambda ps, f: optim.AdamW(
        ps, lr=1e-2, amsgrad=True, maximize=True, foreach=f
    ),
    "NAdam": lambda ps, f: optim.NAdam(ps, lr=1e-2, foreach=f),
    "RAdam": lambda ps, f: optim.RAdam(ps, lr=1e-2, foreach=f),
    "Adamax": lambda ps, f: optim.Adamax(ps, lr=1e-2, foreach=f),
    "Adadelta": lambda ps, f: optim.Adadelta(ps, foreach=f),
    "Adagrad lr decay": lambda ps, f: optim.Adagrad(
        ps, lr=1e-2, lr_decay=0.01, weight_decay=0.1, foreach=f
    ),
    "RMSprop centered momentum": lambda ps, f: optim.RMSprop(
        ps, lr=1e-2, centered=True, momentum=0.5, foreach=f
    ),
    "Rprop": lambda ps, f: optim.Rprop(ps, lr=1e-2, foreach=f),
    # etaminus 0.3 is no bfloat16/float16 value: ``sign == etaminus`` compares with its
    # rounded value there, as ATen casts both operands (0.5, the default, is exact)
    "Rprop etas": lambda ps, f: optim.Rprop(ps, lr=1e-2, etas=(0.3, 1.7), foreach=f),
    "SGD nesterov": lambda ps, f: optim.SGD(
        ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=f
    ),
    "ASGD": lambda ps, f: optim.ASGD(ps, lr=1e-2, foreach=f),
}
# (float16 Adam, AdamW, Adamax and NAdam trace eager's own path (optcompile.optimizer): the
# host computes its .item() arithmetic with Python's floats, the loop nest the rest.)
# NAdam's mu_product is a float32 state tensor whatever the params' dtype: eager reads it
# back rounded, the host keeps the float64 product (as on Triton): float32's precision.
FLOAT32_STATE = {"NAdam"}


def _run(make, foreach, dtype, steps=3, backend="cpu", shapes=None):
    gen = torch.Generator().manual_seed(0)
    if shapes is None:
        shapes = WIDE_SHAPES if dtype in (torch.float32, torch.float64) else SHAPES
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(make(params, foreach), backend=backend)
    eager = make(reference, foreach)
    step_both(params, opt, reference, eager, steps, gen, dtype)
    return params, opt, reference, eager


def _plan(opt):
    plan = _OPTIMIZERS[opt].cache.entries[0].value.plan
    return getattr(plan, "plan", plan)


CASES = [
    *((torch.float32, foreach) for foreach in (False, True)),
    *((dtype, None) for dtype in (torch.float64, torch.bfloat16, torch.float16)),
]


@pytest.mark.parametrize(("dtype", "foreach"), CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("name", sorted(MAKE))
def test_step_runs_as_generated_c_and_matches_eager(name, dtype, foreach):
    params, opt, reference, eager = _run(MAKE[name], foreach, dtype)
    wide = name in FLOAT32_STATE and dtype is torch.float64
    assert_matches_eager(params, opt, reference, eager, dtype, 2**29 if wide else None)
    report = optcompile.explain(opt)
    # (SGD's momentum buffers are created by its first step: the second traces again.)
    assert report.backend == "cpu" and report.fallback_reason is None and report.traces <= 2
    plan = _plan(opt)
    assert isinstance(plan, CpuPlan)
    assert plan.fallback is None, report.graph_code[:300]
    lanes = len(params)
    assert report.graph_code.startswith(f"# 1 C loop nest(s) per step over {lanes} lanes")
    assert report.kernel_launches_per_step == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_0dim_low_precision_parameter_runs_its_casts_on_the_torch_backend_first(dtype):
    """On the for-loop path (the default) only that parameter's own ops run on the torch
    backend: every tensor the prelude makes is 0-dim; the other lanes are one C loop."""
    params, opt, reference, eager = _run(MAKE["RAdam"], None, dtype, shapes=WIDE_SHAPES)
    assert_matches_eager(params, opt, reference, eager, dtype)
    code = optcompile.explain(opt).graph_code
    assert code.startswith("# 1 C loop nest(s) per step over 4 lanes, after ")
    assert "# partly fused: aten._to_copy.default not an op the kernel generator knows" in code
    prelude = _plan(opt).prelude.gm.graph
    made = [n.meta["val"] for n in prelude.nodes if n.op == "call_function"]
    assert all(v.dim() == 0 for v in made if isinstance(v, torch.Tensor))


def test_a_0dim_low_precision_parameter_on_the_foreach_path_runs_whole_foreach_ops_first():
    """With foreach=True its casts read items of foreach ops over every parameter: those
    run on the torch backend before the loop (documented), and the step matches eager."""
    params, opt, reference, eager = _run(
        MAKE["Adagrad lr decay"], True, torch.bfloat16, shapes=WIDE_SHAPES
    )
    assert_matches_eager(params, opt, reference, eager, torch.bfloat16)
    assert optcompile.explain(opt).graph_code.startswith("# 1 C loop nest(s) per step over 5")
    prelude = _plan(opt).prelude.gm.graph
    assert any("_foreach_add.List" in str(n.target) for n in prelude.nodes)


def test_auto_picks_the_generated_c_for_cpu_params_and_says_why():
    params, opt, reference, eager = _run(MAKE["AdamW weight decay"], None, torch.float32, 2, "auto")
    assert_matches_eager(params, opt, reference, eager, torch.float32)
    report = optcompile.explain(opt)
    assert report.backend == "cpu"
    assert "auto: the params are on the CPU and a C compiler builds" in report.backend_reason
    assert f"backend cpu: {report.backend_reason}" in str(report).splitlines()[1]


def test_without_a_compiler_auto_picks_the_torch_backend_and_says_why(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    find_compiler.cache_clear()
    try:
        params, opt, reference, _ = _run(MAKE["Adam"], None, torch.float32, 2, "auto")
        report = optcompile.explain(opt)
    finally:
        find_compiler.cache_clear()
    assert report.backend == "torch"
    assert "the generated C cannot be built (no C compiler found" in report.backend_reason
    torch.testing.assert_close(params, reference, rtol=0, atol=0)  # eager's ops, bitwise
    with pytest.raises(optcompile.CompileError, match="backend='cpu' cannot run here"):
        monkeypatch.setenv("CC", "/nonexistent/cc")
        find_compiler.cache_clear()
        try:
            optcompile.compile(optim.SGD(params, lr=0.1), backend="cpu")
        finally:
            find_compiler.cache_clear()


def test_a_graph_the_lanes_do_not_cover_runs_on_the_batched_torch_backend():
    """Adafactor's per-tensor step sizes are values read from tensors (.item()): not a lane
    program; the plan runs it on the torch backend and explain() says why."""
    params, opt, reference, eager = _run(
        lambda ps, f: optim.Adafactor(ps, lr=0.1, foreach=f), False, torch.float32, 3
    )
    assert_matches_eager(params, opt, reference, eager, torch.float32)
    code = optcompile.explain(opt).graph_code
    assert code.startswith("# not fused (") and "the torch backend runs this graph" in code


@pytest.mark.parametrize("foreach", [False, True])
def test_a_graph_the_lanes_do_not_cover_over_large_tensors_runs_node_by_node_in_place(foreach):
    """Over large tensors Adafactor runs node by node: the results it makes written in place
    (as eager writes them), its column norms in C (closer to the exact norm than ATen's,
    within an ulp of them here); a 3-D parameter factors its last two dims."""
    params, opt, reference, eager = _run(
        lambda ps, f: optim.Adafactor(ps, lr=0.1, weight_decay=0.01, foreach=f),
        foreach,
        torch.float32,
        3,
        shapes=[(), (7,), (2, 3, 4), (640, 480), (480,)],
    )
    assert_matches_eager(params, opt, reference, eager, torch.float32)
    code = optcompile.explain(opt).graph_code
    assert "values per op: ops run in place, column norms in C" in code
    assert "vector_norm(" in code
    # (in place: the foreach ops as eager ran them; on the for-loop path the chains of
    # in-place ops run as generated C)
    assert "_foreach_rsqrt_.default" in code if foreach else "c_chains_c_chain" in code


def test_new_grads_every_step_and_a_step_count_re_pointed_are_read_again():
    """Grads given new storage every step are re-read from their addresses; a step count
    replaced by a new tensor (a state dict loaded) is aliased into the host buffer again."""
    params, opt, reference, eager = _run(MAKE["Adam"], False, torch.float32, 2)
    state = opt.state_dict()
    opt.load_state_dict(state)  # new step tensors (and new exp_avg storage: a retrace)
    eager.load_state_dict(eager.state_dict())
    step_both(params, opt, reference, eager, 2, torch.Generator().manual_seed(5))
    assert_matches_eager(params, opt, reference, eager, torch.float32)


def test_partly_fused_step_runs_its_norms_on_the_torch_backend_first():
    from step_optimizers import TrustRatioSGD

    params, opt, reference, eager = _run(lambda ps, f: TrustRatioSGD(ps), None, torch.float32)
    assert_matches_eager(params, opt, reference, eager, torch.float32)
    code = optcompile.explain(opt).graph_code
    assert "# partly fused: aten.linalg_vector_norm.default" in code
    assert _plan(opt).split is not None


def test_a_param_given_new_storage_retraces_and_the_loops_write_its_new_storage():
    """The static address table is not compared on each call (the entry's data-pointer
    guards are): a param moved by ``p.data = ...`` fails its guard and retraces."""
    params, opt, reference, eager = _run(MAKE["Adam"], False, torch.float32, 2)
    params[1].data = params[1].data.clone()
    step_both(params, opt, reference, eager, 2, torch.Generator().manual_seed(7))
    assert_matches_eager(params, opt, reference, eager, torch.float32)
    assert optcompile.explain(opt).traces == 2


ADAFACTOR_SHAPES = [(), (7,), (2, 3, 4), (640, 480), (480,), (300, 1)]
ADAFACTOR = {
    "default": lambda ps, f: optim.Adafactor(ps, lr=0.1, foreach=f),
    "weight decay maximize": lambda ps, f: optim.Adafactor(
        ps, lr=0.05, weight_decay=0.01, maximize=True, beta2_decay=-0.5, d=1.5, foreach=f
    ),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("options", sorted(ADAFACTOR))
def test_adafactor_runs_its_elementwise_chains_in_c_and_matches_eager(options, foreach):
    """Matrices (one 3-D: its last two dims factored), vectors, a 0-dim param, over 4 steps:
    params and every state tensor as eager's (its column norms in C: within an ulp of
    ATen's, which the params' update carries a few ulps on)."""
    params, opt, reference, eager = _run(
        ADAFACTOR[options], foreach, torch.float32, 4, shapes=ADAFACTOR_SHAPES
    )
    assert_matches_eager(params, opt, reference, eager, torch.float32)
    code = optcompile.explain(opt).graph_code
    assert "elementwise chains in C (optkernels.c_chains)" in code
    # for-loop: per matrix its row and column variances and its variance estimate, per
    # vector its variance and its update, as one C pass each (and with weight decay the
    # param's decay and update); foreach ops over lists stay ATen's
    if foreach is False:
        assert code.count("= optkernels_c_chains_c_chain") >= 2 * len(ADAFACTOR_SHAPES), code


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_chains_in_c_give_the_bits_of_atens_ops(foreach, monkeypatch):
    """The fused chains compute what the node-by-node plan's ATen ops compute, to the bit:
    the same step compiled with and without them, from the same state, several steps."""
    import optkernels.cpu_backend as cpu_backend

    make = ADAFACTOR["weight decay maximize"]
    params, opt, _, _ = _run(make, foreach, torch.float32, 1, shapes=ADAFACTOR_SHAPES)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    monkeypatch.setattr(cpu_backend, "fuse_chains", lambda graph, compiler: 0)
    plain = optcompile.compile(make(plain_params, foreach), backend="cpu")
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    gen = torch.Generator().manual_seed(3)
    monkeypatch.undo()
    for _ in range(3):
        for p, q in zip(params, plain_params, strict=True):
            grad = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        monkeypatch.setattr(cpu_backend, "fuse_chains", lambda graph, compiler: 0)
        plain.step()
        monkeypatch.undo()
    assert "c_chains_c_chain" not in optcompile.explain(plain).graph_code
    for p, q in zip(params, plain_params, strict=True):
        assert torch.equal(p, q)
        for key, value in plain.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("options", sorted(ADAFACTOR))
def test_adafactor_steps_while_the_chains_c_is_still_building_run_their_aten_ops(
    options, monkeypatch
):
    """Until the chains' library is built (in the background: ``c_kernel.build_async``) a
    chain runs its own ATen ops: on a cold disk cache, the first steps. The build is held
    here (an Event) over the first two steps, then let go: the chains ran ATen's ops (with
    weight decay ``add_(p, alpha=<a number computed in the step>)`` among them: its kwargs
    hold nodes), then their C, params and state as eager's all along."""
    import concurrent.futures
    import threading

    import optkernels.c_chains as c_chains
    from optkernels.c_kernel import build

    gate = threading.Event()
    builder = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # (not the shared pool)
    builds = []

    def held_build(compiler, source):
        def run():
            assert gate.wait(timeout=300), "the test never let the build go"
            return build(compiler, source)

        builds.append(builder.submit(run))
        return builds[-1]

    monkeypatch.setattr(c_chains, "build_async", held_build)
    make = ADAFACTOR[options]
    try:
        params, opt, reference, eager = _run(make, False, torch.float32, 2, shapes=ADAFACTOR_SHAPES)
        graph = _plan(opt).fallback.gm.graph
        calls = [n.target for n in graph.nodes if isinstance(n.target, c_chains.ChainCall)]
        assert calls and builds and not any(b.done() for b in builds)
        assert all(call.function is None and call.build_error is None for call in calls)
        assert_matches_eager(params, opt, reference, eager, torch.float32)
    finally:
        gate.set()
        builder.shutdown(wait=True)
    step_both(params, opt, reference, eager, 2, torch.Generator().manual_seed(11))
    assert all(call.function is not None for call in calls)
    assert_matches_eager(params, opt, reference, eager, torch.float32)


@pytest.mark.parametrize("name", ["AdamW weight decay", "RAdam", "Adamax"])
def test_a_graph_the_loops_do_not_take_reads_step_counts_in_float64(name):
    """One grad tensor shared by two float32 params (the trace reads it once: no lane
    program) beside a float64 param: the torch backend runs the graph, with the step counts
    eager reads as Python floats widened to float64, as the host computes them for the
    loops. In float32 the float64 param's bias corrections were 2e-7 off eager's."""
    gen = torch.Generator().manual_seed(0)
    shapes = [((3,), torch.float32), ((3,), torch.float32), ((1,), torch.float64)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in shapes]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = optcompile.compile(MAKE[name](params, False), backend="cpu")
    eager = MAKE[name](reference, False)
    step_sharing_a_grad(params, opt, reference, eager, gen)
    assert "not fused" in optcompile.explain(opt).graph_code.splitlines()[0]
    assert_matches_eager(params, opt, reference, eager, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["NAdam", "Adam", "RMSprop"])
def test_weight_decay_on_a_half_param_takes_its_alpha_in_the_params_dtype(name, dtype):
    """``grad.add(param, alpha=weight_decay)`` on a float16/bfloat16 param: ATen's CPU
    kernel rounds the alpha to the param's dtype first (0.1 -> 0.0999755859375 in float16),
    which the C loops did not (NAdam's exp_avg an ulp off eager's in 4% of its elements)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter((torch.randn(4097, generator=gen) * 3).to(dtype))]
    reference = [torch.nn.Parameter(params[0].detach().clone())]

    def make(ps):
        return getattr(optim, name)(ps, lr=0.01, weight_decay=0.1, foreach=False)

    opt, eager = optcompile.compile(make(params), backend="cpu"), make(reference)
    step_both(params, opt, reference, eager, 1, gen, dtype=dtype)
    assert "not fused" not in optcompile.explain(opt).graph_code.splitlines()[0]
    key = "square_avg" if name == "RMSprop" else "exp_avg"
    assert torch.equal(opt.state[params[0]][key], eager.state[reference[0]][key])
