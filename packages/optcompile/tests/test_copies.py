"""Copies of a compiled optimizer (copy.deepcopy, pickle) are compiled optimizers; compiling
again applies new options; the instance's public attributes stay those of eager's."""

from __future__ import annotations

import copy
import pickle
import warnings

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, run_pair, set_grads, small_model, step_both

optim = torch.optim
# One instance of each torch.optim optimizer, with the options it needs to run on CPU.
MAKERS = {
    "Adam": lambda ps: optim.Adam(ps),
    "AdamW": lambda ps: optim.AdamW(ps),
    "NAdam": lambda ps: optim.NAdam(ps),
    "RAdam": lambda ps: optim.RAdam(ps),
    "Adamax": lambda ps: optim.Adamax(ps),
    "Adadelta": lambda ps: optim.Adadelta(ps),
    "Adagrad": lambda ps: optim.Adagrad(ps),
    "RMSprop": lambda ps: optim.RMSprop(ps),
    "Rprop": lambda ps: optim.Rprop(ps),
    "SGD": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    "ASGD": lambda ps: optim.ASGD(ps),
    "Adafactor": lambda ps: optim.Adafactor(ps),
    "LBFGS": lambda ps: optim.LBFGS(ps),
    "SparseAdam": lambda ps: optim.SparseAdam(ps),
}


def public(obj: object) -> set[str]:
    """What torch's test_deepcopy_copies_all_public_attrs compares."""
    return {k for k in obj.__dict__ if not k.startswith("_")}


def _stepped(name: str, compiled: bool) -> torch.optim.Optimizer:
    """The optimizer over two (2, 3) params, stepped three times, as torch's test does."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(2, 3)) for _ in range(2)]
    for p in params:
        p.grad = torch.rand_like(p)
        if name == "SparseAdam":
            p.grad = p.grad.to_sparse()
    opt = MAKERS[name](params)
    if compiled:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optcompile.FallbackWarning)  # LBFGS, SparseAdam
            opt = optcompile.compile(opt, backend="torch")
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optcompile.FallbackWarning)
            opt.step((lambda: 1) if name == "LBFGS" else None)
    return opt


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_deepcopy_copies_all_public_attrs_as_for_eager(name):
    """torch's test_deepcopy_copies_all_public_attrs, compiled, plus: the same public
    attributes as the eager optimizer and as eager's deepcopy."""
    opt, eager = _stepped(name, compiled=True), _stepped(name, compiled=False)
    assert public(opt) == public(copy.deepcopy(opt))
    assert public(opt) == public(eager)
    assert public(copy.deepcopy(opt)) == public(copy.deepcopy(eager))
    assert "step" not in opt.__dict__ and "_opt_called" not in opt.__dict__


def _model_and_copies(make, through):
    """A compiled optimizer stepped twice, then (model, optimizer) copied ``through`` deepcopy
    or pickle, with an eager twin copied the same way."""
    model, opt, reference, eager = run_pair(make, steps=2, backend="torch")
    copied_model, copied_opt = through((model, opt))
    copied_reference, copied_eager = through((reference, eager))
    return copied_model, copied_opt, copied_reference, copied_eager


THROUGH = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda objs: pickle.loads(pickle.dumps(objs)),
}


@pytest.mark.parametrize("how", sorted(THROUGH))
def test_a_copy_is_compiled_and_matches_eager(how):
    make = lambda ps: optim.AdamW(ps, lr=1e-2)  # noqa: E731
    model, opt, reference, eager = _model_and_copies(make, THROUGH[how])
    assert type(opt).__name__ == "AdamW" and isinstance(opt, optim.AdamW)
    step_both(model, opt, reference, eager, range(2, 5))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 1 and report.entries == 1 and report.fallback_reason is None
    assert report.backend == "torch"


def test_a_copy_keeps_the_options_and_traces_its_own_entries():
    model, opt, *_ = run_pair(
        lambda ps: optim.SGD(ps, lr=0.1), steps=1, backend="torch", recompile_limit=3
    )
    copied_model, copied = copy.deepcopy((model, opt))
    assert optcompile.explain(copied).traces == 0  # nothing traced for it yet
    set_grads(copied_model, 1)
    copied.step()
    report = optcompile.explain(copied)
    assert report.traces == 1 and report.recompile_limit == 3
    assert optcompile.explain(opt).traces == 1  # the original's entries are its own


def test_a_copy_of_lbfgs_runs_its_own_step_and_says_why():
    with pytest.warns(optcompile.FallbackWarning, match="closure"):
        opt = optcompile.compile(optim.LBFGS(small_model().parameters()))
    with pytest.warns(optcompile.FallbackWarning, match="closure"):
        copied = copy.deepcopy(opt)
        assert "closure" in (optcompile.explain(copied).fallback_reason or "")


def test_compiling_again_with_the_same_options_keeps_the_entries():
    _, opt, *_ = run_pair(lambda ps: optim.SGD(ps, lr=0.1), steps=2, backend="torch")
    assert optcompile.compile(opt, backend="torch") is opt
    assert optcompile.explain(opt).entries == 1


def test_compiling_again_with_new_options_drops_the_entries_and_applies_them():
    model, opt, reference, eager = run_pair(
        lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9), steps=2, backend="torch"
    )
    assert optcompile.compile(opt, backend="torch", recompile_limit=2, cudagraphs=False) is opt
    report = optcompile.explain(opt)
    assert report.entries == 0 and report.recompile_limit == 2
    step_both(model, opt, reference, eager, range(2, 4))
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 1 and report.cudagraphs == "off (cudagraphs=False)"


def test_compiling_a_compiled_function_again():
    def scale_(xs):
        torch._foreach_mul_(xs, 2.0)

    f = optcompile.compile(scale_, backend="torch")
    assert optcompile.compile(f, backend="torch") is f
    g = optcompile.compile(f, backend="torch", recompile_limit=2)
    assert g is not f and optcompile.explain(g).recompile_limit == 2
    xs = [torch.ones(2)]
    g(xs)
    torch.testing.assert_close(xs, [torch.full((2,), 2.0)])  # compiled once, not twice
    assert optcompile.explain(g).traces == 1


def test_a_scheduler_made_before_compile_drives_the_compiled_step():
    model = small_model()
    opt = optim.SGD(model.parameters(), lr=0.1)
    sched = optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    optcompile.compile(opt, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither of the scheduler's order warnings
        for step in range(2):
            set_grads(model, step)
            opt.step()
            sched.step()
    assert optcompile.explain(opt).traces == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
