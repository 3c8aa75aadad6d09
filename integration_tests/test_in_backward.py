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
import os
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from optcompile import CompileError, _torch_compat
from optcompile.backward import buckets
from optcompile.testing import assert_same

VOCAB, WIDTH, SEQ = 37, 16, 6
HAS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TinyTransformer(torch.nn.Module):
    """Embedding (tied to the head), two pre-norm encoder layers without biases (a key
    bias gets only rounding noise as its gradient, which Adam would amplify), a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            WIDTH, 2, 2 * WIDTH, dropout=0.0, batch_first=True, norm_first=True, bias=False
        )
        self.layers = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.pos.device)
        x = self.layers(self.embed(tokens) + self.pos, is_causal=False)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1).flatten())


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(step))


def groups(model: torch.nn.Module, **decayed: Any) -> list[dict[str, Any]]:
    """Two groups with different options: matrices decayed, vectors not."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], **decayed},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


OPTIMIZERS: dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]] = {
    "AdamW": lambda m: torch.optim.AdamW(groups(m, weight_decay=0.1), lr=3e-3),
    "SGD": lambda m: torch.optim.SGD(groups(m, weight_decay=1e-2), lr=0.05, momentum=0.9),
}

# Traces per bucket over any number of steps, as compiled after backward: SGD's momentum
# buffers appear in its state after the first step, which retraces once.
TRACES = {"AdamW": 1, "SGD": 2}


def make_pair(
    name: str, device: str = "cpu", **options: Any
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    reference = copy.deepcopy(model)
    opt = optcompile.compile(OPTIMIZERS[name](model), in_backward=True, **options)
    return model, opt, reference, OPTIMIZERS[name](reference)


def eager_iteration(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    model(batch(step)).backward()
    opt.step()
    opt.zero_grad()


def train_side_by_side(name: str, steps: int = 10, **options: Any) -> torch.optim.Optimizer:
    model, opt, reference, eager = make_pair(name, **options)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    eager_sched = torch.optim.lr_scheduler.StepLR(eager, step_size=3, gamma=0.5)
    for step in range(steps):
        model(batch(step)).backward()
        assert all(p.grad is None for p in model.parameters()), f"grads left at step {step}"
        opt.step()  # after an in-backward update: hooks only
        opt.zero_grad()
        sched.step()
        eager_iteration(reference, eager, step)
        eager_sched.step()
        assert_same(model, opt, reference, eager)
    return opt


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
def test_a_bucket_update_is_one_staging_round_for_all_of_its_plans_parts():
    """Two param groups: each bucket's plan has two parts (one per group), which stage
    their buffers in one round (one slot check, at most one event) per update."""
    device, backend = TRITON_DEVICE, "triton"
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    adamw = torch.optim.AdamW(groups(model, weight_decay=0.1), foreach=True)  # (CPU: for-loop)
    opt = optcompile.compile(adamw, backend=backend, in_backward=True, bucket_bytes=8192)
    steps = 3
    for step in range(steps):
        model(batch(step)).backward()
    plans = _bucket_plans(opt)
    assert any(len(plan.parts) == 2 for plan in plans)
    for plan in plans:
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


def test_once_learned_only_the_first_and_each_buckets_last_param_keep_a_hook():
    """Fewer hooks, fewer switches into Python per backward: the first param in arrival
    order and each bucket's last one. The updates still run inside backward: when the last
    gradient arrives, every other bucket's gradients are applied and freed."""
    from optcompile.backward import _STATES

    model, opt, reference, eager = make_pair("AdamW", bucket_bytes=4096)
    state = _STATES[opt]
    model(batch(0)).backward()
    eager_iteration(reference, eager, 0)
    learned = [params for params, _ in buckets(opt)]
    assert len(learned) > 2
    assert sorted(state.handles) == sorted({id(learned[0][0]), *(id(b[-1]) for b in learned)})
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


def test_one_bucket_when_all_gradients_fit():
    model, opt, _, _ = make_pair("AdamW")  # the 25 MiB default
    for step in range(3):
        model(batch(step)).backward()
    ((params, compiled),) = buckets(opt)
    assert len(params) == len(list(model.parameters()))
    assert compiled.stats.traces == 1


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


def test_changes_to_groups_and_state_between_backwards_reach_the_next_update():
    # A bucket's view syncs with the optimizer only where something changed since its last
    # update (compared by identity): each kind of change must still arrive.
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

    for step in range(6):
        change(step, opt, model)
        change(step, eager, reference)
        model(batch(step)).backward()
        opt.step()
        opt.zero_grad()
        eager_iteration(reference, eager, step)
        assert_same(model, opt, reference, eager)


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
