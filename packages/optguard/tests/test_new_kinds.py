"""Sources into globals, weak references and dict keys; identity, data-pointer, weakref-alive
and predicate guards: each prints, fetches, holds on what was seen and names what changed."""

from __future__ import annotations

import sys
import weakref

import torch
from optguard import (
    DataPtrGuard,
    DictKeySource,
    GlobalSource,
    GuardSet,
    IdentityGuard,
    LocalSource,
    PredicateGuard,
    WeakrefAliveGuard,
    WeakRefSource,
    compile_check,
    first_failure,
)

SOME_GLOBAL = 3


def test_global_source_prints_module_path_and_fetches_live_value():
    source = GlobalSource(__name__, "SOME_GLOBAL")
    assert source.name() == f"G[{__name__!r}].SOME_GLOBAL"
    assert source.fetch({}) == 3
    module = sys.modules[__name__]
    module.SOME_GLOBAL = 4
    try:
        assert source.fetch({}) == 4
    finally:
        module.SOME_GLOBAL = 3


def test_weakref_source_follows_the_reference():
    target = torch.zeros(2)
    source = WeakRefSource(LocalSource("ref"))
    assert source.name() == "L['ref']()"
    assert source.fetch({"ref": weakref.ref(target)}) is target


def test_dict_key_source_reads_keys_in_insertion_order():
    source = DictKeySource(LocalSource("d"), 1)
    assert source.name() == "list(L['d'].keys())[1]"
    assert source.fetch({"d": {"a": 1, "b": 2}}) == "b"


def test_identity_guard_holds_only_for_the_same_object_and_fails_once_it_is_freed():
    class Box:
        pass

    box = Box()
    guard = IdentityGuard.of(LocalSource("x"), box)
    assert guard.holds(box) and not guard.holds(Box())
    assert "a different object" in guard.changed(Box())
    del box
    assert not guard.holds(None)  # the weak reference died


def test_identity_guard_on_an_unreferenceable_object_compares_ids():
    items = [1, 2]
    guard = IdentityGuard.of(LocalSource("x"), items)
    assert guard.ref is None
    assert guard.holds(items) and not guard.holds([1, 2])


def test_data_pointer_guard_names_old_and_new_address():
    t = torch.zeros(3)
    guard = DataPtrGuard(LocalSource("t"), t.data_ptr())
    assert guard.holds(t)
    other = torch.zeros_like(t)
    assert not guard.holds(other)
    assert guard.changed(other).startswith("data pointer changed (0x")


def test_generated_checks_name_addresses_and_ids_so_their_text_is_the_same_in_every_run():
    """The check's text keys its compiled-code cache: addresses and ids, which differ between
    processes, are bound names, not literals."""
    codes, checks = [], []
    for _ in range(2):
        t, items = torch.zeros(3), [1]
        guards = GuardSet(
            (
                DataPtrGuard(LocalSource("t"), t.data_ptr()),
                IdentityGuard.of(LocalSource("x"), items),
            )
        )
        check = compile_check(guards)  # the generated tier (it checks addresses)
        assert check({"t": t, "x": items}) and not check({"t": t.clone(), "x": items})
        assert not check({"t": t, "x": list(items)})
        codes.append(check.describe())
        checks.append((t, items))
    assert codes[0] == codes[1]
    assert str(checks[0][0].data_ptr()) not in codes[0]


def test_weakref_alive_guard():
    target = torch.zeros(1)
    ref = weakref.ref(target)
    guard = WeakrefAliveGuard(LocalSource("ref"))
    assert guard.holds(ref)
    del target
    assert not guard.holds(ref)
    assert guard.changed(ref) == "the referenced object was freed"


def test_predicate_guard_over_two_sources_in_the_generated_check():
    wd, lr = LocalSource("wd"), LocalSource("lr")
    guard = PredicateGuard(wd, "(({0} * {1}) != 0)", True, (lr,))
    check = compile_check(GuardSet((guard,)))
    assert check({"wd": 0.1, "lr": 1e-3}) and check({"wd": 0.2, "lr": 5e-3})
    assert not check({"wd": 0.0, "lr": 1e-3})
    reason = first_failure((guard,), {"wd": 0.0, "lr": 1e-3})
    assert reason == "L['wd']: ((L['wd'] * L['lr']) != 0) changed (True -> False)"
