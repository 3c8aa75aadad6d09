"""The torch reference backend: runs the graph's ATen ops eagerly on the real tensors.

It is the ground truth for kernel tests and the default on CPU. The graph module's generated
Python runs each node in order; trailing ``copy_`` nodes write updates into the inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx


class TorchPlan:
    """One graph compiled to Python over ATen ops."""

    backend = "torch"

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.num_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if len(inputs) != self.num_inputs:
            raise ValueError(f"graph takes {self.num_inputs} inputs, got {len(inputs)}")
        with torch.no_grad():
            out = self.gm(*inputs)
        return tuple(out) if isinstance(out, list | tuple) else (out,)

    def describe(self) -> str:
        return self.gm.code.strip()


class TorchBackend:
    """Backend that executes graphs with torch ops (no fusion, any device)."""

    name = "torch"

    def compile(self, gm: fx.GraphModule) -> TorchPlan:
        return TorchPlan(gm)
