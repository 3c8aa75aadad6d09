"""A bucket update replayed from its trigger's hook without Python (optcompile.backward_direct,
optguard's native direct update): the same results as eager, a fallback to the Python update
whenever something it read changed, and nothing native under compiled autograd.

The hook wrapper itself (install, fallback to the Python hooks, compiled autograd) runs on
any machine; the replays need a CUDA device (CUDA graphs).
"""

from __future__ import annotations

import copy

import optcompile
import pytest
import torch
from in_backward_setup import TinyTransformer, batch, groups, needs_cuda
from optcompile import backward
from optcompile.testing import assert_same
from optguard import native

_NATIVE = native.start()
needs_native = pytest.mark.skipif(
    _NATIVE is None or not hasattr(_NATIVE, "direct_arm"),
    reason=f"optguard's native module is not loaded ({native.status()})",
)


@needs_native
def test_unarmed_wrapper_runs_the_python_hooks_and_unwraps():
    module = native.module()
    p = torch.nn.Parameter(torch.randn(3))
    seen: list[torch.Tensor] = []
    p.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.clone()))
    direct = module.direct_new(module.direct_gate())
    assert module.direct_install(direct, p) and module.direct_install(direct, p)
    (p * 2).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))
    replays, fallbacks, _ = module.direct_stats(direct)
    assert replays == 0 and fallbacks[0] == 1  # "not armed": the Python hooks ran
    assert module.direct_uninstall(direct, p) and not module.direct_uninstall(direct, p)
    (p * 2).sum().backward()
    assert len(seen) == 2 and module.direct_stats(direct)[1][0] == 1  # unwrapped: not asked


@needs_native
def test_a_param_without_python_hooks_is_not_wrapped():
    module = native.module()
    direct = module.direct_new(module.direct_gate())
    assert not module.direct_install(direct, torch.nn.Parameter(torch.randn(2)))


@needs_native
def test_under_compiled_autograd_the_wrapped_hooks_are_captured_unwrapped():
    module = native.module()
    p = torch.nn.Parameter(torch.randn(3))
    seen: list[int] = []
    p.register_post_accumulate_grad_hook(lambda t: seen.append(1))
    direct = module.direct_new(module.direct_gate())
    assert module.direct_install(direct, p)
    from torch._dynamo import compiled_autograd

    with compiled_autograd._enable(torch.compile(backend="eager")):
        (p * 3).sum().backward()
    assert seen == [1]
    assert torch.equal(p.grad, torch.full((3,), 3.0))
    assert module.direct_stats(direct)[:2] == (0, [0] * 9)  # compiled autograd never called it


# -- on a GPU: the replays --


def _pair(capturable: bool = True) -> tuple:
    torch.manual_seed(0)
    model = TinyTransformer().cuda()
    reference = copy.deepcopy(model)

    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups(m, weight_decay=0.1), lr=3e-3, capturable=capturable)

    opt = optcompile.compile(make(model), in_backward=True, bucket_bytes=8192)
    return model, opt, reference, make(reference)


def _iteration(model, opt, reference, eager, step: int) -> None:
    model(batch(step)).backward()
    assert all(p.grad is None for p in model.parameters()), f"grads left at step {step}"
    opt.step()
    opt.zero_grad()
    reference(batch(step)).backward()
    eager.step()
    eager.zero_grad()
    assert_same(model, opt, reference, eager)


def _assert_replayed(opt: torch.optim.Optimizer, at_least: int) -> None:
    """Every bucket but the one whose trigger is the backward's first param replayed from
    its hook at least ``at_least`` times, left to Python only where a gradient moved (the
    eager copy's iterations in between shift the allocator's addresses)."""
    lines = backward.direct_status(opt)
    replayed = [line for line in lines if line.startswith("replayed")]
    assert len(lines) > 2 and len(replayed) >= len(lines) - 1, lines
    for line in replayed:
        count = int(line.split(": ")[1].split(" ")[0])
        assert count >= at_least, lines
        left = line.split("left to Python: ")[1].split("; not armed")[0] if "left" in line else ""
        assert all("gradient missing" in why for why in left.split("; ") if why), lines


def _replays(opt: torch.optim.Optimizer) -> int:
    lines = backward.direct_status(opt)
    return sum(int(line.split(": ")[1].split(" ")[0]) for line in lines if "without Python" in line)


@needs_native
@needs_cuda
def test_capturable_buckets_replay_from_their_hooks_and_match_eager():
    model, opt, reference, eager = _pair()
    for step in range(8):
        _iteration(model, opt, reference, eager, step)
    _assert_replayed(opt, 4)  # (6 where no gradient moved: from the third backward on)
    report = optcompile.explain(opt)
    assert any("replayed from its hook without Python" in b for b in report.buckets)
    # the graphs count the native replays too: the first update runs without its graph,
    # the second records it (and replays it), the other six replay it
    assert all("1 recording(s), 7 replay(s)" in b for b in report.buckets), report.buckets


@needs_native
@needs_cuda
def test_what_the_update_reads_changing_falls_back_to_python_and_matches_eager():
    model, opt, reference, eager = _pair()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    eager_sched = torch.optim.lr_scheduler.StepLR(eager, step_size=2, gamma=0.5)
    for step in range(10):
        if step == 5:  # state loaded: new state tensors (other addresses)
            opt.load_state_dict(copy.deepcopy(eager.state_dict()))
            eager.load_state_dict(copy.deepcopy(eager.state_dict()))
        if step == 7:
            for group in (*opt.param_groups, *eager.param_groups):
                group["betas"] = (0.8, 0.99)
        _iteration(model, opt, reference, eager, step)
        sched.step()
        eager_sched.step()
    lines = backward.direct_status(opt)
    assert any("left to Python" in line and "changed" in line for line in lines), lines
    assert _replays(opt) > 0, lines


@needs_native
@needs_cuda
def test_a_hook_added_on_a_trigger_param_runs_every_backward():
    model, opt, reference, eager = _pair()
    for step in range(3):
        _iteration(model, opt, reference, eager, step)
    before = _replays(opt)
    assert before > 0
    state = backward._STATES[opt]
    trigger = next(b.direct_on for b in state.buckets if b.direct_on is not None)
    calls: list[int] = []
    trigger.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    for step in range(3, 6):
        _iteration(model, opt, reference, eager, step)
    assert calls == [1, 1, 1]


@needs_native
@needs_cuda
@pytest.mark.parametrize("schedule", [False, True])
def test_step_counts_on_the_cpu_replay_with_their_host_values_sent_ahead(schedule: bool):
    """capturable=False: the step counts live on the CPU and the host computes the bias
    corrections; each backward's first hook computes and sends them for every bucket, the
    hooks write the step counts' new values and replay."""
    model, opt, reference, eager = _pair(capturable=False)
    schedules = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=3e-3, total_steps=20) for o in (opt, eager)
    ]
    for step in range(8):
        _iteration(model, opt, reference, eager, step)  # (step counts compared too)
        if schedule:
            for s in schedules:
                s.step()
    _assert_replayed(opt, 4)
    steps = {float(opt.state[p]["step"]) for p in model.parameters()}
    assert steps == {8.0}, steps


@needs_native
@needs_cuda
def test_a_schedule_changing_numbers_every_step_keeps_replaying_and_matches_eager():
    model, opt, reference, eager = _pair()
    schedules = [
        torch.optim.lr_scheduler.OneCycleLR(o, max_lr=3e-3, total_steps=20) for o in (opt, eager)
    ]
    for step in range(10):
        if step == 7:  # a flag the trace branched on: the update retraces, in Python
            for group in (*opt.param_groups, *eager.param_groups):
                group["maximize"] = True
        _iteration(model, opt, reference, eager, step)
        for schedule in schedules:
            schedule.step()  # a new lr and new betas every step
    lines = backward.direct_status(opt)
    replayed = [line for line in lines if line.startswith("replayed")]
    assert len(replayed) >= len(lines) - 1, lines
    # steps 2-6 natively (lr and betas sent at each backward's first hook); at step 7 the
    # flag's guard fails there: the update retraces in Python (its new graph is recorded
    # by its second call, step 8, which arms it again) and replays natively at step 9
    assert all(int(line.split(": ")[1].split(" ")[0]) >= 4 for line in replayed), lines
    assert all("not armed" in line for line in replayed), lines  # (step 7's fallback)


@needs_native
@needs_cuda
def test_gradients_moving_every_backward_stop_the_arming():
    model, opt, reference, eager = _pair()
    state = backward._STATES[opt]
    for step in range(2):  # (buckets learned and thinned out)
        _iteration(model, opt, reference, eager, step)
    bucket = next(b for b in state.buckets if len(b.params) > 1 and b.params[-1] is not state.first)
    moved = bucket.params[0]
    spare = [torch.empty_like(moved), torch.empty_like(moved)]
    turn = [0]

    def elsewhere(p: torch.Tensor) -> None:  # its grad at one of two addresses, in turn
        turn[0] += 1
        p.grad = spare[turn[0] % 2].copy_(p.grad)

    moved.register_post_accumulate_grad_hook(elsewhere)
    for step in range(2, 10):
        _iteration(model, opt, reference, eager, step)
    assert bucket.direct_reason is not None and "left to Python for good" in bucket.direct_reason
    assert "gradient missing or at another address" in bucket.direct_reason
    assert bucket.direct_on is None  # its hooks unwrapped
    others = [b for b in state.buckets if b is not bucket and b.direct_reason is None]
    assert others, backward.direct_status(opt)


@needs_native
@needs_cuda
@pytest.mark.parametrize("capturable", [False, True])
def test_the_hooks_replays_give_the_bits_of_the_python_updates(capturable: bool):
    """The same training twice, one copy's updates replayed from its hooks, the other's in
    Python (``replay_in_hooks(opt, False)``), with a schedule changing lr and betas."""
    pairs = [_pair(capturable)[:2] for _ in range(2)]
    backward.replay_in_hooks(pairs[1][1], False)
    schedules = [
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=20) for _, opt in pairs
    ]
    for step in range(8):
        for (model, opt), schedule in zip(pairs, schedules, strict=True):
            model(batch(step)).backward()
            opt.step()
            schedule.step()
        (a, first), (b, second) = pairs
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), step
            for key, value in first.state[p].items():
                assert torch.equal(value, second.state[q][key]), (step, key)
    assert _replays(pairs[0][1]) > 0 and _replays(pairs[1][1]) == 0
