"""The backend contract: a backend turns an ATen ``fx.GraphModule`` into a runnable Plan."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

import torch
from torch import fx


class Plan(Protocol):
    """A compiled graph: call it with the graph's inputs, in placeholder order."""

    backend: str

    @property
    def kernel_launches_per_step(self) -> int:
        """Device launches (ATen ops or generated kernels) per call."""
        ...

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]: ...

    def guarded_addresses(self, indices: Collection[int]) -> None:
        """The caller promises that, on every call, the inputs at ``indices`` have the
        addresses they had on the first (it checks them itself): a plan that baked those
        addresses in need not compare them again."""
        ...

    def describe(self) -> str:
        """What runs on each call (the generated code), for explain()."""
        ...


class Backend(Protocol):
    """Lowers graphs for one kind of execution (torch ops, Triton kernels)."""

    name: str
    wants_capturable: bool  # trace the path that keeps every value on the device

    def compile(self, gm: fx.GraphModule) -> Plan: ...
