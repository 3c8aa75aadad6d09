"""Row loops (rows.py): the guards and gathers of many list items generated as one loop."""

from __future__ import annotations

import ast

import torch
from optguard import (
    AttrSource,
    DataPtrGuard,
    DisjointGuard,
    GuardSet,
    ItemSource,
    KeyedSource,
    LengthGuard,
    NoneGuard,
    TensorMatchGuard,
    TensorMeta,
    compile_check,
    compile_fetch,
)
from optguard.rows import MIN_ROWS
from optguard_paths import OPT, PARAMS

STATE = AttrSource(OPT, "state")


def _opt(n: int, shapes: tuple[tuple[int, ...], ...] = ((4, 4),)) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.randn(shapes[i % len(shapes)])) for i in range(n)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.randn_like(p)
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return opt


def _buffer(i: int) -> ItemSource:
    return ItemSource(KeyedSource(STATE, ItemSource(PARAMS, i)), "momentum_buffer")


def _guards(opt: torch.optim.Optimizer) -> GuardSet:
    """What a trace guards on each parameter: the tensor, its address, its grad, its state;
    and that the state buffers share no memory."""
    params = opt.param_groups[0]["params"]
    guards: list = [LengthGuard(PARAMS, len(params))]
    for i, p in enumerate(params):
        param, grad = ItemSource(PARAMS, i), AttrSource(ItemSource(PARAMS, i), "grad")
        buffer = opt.state[p]["momentum_buffer"]
        guards += [
            TensorMatchGuard(param, TensorMeta.of(p)),
            DataPtrGuard(param, p.data_ptr()),
            NoneGuard(grad, False),
            TensorMatchGuard(grad, TensorMeta.of(p.grad)),
            TensorMatchGuard(_buffer(i), TensorMeta.of(buffer)),
            DataPtrGuard(_buffer(i), buffer.data_ptr()),
        ]
    guards.append(DisjointGuard(_buffer(0), tuple(_buffer(i) for i in range(1, len(params)))))
    return GuardSet(tuple(guards))


def _inputs(opt: torch.optim.Optimizer) -> list:
    n = len(opt.param_groups[0]["params"])
    items = [ItemSource(PARAMS, i) for i in range(n)]
    return [*items, *(AttrSource(p, "grad") for p in items), *(_buffer(i) for i in range(n))]


def test_check_code_has_the_same_length_for_any_number_of_params():
    small, large = _opt(MIN_ROWS), _opt(10 * MIN_ROWS, shapes=((4, 4), (3,), (2, 5)))
    small_code = compile_check(_guards(small)).code
    large_code = compile_check(_guards(large)).code
    assert "for " in small_code
    assert len(large_code.splitlines()) == len(small_code.splitlines())
    assert [n.name for n in ast.parse(large_code).body] == ["check"]  # type: ignore[attr-defined]


def test_gather_code_has_the_same_length_for_any_number_of_params():
    small, large = _opt(MIN_ROWS), _opt(10 * MIN_ROWS)
    _, small_code = compile_fetch(_inputs(small))
    _, large_code = compile_fetch(_inputs(large))
    assert len(large_code.splitlines()) == len(small_code.splitlines())


def test_few_params_stay_straight_line_code():
    code = compile_check(_guards(_opt(MIN_ROWS - 1))).code
    assert "for " not in code


def test_looped_check_holds_on_unchanged_inputs_and_gathers_in_order():
    opt = _opt(3 * MIN_ROWS, shapes=((4, 4), (3,)))
    assert compile_check(_guards(opt))({"opt": opt}) is True
    sources = _inputs(opt)
    gather, _ = compile_fetch(sources)
    assert all(
        a is b
        for a, b in zip(gather({"opt": opt}), [s.fetch({"opt": opt}) for s in sources], strict=True)
    )


def test_looped_check_fails_on_a_change_in_the_last_row():
    opt = _opt(2 * MIN_ROWS)
    check = compile_check(_guards(opt))
    last = opt.param_groups[0]["params"][-1]
    last.grad = None
    assert check({"opt": opt}) is False
    assert check.first_failure({"opt": opt}) == (
        f"L['opt'].param_groups[0]['params'][{2 * MIN_ROWS - 1}].grad: became None"
    )


def test_looped_check_fails_on_a_moved_state_tensor_or_a_new_shape():
    opt = _opt(2 * MIN_ROWS)
    check = compile_check(_guards(opt))
    p = opt.param_groups[0]["params"][5]
    opt.state[p]["momentum_buffer"] = torch.zeros_like(p)  # same metadata, new address
    assert check({"opt": opt}) is False
    opt = _opt(2 * MIN_ROWS)
    check = compile_check(_guards(opt))
    opt.param_groups[0]["params"][3] = torch.nn.Parameter(torch.zeros(5))
    assert check({"opt": opt}) is False


def test_looped_check_fails_when_the_list_is_shorter():
    opt = _opt(2 * MIN_ROWS)
    guards = GuardSet(tuple(g for g in _guards(opt).guards if not isinstance(g, LengthGuard)))
    check = compile_check(guards)
    opt.param_groups[0]["params"].pop()
    assert check({"opt": opt}) is False


def test_guard_over_every_row_reads_the_values_the_loop_collected():
    opt = _opt(2 * MIN_ROWS)
    check = compile_check(_guards(opt))
    assert "disjoint(" in check.code and check.code.count("momentum_buffer'") == 1
    # One buffer made a view of another: addresses and metadata guards would not all catch
    # it, the disjointness guard does (its guards are rebuilt for the new addresses).
    params = opt.param_groups[0]["params"]
    shared = torch.zeros(2, 4, 4)
    opt.state[params[0]]["momentum_buffer"] = shared[0]
    opt.state[params[1]]["momentum_buffer"] = shared[0]
    check = compile_check(_guards(opt))
    assert check({"opt": opt}) is False
    assert "shares memory with" in (check.first_failure({"opt": opt}) or "")
