"""``compile(opt, in_backward=True)``: the update runs inside ``loss.backward()``.

A small transformer (token embedding tied to the output head, two encoder layers) is trained
side by side with an eager optimizer that steps after backward: params and every state
tensor must match eager's after each of 10 steps, within eager's own foreach tolerance
(the default ``assert_close`` tolerances); gradients are None after every backward. The
same runs with torch's compiled autograd on (the hooks run inside its backward graph).
Triton cases run their kernels under TRITON_INTERPRET=1 on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from in_backward_setup import (
    OPTIMIZERS,
    TRACES,
    TRITON_DEVICE,
    TinyTransformer,
    batch,
    eager_iteration,
    groups,
    make_pair,
    needs_cuda,
    needs_triton,
    train_side_by_side,
)
from optcompile import _torch_compat, backward
from optcompile.backward import buckets
from optcompile.optimizer import registered
from optcompile.testing import assert_same


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_ten_steps_in_backward_match_eager_after_backward(name):
    opt = train_side_by_side(name, bucket_bytes=4096)
    learned = buckets(opt)
    assert len(learned) > 1
    assert [compiled.stats.traces for _, compiled in learned] == [TRACES[name]] * len(learned)


@needs_triton
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_ten_steps_in_backward_on_triton_match_eager(name):
    opt = train_side_by_side(name, device=TRITON_DEVICE, backend="triton", bucket_bytes=8192)
    learned = buckets(opt)
    assert len(learned) > 1
    assert all(c.backend.name.startswith("triton") for _, c in learned)
    assert [c.stats.traces for _, c in learned] == [TRACES[name]] * len(learned)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_in_backward_under_compiled_autograd_matches_eager(name):
    # Compiled autograd captures the backward, the hooks among it, into one FX graph and
    # hands it to a compiler; here the graph runs as captured (see the next test for dynamo).
    with _torch_compat.compiled_autograd(lambda graph: graph):
        opt = train_side_by_side(name, steps=4, bucket_bytes=4096)
    assert [c.stats.traces for _, c in buckets(opt)] == [TRACES[name]] * len(buckets(opt))


def test_compiled_autograd_after_eager_backwards_gives_every_param_its_hook_back():
    """Eager backwards thin the hooks out (see backward.py); under compiled autograd the
    first backward's buckets are updated by step(), and every param is hooked again."""
    from optcompile.backward import _STATES

    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    state = _STATES[opt]
    for step in range(4):
        if step == 2:
            assert state.thin
            context: Any = _torch_compat.compiled_autograd(lambda graph: graph)
        else:
            context = contextlib.nullcontext()
        with context:
            model(batch(step)).backward()
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        eager_iteration(reference, eager, step)
        assert_same(model, opt, reference, eager)
    assert not state.thin and len(state.handles) == len(list(model.parameters()))


def test_in_backward_under_compiled_autograd_compiled_by_dynamo_matches_eager():
    # Dynamo compiles the captured backward; each hook is a graph break (optcompile's update
    # runs outside dynamo's graph), which makes its first compile slow for large models: a
    # small MLP keeps this test short.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    opt = optcompile.compile(torch.optim.AdamW(model.parameters()), in_backward=True)
    eager = torch.optim.AdamW(reference.parameters())
    inputs = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    regions: list[bool] = []
    spy = torch.compiler.disable(lambda p: regions.append(_torch_compat.in_compiled_autograd()))
    model[0].bias.register_post_accumulate_grad_hook(spy)
    with _torch_compat.compiled_autograd(torch.compile(backend="eager")):
        for step in range(3):
            model(inputs * step).pow(2).sum().backward()
            assert all(p.grad is None for p in model.parameters())
            opt.step()
            reference(inputs * step).pow(2).sum().backward()
            eager.step()
            eager.zero_grad()
    assert regions == [True] * 3  # the hooks ran inside compiled autograd's graph
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], eager.state[q]["exp_avg_sq"])


def test_in_backward_with_compiled_autograd_from_the_dynamo_config_matches_eager():
    # torch._dynamo.config.compiled_autograd (read when torch.compile wraps the function):
    # a backward called inside the compiled function runs through compiled autograd.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    opt = optcompile.compile(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), in_backward=True
    )
    eager = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    inputs = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    regions: list[bool] = []
    spy = torch.compiler.disable(lambda p: regions.append(_torch_compat.in_compiled_autograd()))
    model[0].bias.register_post_accumulate_grad_hook(spy)  # (its own hooks run there too)

    with _torch_compat.compiled_autograd_config():

        @torch.compile(backend="eager")
        def train(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).pow(2).sum()
            loss.backward()
            return loss

        for step in range(3):
            train(inputs * step)
            assert all(p.grad is None for p in model.parameters())
            opt.step()
            reference(inputs * step).pow(2).sum().backward()
            eager.step()
            eager.zero_grad()
    assert regions == [True] * 3
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"], eager.state[q]["momentum_buffer"]
        )


def test_a_backward_inside_a_compiled_function_runs_the_hooks_outside_dynamo():
    # Without compiled autograd, the engine calls the hooks from the compiled function's
    # frame (on the CPU, in this thread) while dynamo's frame callback is set: the update
    # must not be traced by dynamo (it would be, frame by frame, without the disabled path).
    from torch._dynamo.utils import counters

    def train_compiled(in_backward: bool) -> tuple[dict[str, int], list[torch.Tensor]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        opt = optcompile.compile(torch.optim.AdamW(model.parameters()), in_backward=in_backward)

        @torch.compile(backend="eager")
        def train(x: torch.Tensor) -> None:
            model(x).pow(2).sum().backward()

        inputs = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
        for step in range(3):
            train(inputs * step)
            assert not in_backward or all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        return dict(counters["stats"]), [p.detach() for p in model.parameters()]

    graphs, params = train_compiled(in_backward=True)
    graphs_after, params_after = train_compiled(in_backward=False)
    assert graphs == graphs_after  # dynamo traced the function's code only
    for p, q in zip(params, params_after, strict=True):
        torch.testing.assert_close(p, q)


def test_under_compiled_autograd_a_bucket_left_incomplete_is_updated_by_step():
    # Compiled autograd runs no end-of-backward callback queued from a hook: a parameter
    # without a gradient leaves its bucket waiting until opt.step().
    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    with _torch_compat.compiled_autograd(lambda graph: graph):
        for step in range(3):
            for m, o in ((model, opt), (reference, eager)):
                m.norm.weight.requires_grad_(step != 1)
                m(batch(step)).backward()
                o.step()
                o.zero_grad()
            assert all(p.grad is None for p in model.parameters())
            assert_same(model, opt, reference, eager)


@needs_cuda
def test_on_cuda_each_bucket_replays_its_cuda_graph_and_matches_eager():
    opt = train_side_by_side("AdamW", device="cuda", bucket_bytes=8192)  # auto: triton
    report = optcompile.explain(opt)
    assert len(report.buckets) > 1
    assert all("1 recording(s), " in line for line in report.buckets), report.buckets


@needs_cuda
def test_on_cuda_peak_memory_drops_by_about_the_gradients():
    def peak(in_backward: bool) -> tuple[int, int]:
        gc.collect()  # the other run's model and optimizer are gone
        torch.manual_seed(0)
        layers = [torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)]
        model = torch.nn.Sequential(*layers).cuda()
        opt = optcompile.compile(
            torch.optim.AdamW(model.parameters()), in_backward=in_backward, bucket_bytes=2**22
        )
        inputs = torch.randn(4, 1024, device="cuda")
        for step in range(3):
            if step == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            model(inputs).sum().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        return torch.cuda.max_memory_allocated(), grads

    after, grads = peak(False)
    inside, _ = peak(True)
    assert inside <= after - grads * 3 // 4, (after, inside, grads)


def _bucket_plans(opt: torch.optim.Optimizer) -> list[Any]:
    """Each bucket's backend plan (inside its CUDA-graph wrapper, where there is one)."""
    plans = [compiled.cache.entries[0].value.plan for _, compiled in buckets(opt)]
    return [getattr(plan, "plan", plan) for plan in plans]


# What makes the host wait for the device, as torch.profiler names it (CUDA runtime calls).
_SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


@needs_cuda
def test_on_cuda_a_bucket_update_never_waits_for_the_device(monkeypatch):
    """The backward keeps the stream fed: no bucket update synchronizes, also once each
    plan's staging slots come back around (after SLOTS updates). Counted by wrappers of
    torch's Python-level synchronizations, and by torch's profiler (every CUDA runtime
    call, on the autograd thread too) against the same iterations of the eager copy."""
    from optkernels.staging import SLOTS
    from torch.profiler import ProfilerActivity, profile

    model, opt, reference, eager = make_pair("AdamW", device="cuda", bucket_bytes=8192)
    backward.replay_in_hooks(opt, False)  # (the Python updates: their staging slots counted)
    for step in range(SLOTS + 2):
        model(batch(step)).backward()
        eager_iteration(reference, eager, step)
    tokens = [batch(SLOTS + 2 + k).cuda() for k in range(6)]  # (no copy in the forwards)
    rounds = [plan.staging.round for plan in _bucket_plans(opt)]
    calls: list[str] = []

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    for owner in (torch.cuda.Event, torch.cuda.Stream):
        monkeypatch.setattr(owner, "synchronize", counted(owner.__name__, owner.synchronize))
    monkeypatch.setattr(torch.cuda, "synchronize", counted("cuda", torch.cuda.synchronize))
    for k in range(3):
        model(tokens[k]).backward()
    monkeypatch.undo()
    assert calls == []

    def syncs(m: torch.nn.Module, step: Callable[[], None]) -> dict[str, int]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k in range(3, 6):
                m(tokens[k]).backward()
                step()
        return {e.key: e.count for e in prof.key_averages() if e.key in _SYNC_CALLS}

    for k in range(3):
        reference(tokens[k]).backward()
        eager.step()
        eager.zero_grad()
    ours = syncs(model, lambda: None)
    assert ours == syncs(reference, lambda: (eager.step(), eager.zero_grad())), ours
    plans = _bucket_plans(opt)
    assert len(plans) > 1
    assert [plan.staging.round for plan in plans] == [r + 6 for r in rounds]  # all updated
    assert all(plan.staging.grown == 0 for plan in plans)  # no slot was still being read
    torch.cuda.synchronize()
    assert_same(model, opt, reference, eager)


@needs_triton
def test_a_bucket_update_is_one_part_and_one_staging_round():
    """Two param groups: a bucket holds one of them, so its plan is one part (one lane
    program) staging its buffers in one round per update; the same groups stepped after
    backward make a plan of two parts, which stage in one round per step all the same."""
    device, backend = TRITON_DEVICE, "triton"
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    after_model = copy.deepcopy(model)
    adamw = torch.optim.AdamW(groups(model, weight_decay=0.1), foreach=True)  # (CPU: for-loop)
    opt = optcompile.compile(adamw, backend=backend, in_backward=True, bucket_bytes=8192)
    backward.replay_in_hooks(opt, False)  # (each update's prepare runs: rounds counted)
    after = optcompile.compile(
        torch.optim.AdamW(groups(after_model, weight_decay=0.1), foreach=True), backend=backend
    )
    steps = 3
    for step in range(steps):
        model(batch(step)).backward()
        after_model(batch(step)).backward()
        after.step()
        after.zero_grad()
    plans = _bucket_plans(opt)
    assert len(plans) > 2
    assert all(len(plan.parts) == 1 and plan.staging.round == steps for plan in plans)
    (entry,) = registered(after).cache.entries
    plan = getattr(entry.value.plan, "plan", entry.value.plan)
    assert len(plan.parts) == 2
    assert {id(part.staging) for part in plan.parts} == {id(plan.staging)}
    assert plan.staging.round == steps


def test_the_packages_wait_for_the_device_only_where_a_staging_ring_is_dropped():
    """Structural: the only host synchronization in optcompile's packages is the one that
    keeps a dropped staging ring's pinned memory until its copies are done (``_drain``, not
    reachable from a step); a step, and so a bucket update, has none to make. An added
    ``synchronize()``/``.item()`` on a device tensor in the hot path shows up in the GPU
    test above; this one catches a ``synchronize`` anywhere, on the CPU."""
    import ast
    from pathlib import Path

    packages = Path(__file__).resolve().parents[1] / "packages"
    found = []
    for path in sorted(packages.glob("*/src/*/*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                called = node.func if isinstance(node, ast.Call) else None
                name = getattr(called, "attr", getattr(called, "id", None))
                if name in ("synchronize", "cudaDeviceSynchronize", "cudaStreamSynchronize"):
                    found.append(f"{path.parent.name}/{path.name}:{func.name}")
    assert sorted(set(found)) == ["optkernels/staging.py:_drain"], found
