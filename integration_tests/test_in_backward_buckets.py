"""``compile(opt, in_backward=True)``: how parameters are bucketed and hooked, and what
the in-backward optimizer does with what users change between backwards (gradient
accumulation, frozen or unused params, new groups, state_dict round trips, options), against
an eager optimizer stepping after backward; and what it refuses (closures, a global
``clip_grad_norm_``, GradScaler) with a clear error.
"""

from __future__ import annotations

import copy
import gc
import sys
from typing import Any

import optcompile
import pytest
import torch
from in_backward_setup import (
    OPTIMIZERS,
    WIDTH,
    TinyTransformer,
    batch,
    eager_iteration,
    make_pair,
)
from optcompile import CompileError
from optcompile.backward import buckets
from optcompile.testing import assert_same


def test_once_learned_only_the_first_and_each_buckets_last_param_keep_a_hook():
    """Fewer hooks, fewer switches into Python per backward: the first param in arrival
    order and each bucket's last one. The updates still run inside backward: when the last
    gradient arrives, every other bucket's gradients are applied and freed."""
    from optcompile.backward import _STATES

    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    state = _STATES[opt]
    arrived: list[torch.Tensor] = []
    handles = [p.register_post_accumulate_grad_hook(arrived.append) for p in model.parameters()]
    model(batch(0)).backward()
    for handle in handles:
        handle.remove()
    eager_iteration(reference, eager, 0)
    learned = [params for params, _ in buckets(opt)]
    assert len(learned) > 2
    assert sorted(state.handles) == sorted({id(arrived[0]), *(id(b[-1]) for b in learned)})
    freed: list[bool] = []
    last = learned[-1][-1]
    earlier = [p for params in learned[:-1] for p in params]
    handle = last.register_post_accumulate_grad_hook(
        lambda _: freed.append(all(p.grad is None for p in earlier))
    )
    for step in range(1, 4):
        model(batch(step)).backward()
        eager_iteration(reference, eager, step)
        assert_same(model, opt, reference, eager)
    handle.remove()
    assert freed == [True] * 3


def test_a_gradient_held_before_backward_defers_the_updates_to_its_end():
    """A gradient set before backward (accumulated into, as eager does): the first hook
    finds it, so no bucket updates before the backward's end, with the summed gradient."""
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    for step in range(4):
        for m in (model, reference):
            if step == 2:
                m.layers.layers[0].linear1.weight.grad = torch.ones_like(
                    m.layers.layers[0].linear1.weight
                )
        model(batch(step)).backward()
        assert all(p.grad is None for p in model.parameters())
        eager_iteration(reference, eager, step)
        assert_same(model, opt, reference, eager)


def test_buckets_follow_the_order_gradients_arrive_in():
    model, opt, _, _ = make_pair("AdamW", bucket_bytes=1)  # one param per bucket
    model(batch(0)).backward()
    order = [params[0] for params, _ in buckets(opt)]
    assert order[0] is model.norm.weight or order[0] is model.norm.bias  # head's input grads
    assert order[-1] is model.embed.weight or order[-1] is model.pos  # the first layer last
    assert len(order) == len(list(model.parameters()))


def test_a_bucket_holds_one_param_group_in_arrival_order():
    """Each bucket's update is one lane program: its params come from one group (the
    decayed matrices or the undecayed vectors), in the order their gradients arrived; a
    group's last bucket closes with its last gradient, however few bytes it holds."""
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    arrived: list[torch.Tensor] = []
    handles = [p.register_post_accumulate_grad_hook(arrived.append) for p in model.parameters()]
    model(batch(0)).backward()
    for handle in handles:
        handle.remove()
    eager_iteration(reference, eager, 0)
    group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
    learned = [params for params, _ in buckets(opt)]
    assert {len({group_of[id(p)] for p in params}) for params in learned} == {1}
    assert sorted(group_of[id(params[0])] for params in learned).count(1) == 1  # vectors
    for params in learned:
        order = [i for i, p in enumerate(arrived) if any(p is q for q in params)]
        assert order == sorted(order)
    assert sum(map(len, learned)) == len(arrived)
    for step in range(1, 4):
        model(batch(step)).backward()
        eager_iteration(reference, eager, step)
        assert_same(model, opt, reference, eager)


def test_one_bucket_per_group_when_all_gradients_fit():
    model, opt, _, _ = make_pair("AdamW")  # the default size
    for step in range(3):
        model(batch(step)).backward()
    learned = buckets(opt)
    assert sorted(len(params) for params, _ in learned) == sorted(
        len(g["params"]) for g in opt.param_groups
    )
    assert [compiled.stats.traces for _, compiled in learned] == [1, 1]


def test_gradient_accumulation_updates_once_with_the_summed_gradients():
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    for step in range(3):
        for micro in range(2):
            with optcompile.accumulate(opt):
                model(batch(10 * step + micro)).backward()
            assert all(p.grad is not None for p in model.parameters())
            with optcompile.accumulate(opt):
                opt.step()  # hooks only: the gradients stay for the next backward
            assert all(p.grad is not None for p in model.parameters())
        model(batch(10 * step + 2)).backward()
        assert all(p.grad is None for p in model.parameters())
        for micro in range(3):
            reference(batch(10 * step + micro)).backward()
        eager.step()
        eager.zero_grad()
        assert_same(model, opt, reference, eager)


def test_a_parameter_without_gradient_is_left_alone_and_its_bucket_still_runs():
    model, opt, reference, eager = make_pair("SGD", bucket_bytes=4096)
    for m in (model, reference):
        m.pos.requires_grad_(False)  # no grad, ever: eager skips it too
    for step in range(3):
        model(batch(step)).backward()
        assert all(p.grad is None for p in model.parameters())
        eager_iteration(reference, eager, step)
    assert_same(model, opt, reference, eager)


def test_a_parameter_frozen_at_compile_and_trained_later_is_updated_as_eager_does():
    torch.manual_seed(0)
    model = TinyTransformer()
    model.pos.requires_grad_(False)
    reference = copy.deepcopy(model)
    opt = optcompile.compile(OPTIMIZERS["AdamW"](model), in_backward=True, bucket_bytes=4096)
    eager = OPTIMIZERS["AdamW"](reference)
    for step in range(4):
        for m, o in ((model, opt), (reference, eager)):
            m.pos.requires_grad_(step >= 1)  # frozen when compiled: no hook then
            m(batch(step)).backward()
            o.step()
            o.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert_same(model, opt, reference, eager)


def test_a_parameter_unused_in_one_backward_is_updated_as_eager_does():
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    for step in range(4):
        frozen = step == 2  # the final norm gets no gradient in this step
        for m, o in ((model, opt), (reference, eager)):
            if frozen:
                m.norm.weight.requires_grad_(False)
            m(batch(step)).backward()
            m.norm.weight.requires_grad_(True)
            o.step()
            o.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert_same(model, opt, reference, eager)


def test_add_param_group_hooks_the_new_params_and_matches_eager():
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    extra = torch.nn.Parameter(torch.ones(WIDTH))
    extra_reference = torch.nn.Parameter(torch.ones(WIDTH))
    for step in range(4):
        if step == 1:
            opt.add_param_group({"params": [extra], "lr": 0.01})
            eager.add_param_group({"params": [extra_reference], "lr": 0.01})
        for m, o, e in ((model, opt, extra), (reference, eager, extra_reference)):
            (m(batch(step)) + (e * step).sum()).backward()
            o.step()
            o.zero_grad()
        assert step == 0 or extra.grad is None  # (before it joins, no optimizer owns it)
        torch.testing.assert_close(extra, extra_reference)
        assert_same(model, opt, reference, eager)
    assert sum(len(params) for params, _ in buckets(opt)) == len(list(model.parameters())) + 1


def test_state_dict_round_trip_continues_like_eager():
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    for step in range(2):
        model(batch(step)).backward()
        eager_iteration(reference, eager, step)
    saved = copy.deepcopy(opt.state_dict())
    model(batch(2)).backward()  # an update that the reload undoes in the state
    opt.load_state_dict(saved)
    reloaded = copy.deepcopy(eager.state_dict())
    eager.load_state_dict(reloaded)
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            p.copy_(q)
    for step in range(3, 5):
        model(batch(step)).backward()
        eager_iteration(reference, eager, step)
    assert_same(model, opt, reference, eager)
    assert opt.state_dict()["param_groups"] == eager.state_dict()["param_groups"]


@pytest.mark.parametrize("tags", [True, False], ids=["dict-versions", "lookups"])
def test_changes_to_groups_and_state_between_backwards_reach_the_next_update(tags, monkeypatch):
    # A bucket's view syncs with the optimizer only where something changed since its last
    # update (compared by identity; the state's lookups skipped while CPython's version tags
    # say neither state dict changed): each kind of change must still arrive.
    from optcompile import backward, backward_hooks

    if not tags:
        monkeypatch.setattr(backward_hooks, "_dict_version", backward_hooks._no_version)
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)

    def change(step: int, o: torch.optim.Optimizer, m: torch.nn.Module) -> None:
        if step == 2:  # the whole state cleared
            o.state.clear()
        elif step == 3:  # one param's state entry replaced, another's removed
            entry = o.state[m.norm.weight]
            o.state[m.norm.weight] = {**entry, "exp_avg": torch.ones_like(entry["exp_avg"])}
            del o.state[m.pos]
        elif step == 4:  # group options written directly
            o.param_groups[0]["weight_decay"] = 0.5
            o.param_groups[1]["lr"] = 1e-2
        elif step == 5:  # an entry's own values replaced (its dict the same, the state too)
            entry = o.state[m.norm.bias]
            entry["exp_avg_sq"] = torch.full_like(entry["exp_avg_sq"], 0.5)
        elif step == 6:  # a group's key removed and another added
            del o.param_groups[1]["maximize"]
            o.param_groups[1]["maximize"] = False
            o.param_groups[0]["note"] = "added"

    for step in range(8):
        change(step, opt, model)
        change(step, eager, reference)
        model(batch(step)).backward()
        opt.step()
        opt.zero_grad()
        eager_iteration(reference, eager, step)
        assert_same(model, opt, reference, eager)
    versioned = [isinstance(b.tags[0], int) for b in backward._STATES[opt].buckets]
    native = backward_hooks._dict_version is not backward_hooks._no_version
    assert versioned == [tags and native] * len(versioned)


class _LrSumSGD(torch.optim.Optimizer):
    """Plain SGD whose step writes into its param groups: the sum of the lrs it stepped with."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["lr_sum"] = group.get("lr_sum", 0.0) + group["lr"]
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("tags", [True, False], ids=["dict-versions", "lookups"])
def test_what_a_step_writes_into_its_group_reaches_the_next_buckets_update(tags, monkeypatch):
    # Each bucket's view steps with its own copy of the group: what one bucket's step wrote
    # is pushed into the optimizer's group, and the next bucket of that group (in the same
    # backward) pulls it, though nothing else changed in between.
    from optcompile import backward_hooks

    if not tags:
        monkeypatch.setattr(backward_hooks, "_dict_version", backward_hooks._no_version)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    opt = optcompile.compile(
        _LrSumSGD(model.parameters(), lr=0.5), in_backward=True, bucket_bytes=600
    )
    for step in range(4):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        count = len(buckets(opt))
        assert count == 2
        assert opt.param_groups[0]["lr_sum"] == (step + 1) * count * 0.5


def _calls_outside_steps(opt: torch.optim.Optimizer, iteration: Any) -> tuple[int, int]:
    """(bucket updates, Python function calls those updates made outside their compiled
    steps) during ``iteration()``."""
    from optcompile import backward
    from optcompile.driver import Compiled

    update, step = backward.InBackward.update.__code__, Compiled.__call__.__code__
    counts = {"updates": 0, "calls": 0}
    inside: dict[str, Any] = {"update": None, "step": None}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            if frame.f_code is update and inside["update"] is None:
                inside["update"] = frame
                counts["updates"] += 1
            elif frame.f_code is step and inside["step"] is None:
                inside["step"] = frame
            if inside["update"] is not None and inside["step"] is None:
                counts["calls"] += 1
        elif event == "return":
            for key in ("update", "step"):
                if frame is inside[key]:
                    inside[key] = None

    sys.setprofile(profile)
    try:
        iteration()
    finally:
        sys.setprofile(None)
    return counts["updates"], counts["calls"]


@pytest.mark.parametrize("scheduled", [False, True], ids=["same-lr", "lr-schedule"])
def test_a_bucket_update_makes_one_python_call_outside_its_step_when_nothing_changed(
    scheduled,
):
    # Inside backward every Python operation costs several times what it does on the main
    # thread: with nothing changed since the last backward, the update itself is the one
    # call (its groups and state tested by version tags, its grads freed natively); the
    # lr an LR scheduler set adds the group's pull (and its identity pass).
    from optcompile import backward_hooks

    model, opt, _, _ = make_pair("AdamW", bucket_bytes=4096)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (step + 1))

    def iteration(step: int) -> None:
        model(batch(step)).backward()
        opt.step()
        if scheduled:
            sched.step()

    for step in range(3):
        iteration(step)
    if backward_hooks._dict_version is backward_hooks._no_version:
        pytest.skip("no native dict version tags (OPTCOMPILE_NATIVE=0, or CPython 3.14+)")
    updates, calls = _calls_outside_steps(opt, lambda: iteration(3))
    assert updates == len(buckets(opt)) >= 3
    assert calls == updates * (3 if scheduled else 1)


def test_explain_lists_the_buckets_and_counts_their_traces():
    model, opt, _, _ = make_pair("AdamW", bucket_bytes=4096)
    assert "the first backward learns them" in str(optcompile.explain(opt))
    for step in range(2):
        model(batch(step)).backward()
    report = optcompile.explain(opt)
    assert len(report.buckets) == len(buckets(opt)) > 1
    assert report.traces == len(buckets(opt)) and report.name == "AdamW.step"
    assert report.buckets[0].startswith("bucket 0: ") and "traces 1" in report.buckets[0]
    assert len(str(report).splitlines()) <= 40


def test_step_hooks_run_in_step_not_per_bucket():
    model, opt, _, _ = make_pair("AdamW", bucket_bytes=4096)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    model(batch(0)).backward()
    assert calls == [] and len(buckets(opt)) > 1
    opt.step()
    assert calls == ["pre", "post"]


def test_compiling_again_without_in_backward_removes_the_hooks():
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    model(batch(0)).backward()
    eager_iteration(reference, eager, 0)
    optcompile.compile(opt, in_backward=False)
    model(batch(1)).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    opt.zero_grad()
    eager_iteration(reference, eager, 1)
    assert_same(model, opt, reference, eager)


def test_a_closure_is_refused():
    model, opt, _, _ = make_pair("AdamW")
    with pytest.raises(CompileError, match="closure"):
        opt.step(lambda: model(batch(0)))


def test_clip_grad_norm_over_in_backward_params_is_refused():
    pair = make_pair("AdamW")  # the optimizer stays alive (its death removes the hooks)
    model = pair[0]
    model(batch(0)).backward()
    with pytest.raises(CompileError, match="each bucket by its own norm is not the same"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    other = torch.nn.Linear(2, 2)  # a model of no in-backward optimizer clips as before
    other(torch.ones(2)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3) > 1e-3


def test_params_outliving_their_in_backward_optimizer_train_as_before():
    model, opt, _, _ = make_pair("SGD")
    del opt
    gc.collect()
    model(batch(0)).backward()  # no hook left: the gradients stay
    assert all(p.grad is not None for p in model.parameters())
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) > 0


def test_grad_scaler_is_refused_before_the_backward():
    pair = make_pair("AdamW")
    model = pair[0]
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(CompileError, match="GradScaler"):
        scaler.scale(model(batch(0)))
    assert all(p.grad is None for p in model.parameters())
    other = torch.nn.Linear(2, 2)
    scaler.scale(other(torch.ones(2)).sum()).backward()  # other models scale as before


def test_in_backward_is_refused_where_it_cannot_hold():
    with pytest.raises(CompileError, match="LBFGS"):
        lbfgs = torch.optim.LBFGS(TinyTransformer().parameters())
        optcompile.compile(lbfgs, in_backward=True)
    assert type(lbfgs) is torch.optim.LBFGS  # left as it was
    with pytest.raises(CompileError, match="optimizers"):
        optcompile.compile(lambda x: x.add_(1), in_backward=True)
    with pytest.raises(CompileError, match="in_backward must be True or False"):
        optcompile.compile(torch.optim.SGD(TinyTransformer().parameters()), in_backward=1)
    with pytest.raises(CompileError, match="bucket_bytes"):
        optcompile.compile(torch.optim.SGD(TinyTransformer().parameters()), bucket_bytes=0)
    plain = torch.optim.SGD(TinyTransformer().parameters())
    with pytest.raises(CompileError, match="in_backward=True"), optcompile.accumulate(plain):
        pass
