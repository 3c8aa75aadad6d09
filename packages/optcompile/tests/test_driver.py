from __future__ import annotations

import gc
from collections.abc import Iterator

import optcompile
import pytest
import torch
from optcompile.driver import newest
from optcompile.optimizer import registered
from optcompile.testing import set_grads, small_model
from optguard import native


@pytest.fixture
def no_collections() -> Iterator[None]:
    """The collector off (no collection moves objects between generations meanwhile)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _in_generation(obj: object, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


def _compiled_step() -> tuple[torch.optim.Optimizer, object]:
    model = small_model()
    set_grads(model, 0)
    opt = optcompile.compile(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt.step()
    entry = newest(registered(opt))
    assert entry is not None
    return opt, next(iter(entry.traced.graph.nodes))


def test_what_a_miss_builds_lands_in_the_oldest_generation(no_collections):
    frozen = gc.get_freeze_count()
    _, node = _compiled_step()
    if frozen:  # someone froze objects (some interpreters' startup does): they stay frozen,
        # so the miss moves nothing rather than unfreeze them
        assert gc.get_freeze_count() > 0
        assert not _in_generation(node, 2)
        return
    assert _in_generation(node, 2)
    assert not _in_generation(node, 0) and not _in_generation(node, 1)


def test_objects_frozen_by_someone_else_stay_frozen_through_a_miss(no_collections):
    sentinel: list[object] = []  # (tracked by the collector)
    gc.freeze()
    try:
        _, node = _compiled_step()
        assert not any(_in_generation(sentinel, g) for g in range(3))  # still frozen
        assert not _in_generation(node, 2)  # and the miss's own objects not moved
    finally:
        gc.unfreeze()


def test_the_native_module_is_started_before_an_entrys_first_run(monkeypatch):
    # The first run's staged copies and address tables go through optguard's C++ module like
    # every later call's: lowering starts it, not the prologue's fast tier at the first hit.
    started: list[bool | None] = []
    start = native.start
    monkeypatch.setattr(native, "start", lambda wait=None: started.append(wait) or start(wait))
    _compiled_step()  # one call: a miss (traced, lowered, run once)
    assert started


def test_objects_frozen_by_the_user_stay_frozen(no_collections):
    marker = [[]]  # a container the collector tracks
    gc.freeze()
    try:
        _, node = _compiled_step()
        assert not any(_in_generation(marker, g) for g in range(3))  # still frozen
        assert _in_generation(node, 0)  # (nothing moved)
    finally:
        gc.unfreeze()


def test_a_miss_arms_the_fast_tier_so_the_next_call_is_a_fast_hit(no_collections):
    """The fast tier is built after the miss's first run, with the miss's objects (into the
    oldest generation): the second call neither builds it nor pays a full collection."""
    model = small_model()
    set_grads(model, 0)
    opt = optcompile.compile(torch.optim.AdamW(model.parameters(), lr=0.1))
    opt.step()
    prologue = newest(registered(opt)).prologue
    if prologue.fast_note == "off: not available with this torch":
        pytest.skip("this torch lacks the C++ guards (no fast tier)")
    assert prologue.fast is not None and _in_generation(prologue.fast, 2)
    opt.step()
    assert prologue.fast_hits == 1 and prologue.rebuilds == 1
