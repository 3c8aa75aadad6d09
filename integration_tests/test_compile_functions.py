"""optcompile.compile(fn) on functions, and how untraceable steps are reported.

Functions: a training step that calls ``opt.step(closure)`` (the closure runs forward and
backward), a functional foreach update over lists of params and grads called with changing
Python floats (one trace), and a function that returns its input (the caller gets the same
object back).

Errors: a custom optimizer that branches in Python on a tensor value, and one that calls
``.item()``. With ``fullgraph=True`` the step raises ``opttrace.TraceError`` naming this file,
the line of the offending statement and a reason; without it, the step runs eagerly with
exactly one ``FallbackWarning`` saying the same, and its results equal eager's.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, set_grads, small_model
from opttrace import TraceError

# --- (a) a training step calling opt.step(closure) ------------------------------------------


def train_step(params: list[torch.Tensor], opt: torch.optim.Optimizer, closure: Any) -> Any:
    return opt.step(closure)


def _closure(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return closure


def _run_train_steps(steps: int = 3) -> tuple[Any, ...]:
    model = small_model()
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    compiled_step = optcompile.compile(train_step, backend="torch")
    closure, eager_closure = _closure(model, opt, x), _closure(reference, eager, x)
    losses, eager_losses = [], []
    for _ in range(steps):
        losses.append(compiled_step(list(model.parameters()), opt, closure))
        eager_losses.append(train_step(list(reference.parameters()), eager, eager_closure))
    return model, opt, reference, eager, compiled_step, losses, eager_losses


def test_train_step_with_closure_matches_eager_and_returns_the_loss():
    model, opt, reference, eager, _, losses, eager_losses = _run_train_steps()
    for loss, eager_loss in zip(losses, eager_losses, strict=True):
        assert isinstance(loss, torch.Tensor)
        torch.testing.assert_close(loss.detach(), eager_loss.detach())
    # The loss went down: the closure's backward fed the update.
    assert eager_losses[-1] < eager_losses[0]
    assert_same(model, opt, reference, eager)


def test_train_step_with_closure_is_compiled():
    _, opt, *_, compiled_step, _, _ = _run_train_steps()
    report = optcompile.explain(compiled_step)
    assert report.fallback_reason is None
    # The first call sees params without grads (the closure makes them): one retrace, no more.
    assert report.traces == 2, report.retrace_reasons
    assert report.retrace_reasons == ["L['params'][0].grad: became a tensor (was None)"]
    # The function replays the optimizer's step as a call; that step is itself compiled.
    assert "result_0 = opt.step(closure)" in report.replay_code
    step_report = optcompile.explain(opt)
    assert step_report.fallback_reason is None and step_report.traces == 2  # + momentum state


def test_tensor_work_after_step_in_a_compiled_function_is_refused_with_reason():
    def step_then_scale(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> Any:
        opt.step()
        return torch._foreach_mul(params, 2.0)

    model = small_model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = optcompile.compile(step_then_scale, fullgraph=True)
    with pytest.raises(TraceError, match=r"after calling L\['opt'\]\.step"):
        compiled(list(model.parameters()), opt)


# --- (b) a functional foreach update --------------------------------------------------------


def adam_like_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> list[torch.Tensor]:
    """Updates params and moments in place; returns the (new) update tensors."""
    with torch.no_grad():
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_add(exp_avg_sqs, eps)
        torch._foreach_sqrt_(denom)
        updates = torch._foreach_div(exp_avgs, denom)
        torch._foreach_mul_(updates, lr)
        torch._foreach_add_(params, updates, alpha=-1.0)
    return updates


def test_functional_foreach_update_matches_eager_and_never_retraces_for_floats():
    model = small_model()
    reference = copy.deepcopy(model)
    update = optcompile.compile(adam_like_update, backend="torch")

    def buffers(m: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [torch.zeros_like(p) for p in m.parameters()], [
            torch.zeros_like(p) for p in m.parameters()
        ]

    (m1, v1), (m2, v2) = buffers(model), buffers(reference)
    settings = [(0.1, 0.9, 0.999), (0.05, 0.8, 0.99), (0.01, 0.85, 0.995), (0.2, 0.9, 0.9)]
    for step, (lr, beta1, beta2) in enumerate(settings):
        set_grads(model, step)
        set_grads(reference, step)
        ps, qs = list(model.parameters()), list(reference.parameters())
        out = update(ps, [p.grad for p in ps], m1, v1, lr, beta1, beta2, 1e-8)
        expected = adam_like_update(qs, [q.grad for q in qs], m2, v2, lr, beta1, beta2, 1e-8)
        assert len(out) == len(expected)
        for got, want in zip(out, expected, strict=True):
            torch.testing.assert_close(got, want)
            assert all(got is not p for p in ps)
        for got, want in zip([*ps, *m1, *v1], [*qs, *m2, *v2], strict=True):
            torch.testing.assert_close(got, want)
    report = optcompile.explain(update)
    assert report.fallback_reason is None
    assert report.traces == 1, report.retrace_reasons


# --- (c) returned inputs keep their identity ------------------------------------------------


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def scale_(x: torch.Tensor, factor: float) -> torch.Tensor:
    x.mul_(factor)
    return x


def first(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0]


def test_returned_input_is_the_same_object():
    t = torch.randn(4)
    compiled = optcompile.compile(identity, backend="torch")
    assert compiled(t) is t
    assert compiled(t) is t  # the cached entry too, not only the first trace

    xs = [torch.randn(3), torch.randn(2)]
    assert optcompile.compile(first, backend="torch")(xs) is xs[0]

    u = torch.ones(3)
    compiled_scale = optcompile.compile(scale_, backend="torch")
    assert compiled_scale(u, 2.0) is u
    assert compiled_scale(u, 3.0) is u
    torch.testing.assert_close(u, torch.full((3,), 6.0))


# --- untraceable steps: TraceError with fullgraph=True, one warning and eager otherwise -----


class BranchOnTensor(torch.optim.Optimizer):
    """SGD that skips params whose gradient sums to a non-positive value."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad.sum() > 0:  # offending: Python branch on a tensor value
                    p.add_(p.grad, alpha=-group["lr"])


class CallsItem(torch.optim.Optimizer):
    """SGD with the step scaled by a Python float read from the gradient with ``.item()``.

    The float feeds a Python decision (a comparison) in the same statement: whether a tracer
    reports the ``.item()`` itself or the first decision on its value, it is this line.
    (``max(norm, 1.0)`` would not do: the graph computes that.)
    """

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                norm = 1.0 if p.grad.norm().item() < 1.0 else 2.0  # offending: a decision
                p.add_(p.grad, alpha=-group["lr"] / norm)


UNTRACEABLE = {"branch on tensor": BranchOnTensor, "item": CallsItem}


def offending_location(cls: type) -> str:
    """``<this file's name>:<line>`` of the statement marked 'offending' in ``cls.step``."""
    lines, start = inspect.getsourcelines(cls.step)
    offset = next(i for i, line in enumerate(lines) if "# offending" in line)
    return f"{Path(__file__).name}:{start + offset}"


def trace_error(cls: type) -> TraceError:
    """The TraceError that ``cls.step`` raises when compiled with fullgraph=True."""
    model = small_model()
    opt = optcompile.compile(cls(model.parameters()), backend="torch", fullgraph=True)
    set_grads(model, 0)
    with pytest.raises(TraceError) as info:
        opt.step()
    return info.value


@pytest.mark.parametrize("case", sorted(UNTRACEABLE))
def test_fullgraph_raises_trace_error_naming_file_line_and_reason(case):
    cls = UNTRACEABLE[case]
    error = trace_error(cls)
    message = str(error)
    assert offending_location(cls) in message, message
    assert error.reason, message
    assert error.reason not in offending_location(cls)
    assert error.reason in message


@pytest.mark.parametrize("case", sorted(UNTRACEABLE))
def test_without_fullgraph_one_warning_and_eager_results(case):
    cls = UNTRACEABLE[case]
    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(cls(model.parameters()), backend="torch")
    eager = cls(reference.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for m, o in ((model, opt), (reference, eager)):
                set_grads(m, step)
                o.step()
    fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in fallbacks]
    message = str(fallbacks[0].message)
    assert offending_location(cls) in message, message
    # It says the same as the TraceError that fullgraph=True raises: location and reason.
    assert trace_error(cls).reason in message, message
    report = optcompile.explain(opt)
    assert report.fallback_reason is not None
    assert offending_location(cls) in report.fallback_reason
    assert_same(model, opt, reference, eager, atol=0.0, rtol=0.0)


def test_a_training_step_under_torch_compile_runs_the_compiled_step_as_it_is():
    """torch.compile tracing a training step must not trace optcompile's glue and plan (it
    did, op by op, up to its recompile limits): the step runs as compiled, a graph break."""
    graphs: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm.code)
        return gm.forward

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    # (the torch backend: eager's own ops, so the results are compared bitwise)
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2), backend="torch")
    eager = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def train(m: torch.nn.Module, o: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        o.zero_grad()
        loss = m(x).pow(2).sum()
        loss.backward()
        o.step()
        return loss

    compiled_train = torch.compile(train, backend=recording_backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            x = torch.randn(8, 4)
            torch.testing.assert_close(compiled_train(model, opt, x), train(reference, eager, x))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert optcompile.explain(opt).traces == 1
    assert graphs and not any("addcdiv" in code or "lerp" in code for code in graphs)
    assert not [w for w in caught if "Dynamo" in str(w.message)]
    torch._dynamo.reset()


def test_a_compiled_function_called_under_torch_compile_runs_as_it_is():
    def scale_(xs: list[torch.Tensor], factor: float) -> None:
        with torch.no_grad():
            torch._foreach_mul_(xs, factor)

    compiled = optcompile.compile(scale_)

    def outer(xs: list[torch.Tensor]) -> torch.Tensor:
        total = xs[0].sum() * 2
        compiled(xs, 0.5)
        return total

    xs, twins = [torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(2)]
    compiled_outer = torch.compile(outer, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(compiled_outer(xs), twins[0].sum() * 2)
            scale_(twins, 0.5)
    for x, y in zip(xs, twins, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert optcompile.explain(compiled).traces == 1
    assert not [w for w in caught if "Dynamo" in str(w.message)]
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_in_place_op_rounds_to_its_tensors_dtype_where_the_functional_form_promotes(dtype):
    """``x.mul_(b)`` with x a 0-dim half tensor and b a 0-dim float32 stores a rounded
    value in eager; ``mul(x, b)``, which the trace records, is float32: the later ops ran on
    the unrounded value (AdamW with tensor betas on a 0-dim bf16 param drifted an ulp)."""

    def update(x: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> None:
        x.mul_(b).addcmul_(g, g, value=0.05)

    x = torch.tensor(0.0908203125, dtype=dtype)
    b, g = torch.tensor(0.95), torch.tensor(-0.6953125, dtype=dtype)
    eager_x, compiled_x = x.clone(), x.clone()
    update(eager_x, b, g)
    optcompile.compile(update, backend="torch")(compiled_x, b, g)
    assert compiled_x.dtype == dtype and torch.equal(compiled_x, eager_x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_foreach_op_in_place_rounds_each_promoted_item_to_its_dtype(dtype):
    """The foreach form of the case above (NAdam with a Tensor lr over a 0-dim half param:
    ``_foreach_mul_(params, 1 - lr * wd)``): the promoted item is stored rounded, the other
    items as they are; the batched torch backend then ran on the float32 value."""

    def update(xs: list[torch.Tensor], b: torch.Tensor, gs: list[torch.Tensor]) -> None:
        torch._foreach_mul_(xs, b)
        torch._foreach_addcmul_(xs, gs, gs, value=0.05)

    xs = [torch.tensor(0.0908203125, dtype=dtype), torch.randn(3)]
    gs = [torch.tensor(-0.6953125, dtype=dtype), torch.randn(3)]
    b = torch.tensor(0.95)
    eager_xs, compiled_xs = [x.clone() for x in xs], [x.clone() for x in xs]
    update(eager_xs, b, gs)
    optcompile.compile(update, backend="torch")(compiled_xs, b, gs)
    for compiled, eager in zip(compiled_xs, eager_xs, strict=True):
        assert compiled.dtype == eager.dtype and torch.equal(compiled, eager)
