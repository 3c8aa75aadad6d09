from __future__ import annotations

import torch
from optguard import AttrSource, ItemSource, LocalSource
from optsidefx import AttrStore, Const, Input, ItemStore, Ledger, Return

OPT = Input(LocalSource("opt"))
GROUP = Input(ItemSource(AttrSource(LocalSource("opt"), "param_groups"), 0))


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
