"""compile() of what has no tensor function to trace raises a TypeError saying what to pass;
warnings point at the user's line."""

from __future__ import annotations

import sys
import warnings

import optcompile
import pytest
import torch
from optcompile.testing import set_grads, small_model


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: small_model(), r"torch\.compile\(model\)"),
        (lambda: torch.nn.Linear(2, 2), r"optcompile\.compile\(torch\.optim\.AdamW\("),
        (lambda: torch.optim.AdamW, r"optcompile\.compile\(AdamW\(params"),
        (lambda: torch.optim.SGD(small_model().parameters(), lr=0.1).step, r"compile\(opt\)"),
        (
            lambda: torch.optim.lr_scheduler.StepLR(
                torch.optim.SGD(small_model().parameters(), lr=0.1), step_size=1
            ),
            r"scheduler\.optimizer",
        ),
        (lambda: torch.add, "wrap it in a Python function"),
        (lambda: 3, "got int"),
    ],
    ids=["module", "linear", "optimizer-class", "bound-step", "scheduler", "builtin", "int"],
)
def test_objects_without_a_tensor_function_raise_a_type_error_saying_what_to_pass(make, says):
    with pytest.raises(TypeError, match=says) as raised:
        optcompile.compile(make())
    assert isinstance(raised.value, optcompile.NotCompilableError)
    assert isinstance(raised.value, optcompile.CompileError)


def test_a_python_callable_object_still_compiles():
    class Scale:
        def __call__(self, xs):
            torch._foreach_mul_(xs, 3.0)

    f = optcompile.compile(Scale(), backend="torch")
    xs = [torch.ones(2)]
    f(xs)
    torch.testing.assert_close(xs, [torch.full((2,), 3.0)])


@pytest.mark.parametrize(
    ("option", "value"),
    [("fullgraph", "yes"), ("recompile_limit", 0), ("recompile_limit", True), ("cudagraphs", 1)],
)
def test_bad_option_values_are_refused_naming_them(option, value):
    opt = torch.optim.SGD(small_model().parameters(), lr=0.1)
    with pytest.raises(optcompile.CompileError, match=option):
        optcompile.compile(opt, **{option: value})


def test_a_fallback_warning_points_at_the_users_step_call():
    model = small_model()
    opt = optcompile.compile(torch.optim.Adam(model.parameters(), fused=True))
    set_grads(model, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _next_line()
        opt.step()
    [warning] = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_a_fallback_warning_through_a_scheduler_points_at_the_users_step_call():
    model = small_model()
    opt = optcompile.compile(torch.optim.Adam(model.parameters(), fused=True))
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step in torch's code
    set_grads(model, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _next_line()
        opt.step()
    [warning] = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_a_fallback_warning_at_compile_points_at_the_compile_call():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _next_line()
        optcompile.compile(torch.optim.LBFGS(small_model().parameters()))
    [warning] = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert (warning.filename, warning.lineno) == (__file__, line)


def _next_line() -> int:
    """The number of the line after the caller's."""
    return sys._getframe(1).f_lineno + 1
