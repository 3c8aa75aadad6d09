"""Host values sent ahead: at a backward's first hook, every bucket's host values (the bias
corrections of a capturable=False optimizer's CPU step counts, lr and the other scalars) are
computed and sent in one copy (``InBackward.stage_ahead``, ``optkernels.ahead``), so that
each bucket's update inside the backward only replays its kernels.

Each test trains two copies of one model side by side, one in-backward optimizer sending
ahead (``backward.send_ahead(opt, True)``) and one not (the default: each update computes
and sends its own values), and asserts after every step that parameters and every state tensor are
bitwise equal: over an LR schedule, param groups with other options, gradient accumulation,
a ``load_state_dict`` between steps and a param without gradient in one backward. On the
Triton backend (TRITON_INTERPRET=1 on the CPU: the values go into the plans' buffers by the
same ``_foreach_copy_``) the updates must have taken the values sent ahead; the torch
backend's plans have no host values to send, and train the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from in_backward_setup import HAS_TRITON, TRITON_DEVICE
from optcompile import backward

needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


class Net(torch.nn.Module):
    """Two linear layers around a norm, and a bias ``shift`` a forward may leave out (its
    param then gets no gradient in that backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 8)
        self.shift = torch.nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x: torch.Tensor, shift: bool = True) -> torch.Tensor:
        y = self.out(self.norm(torch.tanh(self.inp(x))))
        if shift:
            y = y + self.shift
        return (y - 0.5).square().mean()


def _groups(model: Net) -> list[dict[str, Any]]:
    """Two groups with other options: matrices decayed, vectors not, their own lr and betas."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {
            "params": [p for p in params if p.dim() < 2],
            "weight_decay": 0.0,
            "lr": 2e-2,
            "betas": (0.8, 0.95),
        },
    ]


OPTIMIZERS: dict[str, Callable[[Net], torch.optim.Optimizer]] = {
    "AdamW": lambda m: torch.optim.AdamW(_groups(m), lr=1e-2),
    "NAdam": lambda m: torch.optim.NAdam(_groups(m), lr=1e-2),
}


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


class Pair:
    """The same model and in-backward optimizer twice: ``ahead`` sends values ahead,
    ``own`` computes each update's itself; each with an LR schedule that changes every
    step, differently per group."""

    def __init__(self, name: str, backend: str) -> None:
        torch.manual_seed(0)
        device = TRITON_DEVICE if backend == "triton" else "cpu"
        self.models = [Net().to(device)]
        self.models.append(copy.deepcopy(self.models[0]))
        self.opts = [
            optcompile.compile(
                OPTIMIZERS[name](m), in_backward=True, backend=backend, bucket_bytes=256
            )
            for m in self.models
        ]
        backward.send_ahead(self.opts[0], True)
        for opt in self.opts:  # (the Python updates' prepare: what they take is counted)
            backward.replay_in_hooks(opt, False)
        self.scheds = [
            torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9**s, lambda s: 1.0 / (1 + s)])
            for o in self.opts
        ]
        self.device = device

    def iteration(self, step: int, **forward: Any) -> None:
        for model, opt, sched in zip(self.models, self.opts, self.scheds, strict=True):
            model(_inputs(step).to(self.device), **forward).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        self.assert_bitwise_equal(step)

    def assert_bitwise_equal(self, step: int) -> None:
        ahead, own = self.models
        for (name, a), b in zip(ahead.named_parameters(), own.parameters(), strict=True):
            assert a.grad is None and b.grad is None
            assert torch.equal(a, b), f"{name} differs at step {step}"
        states = [opt.state_dict()["state"] for opt in self.opts]
        assert states[0].keys() == states[1].keys()
        for key, entry in states[0].items():
            for field, value in entry.items():
                other = states[1][key][field]
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (
                    f"state[{key}][{field!r}] differs at step {step}"
                )

    def taken(self, copy: int = 0) -> tuple[int, int]:
        """(sent ahead, taken) summed over a copy's bucket plans (0: the ahead copy)."""
        counts = [(0, 0)]
        for _, compiled in backward.buckets(self.opts[copy]):
            for entry in compiled.cache.entries:
                plan = getattr(entry.value.plan, "plan", entry.value.plan)
                counts.append(getattr(plan, "ahead_counts", (0, 0)))
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def buckets(self) -> int:
        return len(backward.buckets(self.opts[0]))


def _expect_taken(pair: Pair, backend: str, at_least: int) -> None:
    sent, taken = pair.taken()
    if backend == "triton":
        assert taken >= at_least, (sent, taken)
    else:
        assert (sent, taken) == (0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_values_sent_ahead_give_the_same_bits_over_an_lr_schedule(name, backend):
    pair = Pair(name, backend)
    steps = 6
    for step in range(steps):
        pair.iteration(step)
    buckets = pair.buckets()
    assert buckets >= 3
    # (the first backward learns the buckets; every later one sends all of them ahead)
    _expect_taken(pair, backend, (steps - 1) * buckets)
    if backend == "triton":
        assert pair.taken()[0] == pair.taken()[1]
    assert pair.taken(1) == (0, 0)  # sending ahead is off by default


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_sent_ahead_give_the_same_bits_with_gradient_accumulation(backend):
    pair = Pair("AdamW", backend)
    for step in range(6):
        if step in (2, 4):
            for model, opt in zip(pair.models, pair.opts, strict=True):
                with optcompile.accumulate(opt):
                    model(_inputs(100 + step).to(pair.device)).backward()
        pair.iteration(step)
    _expect_taken(pair, backend, 3 * pair.buckets())


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_sent_ahead_give_the_same_bits_after_load_state_dict_between_steps(backend):
    pair = Pair("AdamW", backend)
    saved: list[dict[str, Any]] = []
    for step in range(7):
        if step == 2:
            saved = [copy.deepcopy(opt.state_dict()) for opt in pair.opts]
        if step == 4:  # (older step counts: the values sent ahead from them must be these)
            for opt, state in zip(pair.opts, saved, strict=True):
                opt.load_state_dict(state)
        pair.iteration(step)
    _expect_taken(pair, backend, 2 * pair.buckets())


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_sent_ahead_give_the_same_bits_when_a_param_gets_no_grad_in_one_backward(
    backend,
):
    pair = Pair("AdamW", backend)
    for step in range(7):
        pair.iteration(step, shift=step != 3)
    _expect_taken(pair, backend, 3 * pair.buckets())


def _halve_lr(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        group["lr"] *= 0.5


def _restart_step_counts(opt: torch.optim.Optimizer) -> None:
    for state in opt.state.values():
        state["step"].fill_(1.0)  # (in place: the tensors the plans read stay)


@needs_triton
@pytest.mark.parametrize("change", [_halve_lr, _restart_step_counts])
def test_a_bucket_whose_inputs_changed_since_they_were_sent_computes_its_own(change):
    """A learning rate or step counts changed inside the backward (by a hook between the
    first one, which sent every bucket's values, and the bucket's update) are the ones the
    update uses."""
    pair = Pair("AdamW", "triton")
    for step in range(2):
        pair.iteration(step)
    before = pair.taken()
    for model, opt in zip(pair.models, pair.opts, strict=True):
        changed = [False]

        def hook(
            _: torch.Tensor, opt: torch.optim.Optimizer = opt, changed: list[bool] = changed
        ) -> None:
            if not changed[0]:
                changed[0] = True
                change(opt)

        handle = model.out.weight.register_post_accumulate_grad_hook(hook)
        model(_inputs(2).to(pair.device)).backward()
        handle.remove()
        opt.step()
    sent, taken = pair.taken()
    assert sent - before[0] == pair.buckets() and taken - before[1] < pair.buckets()
    pair.assert_bitwise_equal(2)
    pair.iteration(3)
