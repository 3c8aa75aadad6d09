"""The recorder: functional graphs from in-place code, aliasing, foreach lists, metadata."""

from __future__ import annotations

import operator
import random
import types

import pytest
import torch
from opttrace import TraceError, trace

aten = torch.ops.aten


def _targets(traced):
    return [n.target for n in traced.graph.nodes if n.op == "call_function"]


def _run(traced, *inputs):
    """Run the traced graph with the torch ops it names (the reference semantics)."""
    return traced.graph_module(*inputs)


def test_in_place_ops_become_functional_ops_and_one_trailing_write():
    def step(x):
        x.mul_(2).add_(1)

    traced = trace(step, {"x": torch.ones(3)})
    targets = _targets(traced)
    assert targets == [aten.mul.Tensor, aten.add.Tensor, aten.copy_.default]
    x = torch.full((3,), 2.0)
    _run(traced, x)
    torch.testing.assert_close(x, torch.full((3,), 5.0))


def test_out_variant_is_recorded_functionally_and_rebinds_out():
    def step(a, b, out):
        torch.maximum(a, b, out=out)
        return out * 1

    traced = trace(step, {"a": torch.zeros(2), "b": torch.ones(2), "out": torch.empty(2)})
    assert aten.maximum.default in _targets(traced)
    assert aten.maximum.out not in _targets(traced)


def test_a_foreach_result_list_feeds_the_next_foreach_op_as_one_node():
    def step(xs):
        ys = torch._foreach_mul(xs, 2.0)
        return torch._foreach_add(ys, 1.0)

    traced = trace(step, {"xs": [torch.ones(2), torch.ones(3), torch.ones(4)]})
    add = next(n for n in traced.graph.nodes if n.target is aten._foreach_add.Scalar)
    assert add.args[0].target is aten._foreach_mul.Scalar  # not a list of three getitems
    getitems = [n for n in traced.graph.nodes if n.target is operator.getitem]
    assert len(getitems) == 3  # only for the returned tensors


def test_a_foreach_node_records_its_items_and_a_foreach_norm_gives_0_dim_items():
    def step(xs):
        norms = torch._foreach_norm(xs)
        scaled = torch._foreach_mul(xs, norms)
        torch._foreach_add_(xs, scaled)
        return torch.stack(norms)

    xs = [torch.ones(2), torch.ones(3, 4)]
    traced = trace(step, {"xs": xs})
    nodes = {n.target: n for n in traced.graph.nodes}
    norm = nodes[aten._foreach_norm.Scalar]
    assert [tuple(v.shape) for v in norm.meta["val"]] == [(), ()]
    mul = nodes[aten._foreach_mul.List]
    assert [tuple(v.shape) for v in mul.meta["val"]] == [(2,), (3, 4)]
    out = _run(traced, *[x.clone() for x in xs])
    torch.testing.assert_close(out[0], torch.tensor([2**0.5, 12**0.5]))


def test_writes_through_a_full_alias_reach_the_aliased_input():
    def step(x):
        x.detach().add_(1)
        return x * 2

    traced = trace(step, {"x": torch.ones(3)})
    x = torch.ones(3)
    (doubled,) = _run(traced, x)
    torch.testing.assert_close(x, torch.full((3,), 2.0))
    torch.testing.assert_close(doubled, torch.full((3,), 4.0))


WRITES_THROUGH_VIEWS = {
    "slice": lambda x: x[:, 1:3].add_(1),
    "select": lambda x: x[1].mul_(3),
    "transpose": lambda x: x.T.div_(torch.arange(1.0, 4.0)),
    "view then slice": lambda x: x.view(-1)[2:9].sub_(0.5),
    "diagonal": lambda x: x.diagonal().fill_(7),
    "split": lambda x: x.split(1)[1].add_(10),
    "split, then a slice": lambda x: x.split(2)[1][:, 1:].add_(1),
    "unbind": lambda x: x.unbind(1)[3].neg_(),
    "two writes, one foreach": lambda x: torch._foreach_add_([x[0], x[2]], [1.0, 2.0]),
    "view of a view, then the base": lambda x: (x[1:][:, :2].mul_(2), x.add_(1)),
}


@pytest.mark.parametrize("name", sorted(WRITES_THROUGH_VIEWS))
def test_a_write_through_a_view_writes_its_base(name):
    write = WRITES_THROUGH_VIEWS[name]

    def step(x):
        write(x)
        return x * 1  # reads the base after the write

    x0 = torch.arange(12.0).reshape(3, 4)
    traced = trace(step, {"x": x0.clone()})
    expected = x0.clone()
    write(expected)
    x = x0.clone()
    (out,) = _run(traced, x)
    torch.testing.assert_close(x, expected)
    torch.testing.assert_close(out, expected)


def test_a_write_through_a_view_of_an_intermediate_reaches_what_reads_it_later():
    # Muon: ortho = grad.bfloat16(); ortho = ortho.T (if tall); ortho.div_(ortho.norm())
    def step(g):
        base = g * 2
        view = base.T
        view.div_(view.norm())
        return base, view @ view.T

    g = torch.randn(5, 3)
    traced = trace(step, {"g": g})
    base, gram = _run(traced, g)
    expected = g * 2
    expected.T.div_(expected.norm())
    torch.testing.assert_close(base, expected)
    torch.testing.assert_close(gram, expected.T @ expected)


def test_a_write_through_a_strided_view_is_refused_naming_the_view_op():
    def step(x):
        x.as_strided((2,), (2,)).add_(1)

    with pytest.raises(TraceError, match=r"through a view made by aten\.as_strided"):
        trace(step, {"x": torch.ones(4)})


def test_a_write_through_a_small_slice_of_a_large_tensor_is_refused_as_too_costly():
    # A flat buffer written piece by piece: each write would copy all of it in the graph.
    def step(flat, x):
        flat[10:20].copy_(x)

    with pytest.raises(TraceError, match=r"\(10 of 100000 elements\).*copy the whole tensor"):
        trace(step, {"flat": torch.zeros(100_000), "x": torch.ones(10)})

    def transpose(big):  # a full view of a large tensor is no copy: fine
        big.T.mul_(2)

    trace(transpose, {"big": torch.ones(400, 300)})


def test_another_view_of_the_base_goes_stale_after_a_write_through_one_view():
    def step(x):
        head, tail = x[:2], x[2:]
        head.add_(1)
        return tail * 2

    with pytest.raises(TraceError, match="after writing that tensor in place"):
        trace(step, {"x": torch.ones(4)})


def test_using_a_view_after_its_base_was_written_is_refused():
    def step(x):
        head = x[:2]
        x.add_(1)
        return head * 2

    with pytest.raises(TraceError, match="after writing that tensor in place"):
        trace(step, {"x": torch.ones(3)})


def test_a_view_taken_and_used_before_the_write_is_fine():
    def step(x):
        doubled_head = x[:2] * 2
        x.add_(1)
        return doubled_head

    traced = trace(step, {"x": torch.ones(3)})
    x = torch.ones(3)
    (out,) = _run(traced, x)
    torch.testing.assert_close(out, torch.full((2,), 2.0))
    torch.testing.assert_close(x, torch.full((3,), 2.0))


def test_writing_in_place_to_a_tensor_that_is_not_an_input_is_refused():
    hidden = torch.zeros(1)

    def step(x):
        hidden.add_(x.sum())

    with pytest.raises(TraceError):
        trace(step, {"x": torch.ones(3)})


def test_output_metadata_follows_type_promotion_and_broadcasting():
    def step(x, h):
        return x * h, (x > 0), x.sum(0)

    traced = trace(step, {"x": torch.ones(4, 3), "h": torch.ones(3, dtype=torch.float64)})
    vals = [n.meta["val"] for n in traced.graph.output_node().args[0]]
    assert (vals[0].dtype, tuple(vals[0].shape)) == (torch.float64, (4, 3))
    assert vals[1].dtype is torch.bool
    assert tuple(vals[2].shape) == (3,)


def test_traced_tensors_report_the_real_device_and_no_storage():
    seen = types.SimpleNamespace()  # attributes of a captured object: not audited

    def step(x):
        seen.device = x.device
        seen.type = type(x).__name__
        return x + 1

    trace(step, {"x": torch.ones(2)})
    assert (seen.device, seen.type) == (torch.device("cpu"), "TracedTensor")


@pytest.mark.parametrize("write", [lambda t: t.square_(), lambda t: t.pow_(3), lambda t: t.pow_(t)])
def test_in_place_powers_record_the_overload_with_the_same_arguments(write):
    # pow_.Scalar(Tensor self, Scalar exponent) is pow.Tensor_Scalar: pow.Scalar takes a
    # Scalar base, and running it on a tensor fails (or worse).
    def step(x):
        write(x)

    traced = trace(step, {"x": torch.ones(3)})
    assert aten.pow.Scalar not in _targets(traced)
    x, expected = torch.tensor([0.5, 2.0, 3.0]), torch.tensor([0.5, 2.0, 3.0])
    write(expected)
    _run(traced, x)
    torch.testing.assert_close(x, expected)


def test_recorded_nodes_have_unique_names_and_the_graph_lints():
    def step(x, y):
        for _ in range(3):
            x.mul_(y).add_(1)  # the same stems again and again

    traced = trace(step, {"x": torch.ones(3), "y": torch.full((3,), 2.0)})
    names = [n.name for n in traced.graph.nodes]
    assert len(set(names)) == len(names)
    traced.graph.lint()  # users, insert order, names: as fx's create_node makes them
    later = traced.graph.create_node("call_function", aten.mul.Tensor, name="mul")
    assert later.name not in names
    x = torch.ones(3)
    _run(traced, x, torch.full((3,), 2.0))
    torch.testing.assert_close(x, torch.full((3,), 15.0))


def test_the_dispatch_mode_runs_without_dynamo_s_disable_wrapper():
    from opttrace.recorder import Recorder

    assert Recorder.__dict__["__torch_dispatch__"].__qualname__ == "Recorder.__torch_dispatch__"


def test_appended_nodes_are_named_as_fx_names_them():
    from opttrace import _torch_compat as compat
    from torch import fx

    stems = ["mul_tensor", "abs", "x_1", "x", "mul_tensor_2", "if", "x_y", "mul_tensor_1"]
    rng = random.Random(0)
    for _ in range(20):
        ours, theirs = fx.Graph(), fx.Graph()
        for stem in rng.choices(stems, k=40):
            compat.append_node(ours, "call_function", stem, aten.relu.default)
            theirs.create_node("call_function", aten.relu.default, name=stem)
        assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]
        ours.lint()


def test_placeholders_are_named_as_fx_names_them():
    from opttrace import _torch_compat as compat
    from torch import fx

    stems = ["opt_params_0", "opt_params_0_grad", "x_1", "x", "if", "print", "_5", "a__7"]
    stems += ["opt_params", "x_", "2x", "a-b", "x_01", "opt_params_1", "\u00e9_1"]
    rng = random.Random(0)
    for _ in range(20):
        ours, theirs = fx.Graph(), fx.Graph()
        last: fx.Node | None = None
        their_last: fx.Node | None = None
        for stem in rng.choices(stems, k=30):
            if rng.random() < 0.3:
                compat.append_node(ours, "call_function", stem, aten.relu.default)
                theirs.create_node("call_function", aten.relu.default, name=stem)
                continue
            last = compat.append_placeholder(ours, stem, last)
            where = theirs.inserting_before(None) if their_last is None else None
            with where or theirs.inserting_after(their_last):
                their_last = theirs.placeholder(stem)
        assert [n.name for n in ours.nodes] == [n.name for n in theirs.nodes]
        assert [n.target for n in ours.nodes] == [n.target for n in theirs.nodes]
        ours.lint()


def _graph_text(traced):
    """Each node's name, op, target, arguments and metadata (values as their layout)."""

    def shown(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.stride(), value.dtype, value.device)
        if isinstance(value, list | tuple):
            return tuple(shown(v) for v in value)
        return value if isinstance(value, int | float | bool | str) else type(value).__name__

    return [
        (
            n.name,
            n.op,
            str(n.target),
            str(n.args),
            str(n.kwargs),
            *[(k, shown(v)) for k, v in n.meta.items() if k != "source"],
        )
        for n in traced.graph.nodes
    ]


def _adam_like(params, grads, avgs, lr, beta):
    for p, g, m in zip(params, grads, avgs, strict=True):
        m.lerp_(g, 1 - beta)
        p.mul_(1 - lr * 0.01)
        denom = (m * m).sqrt().add_(1e-8)
        p.addcdiv_(m, denom, value=-lr)
        p.add_(g, alpha=2)
        m.add_(1)


class _Forgetful(dict):
    """A plan cache that keeps nothing: every op recorded step by step."""

    def __setitem__(self, key, value):
        pass


def test_ops_repeated_per_parameter_record_what_a_trace_without_plans_records(monkeypatch):
    """Later parameters of a layout take the first's op plans (float32 and bfloat16 ones,
    two shapes): the graph equals one recorded without plans (names, targets, arguments,
    metadata), and runs to eager's values."""
    from opttrace import meta

    dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    shapes = [(4, 4), (4, 4), (4, 4), (3,), (4, 4)]

    def inputs():
        torch.manual_seed(0)
        return {
            "params": [torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)],
            "grads": [torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)],
            "avgs": [torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)],
            "lr": 0.1,
            "beta": 0.9,
        }

    meta.clear_cache()
    planned = trace(_adam_like, inputs())
    assert len(meta.PLANS) >= 8  # (each op planned once per layout and scalar kinds)
    monkeypatch.setattr(meta, "PLANS", _Forgetful())
    unplanned = trace(_adam_like, inputs())
    assert _graph_text(planned) == _graph_text(unplanned)
    ours, eager = inputs(), inputs()
    _run(planned, *(source.fetch(ours) for source in planned.input_sources))
    _adam_like(**eager)
    for name in ("params", "avgs"):
        for mine, theirs in zip(ours[name], eager[name], strict=True):
            torch.testing.assert_close(mine, theirs)


def test_a_planned_in_place_op_leaves_the_views_of_what_it_writes_stale():
    def step(x, y):
        x.mul_(2)  # (planned here)
        head = y[:2]
        y.mul_(2)  # (from the plan)
        return head * 2

    with pytest.raises(TraceError, match="after writing that tensor in place"):
        trace(step, {"x": torch.ones(3), "y": torch.ones(3)})


def test_a_planned_in_place_op_writes_a_full_alias_s_input():
    def step(x, y):
        x.mul_(2)
        y.detach().mul_(3)  # (the plan of mul_ on a tensor of x's layout, through an alias)

    traced = trace(step, {"x": torch.ones(3), "y": torch.ones(3)})
    x, y = torch.ones(3), torch.ones(3)
    _run(traced, x, y)
    torch.testing.assert_close(y, torch.full((3,), 3.0))


def test_an_op_s_plan_is_per_scalar_kind_and_layout():
    def step(i, j, h):
        return i * 2, j * 2.5, i * 3, h * 2.5, h[:, :1] * 2.5

    traced = trace(
        step,
        {
            "i": torch.ones(2, 2, dtype=torch.int64),
            "j": torch.ones(2, 2, dtype=torch.int64),
            "h": torch.ones(2, 2, dtype=torch.float16),
        },
    )
    vals = [n.meta["val"] for n in traced.graph.output_node().args[0]]
    assert [v.dtype for v in vals] == [torch.int64, torch.float32, torch.int64] + [
        torch.float16
    ] * 2
    assert [tuple(v.shape) for v in vals] == [(2, 2)] * 4 + [(2, 1)]
