"""Python side effects of a compiled step, replayed each call, compared with eager; and what
the compiled entries keep alive."""

from __future__ import annotations

import copy
import gc
import random
import warnings
import weakref
from typing import Any

import optcompile
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from optcompile.testing import assert_same, run_pair, set_grads, small_model, step_both
from opttrace import TraceError


class LazyMomentum(torch.optim.Optimizer):
    """SGD with momentum whose state is created inside step, the way custom optimizers do."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


class CountingDecay(torch.optim.Optimizer):
    """Keeps a step counter on itself and decays its own lr inside step."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.step_count = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.step_count += 1
        for group in self.param_groups:
            group["lr"] = group["lr"] * 0.9
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / self.step_count)


class ClearsGrads(torch.optim.Optimizer):
    """Sets each grad to None after using it (an effect on .grad)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])
                p.grad = None


def test_state_created_lazily_inside_step_matches_eager():
    model, opt, reference, eager = run_pair(lambda ps: LazyMomentum(ps), steps=1)
    # The first trace creates the buffers in the graph; its replay stores them in the state.
    assert "] = {'buf': outs[" in optcompile.explain(opt).replay_code
    step_both(model, opt, reference, eager, range(1, 5))
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    report = optcompile.explain(opt)
    assert report.fallback_reason is None and report.traces == 2


def test_step_counter_and_lr_written_by_the_step_match_eager_without_retrace():
    model, opt, reference, eager = run_pair(lambda ps: CountingDecay(ps), steps=6)
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    assert opt.step_count == eager.step_count == 6
    assert type(opt.step_count) is int
    assert opt.param_groups[0]["lr"] == eager.param_groups[0]["lr"]
    report = optcompile.explain(opt)
    assert report.traces == 1, report.retrace_reasons
    assert "opt.step_count = outs[" in report.replay_code


def test_grad_assigned_inside_step_is_replayed():
    model, opt, reference, eager = run_pair(lambda ps: ClearsGrads(ps), steps=3)
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())
    assert ".grad = None" in optcompile.explain(opt).replay_code


def test_closure_that_assigns_grads_runs_eagerly_before_the_compiled_update():
    model, reference = small_model(), small_model()
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    eager = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    def closure_for(m: torch.nn.Module, step: int) -> Any:
        def closure() -> torch.Tensor:
            set_grads(m, step)  # assigns p.grad for every parameter
            return torch.tensor(float(step))

        return closure

    for step in range(4):
        assert opt.step(closure_for(model, step)) == eager.step(closure_for(reference, step))
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    assert optcompile.explain(opt).fallback_reason is None


@pytest.mark.parametrize("foreach", [True, False])
def test_deleting_model_and_compiled_optimizer_frees_the_parameters(foreach):
    model = small_model()
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach))
    for step in range(3):
        set_grads(model, step)
        opt.step()
    param = weakref.ref(next(iter(model.parameters())))
    state = weakref.ref(opt.state[next(iter(model.parameters()))]["exp_avg"])
    compiled = _OPTIMIZERS[opt]  # held on purpose: the entries must go anyway
    assert compiled.cache.entries
    del model, opt
    gc.collect()
    assert param() is None and state() is None
    assert compiled.released and not compiled.cache.entries


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_a_step_keeps_no_gradient_alive_after_zero_grad(groups):
    """Each param group's grads are read by the fast tier's check on every hit; none may be
    held once the step is done (found: with several groups, the lists the check read were
    kept until the next step, a whole model's gradients alive through the next forward)."""
    model = small_model()
    params = list(model.parameters())
    opt = optcompile.compile(
        torch.optim.AdamW(
            [{"params": params[i::groups], "weight_decay": 0.01 * i} for i in range(groups)]
        )
    )
    held = []
    for step in range(5):
        set_grads(model, step)
        grads = [weakref.ref(p.grad) for p in params]
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        held.append(sum(g() is not None for g in grads))
    assert optcompile.explain(opt).fallback_reason is None
    assert held == [0] * 5


class KeepsNorms(torch.optim.Optimizer):
    """Appends a tensor to a list on itself each step and keeps only the last two."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.norms: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            grads = [p.grad for p in group["params"]]
            self.norms.append(torch.stack([g.norm() for g in grads]).norm())
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])
        while len(self.norms) > 2:
            self.norms.pop(0)


def test_appends_and_pops_on_a_list_the_step_keeps_are_replayed():
    model, opt, reference, eager = run_pair(lambda ps: KeepsNorms(ps), steps=5)
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    assert len(opt.norms) == len(eager.norms) == 2
    for mine, theirs in zip(opt.norms, eager.norms, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert ".append(outs[" in optcompile.explain(opt).replay_code


COUNTER = 0
HISTORY: list[float] = []


class StoresGlobal(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        global COUNTER
        COUNTER += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


class AppendsToGlobal(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        HISTORY.append(1.0)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


def _make_closure_counter() -> type[torch.optim.Optimizer]:
    calls = 0

    class StoresClosureCell(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float = 0.1) -> None:
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            nonlocal calls
            calls += 1
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"])

    return StoresClosureCell


UNREPLAYABLE = {
    "global store": (StoresGlobal, "global 'COUNTER'"),
    "global list append": (AppendsToGlobal, "global 'HISTORY'"),
    "closure cell store": (_make_closure_counter(), "closure variable 'calls'"),
}


@pytest.mark.parametrize("case", sorted(UNREPLAYABLE))
def test_stores_a_replay_cannot_repeat_raise_with_fullgraph(case):
    cls, what = UNREPLAYABLE[case]
    model = small_model()
    set_grads(model, 0)
    opt = optcompile.compile(cls(model.parameters()), fullgraph=True)
    before = (COUNTER, len(HISTORY))
    with pytest.raises(TraceError, match=what):
        opt.step()
    assert (COUNTER, len(HISTORY)) == before  # the trace's own store was undone


@pytest.mark.parametrize("case", sorted(UNREPLAYABLE))
def test_stores_a_replay_cannot_repeat_fall_back_to_eager_with_one_warning(case):
    cls, what = UNREPLAYABLE[case]
    before = (COUNTER, len(HISTORY))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, reference, eager = run_pair(lambda ps: cls(ps), steps=3)
    fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert len(fallbacks) == 1 and what in str(fallbacks[0].message)
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    if case == "global store":
        assert before[0] + 6 == COUNTER  # three eager steps each, nothing lost or doubled
    if case == "global list append":
        assert len(HISTORY) == before[1] + 6


class DrawsRandom(torch.optim.Optimizer):
    """Scales each update by a number from Python's or numpy's global generator."""

    def __init__(self, params: Any, source: str) -> None:
        super().__init__(params, {"lr": 0.1})
        self.source = source

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if self.source == "random":
                    scale = random.random()
                else:
                    scale = float(pytest.importorskip("numpy").random.rand())
                p.add_(p.grad, alpha=-group["lr"] * scale)


@pytest.mark.parametrize(
    ("source", "named"), [("random", "Python's random module"), ("numpy", "numpy.random")]
)
def test_draws_from_a_global_random_generator_run_eagerly_and_draw_what_eager_draws(source, named):
    """A number drawn while tracing would be the same on every call: the trace is refused,
    and the generator's state put back, so the eager steps draw the numbers eager draws."""
    numpy = pytest.importorskip("numpy")
    model = small_model()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = optcompile.compile(DrawsRandom(model.parameters(), source))
        eager = DrawsRandom(reference.parameters(), source)
        for step in range(3):
            for m, o in ((model, opt), (reference, eager)):
                set_grads(m, step)
                random.seed(step)
                numpy.random.seed(step)
                o.step()
    fallbacks = [w for w in caught if issubclass(w.category, optcompile.FallbackWarning)]
    assert len(fallbacks) == 1
    assert f"the step draws random numbers from {named}" in str(fallbacks[0].message)
    assert_same(model, opt, reference, eager, rtol=0, atol=0)
    state = random.getstate() if source == "random" else numpy.random.get_state()[1].copy()
    with pytest.raises(TraceError, match=f"draws random numbers from {named}"):
        optcompile.compile(DrawsRandom(model.parameters(), source), fullgraph=True).step()
    after = random.getstate() if source == "random" else numpy.random.get_state()[1]
    assert (state == after) if source == "random" else (state == after).all()


def test_a_compiled_function_keeps_no_argument_alive():
    def scale_(params: list[torch.Tensor], factor: float) -> None:
        with torch.no_grad():
            torch._foreach_mul_(params, factor)

    compiled = optcompile.compile(scale_)
    model = small_model()
    compiled(list(model.parameters()), 0.5)
    compiled(list(model.parameters()), 0.25)
    assert optcompile.explain(compiled).traces == 1
    param = weakref.ref(next(iter(model.parameters())))
    del model
    gc.collect()
    assert param() is None  # the compiled function (alive) holds no parameter


def test_stores_into_a_dict_passed_in_and_fresh_containers_returned_each_call():
    def update(xs: list[torch.Tensor], log: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            norms = [x.norm() for x in xs]
            torch._foreach_mul_(xs, 0.5)
        log["first_norm"] = norms[0]
        dropped = {"scratch": norms[1]}  # created and dropped: nothing of it is replayed
        del dropped
        return {"norms": norms}

    compiled = optcompile.compile(update)
    xs, eager_xs = [torch.ones(3), torch.full((2,), 2.0)], [torch.ones(3), torch.full((2,), 2.0)]
    log, eager_log = {}, {}
    first = compiled(xs, log)
    second = compiled(xs, log)
    update(eager_xs, eager_log)
    expected = update(eager_xs, eager_log)
    assert first is not second and first["norms"] is not second["norms"]
    for mine, theirs in zip(second["norms"], expected["norms"], strict=True):
        torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(log["first_norm"], eager_log["first_norm"])
    for x, y in zip(xs, eager_xs, strict=True):
        torch.testing.assert_close(x, y)
    report = optcompile.explain(compiled)
    assert "['first_norm'] = outs[" in report.replay_code and "scratch" not in report.replay_code
