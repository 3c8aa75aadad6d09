"""The torch backend batches a step over its parameters (lanes): each op the step repeats for
every parameter runs as one foreach call (in place where eager's would be) or one loop.

On the CPU a foreach op runs the per-tensor kernel on each tensor, so the batched plan must
give the bits of the node-by-node plan, and those of eager torch.optim wherever the
node-by-node plan does. Steps it cannot batch run node by node, and explain() says which.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optcompile
import optkernels.reference
import pytest
import torch
from optcompile.testing import set_grads
from optkernels.reference import node_by_node
from step_optimizers import DecayMatricesOnly

BATCHED = "# torch backend, batched over lanes"
NODE_BY_NODE = "# torch backend, node by node (not batched: "
NAMES = [
    "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta", "Adagrad", "RMSprop", "Rprop",
    "SGD", "ASGD",
]  # fmt: skip
OPTIONS: dict[str, dict[str, Any]] = {"SGD": {"momentum": 0.9}, "Adadelta": {"lr": 0.5}}
# Where the trace's graph itself is not eager's to the bit, on either plan: RAdam's foreach
# and ASGD's for-loop paths take the capturable path (step counts on the host in eager).
ROUNDING = {
    ("RAdam", True, torch.float32),
    ("RAdam", True, torch.float64),
    ("ASGD", False, torch.float64),
    ("ASGD", False, torch.bfloat16),
}
BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def mlp(dtype: torch.dtype) -> torch.nn.Module:
    """Six parameters of five shapes: a family of six lanes per op."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
    )
    return model.to(dtype)


def run(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    model: torch.nn.Module,
    steps: list[tuple[int, ...]],
    compiled: bool,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``make``'s optimizer (compiled on the torch backend or eager) over a copy of
    ``model``; step i leaves the grads of the params ``steps[i]`` None."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    opt = make(params)
    if compiled:
        opt = optcompile.compile(opt, backend="torch")
    for i, none in enumerate(steps):
        set_grads(model, i)
        for j in none:
            params[j].grad = None
        opt.step()
    return model, opt


def node_by_node_run(
    monkeypatch: pytest.MonkeyPatch, *args: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``run`` compiled with the torch backend forced to its node-by-node plan."""
    with monkeypatch.context() as m:
        m.setattr(optkernels.reference.TorchBackend, "compile", lambda self, gm: node_by_node(gm))
        model, opt = run(*args, compiled=True)
        assert not optcompile.explain(opt).graph_code.startswith(BATCHED)
        return model, opt


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The params and every state tensor, in a fixed order."""
    out = []
    for p in model.parameters():
        out.append(p.detach())
        state = opt.state[p]
        out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (``torch.equal`` takes 0.0 for -0.0 and NaN for unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = BITS.get(a.dtype)
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def check(
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    model: torch.nn.Module,
    steps: list[tuple[int, ...]],
    bitwise_eager: bool,
) -> str:
    """Run ``make`` batched, node by node and eagerly; assert the batched run has the
    node-by-node run's bits and (``bitwise_eager``) eager's, else is close to eager.
    Returns the batched plan's description."""
    batched = run(make, model, steps, compiled=True)
    nodes = node_by_node_run(monkeypatch, make, model, steps)
    eager = run(make, model, steps, compiled=False)
    report = optcompile.explain(batched[1])
    assert report.fallback_reason is None
    mine, theirs, expected = tensors(*batched), tensors(*nodes), tensors(*eager)
    assert len(mine) == len(theirs) == len(expected)
    for i, (a, b, c) in enumerate(zip(mine, theirs, expected, strict=True)):
        assert same_bits(a, b), (i, a, b)
        if bitwise_eager:
            assert same_bits(a, c), (i, a, c)
        else:
            torch.testing.assert_close(a, c)
    return report.graph_code


def make_optimizer(name: str, foreach: bool) -> Callable[[Any], torch.optim.Optimizer]:
    cls = getattr(torch.optim, name)
    options = {"lr": 1e-2, **OPTIONS.get(name, {})}
    return lambda params: cls(params, foreach=foreach, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_runs_batched_with_eager_bits(monkeypatch, name, foreach, dtype):
    code = check(
        monkeypatch,
        make_optimizer(name, foreach),
        mlp(dtype),
        [()] * 4,
        bitwise_eager=(name, foreach, dtype) not in ROUNDING,
    )
    assert code.startswith(BATCHED), code[:300]
    if not foreach:  # the for-loop's ops, six lanes each, as foreach calls
        assert "x6: " in code and "_foreach_" in code.split("\ndef forward")[0]


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("name", NAMES)
def test_lanes_with_different_step_counts_keep_eager_bits(monkeypatch, name, foreach):
    # Params 1 and 3 miss some steps, so the lanes' step counts differ: the per-lane Python
    # arithmetic on them runs per lane and the foreach ops take ScalarLists. (ASGD's for-loop
    # trace rounds its per-step values apart from eager once the counts differ.)
    steps = [(1,), (), (3,), (), (1, 3), ()]
    rounding = (name, foreach) in {("RAdam", True), ("ASGD", False)}
    code = check(
        monkeypatch, make_optimizer(name, foreach), mlp(torch.float32), steps, not rounding
    )
    assert code.startswith(BATCHED), code[:300]


def test_parameters_with_different_op_sequences_run_as_one_batch_per_sequence(monkeypatch):
    # Weight decay on the matrices only: two families of three lanes.
    code = check(
        monkeypatch, lambda ps: DecayMatricesOnly(ps, lr=1e-2), mlp(torch.float32), [()] * 3, True
    )
    assert code.startswith(BATCHED) and "x3: aten.mul.Tensor" in code, code[:600]


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on grads divided by their global norm: every parameter's update reads all grads."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            total = torch.stack([p.grad.norm() for p in params]).norm()
            for p in params:
                p.add_(p.grad / (total + 1e-6), alpha=-group["lr"])


def test_a_step_that_reads_across_parameters_runs_node_by_node(monkeypatch):
    code = check(
        monkeypatch, lambda ps: GlobalNormSGD(ps), mlp(torch.float32), [()] * 3, bitwise_eager=True
    )
    assert code.startswith(NODE_BY_NODE + "no per-parameter op sequence repeats"), code[:300]


def test_large_tensors_in_batches_of_two_run_node_by_node_in_place(monkeypatch):
    """Adafactor over two large matrices and their biases: its batched calls would each
    cover at most two tensors and allocate every result (1.8-3x eager's time over an MLP's
    1024x1024 matrices); node by node, each op runs in place where eager's did, with the
    node-by-node plan's bits and eager's (Adafactor's step sizes are read with .item(): its
    graph is eager's for-loop)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    code = check(monkeypatch, lambda ps: torch.optim.Adafactor(ps), model, [()] * 3, True)
    assert code.startswith(NODE_BY_NODE + "its batched calls would cover at most 2"), code[:300]


class ScalarBf16(torch.nn.Module):
    """A float32 vector and a 0-dim bfloat16 parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3))
        self.s = torch.nn.Parameter(torch.randn(()).to(torch.bfloat16))


def test_a_promoting_in_place_foreach_op_keeps_eager_dtype(monkeypatch):
    # Decoupled weight decay with a Tensor lr: ``_foreach_mul_(params, 1 - lr * wd)`` on a
    # 0-dim bfloat16 param keeps bfloat16 in eager, where the functional op computes float32
    # (the tracer records it with a cast back to the param's dtype).
    def make(params: Any) -> torch.optim.Optimizer:
        return torch.optim.NAdam(
            params, lr=torch.tensor(0.01), weight_decay=0.1, decoupled_weight_decay=True,
            foreach=True,
        )  # fmt: skip

    code = check(monkeypatch, make, ScalarBf16(), [()] * 3, bitwise_eager=True)
    assert code.startswith(BATCHED), code[:600]


def test_an_in_place_op_on_a_strided_half_param_computes_as_eager_on_that_layout():
    """Adafactor's weight decay and update run in place on the param (``mul_``, ``add_``
    with alpha): on a non-dense bfloat16 view ATen's CPU kernel takes its non-vectorized
    path; the functional op's dense result took the vectorized one (an ulp off in ~3% of
    the elements; the differential test found it). The batched plan runs eager's op on a
    copy laid out alike."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(3, generator=gen) for _ in range(3)]
    values.append(torch.randn(2050, generator=gen).bfloat16())
    runs = []
    for compiled in (True, False):
        params = [torch.nn.Parameter(v.clone()) for v in values[:3]]
        params.append(torch.nn.Parameter(values[3].clone()[::2]))
        opt = torch.optim.Adafactor(params, lr=1e-2, weight_decay=0.1)
        if compiled:
            opt = optcompile.compile(opt, backend="torch")
        for step in range(2):
            grads = torch.Generator().manual_seed(10 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=grads).to(p.dtype)
            opt.step()
        runs.append((params, opt))
    (params, opt), (reference, eager) = runs
    assert "strided lanes, as eager" in optcompile.explain(opt).graph_code
    for p, q in zip(params, reference, strict=True):
        assert torch.equal(p, q)
        for key, value in eager.state[q].items():
            assert torch.equal(opt.state[p][key], value), key


def test_a_check_on_numpy_numbers_runs_batched():
    """A numpy float64 lr makes the step's Python comparisons numpy bools (ASGD with Tensor
    lambd, alpha and t0 in a second group checks them): the batched plan handed them to
    ``aten._assert_scalar`` as they were, which ATen refused (a RuntimeError); it passes
    them as the node-by-node plan does."""
    import numpy as np

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, generator=gen)) for _ in range(3)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def make(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        tensors = {k: torch.tensor(v) for k, v in (("lambd", 1e-4), ("alpha", 0.75), ("t0", 1e6))}
        groups = [{"params": ps[:2]}, {"params": ps[2:], **tensors}]
        return torch.optim.ASGD(groups, lr=np.float64(0.01))

    opt = optcompile.compile(make(params), backend="torch")
    eager = make(reference)
    for _ in range(3):
        for p, q in zip(params, reference, strict=True):
            p.grad = torch.randn(3, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        eager.step()
    assert optcompile.explain(opt).graph_code.startswith(BATCHED)
    for p, q in zip(params, reference, strict=True):
        assert torch.equal(p, q)
        for key, value in eager.state[q].items():
            assert torch.equal(opt.state[p][key], value), key
