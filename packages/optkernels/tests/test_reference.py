from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optkernels import BackendError, TorchBackend, get_backend
from torch import fx

aten = torch.ops.aten


def _sgd_graph() -> fx.GraphModule:
    """p <- p - lr * g, written back in place; returns p * 2 as a new tensor."""
    graph = fx.Graph()
    p, g = graph.placeholder("p"), graph.placeholder("g")
    new_p = graph.call_function(aten.add.Tensor, (p, g), {"alpha": -0.5})
    doubled = graph.call_function(aten.mul.Tensor, (new_p, 2.0))
    graph.call_function(aten.copy_.default, (p, new_p))
    graph.output([doubled])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_torch_plan_matches_eager_ops_and_writes_back():
    p, g = torch.randn(7), torch.randn(7)
    expected = p - 0.5 * g
    (doubled,) = TorchBackend().compile(_sgd_graph())([p, g])
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(doubled, expected * 2)


def test_plan_writes_into_a_leaf_that_requires_grad():
    p = torch.nn.Parameter(torch.ones(3))
    TorchBackend().compile(_sgd_graph())([p, torch.ones(3)])
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.5))


def test_wrong_number_of_inputs_is_refused():
    with pytest.raises(ValueError, match="takes 2 inputs, got 1"):
        TorchBackend().compile(_sgd_graph())([torch.ones(3)])


def test_describe_shows_the_ops():
    assert "aten.add.Tensor" in TorchBackend().compile(_sgd_graph()).describe()


def test_get_backend_by_name():
    assert get_backend("torch").name == "torch"
    with pytest.raises(BackendError, match="torch, triton"):
        get_backend("tpu")


def test_plan_returns_a_tuple_of_outputs():
    outs = TorchBackend().compile(_sgd_graph())([torch.ones(2), torch.ones(2)])
    assert type(outs) is tuple and len(outs) == 1


def test_a_graph_with_one_bare_output_returns_a_one_tuple():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(aten.neg.default, (x,)))
    outs = TorchBackend().compile(fx.GraphModule(torch.nn.Module(), graph))([torch.ones(2)])
    assert type(outs) is tuple and len(outs) == 1 and torch.equal(outs[0], -torch.ones(2))


def test_outputs_carry_no_autograd_history():
    p = torch.nn.Parameter(torch.ones(3))
    (doubled,) = TorchBackend().compile(_sgd_graph())([p, torch.ones(3)])
    assert not doubled.requires_grad


def test_backend_and_plan_are_named_torch():
    assert TorchBackend.name == TorchBackend().compile(_sgd_graph()).backend == "torch"


def test_describe_shows_the_trailing_copy():
    assert "aten.copy_.default" in TorchBackend().compile(_sgd_graph()).describe()


@settings(deadline=None)  # the first example pays for torch's dispatch warm-up
@given(
    shape=st.lists(st.integers(0, 4), max_size=3),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_plan_matches_the_same_aten_ops_run_eagerly(shape, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    p, g = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    new_p = aten.add.Tensor(p, g, alpha=-0.5)
    (doubled,) = TorchBackend().compile(_sgd_graph())([p, g])
    assert torch.equal(p, new_p) and torch.equal(doubled, aten.mul.Tensor(new_p, 2.0))


def _mixed_device_graph() -> fx.GraphModule:
    """p + s * g (addcmul) and p * s, s a 0-dim CPU tensor, p and g on another device."""
    graph = fx.Graph()
    p, s, g = graph.placeholder("p"), graph.placeholder("s"), graph.placeholder("g")
    p.meta["val"] = g.meta["val"] = torch.empty(3, device="meta")
    s.meta["val"] = torch.tensor(2.0)
    both = graph.call_function(aten.addcmul.default, (p, s, g))
    scaled = graph.call_function(aten.mul.Tensor, (p, s))
    graph.output([both, scaled])
    return fx.GraphModule(torch.nn.Module(), graph)


def test_cpu_scalars_move_to_the_device_of_an_op_that_refuses_them():
    """A capturable-path graph with capturable=False's CPU step counts: on CUDA, addcmul
    refuses a 0-dim CPU operand (the differential test's NAdam case, backend "triton" with
    a param the kernels do not take); binary ops take it as a scalar, as it is."""
    from optkernels.reference import TorchPlan
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, list[str]] = {}

    class Devices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            seen[func.__name__] = [t.device.type for t in tensors]
            return func(*args, **(kwargs or {}))

    plan = TorchPlan(_mixed_device_graph())
    meta = torch.empty(3, device="meta")
    with Devices():
        plan([meta, torch.tensor(2.0), meta])
    assert seen["addcmul.default"] == ["meta", "meta", "meta"]
    assert seen["mul.Tensor"] == ["meta", "cpu"]
    assert plan.kernel_launches_per_step == 2


def test_python_ops_are_not_scanned_for_devices():
    """Only ATen ops get the 0-dim-CPU-operand move; a getitem of a foreach result (whose
    argument holds the whole list's values) is returned as is, so preparing a plan is linear
    in the number of params (it was quadratic: 37 s for 2,000 params on CUDA)."""
    import operator

    from optkernels.reference import _on_device

    graph = fx.Graph()
    xs = []
    for i in range(3):
        x = graph.placeholder(f"x{i}")
        x.meta["val"] = torch.zeros(()) if i == 0 else torch.zeros(2, device="meta")
        xs.append(x)
    out = graph.call_function(torch.ops.aten._foreach_sqrt.default, (xs,))
    out.meta["val"] = [x.meta["val"] for x in xs]
    item = graph.call_function(operator.getitem, (out, 1))
    assert _on_device(item, operator.getitem) is operator.getitem
    lerp = graph.call_function(torch.ops.aten.lerp.Tensor, (xs[1], xs[2], xs[0]))
    target = torch.ops.aten.lerp.Tensor
    assert _on_device(lerp, target) is not target  # a 0-dim CPU weight beside meta tensors


def test_index_put_keeps_its_cpu_scalar_value():
    """``sign[mask] = eta`` with a 0-dim CPU float32 eta into float64 on a device: ATen reads
    the CPU value as a number in the destination's dtype; moved to the device first, the
    kernel refuses the dtypes (found on CUDA by the differential test: Rprop, Tensor etas,
    float64). The plan calls such an op as traced."""
    from optkernels.reference import _on_device

    graph = fx.Graph()
    sign, mask, eta = (graph.placeholder(n) for n in ("sign", "mask", "eta"))
    sign.meta["val"] = torch.zeros(3, dtype=torch.float64, device="meta")
    mask.meta["val"] = torch.zeros(3, dtype=torch.bool, device="meta")
    eta.meta["val"] = torch.tensor(1.2)
    for target, args in (
        (torch.ops.aten.index_put_.default, (sign, [mask], eta)),
        (torch.ops.aten.masked_fill_.Tensor, (sign, mask, eta)),
    ):
        node = graph.call_function(target, args)
        assert _on_device(node, target) is target
