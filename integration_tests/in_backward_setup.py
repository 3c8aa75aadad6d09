"""The model, optimizers and side-by-side training the step-inside-backward tests share
(test_in_backward.py, test_in_backward_buckets.py): a small transformer (token embedding tied to
the output head, two encoder layers), each step's batch, and an in-backward compiled optimizer
trained beside an eager one that steps after backward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from optcompile.testing import assert_same
from triton_setup import TRITON_RUNS

VOCAB, WIDTH, SEQ = 37, 16, 6
HAS_TRITON = TRITON_RUNS
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
