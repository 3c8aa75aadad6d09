"""FastGather: after a fast-tier hit, the same inputs as the full gather, fetching only what
can change (grads, hyperparameters)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from optguard import AttrSource, FastGather, ItemSource, KeyedSource, compile_fetch
from optguard import _torch_compat as compat
from optguard_paths import GROUP, OPT, PARAMS
from test_fast import _check, _optimizer

needs_fast = pytest.mark.skipif(not compat.available(), reason="this torch lacks the C++ guards")


def _sources(n: int, interleaved: bool = True):
    params = [ItemSource(PARAMS, i) for i in range(n)]
    grads = [AttrSource(p, "grad") for p in params]
    bufs = [ItemSource(KeyedSource(AttrSource(OPT, "state"), p), "momentum_buffer") for p in params]
    lr = ItemSource(GROUP, "lr")
    if interleaved:  # evenly spaced grads: one slice assignment
        return [lr, *(s for trio in zip(params, grads, bufs, strict=True) for s in trio)]
    # grads at uneven positions: the loop
    return [grads[0], lr, *params, *grads[1:], *bufs]


def _setup(n: int, interleaved: bool = True):
    """An optimizer whose check passed (fast tier built), its sources' full gather, and an
    unarmed FastGather over the tier's pinned sources."""
    opt = _optimizer(n)
    L = {"opt": opt}
    check = _check(opt)
    assert check(L) and check.fast is not None
    sources = _sources(n, interleaved)
    full, _ = compile_fetch(sources)
    return opt, L, check, full, FastGather(sources, check.fast.pinned, check.fast.grad_lists)


@needs_fast
@pytest.mark.parametrize("interleaved", [True, False])
def test_fast_gather_returns_what_the_full_gather_does_fetching_only_grads_and_scalars(
    interleaved, checks
):
    opt, L, check, full, fast = _setup(4, interleaved)
    assert fast.fetched == 5  # 4 grads and lr
    assert ("out[" in fast.code and ":3] = " in fast.code) == interleaved
    assert ("grads(bases[0])" in fast.code) == (checks == "native")
    # ...and, natively, first the grads the tier's check has just read and matched
    assert ("take(" in fast.code) == (checks == "native")
    assert not fast.armed
    fast.arm(L, full(L))
    for step in range(3):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)  # new tensors, as after zero_grad(set_to_none=True)
        opt.param_groups[0]["lr"] = 0.1 / (step + 1)
        assert check(L) and check.fast_hit
        got, want = list(fast(L)), full(L)
        again = list(fast(L))  # no check in between: nothing to take, the grads are read
        fast.release()
        assert len(got) == len(want)
        assert all(a is b for a, b in zip(got, want, strict=True))
        assert all(a is b for a, b in zip(again, want, strict=True))


@needs_fast
def test_released_fast_gather_keeps_no_grad_of_the_call(checks):
    opt, L, check, full, fast = _setup(3)
    fast.arm(L, full(L))
    assert check(L) and check.fast_hit
    grad = weakref.ref(opt.param_groups[0]["params"][1].grad)
    inputs = fast(L)
    assert any(x is grad() for x in inputs)
    fast.release()
    del inputs
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None


@needs_fast
def test_a_missing_grad_reads_as_none_and_the_fast_tier_misses(checks):
    opt, L, check, full, fast = _setup(2)
    fast.arm(L, full(L))
    opt.param_groups[0]["params"][1].grad = None
    assert not check(L)  # the caller never reaches the fast gather
    assert fast(L)[5] is None  # what it would read


def test_unarmed_fast_gather_refuses_to_run():
    fast = FastGather(_sources(1), frozenset())
    with pytest.raises(AssertionError, match="before arm"):
        fast({"opt": _optimizer(1)})


@needs_fast
def test_arming_holds_the_pinned_values_only():
    opt, L, _, full, fast = _setup(2)
    grad = weakref.ref(opt.param_groups[0]["params"][0].grad)
    fast.arm(L, full(L))
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None  # the template did not keep the old gradient


@needs_fast
def test_grads_a_hit_read_are_not_kept_when_no_gather_takes_them(checks):
    opt, L, check, _, _ = _setup(2)
    assert check(L) and check.fast_hit  # the native check read the grads: not taken
    grad = weakref.ref(opt.param_groups[0]["params"][0].grad)
    check.fast.forget()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    opt.param_groups[0]["lr"] = 1  # the tree's grad check passes, the residual fails
    grad = weakref.ref(opt.param_groups[0]["params"][0].grad)
    assert not check.fast(L)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None
