"""GPT-2-style language models built from torch.nn layers (no downloads), for the sharded
benchmarks: the parameter shapes of GPT-2 124M (148 tensors, embeddings tied) and of a GPT
1.3B, and a tiny one for CPU smoke runs. nn.Linear keeps its weight as (out, in), the
transpose of GPT-2's Conv1D: the same elements, the same bytes per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int
    positions: int
    width: int
    layers: int
    heads: int


CONFIGS = {
    "gpt2": Config(vocab=50257, positions=1024, width=768, layers=12, heads=12),
    "1.3b": Config(vocab=50257, positions=2048, width=2048, layers=24, heads=16),
    "tiny": Config(vocab=64, positions=16, width=16, layers=2, heads=2),
}


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x MLP."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln_1 = nn.LayerNorm(c.width)
        self.attn = nn.Linear(c.width, 3 * c.width)
        self.attn_proj = nn.Linear(c.width, c.width)
        self.ln_2 = nn.LayerNorm(c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.fc_proj = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm; the logits reuse the
    token embedding (tied, counted once)."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.width)
        self.wpe = nn.Embedding(c.positions, c.width)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.ln_f = nn.LayerNorm(c.width)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def build(name: str, device: str, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(CONFIGS[name])


def shard(model: GPT, **fsdp_options: Any) -> GPT:
    """FSDP2 as its docs recommend: each block a unit, then the root (embeddings, norm)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **fsdp_options)
    fully_shard(model, **fsdp_options)
    return model


def batch(name: str, size: int, length: int, device: str, seed: int) -> torch.Tensor:
    """Random tokens (a fixed generator per ``seed``: every rank and twin can redo them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIGS[name].vocab, (size, length + 1), generator=gen).to(device)


def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
