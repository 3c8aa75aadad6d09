from __future__ import annotations

import ast

import torch
from optguard import (
    AttrSource,
    ConstantGuard,
    GuardedCache,
    GuardSet,
    GuardSetBuilder,
    ItemSource,
    KeyedSource,
    KeysGuard,
    LengthGuard,
    LocalSource,
    Prologue,
    TensorMatchGuard,
    TensorMeta,
    compile_check,
    compile_fetch,
)
from optguard_paths import GROUP, GROUPS, OPT, PARAMS


def _opt(lr=0.1, n=2):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3)) for _ in range(n)], lr=lr)


def _guards(opt) -> GuardSet:
    b = GuardSetBuilder()
    b.add(LengthGuard(GROUPS, 1))
    b.add(LengthGuard(PARAMS, 2))
    b.add(ConstantGuard(ItemSource(GROUP, "lr"), 0.1))
    for i, p in enumerate(opt.param_groups[0]["params"]):
        b.add(TensorMatchGuard(ItemSource(PARAMS, i), TensorMeta.of(p)))
    return b.build()


def test_check_holds_on_unchanged_inputs():
    opt = _opt()
    assert compile_check(_guards(opt))({"opt": opt})


def test_check_fails_and_first_failure_names_the_first_failing_guard():
    opt = _opt()
    check = compile_check(_guards(opt))
    opt.param_groups[0]["lr"] = 0.2
    opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.zeros(4))
    assert not check({"opt": opt})
    assert check.first_failure({"opt": opt}) == (
        "L['opt'].param_groups[0]['lr']: value changed (0.1 -> 0.2)"
    )


def test_check_is_a_miss_not_an_error_when_fetching_raises():
    opt = _opt()
    guards = GuardSet((TensorMatchGuard(ItemSource(PARAMS, 1), TensorMeta.of(torch.zeros(3))),))
    check = compile_check(guards)
    opt.param_groups[0]["params"].pop()
    assert check({"opt": opt}) is False
    assert "no longer reachable" in (check.first_failure({"opt": opt}) or "")


def test_generated_code_fetches_each_shared_prefix_once():
    opt = _opt()
    code = compile_check(_guards(opt)).code
    assert code.count(".param_groups") == 1
    assert code.count("['params']") == 1


def test_builder_drops_duplicates_and_keeps_order():
    b = GuardSetBuilder()
    b.add(LengthGuard(GROUPS, 1))
    b.add(ConstantGuard(OPT, 1))
    b.add(LengthGuard(GROUPS, 1))
    assert b.build().guards == (LengthGuard(GROUPS, 1), ConstantGuard(OPT, 1))


def test_compile_fetch_returns_values_in_source_order():
    opt = _opt()
    fetch, code = compile_fetch([ItemSource(GROUP, "lr"), ItemSource(PARAMS, 1)])
    lr, p1 = fetch({"opt": opt})
    assert lr == 0.1 and p1 is opt.param_groups[0]["params"][1]
    assert code.count(".param_groups") == 1


def test_cache_tries_newest_entry_first_and_explains_misses():
    opt = _opt()
    cache: GuardedCache[str] = GuardedCache(limit=2)
    assert cache.miss_reason({"opt": opt}) is None
    cache.add(Prologue(GuardSet((ConstantGuard(ItemSource(GROUP, "lr"), 0.1),))), "old")
    cache.add(Prologue(GuardSet((LengthGuard(PARAMS, 2),))), "new")
    assert cache.lookup({"opt": opt}) == "new"
    assert cache.full
    opt.param_groups[0]["params"].pop()
    assert cache.lookup({"opt": opt}) == "old"
    assert "length changed (2 -> 1)" in (cache.miss_reason({"opt": opt}) or "")


def test_cache_limit_must_be_positive():
    try:
        GuardedCache(limit=0)
    except ValueError as exc:
        assert "at least 1" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_check_fails_when_only_the_last_guard_fails():
    opt = _opt()
    check = compile_check(_guards(opt))
    opt.param_groups[0]["params"][1] = torch.nn.Parameter(torch.zeros(4))
    assert check({"opt": opt}) is False


def test_first_failure_is_none_when_every_guard_holds():
    opt = _opt()
    assert compile_check(_guards(opt)).first_failure({"opt": opt}) is None


def test_empty_guard_set_always_holds():
    assert compile_check(GuardSet(()))({}) is True


def test_generated_check_is_valid_python_defining_check():
    tree = ast.parse(compile_check(_guards(_opt())).code)
    assert [node.name for node in tree.body] == ["check"]  # type: ignore[attr-defined]


def test_guard_set_describe_lists_the_guards_in_order():
    guards = GuardSet((LengthGuard(GROUPS, 1), ConstantGuard(ItemSource(GROUP, "lr"), 0.1)))
    assert guards.describe() == [
        "L['opt'].param_groups has length 1",
        "L['opt'].param_groups[0]['lr'] == 0.1",
    ]


def test_check_reads_a_missing_state_entry_as_absent_without_creating_it():
    opt = _opt()
    state = KeyedSource(AttrSource(OPT, "state"), ItemSource(PARAMS, 0))
    assert compile_check(GuardSet((KeysGuard(state, None),)))({"opt": opt}) is True
    assert len(opt.state) == 0


def test_first_failure_explains_a_list_that_became_none():
    check = compile_check(GuardSet((LengthGuard(PARAMS, 2),)))
    opt = _opt()
    opt.param_groups[0]["params"] = None
    assert check.first_failure({"opt": opt}) == (
        "L['opt'].param_groups[0]['params']: expected has length 2, found None"
    )


def test_check_holds_when_an_argument_is_named_like_a_builtin():
    guards = (ConstantGuard(LocalSource("lr"), 0.1), ConstantGuard(LocalSource("type"), "sgd"))
    assert compile_check(GuardSet(guards))({"lr": 0.1, "type": "sgd"}) is True


def test_check_holds_on_an_infinite_constant():
    check = compile_check(GuardSet((ConstantGuard(LocalSource("max_norm"), float("inf")),)))
    assert check({"max_norm": float("inf")}) is True
