"""The hit path (prologue -> plan -> replay) keeps every guard's meaning once its fast tier
is armed, and the plan's host-side step counts follow what the user writes between steps.

Run on the Triton backend (the interpreter on CPU): AdamW with the defaults keeps its step
counts on the CPU, so the plan computes with them on the host (host mode), aliasing them into
one buffer per column; the prologue's fast tier pins the state tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import optcompile
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from optcompile.testing import assert_same, run_pair, step_both

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _armed_pair() -> tuple[Any, Any, Any, Any]:
    model = torch.nn.Linear(4, 4).to(DEVICE)  # two lanes: a weight and a bias
    pair = run_pair(
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.01),
        steps=2,
        model=model,
        backend="triton",
    )
    entry = _OPTIMIZERS[pair[1]].cache.entries[0].value
    assert entry.prologue.fast is not None and entry.prologue.fast.gather is not None
    return pair


def _exp_avg(opt: torch.optim.Optimizer) -> torch.Tensor:
    return opt.state[opt.param_groups[0]["params"][0]]["exp_avg"]


# In-place changes to a pinned state tensor that keep its object and its entry's dict
# version; each changes what the kernels would read at the address the plan holds.
_IN_PLACE: dict[str, Callable[[torch.Tensor], Any]] = {
    "t_": lambda t: t.t_(),
    "as_strided_": lambda t: t.as_strided_((4, 4), (1, 4)),
    "resize_": lambda t: t.resize_(2),
    ".data =": lambda t: setattr(t, "data", t.data.clone()),
    "set_": lambda t: t.set_(t.clone()),
}


@pytest.mark.parametrize("how", list(_IN_PLACE))
def test_a_pinned_state_tensor_changed_in_place_is_not_a_hit(how):
    model, opt, reference, eager = _armed_pair()
    compiled, L = _OPTIMIZERS[opt], {"opt": opt}
    found = compiled.cache.find(L)
    assert found is not None  # a hit before the change
    found[0].prologue.release()
    for o in (opt, eager):
        _IN_PLACE[how](_exp_avg(o))
    assert compiled.cache.find(L) is None
    reason = compiled.cache.miss_reason(L)
    assert reason is not None and "['exp_avg']" in reason, reason
    if how != "resize_":  # (eager's step refuses a state of another shape)
        step_both(model, opt, reference, eager, range(2, 4))
        assert_same(model, opt, reference, eager, rtol=1e-5, atol=1e-6)


def test_step_counts_the_user_writes_between_hits_are_honoured():
    model, opt, reference, eager = _armed_pair()
    plan = _OPTIMIZERS[opt].cache.entries[0].value.plan
    assert getattr(plan, "plan", plan).host  # the step counts are computed with on the host
    params = [model.weight, reference.weight]  # (lanes then differ: the bias keeps its count)

    def both(change: Callable[[torch.optim.Optimizer, torch.Tensor], None]) -> None:
        for o, p in zip((opt, eager), params, strict=True):
            change(o, p)

    changes: list[Callable[[torch.optim.Optimizer, torch.Tensor], None]] = [
        lambda o, p: o.state[p]["step"].fill_(10.0),  # in place
        lambda o, p: o.state[p]["step"].copy_(torch.tensor(3.0)),
        lambda o, p: setattr(o.state[p]["step"], "data", torch.tensor(7.0)),  # re-pointed
        lambda o, p: o.state[p]["step"].set_(torch.tensor(5.0)),
        lambda o, p: o.state[p].__setitem__("step", torch.tensor(20.0)),  # replaced
    ]
    for k, change in enumerate(changes):
        both(change)
        step_both(model, opt, reference, eager, range(2 + 2 * k, 4 + 2 * k))
        assert_same(model, opt, reference, eager, rtol=1e-5, atol=1e-6)
    assert float(opt.state[params[0]]["step"]) == 22.0
    assert optcompile.explain(opt).traces <= 2  # (a replaced entry may retrace once)


def test_a_hit_hands_the_grads_to_the_plan_by_address_and_a_reload_rearms_it():
    """The plan reads the grads only for its address tables: a fast-tier hit leaves their
    slots None (the native check keeps their pointers; explain says so), and the tier
    rebuilt after a checkpoint reload links the plan to its new check."""
    model, opt, reference, eager = _armed_pair()
    compiled, L = _OPTIMIZERS[opt], {"opt": opt}
    entry, inputs = compiled.cache.find(L)
    prologue = entry.prologue
    grads = {i for i, s in enumerate(prologue.input_sources) if s.name().endswith(".grad")}
    assert grads and grads <= prologue.by_address
    assert all(inputs[i] is None for i in grads)
    prologue.release()
    assert "grads handed over by address (native)" in optcompile.explain(opt).check_code
    for o in (opt, eager):
        o.load_state_dict(o.state_dict())  # new state tensors: the tier is built anew
    step_both(model, opt, reference, eager, range(2, 5))
    assert_same(model, opt, reference, eager, rtol=1e-5, atol=1e-6)
    fast = _OPTIMIZERS[opt].cache.entries[0].value.prologue.fast
    assert fast is not None and fast.gather is not None and fast.gather.links
