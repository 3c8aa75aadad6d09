"""A tiny transformer trained on a fixed synthetic language, for low-precision state tests.

The language is a random first-order Markov chain over ``VOCAB`` tokens (fixed seed): a
model that learns its bigram table reaches the chain's entropy, so losses of runs with
different optimizer state precision can be compared at the end. Everything is seeded, and
the batches are the same for every run; on the CPU a run of 300 steps takes about a second.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optcompile
import torch

VOCAB = 32
WIDTH = 64  # 64x64 attention/FF blocks: 4096+ elements, so their state is compressed
SEQ = 16
BATCH = 16


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.block = torch.nn.TransformerEncoderLayer(
            WIDTH, nhead=4, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True
        )
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position
        return self.head(self.block(x, src_mask=self.mask, is_causal=True))  # type: ignore[no-any-return]


def batches(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches of token sequences from the fixed Markov chain."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen) * 3.0, dim=1)
    out = []
    for _ in range(steps):
        tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=gen)
        for t in range(SEQ):
            tokens[:, t + 1] = torch.multinomial(table[tokens[:, t]], 1, generator=gen)[:, 0]
        out.append(tokens)
    return out


def train(
    make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    steps: int = 300,
    state_dtype: Any = None,
    data: list[torch.Tensor] | None = None,
) -> tuple[float, torch.optim.Optimizer]:
    """Train a fresh TinyTransformer (seed 0) for ``steps`` with a compiled optimizer
    (``state_dtype``); returns the mean loss of the last 20 steps and the optimizer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend (CI shares 2 cores)
    try:
        return _train(make_opt, steps, state_dtype, batches(steps) if data is None else data)
    finally:
        torch.set_num_threads(threads)


def _train(
    make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    steps: int,
    state_dtype: Any,
    data: list[torch.Tensor],
) -> tuple[float, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = optcompile.compile(make_opt(list(model.parameters())), state_dtype=state_dtype)
    losses = []
    for tokens in data[:steps]:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    tail = losses[-20:]
    return sum(tail) / len(tail), opt
