from __future__ import annotations

import warnings

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, run_pair, set_grads, step_both
from optcompile.testing import small_model as make_model
from torch.optim.optimizer import register_optimizer_step_pre_hook

OPTIMIZERS = {
    "sgd_momentum_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd_momentum_loop": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_five_compiled_steps_match_eager(name):
    assert_same(*run_pair(OPTIMIZERS[name], steps=5))


def test_compile_returns_the_same_optimizer():
    opt = torch.optim.SGD(make_model().parameters(), lr=0.1)
    assert optcompile.compile(opt) is opt
    assert optcompile.compile(opt) is opt  # compiling twice is a no-op


def test_calling_again_with_nothing_changed_does_not_retrace():
    _, opt, *_ = run_pair(OPTIMIZERS["adamw_foreach"], steps=5)
    report = optcompile.explain(opt)
    assert report.traces == 1
    assert report.retrace_reasons == []


def test_state_clear_retraces_once_with_reason():
    model, opt, *_ = run_pair(OPTIMIZERS["adamw_foreach"], steps=2)
    opt.state.clear()
    for step in range(3):
        set_grads(model, step)
        opt.step()
    report = optcompile.explain(opt)
    assert report.traces == 2
    assert report.retrace_reasons == ["L['opt'].state: keys changed (4 entries -> 0)"]


def test_state_clear_then_steps_match_a_fresh_eager_optimizer():
    model, opt, reference, eager = run_pair(OPTIMIZERS["adamw_loop"], steps=2)
    opt.state.clear()
    eager.state.clear()
    step_both(model, opt, reference, eager, range(3))
    assert_same(model, opt, reference, eager)


def test_explain_reports_traces_guards_and_graph():
    _, opt, *_ = run_pair(OPTIMIZERS["adamw_foreach"], steps=1, backend="torch")
    report = optcompile.explain(opt)
    assert isinstance(report.traces, int) and report.traces == 1
    assert isinstance(report.retrace_reasons, list)
    assert "L['opt'].param_groups[0]['lr'] is a float" in report.guards
    assert "aten._foreach_addcdiv" in report.graph_code
    assert "def check(L)" in report.check_code
    assert "traces: 1" in str(report)


def test_reset_drops_every_entry():
    from opttrace import meta

    model, opt, *_ = run_pair(OPTIMIZERS["sgd_momentum_foreach"], steps=3)
    assert meta._CACHE
    optcompile.reset()
    assert not meta._CACHE  # the tracer's op-metadata cache goes too
    assert optcompile.explain(opt).traces == 0
    set_grads(model, 0)
    opt.step()
    report = optcompile.explain(opt)
    assert report.traces == 1 and report.retrace_reasons == []


def test_triton_backend_without_cuda_or_interpreter_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(optcompile.CompileError, match="TRITON_INTERPRET=1"):
        optcompile.compile(torch.optim.SGD(make_model().parameters(), lr=0.1), backend="triton")


def test_unknown_backend_is_refused_with_choices():
    with pytest.raises(optcompile.CompileError, match="auto"):
        optcompile.compile(torch.optim.SGD(make_model().parameters(), lr=0.1), backend="cuda")


def test_compile_refuses_non_callables():
    with pytest.raises(optcompile.CompileError, match="int"):
        optcompile.compile(3)


def test_explain_refuses_uncompiled_objects():
    with pytest.raises(optcompile.CompileError, match="not compiled"):
        optcompile.explain(torch.optim.SGD(make_model().parameters(), lr=0.1))


def test_changing_float_hyperparameters_never_retraces_and_matches_eager():
    model, opt, reference, eager = run_pair(OPTIMIZERS["adamw_foreach"], steps=2)
    for o in (opt, eager):
        o.param_groups[0]["lr"] = 5e-3
        o.param_groups[0]["betas"] = (0.8, 0.95)
        o.param_groups[0]["weight_decay"] = 0.05
    step_both(model, opt, reference, eager, range(2))
    assert_same(model, opt, reference, eager)
    assert optcompile.explain(opt).traces == 1


def test_an_int_hyperparameter_is_a_constant_and_its_change_retraces():
    model, opt, reference, eager = run_pair(
        lambda ps: torch.optim.SGD(ps, lr=1, momentum=0.0), steps=1
    )
    for o in (opt, eager):
        o.param_groups[0]["lr"] = 2
    step_both(model, opt, reference, eager, range(1, 2))
    assert_same(model, opt, reference, eager)
    assert "['lr']: value changed (1 -> 2)" in optcompile.explain(opt).retrace_reasons[0]


def test_fused_falls_back_to_eager_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, reference, eager = run_pair(
            lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), steps=3
        )
    fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert len(fallbacks) == 1 and "fused=True" in str(fallbacks[0].message)
    assert_same(model, opt, reference, eager)
    assert "fused=True" in (optcompile.explain(opt).fallback_reason or "")


def test_fused_with_fullgraph_raises():
    opt = optcompile.compile(
        torch.optim.Adam(make_model().parameters(), fused=True), fullgraph=True
    )
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="fused=True"):
        opt.step()


def test_recompile_limit_falls_back_naming_the_guard():
    model, opt, reference, eager = run_pair(
        OPTIMIZERS["sgd_momentum_foreach"], steps=1, recompile_limit=2
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lr in (2, 3, 4):  # ints are constants: each value is a new trace
            for m, o in ((model, opt), (reference, eager)):
                o.param_groups[0]["lr"] = lr
                set_grads(m, 0)
                o.step()
    messages = [
        str(w.message) for w in caught if issubclass(w.category, optcompile.FallbackWarning)
    ]
    assert len(messages) == 1 and "recompile limit (2)" in messages[0] and "['lr']" in messages[0]
    assert_same(model, opt, reference, eager)


def test_closure_runs_eagerly_and_its_loss_is_returned():
    model = make_model()
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad


def test_step_hooks_run_around_the_compiled_step():
    model = make_model()
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    set_grads(model, 0)
    opt.step()
    assert calls == ["pre", "post"]


def test_hooks_registered_after_direct_steps_run_and_stop_when_removed():
    """The usual call goes straight to the compiled step; a hook (the optimizer's or a
    global one) registered later is still seen on the next call."""
    model = make_model()
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    for step in range(2):
        set_grads(model, step)
        opt.step()  # (direct: no hook yet)
    own = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    shared = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global pre"))
    try:
        opt.step()
    finally:
        shared.remove()
    own.remove()
    opt.step()
    assert calls == ["global pre", "post"]


def test_lr_scheduler_wraps_the_compiled_step():
    model = make_model()
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        for step in range(2):
            set_grads(model, step)
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_compiled_function_returns_new_tensors_and_updates_inputs():
    def update(params, grads, lr):
        torch._foreach_add_(params, grads, alpha=-lr)
        return torch._foreach_mul(params, 2.0)

    f = optcompile.compile(update)
    xs = [torch.ones(3), torch.ones(2)]
    gs = [torch.full((3,), 2.0), torch.full((2,), 4.0)]
    out = f(xs, gs, 0.5)
    torch.testing.assert_close(xs, [torch.zeros(3), torch.full((2,), -1.0)])
    torch.testing.assert_close(out, [torch.zeros(3), torch.full((2,), -2.0)])
    f(xs, gs, 0.5)
    assert optcompile.explain(f).traces == 1


def test_compiled_function_returns_its_input_object():
    f = optcompile.compile(lambda x: x)
    x = torch.ones(2)
    assert f(x) is x


def test_cudagraphs_option_is_checked_and_explain_says_why_no_graph_runs(monkeypatch):
    model = make_model()
    with pytest.raises(optcompile.CompileError, match="cudagraphs must be one of"):
        optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1), cudagraphs="yes")
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert optcompile.explain(opt).cudagraphs == "no entry yet"
    set_grads(model, 0)
    opt.step()
    report = optcompile.explain(opt)
    # (a CUDA machine: these CPU params run on the generated C loops, or ATen without a compiler)
    expected = "no CUDA device" if not torch.cuda.is_available() else "backend runs each op"
    assert report.cudagraphs.startswith("not used: ") and expected in report.cudagraphs
    assert report.cudagraph_recordings == 0 and report.cudagraph_replays == 0
    assert f"CUDA graphs: {report.cudagraphs}" in str(report)

    off = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1), cudagraphs=False)
    off.step()
    assert optcompile.explain(off).cudagraphs == "off (cudagraphs=False)"


def test_cudagraphs_true_raises_with_the_reason_when_the_step_cannot_be_recorded():
    model = make_model()
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1), cudagraphs=True)
    set_grads(model, 0)
    with pytest.raises(optcompile.CompileError, match="cudagraphs=True, but this step cannot"):
        opt.step()


def test_fast_hits_gather_through_the_fast_gather_and_still_match_eager(monkeypatch):
    """After the check's fast tier passes, a compiled optimizer's entry fetches only grads and
    hyperparameters (the full gather is not run); new grads and lr changes still land."""
    from optcompile.api import _OPTIMIZERS
    from optcompile.driver import newest

    model, opt, reference, eager = run_pair(OPTIMIZERS["adamw_foreach"], steps=3)
    entry = newest(_OPTIMIZERS[opt])
    prologue = entry.prologue
    if prologue.fast is None:
        pytest.skip("this torch lacks the C++ guards (no fast tier)")
    assert prologue.fast.gather is not None and prologue.fast.gather.armed

    def no_full_gather(L):
        raise AssertionError("the full gather ran on a fast-tier hit")

    monkeypatch.setattr(type(prologue), "gather", property(lambda _: no_full_gather))
    monkeypatch.setattr(prologue, "fetch", no_full_gather)
    for o in (opt, eager):
        o.param_groups[0]["lr"] = 3e-3
    hits = prologue.fast_hits
    step_both(model, opt, reference, eager, range(3, 6))
    assert prologue.fast_hits == hits + 3
    assert_same(model, opt, reference, eager)
    assert optcompile.explain(opt).traces == 1


def test_swap_tensors_on_a_param_and_a_state_tensor_of_a_compiled_optimizer():
    """torch.utils.swap_tensors (what module.to() does under
    torch.__future__.set_swap_module_params_on_conversion) refuses a tensor something else
    holds: the compiled optimizer's checks must not hold them; the next step sees the swap."""
    model, opt, reference, eager = run_pair(OPTIMIZERS["adamw_foreach"], steps=2)
    for m, o in ((model, opt), (reference, eager)):
        p = next(m.parameters())
        torch.utils.swap_tensors(p, torch.nn.Parameter(p.detach() * 0.5))
        buf = o.state[p]["exp_avg"]
        torch.utils.swap_tensors(buf, buf.clone() * 2)
    step_both(model, opt, reference, eager, range(2, 4))
    assert_same(model, opt, reference, eager)


def _grads_set(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.ones_like(p)


def test_zero_grad_sets_the_optimizers_grads_to_none_and_no_others():
    """zero_grad(): one native pass per group (no Python loop over params), the same result
    as torch's: each of the optimizer's params' grads None, a param outside it untouched."""
    model = make_model()
    params = list(model.parameters())
    opt = optcompile.compile(torch.optim.AdamW(params[:-1], lr=1e-2))
    opt.add_param_group({"params": [params[-1]], "lr": 1e-3})
    opt.param_groups[-1]["params"] = tuple(opt.param_groups[-1]["params"])  # (not a list)
    outside = torch.nn.Parameter(torch.zeros(3))
    outside.grad = torch.ones(3)
    _grads_set(model)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    assert outside.grad is not None


def test_zero_grad_without_set_to_none_zeroes_as_torch_does():
    model = make_model()
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1))
    _grads_set(model)
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_an_optimizer_classs_own_zero_grad_still_runs():
    calls = []

    class Counting(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    model = make_model()
    opt = optcompile.compile(Counting(model.parameters(), lr=0.1))
    _grads_set(model)
    opt.zero_grad()
    assert calls == [True] and all(p.grad is None for p in model.parameters())


def test_zero_grad_under_the_profiler_is_torchs_labelled_one():
    model = make_model()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _grads_set(model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert any("zero_grad" in event.key for event in prof.key_averages())
