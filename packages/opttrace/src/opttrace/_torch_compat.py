"""Every private or unstable torch API opttrace uses, in one place (a torch upgrade edits this)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx


def trace_functional(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> fx.GraphModule:
    """ATen graph of ``fn`` over fake copies of ``inputs``, functionalized.

    In-place writes to inputs appear as trailing ``aten.copy_(input, value)`` nodes and
    everything before them is out-of-place. Inputs must not require grad.
    """
    functional = torch.func.functionalize(fn, remove="mutations_and_views")
    gm: fx.GraphModule = make_fx(functional, tracing_mode="fake")(*inputs)
    return gm


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Make ``torch.compiler.is_compiling()`` report True, so torch.optim takes its
    compile paths (no ``.item()`` syncs, no per-device grouping)."""
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        yield


def raw_step(cls: type) -> Callable[..., Any]:
    """``cls.step`` without torch.optim's profiling/hook wrapper (hooks run outside the trace)."""
    step: Callable[..., Any] = cls.step  # type: ignore[attr-defined]
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        inner: Callable[..., Any] = step.__wrapped__
        return inner
    return step


def rename_placeholder(graph: fx.Graph, node: fx.Node, name: str) -> None:
    """Give a placeholder a readable name (fx has no public API to rename nodes)."""
    node._rename(name)
    node.target = node.name
