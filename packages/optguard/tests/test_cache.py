from __future__ import annotations

import pytest
from optguard import (
    DEFAULT_RECOMPILE_LIMIT,
    ConstantGuard,
    GuardedCache,
    GuardSet,
    LengthGuard,
    LocalSource,
    Prologue,
)

LR = LocalSource("lr")
XS = LocalSource("xs")


def _check(*guards):
    return Prologue(GuardSet(tuple(guards)))


def test_empty_cache_lookup_returns_none():
    assert GuardedCache[str]().lookup({"lr": 0.1}) is None


def test_lookup_returns_the_value_of_the_matching_entry():
    cache: GuardedCache[str] = GuardedCache()
    cache.add(_check(ConstantGuard(LR, 0.1)), "lr=0.1")
    cache.add(_check(ConstantGuard(LR, 0.2)), "lr=0.2")
    assert cache.lookup({"lr": 0.1}) == "lr=0.1"


def test_lookup_tries_the_newest_entry_first():
    cache: GuardedCache[str] = GuardedCache()
    cache.add(_check(ConstantGuard(LR, 0.1)), "old")
    cache.add(_check(ConstantGuard(LR, 0.1)), "new")
    assert cache.lookup({"lr": 0.1}) == "new"


def test_lookup_returns_none_when_no_entry_matches():
    cache: GuardedCache[str] = GuardedCache()
    cache.add(_check(ConstantGuard(LR, 0.1)), "lr=0.1")
    assert cache.lookup({"lr": 0.3}) is None


def test_miss_reason_is_none_on_an_empty_cache():
    assert GuardedCache[str]().miss_reason({"lr": 0.1}) is None


def test_miss_reason_names_the_newest_entrys_failing_guard():
    cache: GuardedCache[str] = GuardedCache()
    cache.add(_check(ConstantGuard(LR, 0.1)), "old")
    cache.add(_check(LengthGuard(XS, 2)), "new")
    assert cache.miss_reason({"lr": 0.3, "xs": [1]}) == "L['xs']: length changed (2 -> 1)"


def test_miss_reason_says_when_a_source_is_no_longer_reachable():
    cache: GuardedCache[str] = GuardedCache()
    cache.add(_check(LengthGuard(XS, 2)), "entry")
    assert cache.miss_reason({}) == "L['xs']: no longer reachable"


def test_miss_reason_explains_a_list_that_became_none():
    cache: GuardedCache[str] = GuardedCache()
    cache.add(_check(LengthGuard(XS, 2)), "entry")
    assert cache.miss_reason({"xs": None}) == "L['xs']: expected has length 2, found None"


def test_full_is_false_below_the_limit():
    cache: GuardedCache[str] = GuardedCache(limit=2)
    cache.add(_check(ConstantGuard(LR, 0.1)), "a")
    assert not cache.full


def test_full_becomes_true_at_the_limit():
    cache: GuardedCache[str] = GuardedCache(limit=2)
    cache.add(_check(ConstantGuard(LR, 0.1)), "a")
    cache.add(_check(ConstantGuard(LR, 0.2)), "b")
    assert cache.full


def test_default_limit_is_the_default_recompile_limit():
    assert GuardedCache[str]().limit == DEFAULT_RECOMPILE_LIMIT


@pytest.mark.parametrize("limit", [0, -1])
def test_limit_below_one_raises_value_error(limit):
    with pytest.raises(ValueError, match=f"at least 1, got {limit}"):
        GuardedCache(limit=limit)


def test_clear_empties_the_cache():
    cache: GuardedCache[str] = GuardedCache(limit=1)
    cache.add(_check(ConstantGuard(LR, 0.1)), "a")
    cache.clear()
    assert (cache.entries, cache.full, cache.lookup({"lr": 0.1})) == ([], False, None)
