"""The torch backend's batched plan on hand-built graphs: it must give the node-by-node
plan's results bit for bit (the foreach ops it uses run the per-tensor kernels on the CPU),
and keep graphs it cannot batch node by node."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optkernels import TorchBackend, TorchPlan
from optkernels.batched import BatchedPlan
from optkernels.families import families
from torch import fx

aten = torch.ops.aten
BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


class Builder:
    """A graph whose nodes carry ``meta["val"]`` computed on example values, as traced
    graphs do."""

    def __init__(self) -> None:
        self.graph = fx.Graph()

    def input(self, name: str, val: Any) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = val
        return node

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = target(*_vals(args), **_vals(kwargs))
        return node

    def write(self, dst: fx.Node, src: fx.Node) -> None:
        self.graph.call_function(aten.copy_.default, (dst, src))

    def done(self, outputs: Any = ()) -> fx.GraphModule:
        self.graph.output(outputs)
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _vals(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return a.meta["val"]
    if isinstance(a, list | tuple):
        return type(a)(_vals(x) for x in a)
    if isinstance(a, dict):
        return {k: _vals(v) for k, v in a.items()}
    return a


def same_bits(a: Any, b: Any) -> bool:
    """Equal to the bit (``torch.equal`` takes 0.0 for -0.0 and NaN for unequal)."""
    if not isinstance(a, torch.Tensor):
        return a == b or (a != a and b != b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = BITS.get(a.dtype)
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def run_both(gm: fx.GraphModule, inputs: list[Any], steps: int = 2) -> BatchedPlan:
    """Run the graph ``steps`` times batched and node by node on copies; assert every input
    and output ends up with the same bits. Returns the batched plan."""
    plan = TorchBackend().compile(gm)
    assert isinstance(plan, BatchedPlan), plan.describe()[:300]
    reference = TorchPlan(gm)
    mine = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    theirs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    for _ in range(steps):
        out_mine, out_theirs = plan(mine), reference(theirs)
        assert len(out_mine) == len(out_theirs)
        for a, b in zip(out_mine, out_theirs, strict=True):
            assert same_bits(a, b)
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert same_bits(a, b), (i, a, b)
    return plan


def momentum_graph(sizes: list[int], dtype: torch.dtype, foreach: bool) -> fx.GraphModule:
    """SGD with momentum, as a for-loop or a foreach step: b = b * m + g; p = p - lr * b."""
    g = Builder()
    ps = [g.input(f"p{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]
    gs = [g.input(f"g{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]
    bs = [g.input(f"b{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]
    lr, momentum = g.input("lr", 0.1), g.input("momentum", 0.9)
    neg_lr = g.call(operator.neg, lr)
    if foreach:
        scaled = g.call(aten._foreach_mul.Scalar, bs, momentum)
        new_bs = g.call(aten._foreach_add.List, scaled, gs)
        new_ps = g.call(aten._foreach_add.List, ps, new_bs, alpha=neg_lr)
        for i in range(len(sizes)):
            g.write(bs[i], g.call(operator.getitem, new_bs, i))
            g.write(ps[i], g.call(operator.getitem, new_ps, i))
    else:
        for p, grad, b in zip(ps, gs, bs, strict=True):
            new_b = g.call(aten.add.Tensor, g.call(aten.mul.Tensor, b, momentum), grad)
            g.write(b, new_b)
            g.write(p, g.call(aten.add.Tensor, p, new_b, alpha=neg_lr))
    return g.done()


def _random(sizes: list[int], dtype: torch.dtype, seed: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(count) for n in sizes]


@settings(deadline=None, max_examples=25)
@given(
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    foreach=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_step_runs_batched_with_the_bits_of_the_node_by_node_plan(sizes, dtype, foreach, seed):
    gm = momentum_graph(sizes, dtype, foreach)
    plan = run_both(gm, [*_random(sizes, dtype, seed, 3), 0.1, 0.9], steps=3)
    # A foreach step has no per-item ops besides reading items; a for-loop one is one family.
    assert plan.program.largest == (0 if foreach else len(sizes))


def test_for_loop_ops_run_as_one_foreach_call_each_in_place():
    plan = TorchBackend().compile(momentum_graph([3, 5, 7], torch.float32, foreach=False))
    assert isinstance(plan, BatchedPlan)
    text = plan.describe()
    assert text.startswith("# torch backend, batched over lanes: 4 calls per step")
    assert "(up to 3 lanes each)" in text
    assert "_foreach_mul_.Scalar (in place)" in text and "_foreach_add_.List (in place)" in text
    assert "0 of 6 writeback(s) left" in text  # every result already sits in its input
    assert "aten.mul.Tensor" in text  # the graph itself follows the plan


def step_count_graph(lanes: int, shift: bool) -> fx.GraphModule:
    """Per lane: s = step + 1 (written back); p = p / (1 - beta ** s.item()) * s.item(),
    with the Python arithmetic per lane as the trace records it; ``shift``: p also gets
    ``value=-(s.item())`` through addcdiv (a per-lane scalar keyword)."""
    g = Builder()
    beta = g.input("beta", 0.9)
    for i in range(lanes):
        p = g.input(f"p{i}", torch.zeros(4))
        step = g.input(f"step{i}", torch.zeros(()))
        s = g.call(aten.add.Tensor, step, 1)
        g.write(step, s)
        n = g.call(aten._local_scalar_dense.default, s)
        bias = g.call(operator.sub, 1.0, g.call(operator.pow, beta, n))
        new = g.call(aten.mul.Tensor, g.call(aten.div.Tensor, p, bias), n)
        if shift:
            new = g.call(aten.addcdiv.default, new, p, p, value=g.call(operator.neg, n))
        g.write(p, new)
    return g.done()


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize(
    "steps", [[3.0, 3.0, 3.0], [1.0, 7.0, 3.0], [-1.0, -1.0, -1.0], [0.0, -0.0, 0.0]]
)
def test_per_lane_step_counts_read_as_numbers_give_the_node_by_node_bits(steps, shift):
    # The same count in every lane takes the Scalar overloads (the Python arithmetic once),
    # different counts (a parameter that joined later) the ScalarList ones; -1 + 1 makes
    # 0.0 and -0.0 + 1 as well, while 0.0 and -0.0 read before the increment below differ.
    gm = step_count_graph(3, shift)
    gen = torch.Generator().manual_seed(0)
    inputs: list[Any] = [0.9]
    for s in steps:
        inputs += [torch.randn(4, generator=gen), torch.tensor(s)]
    plan = run_both(gm, inputs, steps=3)
    assert "_local_scalar_dense.default (.item() per lane)" in plan.describe()


def test_lanes_that_read_signed_zeros_are_not_taken_for_one_value():
    g = Builder()
    for i in range(3):
        p, z = g.input(f"p{i}", torch.zeros(3)), g.input(f"z{i}", torch.zeros(()))
        g.write(p, g.call(aten.mul.Tensor, p, g.call(aten._local_scalar_dense.default, z)))
    zeros = [torch.tensor(0.0), torch.tensor(-0.0), torch.tensor(0.0)]
    inputs = [x for z in zeros for x in (torch.ones(3), z)]
    run_both(g.done(), inputs, steps=1)
    assert torch.signbit(inputs[0]).sum() == 0  # the inputs themselves are untouched


def test_a_graph_reading_across_lanes_runs_node_by_node_and_says_why():
    # A global norm: every lane's update reads all lanes' norms, so no lane's ops repeat.
    g = Builder()
    ps = [g.input(f"p{i}", torch.zeros(4)) for i in range(3)]
    norms = [g.call(aten.linalg_vector_norm.default, p) for p in ps]
    total = g.call(aten.sum.default, g.call(aten.stack.default, norms))
    for p in ps:
        g.write(p, g.call(aten.div.Tensor, p, total))
    gm = g.done()
    plan = TorchBackend().compile(gm)
    assert isinstance(plan, TorchPlan)
    assert plan.describe().startswith(
        "# torch backend, node by node (not batched: no per-parameter op sequence repeats"
    )
    inputs = [torch.randn(4) for _ in range(3)]
    expected = [p / torch.stack([q.norm() for q in inputs]).sum() for p in inputs]
    plan(inputs)
    assert all(torch.equal(a, b) for a, b in zip(inputs, expected, strict=True))


def test_a_graph_on_another_device_runs_node_by_node():
    plan = TorchBackend().compile(_scaled_graph(torch.device("meta")))
    assert isinstance(plan, TorchPlan)
    assert "its tensors live on meta" in plan.describe()


def test_a_graph_with_a_random_op_runs_node_by_node():
    g = Builder()
    for i in range(2):
        p = g.input(f"p{i}", torch.zeros(3))
        g.write(p, g.call(aten.add.Tensor, p, g.call(aten.randn_like.default, p)))
    plan = TorchBackend().compile(g.done())
    assert isinstance(plan, TorchPlan) and "draws random numbers" in plan.describe()


def _scaled_graph(device: torch.device) -> fx.GraphModule:
    g = Builder()
    for i in range(2):
        p = g.input(f"p{i}", torch.zeros(3, device=device))
        g.write(p, g.call(aten.mul.Tensor, p, 2.0))
    return g.done()


def test_an_input_still_read_later_is_not_overwritten_early():
    # mul(p) could run in place into p only if nothing read p afterwards; add reads it.
    g = Builder()
    for i in range(3):
        p, q = g.input(f"p{i}", torch.zeros(4)), g.input(f"q{i}", torch.zeros(4))
        doubled, shifted = g.call(aten.mul.Tensor, p, 2.0), g.call(aten.add.Tensor, p, 1.0)
        g.write(q, shifted)
        g.write(p, doubled)
    gm = g.done()
    plan = run_both(gm, _random([4], torch.float32, 0, 6))
    assert not plan.inplace


def test_a_result_written_to_another_input_is_not_made_in_place():
    # a * 2 goes to b and b + 1 to a: each could overwrite its first argument (nothing reads
    # it later), but its result would then live in one input and be copied into another.
    g = Builder()
    for i in range(3):
        a, b = g.input(f"a{i}", torch.zeros(4)), g.input(f"b{i}", torch.zeros(4))
        doubled, shifted = g.call(aten.mul.Tensor, a, 2.0), g.call(aten.add.Tensor, b, 1.0)
        g.write(b, doubled)
        g.write(a, shifted)
    plan = run_both(g.done(), _random([4], torch.float32, 1, 6))
    assert not plan.inplace and "6 of 6 writeback(s) left" in plan.describe()


def test_a_promoting_op_recorded_from_an_in_place_one_stays_functional():
    # The trace records x.div_(y) as div(x, y) with x's dtype in meta["val"], but the
    # functional op promotes float32 / float64 to float64: running it in place would round
    # where the node-by-node plan does not.
    g = Builder()
    for i in range(3):
        x = g.input(f"x{i}", torch.zeros((), dtype=torch.float32))
        y = g.input(f"y{i}", torch.zeros((), dtype=torch.float64))
        node = g.call(aten.div.Tensor, x, y)
        node.meta["val"] = torch.zeros((), dtype=torch.float32)
        g.write(x, node)
    inputs = [t for i in range(3) for t in (torch.tensor(1.0 + i), torch.tensor(3.0 + i).double())]
    plan = run_both(g.done(), inputs)
    assert not plan.inplace


def test_families_group_lanes_whose_op_sequences_differ_separately():
    # Weight decay on the matrices only: two families, each batched.
    g = Builder()
    for i, shape in enumerate([(2, 3), (3,), (3, 2), (2,)]):
        p, grad = g.input(f"p{i}", torch.zeros(shape)), g.input(f"g{i}", torch.zeros(shape))
        if len(shape) > 1:
            p_decayed = g.call(aten.mul.Tensor, p, 0.99)
            g.write(p, g.call(aten.add.Tensor, p_decayed, grad, alpha=-0.1))
        else:
            g.write(p, g.call(aten.add.Tensor, p, grad, alpha=-0.1))
    gm = g.done()
    program = families(gm.graph)
    assert sorted(op.lanes for op in program.ops) == [2, 2, 2]
    gen = torch.Generator().manual_seed(2)
    shapes = [(2, 3), (3,), (3, 2), (2,)]
    run_both(gm, [torch.randn(s, generator=gen) for s in shapes for _ in range(2)])


def test_outputs_of_a_batched_graph_are_returned():
    g = Builder()
    outs = []
    for i in range(3):
        x = g.input(f"x{i}", torch.zeros(2))
        outs.append(g.call(aten.mul.Tensor, x, 3.0))
    gm = g.done(outs)
    plan = run_both(gm, _random([2], torch.float32, 3, 3))
    result = plan([torch.ones(2)] * 3)
    assert type(result) is tuple and len(result) == 3
    assert torch.equal(result[0], torch.full((2,), 3.0))


# Per-tensor ops and the arguments they take, each run over three lanes: "x", "y" tensors,
# "z" a positive tensor, "s" one Python number, "S" a number per lane (read from a step
# count, the same in every lane or not).
CASES: list[tuple[Any, tuple[str, ...], dict[str, str]]] = [
    (aten.add.Tensor, ("x", "y"), {}),
    (aten.add.Tensor, ("x", "y"), {"alpha": "s"}),
    (aten.add.Tensor, ("x", "s"), {}),
    (aten.add.Tensor, ("x", "S"), {}),
    (aten.sub.Tensor, ("x", "y"), {"alpha": "s"}),
    (aten.sub.Tensor, ("x", "S"), {}),
    (aten.mul.Tensor, ("x", "y"), {}),
    (aten.mul.Tensor, ("x", "s"), {}),
    (aten.mul.Tensor, ("x", "S"), {}),
    (aten.div.Tensor, ("x", "z"), {}),
    (aten.div.Tensor, ("x", "s"), {}),
    (aten.div.Tensor, ("x", "S"), {}),
    (aten.maximum.default, ("x", "y"), {}),
    (aten.minimum.default, ("x", "y"), {}),
    (aten.clamp_min.default, ("x", "s"), {}),
    (aten.clamp_max.default, ("x", "S"), {}),
    (aten.pow.Tensor_Scalar, ("z", "s"), {}),
    (aten.pow.Tensor_Scalar, ("z", "S"), {}),
    (aten.pow.Tensor_Tensor, ("z", "y"), {}),
    (aten.pow.Scalar, ("s", "y"), {}),
    (aten.lerp.Scalar, ("x", "y", "s"), {}),
    (aten.lerp.Scalar, ("x", "y", "S"), {}),
    (aten.lerp.Tensor, ("x", "y", "z"), {}),
    (aten.addcmul.default, ("x", "y", "z"), {"value": "s"}),
    (aten.addcmul.default, ("x", "y", "z"), {"value": "S"}),
    (aten.addcdiv.default, ("x", "y", "z"), {"value": "s"}),
    (aten.addcdiv.default, ("x", "y", "z"), {"value": "S"}),
    *((getattr(aten, op).default, ("z",), {}) for op in ("sqrt", "rsqrt", "log", "reciprocal")),
    *((getattr(aten, op).default, ("x",), {}) for op in ("neg", "abs", "sign", "exp", "sigmoid")),
]


def op_graph(
    target: Any, args: tuple[str, ...], kwargs: dict[str, str], dtype: torch.dtype, into: str
) -> tuple[fx.GraphModule, Callable[[int, list[float]], list[Any]]]:
    """Three lanes of ``target``; the result written into "x" (so the op may run in place)
    or into a fourth tensor "w". Returns the graph and a function making its inputs."""
    g = Builder()
    s = g.input("s", 0.9137)  # not a float16/bfloat16 number: a Scalar rounded to it differs
    names = ("x", "y", "z", "w", "step")
    for i in range(3):
        node = {n: g.input(f"{n}{i}", torch.zeros(5, dtype=dtype)) for n in names[:4]}
        node["step"] = g.input(f"step{i}", torch.zeros(()))
        node["s"] = s
        node["S"] = g.call(aten._local_scalar_dense.default, node["step"])
        values = [node[a] for a in args]
        out = g.call(target, *values, **{k: node[v] for k, v in kwargs.items()})
        g.write(node[into], out)
    gm = g.done()

    def inputs(seed: int, steps: list[float]) -> list[Any]:
        gen = torch.Generator().manual_seed(seed)
        made: list[Any] = [0.9137]
        for i in range(3):
            x, y = (torch.randn(5, generator=gen) for _ in range(2))
            x[0], y[1] = 0.0, -0.0  # signed zeros
            z = torch.rand(5, generator=gen) + 0.25
            w = torch.randn(5, generator=gen)
            made += [t.to(dtype) for t in (x, y, z, w)] + [torch.tensor(steps[i])]
        return made

    return gm, inputs


@pytest.mark.parametrize("into", ["x", "w"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("target", "args", "kwargs"), CASES, ids=lambda c: str(c))
def test_each_op_run_as_a_foreach_op_gives_the_per_tensor_bits(target, args, kwargs, dtype, into):
    gm, inputs = op_graph(target, args, kwargs, dtype, into)
    for seed, steps in ((0, [0.3, 0.3, 0.3]), (1, [0.3, 2.7, -1.1])):
        plan = run_both(gm, inputs(seed, steps))
        ran = next(line for line in plan.describe().splitlines() if str(target) in line)
        assert "_foreach_" in ran, ran
        if into == "w":
            assert "(in place)" not in ran


@pytest.mark.parametrize("read_later", [False, True])
def test_a_foreach_node_recorded_in_place_computes_what_eager_did(read_later):
    # x.mul_(lr) over 0-dim bfloat16 xs and a float32 lr tensor, then y = x * 3.7: eager's x
    # stays bfloat16; the functional op the trace records promotes it to float32, and y would
    # be rounded once instead of twice. The plan runs eager's op in place (x written back) or,
    # where x's old value is read afterwards, on copies.
    g = Builder()
    xs = [g.input(f"x{i}", torch.zeros((), dtype=torch.bfloat16)) for i in range(3)]
    ys = [g.input(f"y{i}", torch.zeros((), dtype=torch.bfloat16)) for i in range(3)]
    lr = g.input("lr", torch.zeros(()))
    node = g.call(aten._foreach_mul.Tensor, xs, lr)
    node.meta["inplace"] = aten._foreach_mul_.Tensor
    node.meta["val"] = tuple(x.meta["val"] for x in xs)
    for i in range(3):
        item = g.call(operator.getitem, node, i)
        item.meta["val"] = xs[i].meta["val"]
        g.write(ys[i], g.call(aten.mul.Tensor, item, 3.7))
        g.write(xs[i], g.call(aten.add.Tensor, xs[i], 1.0) if read_later else item)
    plan = TorchBackend().compile(g.done())
    assert isinstance(plan, BatchedPlan)
    assert ("(on copies, as eager ran it)" if read_later else "(in place)") in plan.describe()
    values = [torch.tensor(v, dtype=torch.bfloat16) for v in (0.3, -9.45, 2.9)]
    lr_value = torch.tensor(1.013)
    scaled = [v.clone() for v in values]
    torch._foreach_mul_(scaled, lr_value)  # what eager ran
    inputs = [*(v.clone() for v in values), *(v.clone() for v in values), lr_value]
    plan(inputs)
    assert all(same_bits(y, s * 3.7) for y, s in zip(inputs[3:6], scaled, strict=True))
    xs_after = [v + 1.0 for v in values] if read_later else scaled
    assert all(same_bits(x, e) for x, e in zip(inputs[:3], xs_after, strict=True))
    promoted = torch._foreach_mul(values, lr_value)  # what the recorded op computes
    assert promoted[0].dtype == torch.float32
    assert not all(
        same_bits((p * 3.7).to(torch.bfloat16), s * 3.7)
        for p, s in zip(promoted, scaled, strict=True)
    )


def test_copies_for_eager_in_place_op_keep_a_strided_layout():
    # x.add_(g, alpha=a) on a non-contiguous bfloat16 x whose old value is read afterwards:
    # the plan runs it on a copy, which must keep x's strides (on a contiguous copy the CPU
    # kernel rounds otherwise).
    g = Builder()
    x = g.input("x", torch.zeros(66, dtype=torch.bfloat16)[::2])
    grad = g.input("g", torch.zeros(33, dtype=torch.bfloat16))
    y = g.input("y", torch.zeros(33, dtype=torch.bfloat16))
    node = g.call(aten._foreach_add.List, [x], [grad], alpha=-0.37)
    node.meta["inplace"] = aten._foreach_add_.List
    g.write(y, g.call(operator.getitem, node, 0))
    g.write(x, g.call(aten.add.Tensor, x, 1.0))
    plan = TorchBackend().compile(g.done())
    assert isinstance(plan, BatchedPlan) and "(on copies, as eager ran it)" in plan.describe()
    torch.manual_seed(0)
    base, grads = torch.randn(66).to(torch.bfloat16), torch.randn(33).to(torch.bfloat16)
    expected = base.clone()[::2]
    expected.add_(grads, alpha=-0.37)  # eager, on the strided tensor itself
    contiguous = base[::2].clone()
    contiguous.add_(grads, alpha=-0.37)
    assert not same_bits(contiguous, expected)  # (the layout matters)
    inputs = [base.clone()[::2], grads, torch.zeros(33, dtype=torch.bfloat16)]
    plan(inputs)
    assert same_bits(inputs[2], expected)


def test_direct_call_runs_the_same_op_as_the_overload():
    from optkernels._torch_compat import direct_call

    op = direct_call(aten.add.Tensor)
    assert op is not aten.add.Tensor  # the C++ callable behind it
    x, y = torch.randn(5), torch.randn(5)
    assert same_bits(op(x, y, alpha=0.3), aten.add.Tensor(x, y, alpha=0.3))
    assert direct_call(operator.add) is operator.add  # not an ATen op: itself


def test_a_family_with_the_same_arguments_in_every_lane_runs_once():
    # scalar_tensor(eta) per parameter (Rprop's index_put values): one tensor for all lanes.
    g = Builder()
    eta = g.input("eta", 1.2)
    for i in range(3):
        p = g.input(f"p{i}", torch.zeros(4))
        value = g.call(aten.scalar_tensor.default, eta, dtype=torch.float32)
        g.write(p, g.call(aten.where.self, g.call(aten.gt.Scalar, p, 0), value, p))
    plan = run_both(g.done(), [1.2, *_random([4], torch.float32, 4, 3)])
    k = next(i for i, op in enumerate(plan.program.ops) if op.target is aten.scalar_tensor.default)
    _, run = plan._steps[k]
    values = run([1.2, *(torch.zeros(4) for _ in range(3)), *plan._template])
    assert len(values) == 3 and values[0] is values[1] is values[2]
