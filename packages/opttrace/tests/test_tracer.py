from __future__ import annotations

import collections
import dataclasses
import types

import pytest
import torch
from optguard import LocalSource
from optsidefx import Input, Output, Return, TensorWrite
from opttrace import TraceError, init_state, trace, trace_step
from opttrace.view import is_plain_object

ATEN = torch._ops.OpOverload


def _call_targets(traced):
    return [n.target for n in traced.graph.nodes if n.op == "call_function"]


def test_adamw_foreach_traces_to_aten_ops_only(params):
    traced = trace_step(torch.optim.AdamW(params, lr=1e-3, foreach=True))
    targets = _call_targets(traced)
    assert targets
    # ATen ops on tensors; Python operators on symbolic hyperparameters (1 - beta1, ...).
    assert all(isinstance(t, ATEN) or t.__module__ == "_operator" for t in targets)
    assert any("_foreach_" in str(t) for t in targets)


def test_adamw_for_loop_has_no_foreach_ops(params):
    traced = trace_step(torch.optim.AdamW(params, lr=1e-3, foreach=False))
    assert not any("_foreach_" in str(t) for t in _call_targets(traced))


def test_step_writes_params_and_state_through_trailing_copies(params):
    traced = trace_step(torch.optim.AdamW(params, lr=1e-3, foreach=True))
    writes = [e.target.name() for e in traced.effects if isinstance(e, TensorWrite)]
    assert "L['opt'].param_groups[0]['params'][0]" in writes
    assert "L['opt'].state[L['opt'].param_groups[0]['params'][2]]['exp_avg_sq']" in writes
    nodes = list(traced.graph.nodes)
    copies = [n for n in nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == len(writes) == 3 * 4  # param, step, exp_avg, exp_avg_sq per param
    assert nodes[-len(copies) - 1 : -1] == copies  # all writes come last, before the output


def test_eager_path_reads_step_counts_as_graph_scalars_not_constants(params):
    traced = trace_step(torch.optim.AdamW(params, lr=1e-3, foreach=False))
    reads = [
        n for n in traced.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default
    ]
    # step + 1, read back as eager's step.item() does, once per parameter
    assert len(reads) == len(params)
    for read in reads:
        incremented = read.args[0]
        assert incremented.target is torch.ops.aten.add.Tensor
        assert incremented.args[0].op == "placeholder"
        assert incremented.args[0].name.endswith("_step")
    assert not traced.capturable


def test_capturable_trace_keeps_every_value_on_the_device(params):
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    init_state(opt)
    step = torch.optim.AdamW.step.__wrapped__  # without torch.optim's hook wrapper
    traced = trace(lambda opt: step(opt), {"opt": opt}, capturable=True)
    assert torch.ops.aten._local_scalar_dense.default not in _call_targets(traced)
    assert traced.capturable


def test_radam_falls_back_to_its_capturable_path_when_eager_decides_on_step_counts(params):
    # its foreach path decides per parameter in Python; its for-loop's one decision is
    # traced as an exact select on eager's own path (opttrace.radam)
    assert trace_step(torch.optim.RAdam(params, lr=1e-3, foreach=True)).capturable
    assert not trace_step(torch.optim.RAdam(params, lr=1e-3, foreach=False)).capturable


def test_placeholders_are_named_after_their_sources(params):
    traced = trace_step(torch.optim.SGD(params, lr=0.1))
    names = [n.name for n in traced.graph.nodes if n.op == "placeholder"]
    assert names[0] == "opt_param_groups_0_params_0"
    assert [s.name() for s in traced.input_sources][:2] == [
        "L['opt'].param_groups[0]['params'][0]",
        "L['opt'].param_groups[0]['params'][0].grad",
    ]


def test_params_without_grad_are_not_inputs(params):
    params[1].grad = None
    traced = trace_step(torch.optim.SGD(params, lr=0.1))
    assert "L['opt'].param_groups[0]['params'][1]" not in [s.name() for s in traced.input_sources]
    assert "L['opt'].param_groups[0]['params'][1].grad is None" in traced.guards.describe()


def test_function_over_tensor_list_returns_new_tensors_and_writes_inputs():
    def update(xs, ys, alpha):
        torch._foreach_add_(xs, ys, alpha=alpha)
        return torch._foreach_mul(xs, 2.0)

    xs = [torch.ones(3), torch.ones(2)]
    ys = [torch.ones(3), torch.ones(2)]
    traced = trace(update, {"xs": xs, "ys": ys, "alpha": 0.5})
    assert traced.num_outputs == 2
    ret = next(e for e in traced.effects if isinstance(e, Return))
    assert ret.value.items == (Output(0), Output(1))
    assert "L['alpha'] is a float" in traced.guards.describe()
    assert traced.input_sources[-1] == LocalSource("alpha")  # a graph input, not a constant
    assert {e.target.name() for e in traced.effects if isinstance(e, TensorWrite)} == {
        "L['xs'][0]",
        "L['xs'][1]",
    }


def test_returning_an_input_resolves_to_that_input():
    traced = trace(lambda x: x, {"x": torch.ones(2)})
    ret = next(e for e in traced.effects if isinstance(e, Return))
    assert ret.value == Input(LocalSource("x"))


def test_control_flow_on_tensor_value_names_file_and_line():
    def step(x):
        if x.sum() > 0:  # data-dependent: cannot be traced
            return x * 2
        return x

    try:
        trace(step, {"x": torch.ones(2)})
    except TraceError as exc:
        assert exc.where is not None and exc.where.endswith(f"{step.__code__.co_firstlineno + 1}")
        assert __file__ in exc.where
        assert "tensor's value" in exc.reason
    else:
        raise AssertionError("expected a TraceError")


def test_is_compiling_reports_true_only_inside_a_capturable_trace():
    seen = types.SimpleNamespace(values=())  # attributes of a captured object: not audited

    def fn(x):
        seen.values = (*seen.values, torch.compiler.is_compiling())
        return x + 1

    trace(fn, {"x": torch.ones(2)})
    trace(fn, {"x": torch.ones(2)}, capturable=True)
    assert seen.values == (False, True)
    assert torch.compiler.is_compiling() is False


@torch.library.custom_op("opttrace_test::halve", mutates_args=())
def _halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@torch.library.custom_op("opttrace_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x * 3  # no fake (meta) implementation registered


@_halve.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_custom_op_with_a_fake_implementation_is_traced_as_one_node():
    traced = trace(lambda x: _halve(x) + 1, {"x": torch.ones(3)})
    assert torch.ops.opttrace_test.halve.default in _call_targets(traced)


def test_op_without_meta_kernel_names_the_op_file_and_line():
    def step(x):
        return _opaque(x)  # the op has no meta kernel

    try:
        trace(step, {"x": torch.ones(2)})
    except TraceError as exc:
        assert "opttrace_test.opaque" in exc.reason and "meta" in exc.reason
        assert exc.where == f"{__file__}:{step.__code__.co_firstlineno + 1}"
    else:
        raise AssertionError("expected a TraceError")


def test_mutating_a_captured_list_is_refused_and_undone():
    log = []

    def fn(x):
        log.append(1)
        return x + 1

    try:
        trace(fn, {"x": torch.ones(2)})
    except TraceError as exc:
        assert "closure variable 'log'" in exc.reason
    else:
        raise AssertionError("expected a TraceError")
    assert log == []


def test_a_list_passed_in_is_tracked_and_its_append_recorded():
    def fn(x, out):
        out.append(x * 2)

    traced = trace(fn, {"x": torch.ones(2), "out": []})
    calls = [e for e in traced.effects if type(e).__name__ == "Call"]
    assert [(c.method, c.target.source.name()) for c in calls] == [("append", "L['out']")]


def test_min_and_max_over_a_value_read_from_a_tensor_are_graph_nodes_not_decisions():
    # Adafactor: max(eps2, p.norm().item() / ...) and min(lr, 1 / step.item() ** 0.5).
    def step(x, lr):
        scale = max(0.5, x.norm().item(), 0.25) * min([lr, 1 / x.sum().item()])
        x.mul_(scale)

    traced = trace(step, {"x": torch.ones(4), "lr": 0.1})
    assert max in _call_targets(traced) and min in _call_targets(traced)
    # No decision taken, so no guard on a value: the graph decides, every call.
    kinds = {type(g).__name__ for g in traced.guards.guards}
    assert kinds == {"TensorMatchGuard", "FloatGuard", "AutocastGuard"}
    for values, lr in (([1.0, 1.0, 1.0, 1.0], 0.1), ([0.1, 0.0, 0.0, 0.0], 100.0)):
        x, expected = torch.tensor(values), torch.tensor(values)
        expected.mul_(max(0.5, expected.norm().item(), 0.25) * min([lr, 1 / expected.sum().item()]))
        traced.graph_module(x, lr)
        torch.testing.assert_close(x, expected)


def test_a_cxx_cache_key_comparison_of_values_read_from_tensors_is_by_node_not_a_decision():
    # DTensor's C++ sharding cache, on equal key hashes, compares two keys' scalars with
    # c10's SymFloat::operator== (which passes its header as the file): same node, same key.
    def step(x, y):
        a, b = x.sum().item(), y.sum().item()
        key = ("/src/c10/core/SymFloat.h", 59)
        answers = [
            a.node.eq(a.node).guard_bool(*key),
            a.node.eq(b.node).guard_bool(*key),
            a.node.ne(a.node).guard_bool(*key),
            a.node.ne(b.node).guard_bool(*key),
        ]
        x.mul_(sum(int(answer) * 10**i for i, answer in enumerate(answers)))
        y.mul_(2.0)

    traced = trace(step, {"x": torch.ones(2), "y": torch.ones(2)})  # equal values: not asked
    guards = {type(g).__name__ for g in traced.guards.guards}
    assert not guards & {"PredicateGuard", "ConstantGuard"}, guards
    x = torch.ones(2)
    traced.graph_module(x, torch.ones(2))
    torch.testing.assert_close(x, torch.full((2,), 1001.0))  # same: ==; different: !=

    def deciding(x, y):  # the same comparison from Python code is a decision: refused
        if x.sum().item() == y.sum().item():
            x.mul_(2)

    with pytest.raises(TraceError, match="decision on a tensor's value"):
        trace(deciding, {"x": torch.ones(2), "y": torch.ones(2)})


def test_min_and_max_in_the_graph_keep_pythons_order_of_operands_for_nan():
    def step(x, y):
        x.mul_(max(0.5, x.sum().item()))  # max(0.5, nan) is 0.5; max(nan, 0.5) would be nan
        y.mul_(min(2.0, y.sum().item()))

    traced = trace(step, {"x": torch.ones(2), "y": torch.ones(2)})
    x, y = torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0])
    traced.graph_module(x, y)
    torch.testing.assert_close(x, torch.tensor([float("nan"), 0.5]), equal_nan=True)
    torch.testing.assert_close(y, torch.tensor([float("nan"), 2.0]), equal_nan=True)


def test_the_builtins_min_and_max_are_themselves_outside_a_trace_and_for_other_values():
    import builtins

    min_before, max_before = builtins.min, builtins.max

    def step(x, lr):
        # Plain values, a key=, a decision on a hyperparameter: the builtins as usual.
        assert min([3, 1, 2]) == 1 and max("ab", "b", key=len) == "ab"
        x.mul_(min(lr, 0.5))

    traced = trace(step, {"x": torch.ones(2), "lr": 0.1})
    assert min not in _call_targets(traced)  # lr < 0.5 is a guarded decision
    assert {type(g).__name__ for g in traced.guards.guards} > {"TensorMatchGuard", "FloatGuard"}
    assert builtins.min is min_before and builtins.max is max_before

    def failing(x):
        raise RuntimeError("boom")

    with pytest.raises(TraceError):
        trace(failing, {"x": torch.ones(2)})
    assert builtins.min is min_before and builtins.max is max_before


def test_a_sparse_tensor_input_is_refused_naming_it_and_its_layout():
    weight = torch.nn.Parameter(torch.randn(10, 4))
    weight.grad = torch.sparse_coo_tensor(
        [[1, 3]], torch.randn(2, 4), (10, 4), check_invariants=True
    )
    opt = torch.optim.SparseAdam([weight])
    with pytest.raises(TraceError, match=r"\['params'\]\[0\]\.grad is a sparse_coo tensor"):
        trace_step(opt)


@dataclasses.dataclass
class _Plain:
    x: float = 1.0


@dataclasses.dataclass(frozen=True)
class _Frozen:
    x: float = 1.0


class _Slotted:
    __slots__ = ("x",)


class _Hooked:
    def __getattr__(self, name: str) -> float:
        return 1.0


@pytest.mark.parametrize(
    ("make", "plain"),
    [
        (_Plain, True),
        (lambda: types.SimpleNamespace(x=1.0), True),
        (_Frozen, False),  # its own __setattr__
        (_Slotted, False),
        (_Hooked, False),
        (lambda: torch.nn.Linear(2, 2), False),
        (lambda: _Plain.__init__, False),
        (lambda: torch.zeros(1), False),
        (lambda: collections.namedtuple("P", "x")(1.0), False),
        (lambda: torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), False),
    ],
)
def test_plain_objects_are_those_a_tracking_view_can_stand_in_for(make, plain):
    assert is_plain_object(make()) is plain


class _NoCompilePath(torch.optim.Optimizer):
    """A step whose compile path (``torch.compiler.is_compiling()``) fails, as torch
    2.11's foreach Adafactor does on the ungrouped lists it gets there."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self):
        if torch.compiler.is_compiling():
            raise AssertionError("dtype is needed to compute eps1 when eps1 is unset")
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


def test_a_capturable_trace_that_fails_falls_back_to_the_path_eager_takes(params):
    traced = trace_step(_NoCompilePath(params), capturable=True)
    assert traced.capturable is False
    assert any("add" in str(t) for t in _call_targets(traced))
