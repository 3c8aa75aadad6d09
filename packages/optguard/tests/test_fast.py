"""The fast tier: tried first, implies the full check, re-armed or rebuilt after a miss."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from optguard import (
    AliasGuard,
    AttrSource,
    DataPtrGuard,
    DictLengthGuard,
    DisjointGuard,
    EqualGuard,
    Guard,
    GuardSetBuilder,
    ItemSource,
    KeyedSource,
    KeysGuard,
    LengthGuard,
    NoneGuard,
    Prologue,
    TensorMatchGuard,
    TensorMeta,
    TypeGuard,
)
from optguard import _torch_compat as compat
from optguard_paths import GROUP, GROUPS, OPT, PARAMS


def _optimizer(n: int = 3) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(4, 2)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.step()  # creates momentum buffers
    return opt


def _check(opt: torch.optim.Optimizer, extra: tuple[Guard, ...] = ()):
    """The guards a trace of ``opt.step`` would install, over the live optimizer."""
    b = GuardSetBuilder()
    b.extend(extra)
    b.add(TypeGuard(OPT, type(opt)))
    b.add(LengthGuard(GROUPS, 1))
    b.add(KeysGuard(GROUP, tuple(opt.param_groups[0])))
    b.add(TypeGuard(ItemSource(GROUP, "lr"), float))
    state = AttrSource(OPT, "state")
    b.add(DictLengthGuard(state, len(opt.state)))
    b.add(LengthGuard(PARAMS, len(opt.param_groups[0]["params"])))
    for i, p in enumerate(opt.param_groups[0]["params"]):
        param = ItemSource(PARAMS, i)
        b.add(TensorMatchGuard(param, TensorMeta.of(p)))
        b.add(DataPtrGuard(param, p.data_ptr()))
        b.add(NoneGuard(AttrSource(param, "grad"), False))
        b.add(TensorMatchGuard(AttrSource(param, "grad"), TensorMeta.of(p.grad)))
        buf = ItemSource(KeyedSource(state, param), "momentum_buffer")
        b.add(KeysGuard(KeyedSource(state, param), ("momentum_buffer",)))
        b.add(TensorMatchGuard(buf, TensorMeta.of(opt.state[p]["momentum_buffer"])))
        b.add(DataPtrGuard(buf, opt.state[p]["momentum_buffer"].data_ptr()))
    return _Checked(Prologue(b.build()))


class _Checked:
    """A Prologue (of no inputs) seen as a check: whether it applies to ``L``, and whether
    its fast tier answered (``fast_hit``, from its hit count)."""

    def __init__(self, prologue: Prologue) -> None:
        self.prologue = prologue
        self.fast_hit = False

    def __call__(self, L) -> bool:
        before = self.prologue.fast_hits
        applies = self.prologue(L) is not None
        self.fast_hit = self.prologue.fast_hits > before
        return applies

    def __getattr__(self, name: str):
        return getattr(self.prologue, name)


needs_fast = pytest.mark.skipif(not compat.available(), reason="this torch lacks the C++ guards")


@needs_fast
def test_first_passing_check_arms_the_fast_tier_and_later_hits_use_it(checks):
    opt = _optimizer()
    check = _check(opt)
    L = {"opt": opt}
    assert check.fast is None
    assert check(L)
    assert check.fast is not None and check.fast(L)
    opt.param_groups[0]["lr"] = 0.05  # a float changing is no reason to miss
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)  # new grads every step
    assert check.fast(L) and check(L)
    assert "C++ guard tree" in check.describe()
    native_lines = [line for line in check.fast.lines if "one native check" in line]
    # params (and their data pointers) with their grads in one visit, the state's dict
    # versions, the pinned state tensors' data pointers
    assert len(native_lines) == (3 if checks == "native" else 0)
    if checks == "native":
        assert "data pointer; their grads keep" in native_lines[0]


@needs_fast
@pytest.mark.parametrize(
    "change",
    [
        "grad becomes None",
        "grad strides",
        "grad dtype",
        "grad requires grad",
        "param moved to float64",
        "param reshaped",
        "param replaced",
        "param list shorter",
        "state cleared",
        "state entry gains a key",
        "param re-pointed",
        "state tensor re-pointed",
        "state storage freed",
        "state tensor requires grad",
        "state tensor becomes a Parameter",
        "lr is int",
    ],
)
# (past compat.CHUNK params, the tree reaches the params and state entries through slices)
@pytest.mark.parametrize("n, changed", [(3, 1), (2 * compat.CHUNK + 10, compat.CHUNK + 5)])
def test_the_fast_tier_never_accepts_what_the_full_check_rejects(change, n, changed, checks):
    opt = _optimizer(n)
    check = _check(opt)
    L = {"opt": opt}
    assert check(L) and check.fast is not None
    p = opt.param_groups[0]["params"][changed]
    if change == "grad becomes None":
        p.grad = None
    elif change == "grad strides":
        p.grad = torch.randn(2, 4).t()  # same shape, transposed layout
    elif change == "grad dtype":
        p.grad = None
        p.grad = torch.randn(4, 2)
        p.grad.data = p.grad.data.double()  # .data escapes the grad setter's dtype check
    elif change == "grad requires grad":
        p.grad = torch.randn(4, 2, requires_grad=True)
    elif change == "param moved to float64":
        p.data = p.data.double()
    elif change == "param reshaped":
        p.data = p.data.reshape(2, 4)
    elif change == "param replaced":
        opt.param_groups[0]["params"][changed] = torch.nn.Parameter(p.detach().clone())
    elif change == "param list shorter":
        opt.param_groups[0]["params"].pop()
    elif change == "state cleared":
        opt.state.clear()
    elif change == "state entry gains a key":
        opt.state[p]["extra"] = 1.0
    elif change == "param re-pointed":
        p.data = p.data.clone()  # same metadata, another address
    elif change == "state tensor re-pointed":
        buf = opt.state[p]["momentum_buffer"]
        buf.set_(buf.clone())  # the same object in the same entry: no version changes
    elif change == "state storage freed":
        opt.state[p]["momentum_buffer"].untyped_storage().resize_(0)
    elif change == "state tensor requires grad":
        opt.state[p]["momentum_buffer"].requires_grad_()  # in place: no version changes
    elif change == "state tensor becomes a Parameter":
        opt.state[p]["momentum_buffer"].__class__ = torch.nn.Parameter
    elif change == "lr is int":
        opt.param_groups[0]["lr"] = 1
    assert not check.fast(L)
    assert not check(L)


@needs_fast
def test_a_replaced_state_tensor_misses_the_fast_tier_and_the_full_check_names_it():
    opt = _optimizer()
    check = _check(opt)
    L = {"opt": opt}
    assert check(L)
    p = opt.param_groups[0]["params"][2]
    opt.state[p]["momentum_buffer"] = torch.zeros_like(opt.state[p]["momentum_buffer"])
    assert not check.fast(L)  # the entry's dict version changed
    assert not check(L)
    assert "data pointer changed" in (check.first_failure(L) or "")


@needs_fast
def test_a_change_the_full_check_accepts_rearms_the_fast_tier():
    opt = _optimizer()
    check = _check(opt)
    L = {"opt": opt}
    assert check(L)
    p = opt.param_groups[0]["params"][0]
    buf = opt.state[p]["momentum_buffer"]
    opt.state[p]["momentum_buffer"] = buf.clone()  # a new object...
    opt.state[p]["momentum_buffer"] = buf  # ...and back: same tensors, new versions
    assert not check.fast(L)
    assert check(L)  # the full check passes and builds the tier anew
    assert check.fast is not None and check.fast(L)
    assert check.rebuilds == 2


@needs_fast
def test_a_miss_drops_a_tier_whose_state_was_replaced_and_keeps_one_whose_state_stands(checks):
    """A tier pins state tensors. When its entry stops matching while the state stands (a
    hyperparameter another entry serves), it stays for the next match; when the state was
    replaced (a checkpoint load), it goes, and the old tensors with it."""
    opt = _optimizer()
    check = _check(opt)
    L = {"opt": opt}
    assert check(L) and check.fast is not None
    tier = check.fast
    opt.param_groups[0]["lr"] = 1  # not this entry's
    assert not check(L) and check.fast is tier
    opt.param_groups[0]["lr"] = 0.1
    assert check(L) and check.fast_hit and check.fast is tier
    params = opt.param_groups[0]["params"]
    old = [weakref.ref(opt.state[p]["momentum_buffer"]) for p in params]
    for p in params:  # what load_state_dict does: new entries, new tensors
        opt.state[p] = {"momentum_buffer": opt.state[p]["momentum_buffer"].clone()}
    opt.param_groups[0]["lr"] = 1
    assert not check(L) and check.fast is None
    del tier
    gc.collect()
    assert all(ref() is None for ref in old)
    opt.param_groups[0]["lr"] = 0.1
    assert not check(L)  # the new tensors' addresses are not the traced ones
    assert check.fast is None


@needs_fast
def test_changes_on_every_call_turn_the_fast_tier_off_rare_ones_do_not(monkeypatch):
    opt = _optimizer()
    check = _check(opt)
    L = {"opt": opt}
    p = opt.param_groups[0]["params"][0]

    def touch() -> None:  # same tensor, new dict versions: the full check still passes
        buf = opt.state[p]["momentum_buffer"]
        opt.state[p]["momentum_buffer"] = buf.clone()
        opt.state[p]["momentum_buffer"] = buf

    monkeypatch.setattr(Prologue, "REBUILD_AFTER_HITS", 3)
    for _ in range(Prologue.MAX_REBUILDS + 2):  # rare: hits in between
        assert check(L)
        for _ in range(3):
            assert check(L) and check.fast_hit
        touch()
    assert check(L) and check(L) and check.fast_hit
    for _ in range(Prologue.MAX_REBUILDS + 1):  # on every call
        touch()
        assert check(L) and not check.fast_hit
    assert check.fast is None and check.fast_note == "off: its tree kept changing"
    assert check(L)  # the full check alone still answers


@needs_fast
def test_a_hit_pins_the_params_keying_the_state_and_their_state_tensors_not_grads():
    opt = _optimizer(2)
    check = _check(opt)
    assert check({"opt": opt}) and check.fast is not None
    pinned = {s.name() for s in check.fast.pinned}
    param = "L['opt'].param_groups[0]['params'][1]"
    assert param in pinned
    assert f"L['opt'].state[{param}]['momentum_buffer']" in pinned
    assert f"{param}.grad" not in pinned
    assert "L['opt'].param_groups[0]['params']" not in pinned  # a list: its items may change


def test_without_the_cxx_pieces_every_call_runs_the_full_check(monkeypatch):
    monkeypatch.setattr(compat, "available", lambda: False)
    opt = _optimizer()
    check = _check(opt)
    L = {"opt": opt}
    assert check(L) and check(L)
    assert check.fast is None and check.fast_note == "off: not available with this torch"
    opt.state.clear()
    assert not check(L)


@needs_fast
def test_guards_relating_two_sources_run_on_every_hit_unless_both_lie_in_the_state(checks):
    """A guard over a listed grad and another source is not part of the list's native
    check, nor covered by the state's dict versions when one of its sources lies outside."""
    opt = _optimizer()
    params = opt.param_groups[0]["params"]
    shared = torch.randn(4, 2)
    for p in params:
        p.grad = shared
    grad = [AttrSource(ItemSource(PARAMS, i), "grad") for i in range(3)]
    buf = ItemSource(
        KeyedSource(AttrSource(OPT, "state"), ItemSource(PARAMS, 0)), "momentum_buffer"
    )
    check = _check(opt, (AliasGuard(grad[1], grad[0]), DisjointGuard(buf, (grad[2],))))
    L = {"opt": opt}
    assert check(L) and check.fast is not None and check.fast(L)
    params[1].grad = torch.randn(4, 2)  # same metadata, no longer the shared tensor
    assert not check.fast(L) and not check(L)
    assert check.first_failure(L) == (
        "L['opt'].param_groups[0]['params'][1].grad: is no longer the same object as "
        "L['opt'].param_groups[0]['params'][0].grad"
    )
    params[1].grad = shared
    assert check(L) and check.fast(L)
    params[2].grad = opt.state[params[0]]["momentum_buffer"]  # the state did not change
    assert not check.fast(L) and not check(L)


@needs_fast
def test_an_equality_guard_runs_in_the_tree_and_passes_an_equal_new_object():
    """A DTensor's mesh and placements are EqualGuards: the C++ tree tests them (the same
    object at once, another with ==), not the Python residual."""
    opt = _optimizer()
    opt.layout = ("shard", 0)  # type: ignore[attr-defined]
    layout = AttrSource(OPT, "layout")
    check = _check(opt, (EqualGuard(layout, ("shard", 0)),))
    L = {"opt": opt}
    assert check(L) and check.fast is not None and check.fast(L)
    assert not any(isinstance(g, EqualGuard) for g in check.fast.residual.guards.guards)
    assert any("L['opt'].layout" in line for line in check.fast.lines)
    opt.layout = ("shard", int("0"))  # type: ignore[attr-defined]  # equal, another tuple
    assert check(L) and check.fast_hit
    opt.layout = ("replicate",)  # type: ignore[attr-defined]
    assert not check.fast(L) and not check(L)
    assert "L['opt'].layout" in check.first_failure(L)


@needs_fast
def test_arming_tests_guards_one_by_one_and_generates_the_check_only_when_the_tier_misses(checks):
    opt = _optimizer()
    prologue = _check(opt).prologue
    L = {"opt": opt}
    assert prologue.arm(L)
    assert prologue._check is None and prologue._gather is None  # (nothing generated yet)
    assert prologue(L) is not None and prologue._check is None  # a fast-tier hit
    opt.param_groups[0]["lr"] = 1
    assert prologue(L) is None and prologue._check is not None  # the miss ran the check


@needs_fast
def test_arming_is_refused_where_a_guard_fails(checks):
    opt = _optimizer()
    prologue = _check(opt).prologue
    opt.param_groups[0]["lr"] = 1
    assert not prologue.arm({"opt": opt})
    assert prologue.fast is None


@needs_fast
def test_arming_tests_guards_over_several_sources_as_the_generated_check_does(checks):
    opt = _optimizer()
    params = opt.param_groups[0]["params"]
    state = AttrSource(OPT, "state")
    bufs = [
        ItemSource(KeyedSource(state, ItemSource(PARAMS, i)), "momentum_buffer") for i in range(3)
    ]
    prologue = _check(opt, (DisjointGuard(bufs[0], (bufs[1], bufs[2])),)).prologue
    assert prologue.arm({"opt": opt})
    opt.state[params[1]]["momentum_buffer"] = opt.state[params[0]]["momentum_buffer"]
    shared = _check(opt, (DisjointGuard(bufs[0], (bufs[1], bufs[2])),)).prologue
    assert not shared.arm({"opt": opt})
    assert not shared.check({"opt": opt})  # (the generated check agrees)
