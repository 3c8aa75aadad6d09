"""A for-loop step replicated per kind of parameter traces exactly what the full loop does:
the same graph (ops, arguments, node names, metadata), inputs, guards and effects."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from opttrace import meta, replicate, trace_step

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False),
    "Adam amsgrad": lambda ps: torch.optim.Adam(ps, amsgrad=True, foreach=False),
    "Adam maximize": lambda ps: torch.optim.Adam(ps, maximize=True, foreach=False),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    "SGD momentum": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False
    ),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, weight_decay=0.1, foreach=False),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True, foreach=False),
    "Adamax": lambda ps: torch.optim.Adamax(ps, foreach=False),
    "NAdam": lambda ps: torch.optim.NAdam(ps, decoupled_weight_decay=True, foreach=False),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, weight_decay=0.1, foreach=False),
    "RAdam": lambda ps: torch.optim.RAdam(ps, foreach=False),
    "RAdam decoupled": lambda ps: torch.optim.RAdam(
        ps, weight_decay=0.1, decoupled_weight_decay=True, foreach=False
    ),
    "ASGD": lambda ps: torch.optim.ASGD(ps, t0=1.0, foreach=False),
    "Rprop": lambda ps: torch.optim.Rprop(ps, foreach=False),
    "Rprop maximize": lambda ps: torch.optim.Rprop(
        ps, etas=(0.4, 1.3), step_sizes=(1e-5, 10.0), maximize=True, foreach=False
    ),
}


def _params(shapes: list[tuple[Any, ...]]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape, dtype in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
        p.grad = torch.randn(shape, generator=gen, dtype=dtype)
        params.append(p)
    return params


# Kinds interleaved (weights and biases), another dtype, a transposed (strided) param, a
# param without a grad, and enough of each kind to be replicated.
MIXED = [((4, 3), torch.float32), ((3,), torch.float32)] * 6 + [
    ((2, 2), torch.float64),
    ((2, 2), torch.float64),
] * 5


def _traces(name: str, capturable: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The traces of two steps, with and without replication (of one optimizer: the same
    addresses)."""
    params = _params(MIXED)
    params[3].grad = None
    params[6] = torch.nn.Parameter(params[6].detach().t().contiguous().t())
    params[6].grad = torch.randn(4, 3).t().contiguous().t()
    opt = OPTIMIZERS[name](params)
    out: list[list[Any]] = [[], []]
    for _ in range(2):
        for steps, setting in zip(out, ("1", "0"), strict=True):
            monkeypatch.setenv("OPTTRACE_REPLICATE", setting)
            meta.clear_cache()  # (each trace from cold op plans, as a fresh process's first)
            steps.append(trace_step(opt, capturable=capturable))
        opt.step()  # (eager: the second traces see the state the first step made)
    return out


def _summary(traced: Any) -> tuple[Any, ...]:
    graph = traced.graph_module
    metas = [
        (n.name, str(n.meta.get("val")), n.meta.get("inplace"), n.meta.get("static_address"))
        for n in graph.graph.nodes
    ]
    return (
        graph.code,
        metas,
        traced.input_sources,
        tuple(traced.guards.guards),
        repr(traced.effects),  # (its values name the graph's nodes)
        traced.num_outputs,
    )


@pytest.mark.parametrize("capturable", [False, True], ids=["eager path", "capturable path"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_replicated_trace_is_the_full_trace(name, capturable, monkeypatch):
    copies = []
    original = replicate._Template.replicate
    monkeypatch.setattr(
        replicate._Template, "replicate", lambda self, *a: copies.append(original(self, *a))
    )
    replicated, full = _traces(name, capturable, monkeypatch)
    for a, b in zip(replicated, full, strict=True):
        assert _summary(a) == _summary(b)
    # (what a replica traced was compared, not only the loop as written; Rprop's eager path
    # writes through boolean masks and runs as written)
    assert copies or (name.startswith("Rprop") and not capturable)


def test_replication_runs_the_body_once_per_kind(monkeypatch):
    """(What makes it worth it: the loop body runs for the first param of each kind only.)"""
    calls = []
    original = replicate.run

    def counted(fn, *args, **kwargs):
        inner = fn

        def body(*a, **k):
            calls.append(len(a[0]))
            return inner(*a, **k)

        return original(body, *args, **kwargs)

    monkeypatch.setattr(replicate, "run", counted)
    params = _params([((4,), torch.float32)] * 20 + [((2, 2), torch.float32)] * 20)
    trace_step(torch.optim.AdamW(params, foreach=False), capturable=True)
    assert calls == [1, 1]


def test_views_of_other_params_run_the_loop_as_written(monkeypatch):
    """A param that is a view of another's storage is not a kind of its own: the rest of the
    loop runs as torch wrote it (and traces what the full loop traces)."""
    summaries = []
    params = _params([((4,), torch.float32)] * 12)
    grad = torch.randn(4)
    params[5].grad = grad
    params[6].grad = grad  # (one grad tensor for two params: an alias in the trace)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    opt.step()
    for setting in ("1", "0"):
        monkeypatch.setenv("OPTTRACE_REPLICATE", setting)
        try:
            summaries.append(_summary(trace_step(opt)))
        except Exception as exc:  # (refused alike with or without replication)
            summaries.append(type(exc).__name__)
    assert summaries[0] == summaries[1]
