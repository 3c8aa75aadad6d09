"""backend="triton": the kernels' address tables across steps (new grads rewrite the grads'
table only, a param moved to new storage is seen), and the address checks, through optguard's
C++ loops or torch's compare (setup: triton_setup.py).
"""

from __future__ import annotations

import optcompile
import pytest
import torch
from optcompile.api import _OPTIMIZERS
from triton_setup import FUSED, _assert_close, _run, _unwrap, needs_triton

pytestmark = needs_triton


def test_new_grad_tensors_each_step_update_the_address_table_only():
    params, opt, *_ = _run(FUSED["Adam"], steps=2)
    plan = _unwrap(_OPTIMIZERS[opt].cache.entries[0].value.plan)
    tables = dict(plan._tables)
    (group,) = plan.groups
    static = group.ptrs
    uploads = group.table_uploads
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert plan._tables == tables  # block tables are built once, from shapes
    assert group.ptrs is static  # params and state did not move: their table stays
    assert group.table_uploads == uploads + 1  # the grads' table only
    opt.step()
    assert group.table_uploads == uploads + 1  # same grads: nothing uploaded
    assert _OPTIMIZERS[opt].stats.traces == 1


def test_the_buffers_version_stands_while_every_buffer_stays_and_moves_when_one_is_replaced():
    """A CUDA graph's static inputs (``buffers()``) are compared only when this count moves
    (optcompile.cudagraphs): new grads rewrite their table in place, which keeps it."""
    params, opt, *_ = _run(FUSED["Adam"], steps=2)
    plan = _unwrap(_OPTIMIZERS[opt].cache.entries[0].value.plan)
    version, buffers = plan.buffers_version, plan.buffers()
    for p in params:
        p.grad = torch.ones_like(p)  # new addresses: the grads' table is rewritten
    opt.step()
    opt.step()
    assert plan.buffers_version == version
    assert [b.data_ptr() for b in plan.buffers()] == [b.data_ptr() for b in buffers]
    (group,) = plan.groups
    group.dptrs = None  # as when a table must grow: the next call makes a new buffer
    opt.step()
    assert plan.buffers_version != version
    assert any(a is not b for a, b in zip(plan.buffers(), buffers, strict=True))


def test_a_param_moved_to_new_storage_is_seen_by_the_kernel():
    """``p.data = ...`` keeps the object but moves its address: the entry's data-pointer
    guards (tested on every hit, by either tier) reject the call, so the kernel never reads
    through the old address table; the new trace bakes the new addresses in."""
    params, opt, reference, eager = _run(FUSED["AdamW weight decay"], steps=2)
    entry = _OPTIMIZERS[opt].cache.entries[0].value
    first, inputs = _unwrap(entry.plan), entry.gather({"opt": opt})
    # The plan compares only the static addresses no guard tests: 0-dim CPU step counts.
    checked = first.groups[0].static.compared
    assert all(inputs[i].dim() == 0 and not inputs[i].is_cuda for i in checked)
    assert len(checked) < sum(i >= 0 for i in first.groups[0].static_slots)
    for p, q in zip(params, reference, strict=True):
        p.data = p.data.clone()
        opt.state[p]["exp_avg"].data = opt.state[p]["exp_avg"].data.clone()
        grad = torch.full_like(p, 0.25)
        p.grad, q.grad = grad, grad.clone()
    opt.step()
    eager.step()
    _assert_close(params, opt, reference, eager, rtol=1e-5, atol=1e-6)
    report = optcompile.explain(opt)
    assert report.traces == 2 and "data pointer" in report.retrace_reasons[0]
    assert _unwrap(_OPTIMIZERS[opt].cache.entries[0].value.plan) is not first


@pytest.mark.parametrize("kind", ["native", "torch"])
def test_address_checks_see_a_moved_input_through_either_kind(kind, monkeypatch):
    """An address table's check (optkernels.addresses) with optguard's C++ loops handed in
    and with torch's compare: the same answers."""
    from optguard import native
    from optkernels import addresses

    module = native.start(wait=True) if kind == "native" else None
    if kind == "native" and module is None:
        pytest.skip(f"native checks: {native.status()}")
    monkeypatch.setattr(addresses, "_native", module)
    inputs = [torch.randn(3), 2.0, torch.randn(4), torch.randn(5)]
    check = addresses.AddressCheck([0, -1, 2, 3], checked={0, 2})
    assert check.compared == [0, 2]
    assert not check.equal(inputs)  # nothing recorded
    ptrs = check.record(inputs)
    assert ptrs == [inputs[0].data_ptr(), 0, inputs[2].data_ptr(), inputs[3].data_ptr()]
    assert check.equal(inputs) and check.equal(tuple(inputs))
    assert check.equal([*inputs[:3], torch.randn(5)])  # position 3 is not compared
    inputs[2].set_(torch.randn(4))  # the same object at a new address
    assert not check.equal(inputs)
    check.record(inputs)
    assert check.equal(inputs)
    other = "torch" if kind == "native" else "native"
    monkeypatch.setattr(addresses, "_native", module if other == "native" else None)
    if module is not None:  # recorded by the other kind: not trusted until recorded again
        assert not check.equal(inputs)
        check.record(inputs)
        assert check.equal(inputs)
