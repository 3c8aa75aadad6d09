from __future__ import annotations

import pytest
import torch


@pytest.fixture
def params() -> list[torch.nn.Parameter]:
    """Three small parameters of different shapes, each with a gradient."""
    gen = torch.Generator().manual_seed(0)
    ps = [
        torch.nn.Parameter(torch.randn(*shape, generator=gen))
        for shape in [(4, 3), (5,), (2, 2, 2)]
    ]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    return ps
