from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from optguard import (
    AliasGuard,
    AttrSource,
    ConstantGuard,
    DictLengthGuard,
    DisjointGuard,
    FloatGuard,
    GuardSet,
    GuardSetBuilder,
    ItemSource,
    KeyedSource,
    KeysGuard,
    LengthGuard,
    LocalSource,
    NoneGuard,
    PredicateGuard,
    TensorMatchGuard,
    TensorMeta,
    TypeGuard,
    autocast_guard,
    compile_check,
    first_failure,
)
from optguard.guards import disjoint
from optguard_paths import GROUP, OPT, PARAM


def test_sources_print_readable_access_paths():
    assert ItemSource(GROUP, "lr").name() == "L['opt'].param_groups[0]['lr']"
    state = KeyedSource(AttrSource(OPT, "state"), PARAM)
    assert state.name() == "L['opt'].state[L['opt'].param_groups[0]['params'][0]]"


def test_keyed_source_reads_missing_entry_as_none_without_creating_it():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    assert isinstance(opt.state, defaultdict)
    assert KeyedSource(AttrSource(OPT, "state"), PARAM).fetch({"opt": opt}) is None
    assert len(opt.state) == 0


@pytest.mark.parametrize(
    ("guard", "good", "bad", "reason"),
    [
        (TypeGuard(OPT, list), [], (), "type changed (list -> tuple)"),
        (ConstantGuard(OPT, 1e-3), 1e-3, 2e-3, "value changed (0.001 -> 0.002)"),
        (ConstantGuard(OPT, 1), 1, 1.0, "value changed (1 -> 1.0)"),
        (ConstantGuard(OPT, True), True, 1, "value changed (True -> 1)"),
        (LengthGuard(OPT, 2), [1, 2], [1], "length changed (2 -> 1)"),
        (DictLengthGuard(OPT, 3), {1: 0, 2: 0, 3: 0}, {}, "keys changed (3 entries -> 0)"),
        (KeysGuard(OPT, ("a", "b")), {"a": 1, "b": 2}, {"a": 1}, "['a', 'b'] -> ['a']"),
        (KeysGuard(OPT, None), None, {"a": 1}, "keys changed (absent -> ['a'])"),
        (NoneGuard(OPT, is_none=False), torch.ones(1), None, "became None"),
        (NoneGuard(OPT, is_none=True), None, torch.ones(1), "became a tensor"),
    ],
)
def test_guard_holds_on_its_value_and_names_the_change(guard, good, bad, reason):
    assert guard.holds(good)
    assert not guard.holds(bad)
    assert reason in guard.changed(bad)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: t.to(torch.bfloat16), "dtype changed (torch.float32 -> torch.bfloat16)"),
        (lambda t: t.reshape(3, 2), "shape changed ((2, 3) -> (3, 2))"),
        (lambda t: t.t(), "shape changed"),
        (lambda t: t.detach().requires_grad_(True), "requires_grad changed (False -> True)"),
        (lambda t: torch.nn.Parameter(t), "type changed (Tensor -> Parameter)"),
        (lambda t: t.contiguous().as_strided((2, 3), (1, 2)), "stride changed"),
    ],
)
def test_tensor_match_fails_on_each_metadata_change(change, reason):
    t = torch.randn(2, 3)
    guard = TensorMatchGuard(PARAM, TensorMeta.of(t))
    assert guard.holds(torch.randn(2, 3))
    changed = change(t)
    assert not guard.holds(changed)
    assert reason in guard.changed(changed)


def test_guard_describe_starts_with_its_source():
    guard = ConstantGuard(ItemSource(GROUP, "lr"), 0.1)
    assert guard.describe() == "L['opt'].param_groups[0]['lr'] == 0.1"


@pytest.mark.parametrize(
    ("guard", "text"),
    [
        (TypeGuard(OPT, list), "L['opt'] has type list"),
        (ConstantGuard(OPT, 1e-3), "L['opt'] == 0.001"),
        (LengthGuard(OPT, 2), "L['opt'] has length 2"),
        (DictLengthGuard(OPT, 3), "L['opt'] has 3 entries"),
        (KeysGuard(OPT, ("a", "b")), "L['opt'] has keys ['a', 'b']"),
        (KeysGuard(OPT, None), "L['opt'] is absent"),
        (NoneGuard(OPT, is_none=True), "L['opt'] is None"),
        (NoneGuard(OPT, is_none=False), "L['opt'] is not None"),
        (
            TensorMatchGuard(OPT, TensorMeta.of(torch.zeros(2, 3))),
            "L['opt'] is Tensor(float32, cpu, shape=[2, 3], stride=[3, 1])",
        ),
    ],
)
def test_describe_names_the_source_and_the_expected_fact(guard, text):
    assert guard.describe() == text


def test_describe_of_tensor_match_mentions_requires_grad():
    guard = TensorMatchGuard(PARAM, TensorMeta.of(torch.nn.Parameter(torch.zeros(2))))
    assert guard.describe().endswith("stride=[1], requires_grad)")


def test_constant_guards_on_1_and_1_0_and_true_are_three_guards():
    assert len({ConstantGuard(OPT, 1), ConstantGuard(OPT, 1.0), ConstantGuard(OPT, True)}) == 3


@pytest.mark.parametrize("other", [1, True])
def test_float_constant_guard_rejects_an_equal_int_or_bool(other):
    assert not ConstantGuard(OPT, 1.0).holds(other)


def test_constant_guard_holds_on_infinity():
    assert ConstantGuard(OPT, float("inf")).holds(float("inf"))


def test_keys_guard_fails_when_the_key_order_changes():
    assert not KeysGuard(OPT, ("a", "b")).holds({"b": 1, "a": 2})


def test_keys_guard_reports_a_dict_that_became_absent():
    assert KeysGuard(OPT, ("a",)).changed(None) == "keys changed (['a'] -> absent)"


def test_length_guard_reports_a_value_without_a_length():
    assert LengthGuard(OPT, 2).changed(None) == "expected has length 2, found None"


def test_tensor_match_holds_on_the_tensor_it_was_built_from():
    t = torch.zeros(2, 3)
    assert TensorMatchGuard(PARAM, TensorMeta.of(t)).holds(t)


def test_tensor_match_fails_on_a_device_change():
    guard = TensorMatchGuard(PARAM, TensorMeta.of(torch.zeros(2)))
    moved = torch.empty(2, device="meta")
    assert not guard.holds(moved)
    assert guard.changed(moved) == "device changed (cpu -> meta)"


def test_tensor_match_fails_on_a_value_that_is_no_tensor():
    guard = TensorMatchGuard(PARAM, TensorMeta.of(torch.zeros(2)))
    assert not guard.holds(3)
    assert guard.changed(3) == "is no longer a tensor (int)"


def test_alias_guard_holds_while_two_sources_hold_one_object_in_the_generated_check_too():
    a, b = ItemSource(LocalSource("xs"), 0), ItemSource(LocalSource("xs"), 1)
    guard = AliasGuard(b, a)
    builder = GuardSetBuilder()
    builder.add(guard)
    check = compile_check(builder.build())
    t = torch.zeros(2)
    assert guard.describe() == "L['xs'][1] is L['xs'][0]"
    assert check({"xs": [t, t]}) and guard.holds(guard.fetch({"xs": [t, t]}))
    assert not check({"xs": [t, t.clone()]})
    reason = first_failure([guard], {"xs": [t, torch.zeros(2)]})
    assert reason == "L['xs'][1]: is no longer the same object as L['xs'][0]"


@pytest.mark.parametrize(
    ("make", "apart"),
    [
        (lambda x: (x[:5], x[5:]), True),  # adjacent halves
        (lambda x: (x[:6], x[5:]), False),  # one element in common
        (lambda x: (x, x), False),
        (lambda x: (x.view(2, 5).t(), x[:1]), False),  # a transposed view reaches x[0]
        (lambda x: (x.view(2, 5)[:, :2], x.view(2, 5)[1, 2:]), True),  # one ends, one begins
        (lambda x: (x[0], x[1], x[2]), True),  # 0-dim views of neighbours
        (lambda x: (x[3], x[3]), False),  # two objects, one element
        (lambda x: (x[:0], x[:0]), True),  # nothing reached
        (lambda x: (x, x[4:4]), True),  # an empty view inside another
        (lambda x: (x, torch.zeros(10)), True),  # separate allocations
    ],
)
def test_disjoint_compares_the_bytes_tensors_reach(make, apart):
    tensors = make(torch.arange(10.0))
    assert disjoint(tensors) is apart
    sources = [ItemSource(LocalSource("xs"), i) for i in range(len(tensors))]
    guard = DisjointGuard(sources[0], tuple(sources[1:]))
    L = {"xs": list(tensors)}
    assert compile_check(GuardSet((guard,)))(L) is apart
    if not apart:
        assert first_failure([guard], L) == "L['xs'][0]: shares memory with one of " + ", ".join(
            s.name() for s in sources[1:]
        )


def test_autocast_guard_holds_in_the_autocast_state_it_was_made_in():
    off = autocast_guard()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = autocast_guard()
        assert on.state == "cpu:bfloat16" and on.describe() == "torch.autocast is on (cpu:bfloat16)"
        assert on.holds(on.fetch({})) and not off.holds(off.fetch({}))
        assert first_failure([off], {}) == "torch.autocast: changed (off -> on (cpu:bfloat16))"
        with torch.autocast("cpu", dtype=torch.float16):
            assert not compile_check(GuardSet((on,)))({})
    assert off.describe() == "torch.autocast is off" and off.holds(off.fetch({}))
    assert compile_check(GuardSet((off,)))({})
    assert not compile_check(GuardSet((on,)))({})


def test_float_guard_takes_python_and_numpy_float64_but_not_ints_or_float32():
    numpy = pytest.importorskip("numpy")
    guard = FloatGuard(LocalSource("lr"))
    assert guard.holds(0.1) and guard.holds(numpy.float64(0.1))
    assert not guard.holds(1) and not guard.holds(numpy.float32(0.1)) and not guard.holds(True)
    assert guard.changed(numpy.float32(0.1)) == "type changed (float -> float32)"


def test_predicate_guard_evaluates_numpy_values_whose_repr_is_not_python():
    numpy = pytest.importorskip("numpy")
    guard = PredicateGuard(LocalSource("wd"), "({0} != 0.0)", True)
    assert guard.holds((numpy.float64(0.1),)) and not guard.holds((numpy.float64(0.0),))
    assert guard.changed((numpy.float64(0.0),)) == "(L['wd'] != 0.0) changed (True -> False)"


def test_guards_of_one_kind_share_a_compiled_test_and_each_tests_its_own_constant():
    from optguard import DataPtrGuard
    from optguard.guard import _COMPILED, single_test

    a, b = torch.zeros(3), torch.zeros(3)
    guard_a = DataPtrGuard(LocalSource("a"), a.data_ptr())
    guard_b = DataPtrGuard(LocalSource("b"), b.data_ptr())
    assert single_test(guard_a)(a) and not single_test(guard_a)(b)
    compiled = len(_COMPILED)
    assert single_test(guard_b)(b) and not single_test(guard_b)(a)
    assert len(_COMPILED) == compiled  # (the second reused the first's code)
    # (its holds, which skips the compiled test, answers the same)
    assert guard_a.holds(a) and not guard_a.holds(b) and guard_b.holds(b)


def test_guards_differing_only_in_their_source_share_one_test():
    from optguard.guard import single_test

    meta = TensorMeta.of(torch.zeros(2, 3))
    first = TensorMatchGuard(LocalSource("a"), meta)
    second = TensorMatchGuard(ItemSource(LocalSource("b"), 0), meta)
    other = TensorMatchGuard(LocalSource("a"), TensorMeta.of(torch.zeros(3, 2)))
    assert single_test(first) is single_test(second)
    assert single_test(other) is not single_test(first)
    assert first.holds(torch.ones(2, 3)) and not first.holds(torch.ones(3, 2))
    assert other.holds(torch.ones(3, 2)) and not other.holds(torch.ones(2, 3))
