"""optkernels.ahead: a plan's next call's host values computed and sent ahead, then taken
by that call (or ignored when what they came from changed), bitwise as if computed there.

The graph is a two-lane step of a capturable=False optimizer's shape: float32 step counts
on the CPU read as Python floats, a bias correction from them, a learning rate input. Under
TRITON_INTERPRET=1 the kernels run on the CPU, in host mode (the host computes the bias
corrections), and the values go into the plan's buffer by the same ``_foreach_copy_``.
"""

from __future__ import annotations

import os

import pytest
import torch
from optkernels.ahead import Ahead
from optkernels.triton_backend import TritonPlan
from torch import fx

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernels on the CPU"
)
SIZES = (5, 300)


def _graph() -> fx.GraphModule:
    """Per lane: step += 1; p -= lr * g / (1 - 0.9 ** step)."""
    graph = fx.Graph()
    lanes = []
    for i, size in enumerate(SIZES):
        p, g = graph.placeholder(f"p{i}"), graph.placeholder(f"g{i}")
        p.meta["val"], g.meta["val"] = torch.ones(size), torch.ones(size)
        step = graph.placeholder(f"step{i}")
        step.meta.update(val=torch.tensor(1.0), python_float=True)
        lanes.append((p, g, step))
    lr = graph.placeholder("lr")
    lr.meta["val"] = 0.1
    for p, g, step in lanes:
        new_step = graph.call_function(aten.add.Tensor, (step, 1))
        power = graph.call_function(aten.pow.Scalar, (0.9, new_step))
        correction = graph.call_function(aten.rsub.Scalar, (power, 1))
        scaled = graph.call_function(aten.mul.Tensor, (g, lr))
        update = graph.call_function(aten.div.Tensor, (scaled, correction))
        graph.call_function(
            aten.copy_.default, (p, graph.call_function(aten.sub.Tensor, (p, update)))
        )
        graph.call_function(aten.copy_.default, (step, new_step))
    graph.output([])
    return fx.GraphModule(torch.nn.Module(), graph)


def _inputs(steps: tuple[float, float] = (0.0, 0.0)) -> list[object]:
    torch.manual_seed(0)
    out: list[object] = []
    for size, step in zip(SIZES, steps, strict=True):
        out += [torch.randn(size), torch.randn(size), torch.tensor(step)]
    return [*out, 0.1]


def _with(inputs: list[object], lr: float, seed: int) -> list[object]:
    """``inputs`` with new grads and learning rate (params and step counts stay)."""
    gen = torch.Generator().manual_seed(seed)
    out = list(inputs)
    for i in (1, 4):
        out[i] = torch.randn(SIZES[i // 3], generator=gen)
    out[-1] = lr
    return out


def _equal(a: list[object], b: list[object]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[:-1], b[:-1], strict=True))  # type: ignore[arg-type]


def test_values_sent_ahead_are_taken_and_give_the_same_bits():
    gm = _graph()
    sent_plan, own_plan = TritonPlan(gm), TritonPlan(gm)
    sent, own = _inputs(), _inputs()
    ahead = Ahead()
    for call in range(5):
        lr = 0.1 * 0.7**call
        sent, own = _with(sent, lr, call), _with(own, lr, call)
        if call:  # (a plan's first call settles where its values live)
            assert sent_plan.ahead_inputs() == [6]
            assert ahead.stage([(sent_plan, [None] * 6 + [lr])]) == 1
        sent_plan(sent)
        own_plan(own)
        assert sent_plan.host and _equal(sent, own), call
    assert sent_plan.ahead_counts == (4, 4)
    assert own_plan.ahead_counts == (0, 0)
    assert ahead.rounds == 4


def test_a_call_whose_scalars_or_step_counts_changed_computes_its_own_values():
    gm = _graph()
    sent_plan, own_plan = TritonPlan(gm), TritonPlan(gm)
    sent, own = _inputs((3.0, 3.0)), _inputs((3.0, 3.0))
    sent_plan(sent)
    own_plan(own)
    ahead = Ahead()
    ahead.stage([(sent_plan, [None] * 6 + [0.1])])
    sent, own = _with(sent, 0.05, 1), _with(own, 0.05, 1)  # another lr than sent
    sent_plan(sent)
    own_plan(own)
    assert sent_plan.ahead_counts == (1, 0) and _equal(sent, own)
    ahead.stage([(sent_plan, [None] * 6 + [0.05])])
    for inputs in (sent, own):  # one lane's count moved in place since
        inputs[5].fill_(1.0)  # type: ignore[union-attr]
    sent_plan(sent)
    own_plan(own)
    assert sent_plan.ahead_counts == (2, 0) and _equal(sent, own)
    ahead.stage([(sent_plan, [None] * 6 + [0.05])])  # lanes now differ: row per lane
    sent_plan(sent)
    own_plan(own)
    assert sent_plan.ahead_counts == (3, 1) and _equal(sent, own)


def test_a_plan_without_host_values_sends_nothing_ahead():
    gm = _graph()
    plan = TritonPlan(gm, host_small=False)
    inputs = _inputs()
    plan(inputs)
    assert plan.ahead_inputs() is None
    assert Ahead().stage([(plan, [None] * 6 + [0.1])]) == 0


def test_values_whose_copy_failed_are_not_taken(monkeypatch):
    gm = _graph()
    sent_plan, own_plan = TritonPlan(gm), TritonPlan(gm)
    sent, own = _inputs(), _inputs()
    sent_plan(sent)
    own_plan(own)

    def failing(*args: object) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(torch, "_foreach_copy_", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        Ahead().stage([(sent_plan, [None] * 6 + [0.1])])
    monkeypatch.undo()
    sent, own = _with(sent, 0.1, 1), _with(own, 0.1, 1)
    sent_plan(sent)
    own_plan(own)
    assert sent_plan.ahead_counts == (1, 0) and _equal(sent, own)
