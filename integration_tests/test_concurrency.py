"""Threads, interrupts and failed traces: a compiled step behaves as eager would.

Each test failed before its fix: updates lost between threads, patches left behind by two
threads tracing at once, another thread's random draws undone, Ctrl-C leaving half-made
state, one failed trace making the optimizer eager for good.
"""

from __future__ import annotations

import builtins
import copy
import random
import threading
import warnings
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import assert_same, set_grads, small_model

ORIGINAL_IS_COMPILING = torch.compiler.is_compiling
ORIGINAL_MIN, ORIGINAL_MAX = builtins.min, builtins.max


def _sgd_pair() -> tuple[Any, Any, Any, Any]:
    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    eager = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    for m in (model, reference):
        set_grads(m, 0)
    return model, opt, reference, eager


def test_steps_from_several_threads_lose_no_update() -> None:
    model, opt, reference, eager = _sgd_pair()
    opt.step()
    eager.step()

    def steps() -> None:
        for _ in range(25):
            opt.step()

    threads = [threading.Thread(target=steps) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(100):
        eager.step()
    assert_same(model, opt, reference, eager)
    assert optcompile.explain(opt).traces == 2  # (momentum buffers appear after the first)


class _Gate:
    """Holds a trace inside a step until the test has looked at the process meanwhile."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.go_on = threading.Event()

    def __call__(self) -> None:
        self.inside.set()
        assert self.go_on.wait(30)


def _gated_function(gate: _Gate) -> Any:
    def update(xs: list[torch.Tensor]) -> None:
        gate()
        torch._foreach_add_(xs, max(1.0, 2.0))

    return optcompile.compile(update, backend="torch")


def test_a_trace_in_another_thread_changes_nothing_this_thread_sees() -> None:
    gate = _Gate()
    update = _gated_function(gate)
    xs = [torch.zeros(3)]
    tracer = threading.Thread(target=update, args=(xs,))
    tracer.start()
    try:
        assert gate.inside.wait(30)
        # The trace patches these for its own thread only.
        assert torch.compiler.is_compiling() is False
        assert min([3, 1, 2]) == 1 and max(4, 5) == 5
    finally:
        gate.go_on.set()
        tracer.join()
    torch.testing.assert_close(xs[0], torch.full((3,), 2.0))
    assert torch.compiler.is_compiling is ORIGINAL_IS_COMPILING
    assert (builtins.min, builtins.max) == (ORIGINAL_MIN, ORIGINAL_MAX)


def test_two_threads_tracing_at_once_leave_no_patch_behind() -> None:
    def make() -> Any:
        def update(xs: list[torch.Tensor], lr: float) -> None:
            torch._foreach_add_(xs, max(lr, 0.5))

        return optcompile.compile(update, backend="torch")

    errors: list[BaseException] = []

    def trace_many(seed: int) -> None:
        try:
            for i in range(6):
                make()([torch.zeros(2)], 0.1 * (seed + i))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=trace_many, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert torch.compiler.is_compiling is ORIGINAL_IS_COMPILING
    assert torch.compiler.is_compiling() is False
    assert (builtins.min, builtins.max) == (ORIGINAL_MIN, ORIGINAL_MAX)


def test_another_threads_random_draws_during_a_trace_are_kept() -> None:
    gate = _Gate()
    update = _gated_function(gate)
    xs = [torch.zeros(3)]
    random.seed(7)
    expected = [random.random() for _ in range(6)]
    random.seed(7)
    tracer = threading.Thread(target=update, args=(xs,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the trace must not be refused
        tracer.start()
        try:
            assert gate.inside.wait(30)
            drawn = [random.random() for _ in range(3)]  # while the other thread traces
        finally:
            gate.go_on.set()
            tracer.join()
    drawn += [random.random() for _ in range(3)]
    assert drawn == expected  # none drawn twice
    assert optcompile.explain(update).traces == 1


def test_a_step_drawing_from_random_is_refused_before_it_draws() -> None:
    def update(xs: list[torch.Tensor]) -> None:
        torch._foreach_add_(xs, random.random())

    compiled = optcompile.compile(update, backend="torch")
    xs = [torch.zeros(2)]
    random.seed(3)
    with pytest.warns(optcompile.FallbackWarning, match="draws random numbers"):
        compiled(xs)
    random.seed(3)
    first = random.random()
    torch.testing.assert_close(xs[0], torch.full((2,), first))  # what eager drew, once


# Run in a fresh interpreter with Python's own SIGINT handler: how a signal is delivered is
# process-wide state (a test runner started as a background job inherits SIGINT ignored; an
# earlier test may change the handler); in a process of its own the test says only what
# optcompile does.
_CTRL_C_SCRIPT = """
import copy, signal, warnings
import optcompile, torch
from optcompile.testing import assert_same, set_grads, small_model


class InterruptedAdam(torch.optim.Adam):
    \"\"\"Adam whose state initialization is interrupted (Ctrl-C) once, halfway.\"\"\"

    interrupt = True

    def _init_group(self, group, params, grads, avgs, sqs, maxs, steps):
        for p in group["params"]:
            if p.grad is not None and not self.state[p]:
                self.state[p]["step"] = torch.tensor(0.0)
                if InterruptedAdam.interrupt:
                    InterruptedAdam.interrupt = False
                    signal.raise_signal(signal.SIGINT)
                del self.state[p]
        return super()._init_group(group, params, grads, avgs, sqs, maxs, steps)


# Ctrl-C raises KeyboardInterrupt here (a shell's background job starts with SIGINT ignored,
# and then optcompile, like eager, lets the ignored signal go)
signal.signal(signal.SIGINT, signal.default_int_handler)
model = small_model()
reference = copy.deepcopy(model)
opt = optcompile.compile(InterruptedAdam(model.parameters(), lr=0.01))
eager = torch.optim.Adam(reference.parameters(), lr=0.01)
set_grads(model, 0)
with warnings.catch_warnings():
    warnings.simplefilter("error")  # compiled, not a fallback
    try:
        opt.step()  # held until the step is done, then raised
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the held Ctrl-C was not raised after the step")
set_grads(reference, 0)
eager.step()
assert_same(model, opt, reference, eager)  # the state is whole: every tensor, one step
for step in range(1, 3):
    for m, o in ((model, opt), (reference, eager)):
        set_grads(m, step)
        o.step()
assert_same(model, opt, reference, eager)
assert optcompile.explain(opt).traces == 1
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
print("OK")
"""


def test_ctrl_c_during_the_first_step_leaves_the_optimizer_whole() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


class _SometimesUntraceable(torch.optim.SGD):
    """SGD whose step reads a tensor's value into Python while ``probe`` is set (a debug
    print the user later removes): that cannot be traced."""

    probe = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.probe:
            float(self.param_groups[0]["params"][0].sum())
        return super().step(closure)


def test_a_failed_trace_does_not_make_the_optimizer_eager_for_good() -> None:
    model = small_model()
    reference = copy.deepcopy(model)
    opt = optcompile.compile(_SometimesUntraceable(model.parameters(), lr=0.1))
    eager = torch.optim.SGD(reference.parameters(), lr=0.1)
    set_grads(model, 0)
    set_grads(reference, 0)
    with pytest.warns(optcompile.FallbackWarning, match="a later call traces again"):
        opt.step()
    eager.step()
    assert optcompile.explain(opt).traces == 0
    opt.probe = False
    for step in range(1, 4):
        for m, o in ((model, opt), (reference, eager)):
            set_grads(m, step)
            o.step()
    assert_same(model, opt, reference, eager)
    report = optcompile.explain(opt)
    assert report.traces == 1 and report.fallback_reason is None


def test_a_step_that_never_traces_stops_trying_at_the_recompile_limit() -> None:
    opt = optcompile.compile(
        _SometimesUntraceable(small_model().parameters(), lr=0.1), recompile_limit=3
    )
    tries = 0
    original = opt.step

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optcompile.FallbackWarning)
        for step in range(6):
            set_grads_of(opt, step)
            original()
            tries = optcompile.explain(opt)
    assert tries.traces == 0
    assert tries.fallback_reason is not None
    assert "recompile limit (3) reached; 3 traces failed" in tries.fallback_reason


def set_grads_of(opt: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen)
