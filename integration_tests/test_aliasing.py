"""One tensor reached twice, and inputs sharing memory: the compiled graph reads each input
once, before it writes any, so both must be guarded, or refused where eager's order of
in-place writes matters. Results always equal eager's."""

from __future__ import annotations

import copy
import warnings

import optcompile
import pytest
import torch
from opttrace import TraceError

optim = torch.optim


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(n)]


def _steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], shared: list[bool]):
    for step, one_grad in enumerate(shared):
        gen = torch.Generator().manual_seed(step)
        if one_grad:  # one tensor as the grad of every param
            grad = torch.randn(4, 3, generator=gen)
            for p in params:
                p.grad = grad
        else:
            for p in params:
                p.grad = torch.randn(4, 3, generator=gen)
        opt.step()


def _same(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(p, q)
        for key, value in b.state[q].items():
            torch.testing.assert_close(a.state[p][key], value)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("foreach", [True, False])
def test_one_grad_for_every_param_then_separate_grads_retraces_and_matches_eager(backend, foreach):
    """The trace reads the shared grad once; a later call with separate grads must not
    feed the first one's values to every param."""
    params = _params()
    twins = copy.deepcopy(params)
    make = lambda ps: optim.AdamW(ps, lr=0.1, foreach=foreach)  # noqa: E731
    opt, eager = optcompile.compile(make(params), backend=backend), make(twins)
    pattern = [True, False, True, False]
    _steps(opt, params, pattern)
    _steps(eager, twins, pattern)
    _same(opt, eager)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None
    assert report.traces == 2 and report.entries == 2  # one per pattern, reused after
    assert (
        "grad: is no longer the same object as L['opt'].param_groups[0]['params'][0].grad"
        in (report.retrace_reasons[-1])
    )


@pytest.mark.parametrize("foreach", [True, False])
def test_a_parameter_listed_twice_steps_as_eager_does(foreach):
    """Eager warns of the duplicate and updates it once per listing. A for-loop step
    traces that in order; a foreach op writing one tensor twice is refused: eager."""
    p, q = _params(2)
    twin_p, twin_q = copy.deepcopy([p, q])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = optcompile.compile(optim.SGD([p, q, p], lr=0.1, momentum=0.9, foreach=foreach))
        eager = optim.SGD([twin_p, twin_q, twin_p], lr=0.1, momentum=0.9, foreach=foreach)
        for step in range(3):
            for a, b in ((p, twin_p), (q, twin_q)):
                a.grad = torch.full_like(a, step + 1.0)
                b.grad = torch.full_like(b, step + 1.0)
            opt.step()
            eager.step()
    torch.testing.assert_close(p, twin_p)
    torch.testing.assert_close(q, twin_q)
    fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    report = optcompile.explain(opt)
    if foreach:
        assert len(fallbacks) == 1
        assert "writes one tensor twice (items 0 and 2 of its list)" in report.fallback_reason
    else:
        assert fallbacks == [] and report.fallback_reason is None


def test_a_grad_shared_by_two_params_in_a_foreach_write_is_named_in_the_reason():
    """SGD's nesterov foreach path adds into the grads: one grad tensor given to two params
    is written twice. Eager's result, and a reason that names the shared grad (it blamed a
    duplicate parameter)."""
    p, q = _params(2)
    twin_p, twin_q = copy.deepcopy([p, q])
    make = lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True)  # noqa: E731
    opt, eager = optcompile.compile(make([p, q])), make([twin_p, twin_q])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(2):
            grad, twin_grad = torch.full_like(p, step + 1.0), torch.full_like(p, step + 1.0)
            p.grad = q.grad = grad
            twin_p.grad = twin_q.grad = twin_grad
            opt.step()
            eager.step()
    torch.testing.assert_close(p, twin_p)
    torch.testing.assert_close(q, twin_q)
    reason = optcompile.explain(opt).fallback_reason
    assert "one grad tensor given to several parameters" in reason
    assert "L['opt'].param_groups[0]['params'][0].grad" in reason


def _write_both(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a.add_(1.0)
    b.mul_(2.0)
    return a.sum() + b.sum()


def test_a_function_given_one_tensor_twice_retraces_and_matches_eager():
    compiled = optcompile.compile(_write_both)
    for twice in (False, True, False):  # two tensors; one (a + 1, then * 2); two again
        args, twins = [(x, x) if twice else (x, x.clone()) for x in (torch.ones(4), torch.ones(4))]
        torch.testing.assert_close(compiled(*args), _write_both(*twins))
        for x, y in zip(args, twins, strict=True):
            torch.testing.assert_close(x, y)
    report = optcompile.explain(compiled)
    assert report.traces == 2 and report.entries == 2
    assert report.retrace_reasons[-1] == "L['a']: shares memory with one of L['b']"


def test_a_function_writing_two_overlapping_views_runs_eagerly_naming_them():
    compiled = optcompile.compile(_write_both)
    x, twin = torch.arange(5.0), torch.arange(5.0)
    with pytest.warns(optcompile.FallbackWarning, match=r"L\['a'\] and to L\['b'\], which share"):
        result = compiled(x[:3], x[2:])
    torch.testing.assert_close(result, _write_both(twin[:3], twin[2:]))
    torch.testing.assert_close(x, twin)  # x[2] was written twice, in eager's order
    with pytest.raises(TraceError, match="share memory"):
        optcompile.compile(_write_both, fullgraph=True)(x[:3], x[2:])
