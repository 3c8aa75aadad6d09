from __future__ import annotations

import torch
from optguard import AttrSource, ItemSource, LocalSource
from optsidefx import AttrStore, Const, Input, ItemStore, Ledger, Return, TensorWrite

OPT = Input(LocalSource("opt"))
GROUP = Input(ItemSource(AttrSource(LocalSource("opt"), "param_groups"), 0))
X = LocalSource("x")
Y = LocalSource("y")


def test_later_store_to_the_same_slot_prunes_the_earlier_one():
    ledger = Ledger()
    ledger.store_item(GROUP, "lr", 0.1)
    ledger.store_attr(OPT, "count", 1)
    ledger.store_item(GROUP, "lr", 0.2)
    effects = ledger.finalize(Const)
    assert effects == (AttrStore(OPT, "count", Const(1)), ItemStore(GROUP, Const("lr"), Const(0.2)))


def test_tensor_keys_are_distinct_slots_by_identity():
    a, b = torch.zeros(1), torch.zeros(1)
    ledger = Ledger()
    ledger.store_item(OPT, a, 1)
    ledger.store_item(OPT, b, 2)
    assert len(ledger.finalize(lambda v: Const(v))) == 2


def test_resolve_runs_only_on_values_that_survive_pruning():
    seen = []
    ledger = Ledger()
    ledger.store_item(GROUP, "x", "dropped")
    ledger.store_item(GROUP, "x", "kept")
    ledger.returned("result")

    def resolve(value):
        seen.append(value)
        return Const(value)

    effects = ledger.finalize(resolve)
    assert "dropped" not in seen and {"kept", "result"} <= set(seen)
    assert effects[-1] == Return(Const("result"))


def test_effects_are_recorded_in_program_order():
    ledger = Ledger()
    ledger.store_attr(OPT, "count", 1)
    ledger.write_tensor(X, "node")
    ledger.returned(None)
    assert ledger.effects == (AttrStore(OPT, "count", 1), TensorWrite(X, "node"), Return(None))


def test_the_surviving_store_takes_the_position_of_the_later_store():
    ledger = Ledger()
    ledger.store_item(GROUP, "lr", 0.1)
    ledger.store_item(GROUP, "momentum", 0.9)
    ledger.store_item(GROUP, "lr", 0.2)
    assert [e.key for e in ledger.finalize(Const)] == [Const("momentum"), Const("lr")]


def test_stores_to_the_same_key_of_different_targets_are_both_kept():
    ledger = Ledger()
    ledger.store_item(GROUP, "lr", 0.1)
    ledger.store_item(OPT, "lr", 0.2)
    assert len(ledger.finalize(Const)) == 2


def test_item_and_attr_stores_of_the_same_name_are_different_slots():
    ledger = Ledger()
    ledger.store_item(OPT, "lr", 0.1)
    ledger.store_attr(OPT, "lr", 0.2)
    assert len(ledger.finalize(Const)) == 2


def test_a_second_store_under_the_same_tensor_key_prunes_the_first():
    p = torch.zeros(1)
    ledger = Ledger()
    ledger.store_item(OPT, p, 1)
    ledger.store_item(OPT, p, 2)
    assert ledger.finalize(Const) == (ItemStore(OPT, Const(p), Const(2)),)


def test_finalize_resolves_exactly_the_surviving_keys_and_values_in_order():
    seen = []
    ledger = Ledger()
    ledger.store_item(GROUP, "x", "dropped")
    ledger.store_attr(OPT, "n", 1)
    ledger.store_item(GROUP, "x", "kept")
    ledger.returned("result")

    def resolve(value):
        seen.append(value)
        return Const(value)

    ledger.finalize(resolve)
    assert seen == [1, "x", "kept", "result"]


def test_finalize_keeps_returns_and_tensor_writes_in_order():
    ledger = Ledger()
    ledger.write_tensor(X, "new_x")
    ledger.returned("result")
    ledger.write_tensor(Y, "new_y")
    assert ledger.finalize(Const) == (
        TensorWrite(X, "new_x"),
        Return(Const("result")),
        TensorWrite(Y, "new_y"),
    )
